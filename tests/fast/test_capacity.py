"""One fit rule (:func:`k3launch.planning.capacity.holds`) for every capacity question planning
asks: the node count it picks, the refusals, a plan's own ``capacity.fits``, single_node_tp's
auto-fit and `recipes show` all give the same answer, down to float noise in a recipe's figure."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from inventory_helpers import run_cli
from paths import ROOT

from k3launch.models.selection import Selection
from k3launch.planning import capacity
from k3launch.planning.build import build_plan
from k3launch.planning.capacity import NodeMemory
from k3launch.planning.recipes import RecipeTree

K3 = "models/moonshotai/Kimi-K3.yaml"


def k3_tree(tmp: Path, vram_minimum: str | None) -> RecipeTree:
    """The bundled tree with Kimi K3's ``vram_minimum_gb`` replaced (None: removed)."""
    root = tmp / "recipes"
    shutil.copytree(ROOT / "recipes", root)
    f = root / K3
    text = f.read_text(encoding="utf-8")
    line = "" if vram_minimum is None else f"vram_minimum_gb: {vram_minimum}"
    f.write_text(re.sub(r"vram_minimum_gb: 1680[^\n]*", line, text), encoding="utf-8")
    return RecipeTree(root)


@given(st.floats(0.5, 1e5), st.floats(0.5, 5e3))
def test_nodes_to_fit_is_the_smallest_count_the_rule_accepts(weights: float, node_gb: float) -> None:
    mem = NodeMemory(node_gb)
    n = capacity.nodes_to_fit(weights, mem)
    assert capacity.fits(weights, mem, n)
    assert n == 1 or not capacity.fits(weights, mem, n - 1)


def test_a_hair_over_two_nodes_takes_three() -> None:
    """2 x 2144 GB is short of 4288.000000002 GB by more than float noise: the smallest count is 3,
    and the plan's default takes it instead of refusing its own count."""
    assert capacity.nodes_to_fit(4288.000000002, NodeMemory(2144)) == 3


def test_the_count_chosen_is_planned(tmp_path: Path) -> None:
    tree = k3_tree(tmp_path, "4288.000000002")
    plan = build_plan(tree, Selection(hardware="b300", strategy="multi_node_tp"))
    assert plan.nodes == 3 and plan.capacity.fits


def test_a_plan_that_is_planned_says_it_fits(tmp_path: Path) -> None:
    """A figure a hair over the node's memory (float noise) passes the check that plans it, and the
    plan's own capacity says the same."""
    plan = build_plan(k3_tree(tmp_path, "640.0000000001"), Selection(hardware="h100", strategy="single_node_tp"))
    assert plan.capacity.fits and all(p.fits for p in plan.capacity.pools), plan.capacity


def test_single_node_tp_auto_fit_asks_the_same_rule(tmp_path: Path) -> None:
    """One h200 GPU (141 GB) holds 141.0000000001 GB by the rule the capacity check applies: TP 1."""
    plan = build_plan(k3_tree(tmp_path, "141.0000000001"), Selection(hardware="h200", strategy="single_node_tp"))
    (proc,) = [p for p in plan.processes if p.role != "router"]
    assert proc.argv[proc.argv.index("--tensor-parallel-size") + 1] == "1" and plan.capacity.fits


def test_recipes_show_judges_one_node_by_the_weights_a_plan_counts(tmp_path: Path) -> None:
    """Without vram_minimum_gb Kimi K3's weights are still 2.8T x 0.5 x 1.2 = 1680 GB: one h200
    node (1128 GB) does not hold them, one b300 node (2144 GB) does, as plans say."""
    k3_tree(tmp_path, None)
    r = run_cli(["recipes", "--recipes-dir", str(tmp_path / "recipes"), "show", "moonshotai/Kimi-K3"], tmp_path,
                env={"COLUMNS": "200"})
    assert r.code == 0, r.stdout + r.stderr
    rows = {m.group(1): m.group(2) for m in re.finditer(r"│ (\w+)\s+│[^│]+│[^│]+│ (\w+|\?)\s+│", r.stdout)}
    assert rows["h200"] == "no" and rows["b300"] == "yes", r.stdout
