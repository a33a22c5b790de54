"""Thousands of plans, byte for byte: a digest of every plan of :mod:`plan_matrix` (bundled tree,
example inventories, the upstream trees) against ``tests/golden/plan_matrix/<part>.txt``; seconds
each part (the fast tier's sample: tests/fast/test_plan_matrix.py). Regenerate after an intended
change with ``K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/e2e/local/test_plan_matrix_e2e.py``.
"""

from __future__ import annotations

import pytest
from plan_matrix import GOLDEN, PARTS, UPDATE, available, compare, digest_lines, stored


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
    compare(part, got, stored(part))
