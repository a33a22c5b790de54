"""Golden plans of the bundled Kimi K3 recipe: the exact JSON ``k3launch plan --json`` contract.

Each case is one selection; its ``plan.model_dump(mode="json")`` is stored pretty-printed in
``tests/golden/<name>.json``. Regenerate after an intended change with

    K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/fast/test_golden.py

and read the diff: every golden was checked by hand against the seed when it was frozen.
"""

from __future__ import annotations

import difflib
import json
import os

import pytest
from paths import TESTS

from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.recipes import RecipeTree

GOLDEN = TESTS / "golden"
UPDATE = os.environ.get("K3LAUNCH_UPDATE_GOLDEN") == "1"
ADVANCED_ALL = ("max-num-batched-tokens", "max-num-seqs", "gpu-memory-utilization", "max-model-len")

CASES: dict[str, Selection] = {
    "b300_default": Selection(),
    "h200_default": Selection(hardware="h200"),
    "h100_multi_node_tp_3": Selection(hardware="h100", strategy="multi_node_tp", nodes=3),
    "gb300_multi_node_tep_2": Selection(hardware="gb300", strategy="multi_node_tep", nodes=2),
    "b300_multi_node_dep_2": Selection(hardware="b300", strategy="multi_node_dep", nodes=2),
    "b300_multi_node_dep_2_fault_tolerance": Selection(hardware="b300", strategy="multi_node_dep", nodes=2, fault_tolerance=True),
    "gb300_multi_node_dep_4": Selection(hardware="gb300", strategy="multi_node_dep", nodes=4),
    "h200_multi_node_tp_2_replicas_2": Selection(hardware="h200", strategy="multi_node_tp", nodes=2, replicas=2),
    "b300_multi_node_dep_2_replicas_2": Selection(hardware="b300", strategy="multi_node_dep", nodes=2, replicas=2),
    "mi355x_spec_decoding_advanced_all": Selection(hardware="mi355x", features=("spec_decoding",), advanced=ADVANCED_ALL),
    "pd_cluster_default": Selection(strategy="pd_cluster"),
    "pd_cluster_h200_prefill_tp2_decode_dep2": Selection(
        hardware="h200", strategy="pd_cluster", prefill_strategy="tp", prefill_nodes=2, decode_strategy="dep", decode_nodes=2,
    ),
    "b300_kv_simple": Selection(kv_offload="simple"),
    "b300_kv_lmcache": Selection(kv_offload="lmcache"),
    "mi325x_text_only_unverified": Selection(hardware="mi325x", features=("text_only",)),
}

TREE = RecipeTree()


def _render(sel: Selection) -> str:
    return json.dumps(build_plan(TREE, sel).model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    path = GOLDEN / f"{name}.json"
    got = _render(CASES[name])
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(got, encoding="utf-8")
        return
    assert path.is_file(), f"{path} missing: run K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/fast/test_golden.py and review it"
    want = path.read_text(encoding="utf-8")
    if json.loads(got) != json.loads(want):
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), f"golden/{name}.json", "now", n=2))
        pytest.fail(f"plan {name} differs from its golden (K3LAUNCH_UPDATE_GOLDEN=1 to accept):\n{diff}")


def test_no_stale_goldens() -> None:
    stored = {p.stem for p in GOLDEN.glob("*.json")}
    assert stored == set(CASES), f"goldens without a case: {stored - set(CASES)}; cases without a golden: {set(CASES) - stored}"


# ------------------------------------------------------------------ P/D expert parallelism
def _golden(name: str) -> dict[str, object]:
    return json.loads((GOLDEN / f"{name}.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


EP_POOLS = {
    # TEP/DEP pools of a P/D deployment are TP/DP plus --enable-expert-parallel.
    "pd_cluster_default": ("prefill", "decode"),
    "pd_cluster_h200_prefill_tp2_decode_dep2": ("decode",),
}


@pytest.mark.parametrize("name", sorted(EP_POOLS))
def test_golden_pd_expert_parallel_pools(name: str) -> None:
    plan = _golden(name)
    for proc in plan["processes"]:  # type: ignore[attr-defined]
        if proc["role"] in EP_POOLS[name]:
            assert "--enable-expert-parallel" in proc["argv"], f"{proc['id']} of {name}"
