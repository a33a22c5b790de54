"""Thousands of plans, byte for byte: a sample of the digests of :mod:`plan_matrix` (bundled tree
and example inventories) against ``tests/golden/plan_matrix/<part>.txt``; the whole matrix, every
part, is tests/e2e/local/test_plan_matrix_e2e.py.

A refactoring of planning must leave every line alone. After an intended change regenerate with

    K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/e2e/local/test_plan_matrix_e2e.py

and find the plans behind a changed line with ``python tests/support/plan_matrix.py dump DIR`` on
both sides (``diff -r``).
"""

from __future__ import annotations

import pytest
from plan_matrix import compare, digest_lines, stored

SAMPLE = {"bundled": 12, "inventory": 1}  # one group in n of each part: well under a second together


@pytest.mark.parametrize("part", sorted(SAMPLE))
def test_a_sample_of_the_matrix(part: str) -> None:
    got = digest_lines(part, SAMPLE[part])
    assert got, "the sample is empty"
    kept = {line.split(" ", 1)[1].rsplit(" (", 1)[0]: line for line in stored(part)}
    compare(part, got, [kept.get(line.split(" ", 1)[1].rsplit(" (", 1)[0], "(missing)") for line in got])
