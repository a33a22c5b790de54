"""Thousands of plans, byte for byte: a digest of every plan of :mod:`plan_matrix` (bundled tree,
example inventories, the upstream trees) against ``tests/golden/plan_matrix/<part>.txt``.

A refactoring of planning must leave every line alone. After an intended change regenerate with

    K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/test_plan_matrix.py -m e2e

and find the plans behind a changed line with ``python tests/plan_matrix.py dump DIR`` on both
sides (``diff -r``). The whole matrix takes seconds (slow tier); the fast tier checks a sample
(``SAMPLE``) of the bundled tree and the inventories.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from plan_matrix import PARTS, available, digest_lines

GOLDEN = Path(__file__).parent / "golden" / "plan_matrix"
UPDATE = os.environ.get("K3LAUNCH_UPDATE_GOLDEN") == "1"
SAMPLE = {"bundled": 12, "inventory": 1}  # one group in n of each part: well under a second together


def _stored(part: str) -> list[str]:
    path = GOLDEN / f"{part}.txt"
    assert path.is_file(), f"{path} missing: run K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/test_plan_matrix.py -m e2e"
    return path.read_text(encoding="utf-8").splitlines()


def _compare(part: str, got: list[str], want: list[str]) -> None:
    if got != want:
        diff = "\n".join(difflib.unified_diff(want, got, f"golden/plan_matrix/{part}.txt", "now", lineterm="", n=0))
        pytest.fail(f"plans of {part} changed (dump both sides with tests/plan_matrix.py to see how):\n{diff}")


@pytest.mark.e2e
@pytest.mark.parametrize("part", [pytest.param(p, marks=[pytest.mark.upstream] if p.startswith("upstream") else []) for p in PARTS])
def test_every_plan_of_the_matrix(part: str) -> None:
    if not available(part):
        pytest.skip(f"{part}: the upstream trees are absent")
    got = digest_lines(part)
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        (GOLDEN / f"{part}.txt").write_text("\n".join(got) + "\n", encoding="utf-8")
        return
    _compare(part, got, _stored(part))


@pytest.mark.parametrize("part", sorted(SAMPLE))
def test_a_sample_of_the_matrix(part: str) -> None:
    got = digest_lines(part, SAMPLE[part])
    assert got, "the sample is empty"
    stored = {line.split(" ", 1)[1].rsplit(" (", 1)[0]: line for line in _stored(part)}
    _compare(part, got, [stored.get(line.split(" ", 1)[1].rsplit(" (", 1)[0], "(missing)") for line in got])
