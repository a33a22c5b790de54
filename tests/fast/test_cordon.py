"""Cordoned nodes: kept in the state directory, skipped by planning (with a notice; Slurm:
``sbatch --exclude``), refused to ``up`` in a plan made before the cordon, and the CLI around them."""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import yaml
from inventory_helpers import example, run_cli
from paths import ROOT

from k3launch import api
from k3launch.deploy import cordons
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.cordon import by_supervisor

LOCAL = example("local")
SLURM = example("slurm-b200")
TEP2 = {"strategy": "multi_node_tep", "nodes": 2}


def hosts(plan: object) -> list[str]:
    return [h.name for h in plan.hosts if h.role != "router"]  # type: ignore[attr-defined]


def cordon_notices(plan: object) -> list[str]:
    return [n.message for n in plan.notices if n.code == "cordoned"]  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------ planning
def test_a_cordoned_node_is_skipped_with_a_notice_and_the_next_one_taken(tmp_path: Path) -> None:
    cordons.cordon(StateStore(tmp_path), "local", ["local-1"], "unreachable for 300 s", by_supervisor("dep-a"), now=1735787045.0)
    plan = api.plan(LOCAL, state_dir=tmp_path, **TEP2)
    assert hosts(plan) == ["local-2", "local-3"]
    assert plan.exclude == ["local-1"]
    assert cordon_notices(plan) == [
        "node local-1 cordoned since 2025-01-02 03:04:05 UTC (unreachable for 300 s; by supervisor of dep-a): skipped; "
        f"`k3launch uncordon local-1 -i {LOCAL}` puts it back"]


def test_uncordon_puts_the_node_back_and_the_plan_is_as_without_cordons(tmp_path: Path) -> None:
    clean = api.plan(LOCAL, state_dir=tmp_path / "empty", **TEP2)
    api.cordon(LOCAL, ["local-1"], "fan", tmp_path)
    assert hosts(api.plan(LOCAL, state_dir=tmp_path, **TEP2)) == ["local-2", "local-3"]
    change = api.uncordon(LOCAL, ["local-1", "local-4"], tmp_path)
    assert (change.changed, change.unchanged, change.cordoned) == (("local-1",), ("local-4",), {})
    back = api.plan(LOCAL, state_dir=tmp_path, **TEP2)
    assert hosts(back) == ["local-1", "local-2"] and not cordon_notices(back)
    assert back.to_json() == clean.to_json()  # nothing of the cordon is left in the plan
    assert api.cordoned(LOCAL, tmp_path) == {}


def test_a_selection_that_no_longer_fits_names_the_cordoned_nodes_and_the_way_back(tmp_path: Path) -> None:
    api.cordon(LOCAL, ["local-2", "local-1"], "", tmp_path)
    with pytest.raises(K3Error) as exc:
        api.plan(LOCAL, state_dir=tmp_path, strategy="multi_node_tep", nodes=4)
    assert exc.value.code == "too-few-nodes"
    assert "has 2 usable (cordoned 2: local-1, local-2)" in exc.value.message
    assert exc.value.hint.startswith(f"`k3launch uncordon local-1 local-2 -i {LOCAL}` puts them back")


def test_a_cordoned_router_node_is_refused_with_the_way_back(tmp_path: Path) -> None:
    data = yaml.safe_load(LOCAL.read_text())
    data["router"] = {"node": "local-4"}
    inv = tmp_path / "routed.yaml"
    inv.write_text(yaml.safe_dump(data))
    api.cordon(inv, ["local-4"], "psu", tmp_path / "state")
    with pytest.raises(K3Error) as exc:
        api.plan(inv, state_dir=tmp_path / "state", strategy="pd_cluster")
    assert exc.value.code == "router-node-unavailable" and "router.node local-4 is cordoned since" in exc.value.message
    assert "k3launch uncordon local-4" in exc.value.hint


def test_cordons_are_kept_per_inventory_name(tmp_path: Path) -> None:
    cordons.cordon(StateStore(tmp_path), "another-inventory", ["local-1"])
    assert hosts(api.plan(LOCAL, state_dir=tmp_path, **TEP2)) == ["local-1", "local-2"]


def test_a_plan_made_before_the_cordon_is_refused_by_up_and_dry_run(tmp_path: Path) -> None:
    plan = api.plan(LOCAL, state_dir=tmp_path, **TEP2)  # on local-1 and local-2
    api.cordon(LOCAL, ["local-4"], "", tmp_path)
    assert api.dry_run(plan, LOCAL, state_dir=tmp_path).steps  # a node it does not use: nothing to refuse
    api.cordon(LOCAL, ["local-2"], "lost", tmp_path)
    for call in (lambda: api.dry_run(plan, LOCAL, state_dir=tmp_path), lambda: api.up(plan, LOCAL, state_dir=tmp_path)):
        with pytest.raises(K3Error) as exc:
            call()
        assert exc.value.code == "cordoned-node" and "node local-2 was cordoned since" in exc.value.message
        assert "k3launch uncordon local-2" in exc.value.hint
    assert not (tmp_path / "deployments").exists() or not list((tmp_path / "deployments").iterdir())  # nothing started


# ------------------------------------------------------------------------------------ Slurm
def test_slurm_plans_exclude_cordoned_nodes_in_the_sbatch_script(tmp_path: Path) -> None:
    api.cordon(SLURM, ["gpu-01"], "ib down", tmp_path)
    plan = api.plan(SLURM, state_dir=tmp_path, exclude=["gpu-03"], **TEP2)
    assert hosts(plan) == ["gpu-02", "gpu-04"] and plan.exclude == ["gpu-03", "gpu-01"]
    sbatch = api.dry_run(plan, SLURM, state_dir=tmp_path).sbatch
    assert sbatch is not None and "#SBATCH --exclude=gpu-03,gpu-01\n" in sbatch


def test_slurm_without_a_nodelist_excludes_any_cordoned_name(tmp_path: Path) -> None:
    data = yaml.safe_load(SLURM.read_text())
    del data["slurm"]["nodelist"]
    inv = tmp_path / "partition.yaml"
    inv.write_text(yaml.safe_dump(data))
    api.cordon(inv, ["node-x17"], "", tmp_path / "state")  # Slurm's nodes are not listed: any host name
    plan = api.plan(inv, state_dir=tmp_path / "state", **TEP2)
    assert plan.exclude == ["node-x17"] and cordon_notices(plan)
    sbatch = api.dry_run(plan, inv, state_dir=tmp_path / "state").sbatch
    assert sbatch is not None and "#SBATCH --exclude=node-x17\n" in sbatch


# ------------------------------------------------------------------------------------ the file
def test_unknown_nodes_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    for call in (lambda: api.cordon(LOCAL, ["local-1", "nope"], "", tmp_path), lambda: api.uncordon(LOCAL, ["nope"], tmp_path)):
        with pytest.raises(K3Error) as exc:
            call()
        assert exc.value.code == "unknown-node" and exc.value.message == "node nope: no such node in inventory local"
        assert exc.value.hint == "its nodes: local-1, local-2, local-3, local-4"
    assert not StateStore(tmp_path).cordons_path().exists()


def test_a_cordoned_name_the_inventory_lost_can_still_be_uncordoned(tmp_path: Path) -> None:
    cordons.cordon(StateStore(tmp_path), "local", ["local-9"])  # a node since removed from the inventory
    assert api.uncordon(LOCAL, ["local-9"], tmp_path).changed == ("local-9",)


def test_cordoning_twice_keeps_the_first_cordon(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    first = cordons.cordon(store, "local", ["local-1"], "unreachable", by_supervisor("a"), now=100.0)
    again = cordons.cordon(store, "local", ["local-1", "local-2"], "by hand", now=200.0)
    assert first.changed == ("local-1",) and (again.changed, again.unchanged) == (("local-2",), ("local-1",))
    kept = cordons.cordoned(store, "local")
    assert list(kept) == ["local-1", "local-2"]  # oldest first
    assert (kept["local-1"].since, kept["local-1"].reason, kept["local-1"].by) == (100.0, "unreachable", "supervisor of a")


def test_a_damaged_cordon_file_is_set_aside_and_reported_never_lost(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    garbage = b'{"version": 1, "inventories": {"local": {"local-1": {"node": "local-1", "since": 1'
    store.cordons_path().write_bytes(garbage)
    with pytest.raises(K3Error) as exc:
        api.plan(LOCAL, state_dir=tmp_path, **TEP2)  # a plan never quietly uses a node the file may have cordoned
    assert exc.value.code == "bad-cordons" and "kept aside as cordons.json.corrupt-" in exc.value.message
    (aside,) = tmp_path.glob("cordons.json.corrupt-*")
    assert aside.read_bytes() == garbage and aside.name in exc.value.hint
    assert api.cordoned(LOCAL, tmp_path) == {}  # reported once; planning goes on without it
    # a writer finding a damaged file sets it aside too, writes its cordon, and says so
    store.cordons_path().write_bytes(b"not json")
    change = api.cordon(LOCAL, ["local-3"], "", tmp_path)
    assert change.set_aside is not None and change.set_aside.read_bytes() == b"not json"
    assert list(api.cordoned(LOCAL, tmp_path)) == ["local-3"]
    assert len(list(tmp_path.glob("cordons.json.corrupt-*"))) == 2
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob(".cordons.*"))  # no lock or temporary file left


def _cordon_many(args: tuple[str, int]) -> None:
    root, worker = args
    store = StateStore(Path(root))
    for i in range(10):
        cordons.cordon(store, "inv", [f"n{worker}-{i}"], f"worker {worker}", by_supervisor(f"dep-{worker}"))
        cordons.uncordon(store, "inv", [f"gone{worker}-{i}"])  # writers that remove interleave with those that add


def test_concurrent_writers_keep_every_cordon(tmp_path: Path) -> None:
    with ProcessPoolExecutor(6) as pool:
        list(pool.map(_cordon_many, [(str(tmp_path), w) for w in range(6)]))
    found = cordons.cordoned(StateStore(tmp_path), "inv")
    assert sorted(found) == sorted(f"n{w}-{i}" for w in range(6) for i in range(10))
    assert all(c.by == f"supervisor of dep-{c.node[1]}" for c in found.values())
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob(".cordons.*"))


# ------------------------------------------------------------------------------------ campaigns
def test_a_campaign_plans_with_the_cordons_it_started_with(tmp_path: Path) -> None:
    from k3launch.campaign.run import named_plan, prepare

    api.cordon(LOCAL, ["local-1"], "", tmp_path)
    prep = prepare(ROOT / "campaigns" / "local-demo.yaml", state_dir=tmp_path)
    assert prep.plans and all(hosts(p) == ["local-2"] for p in prep.plans.values())
    api.cordon(LOCAL, ["local-2"], "lost mid-run", tmp_path)
    plan = named_plan(prep, prep.groups[0])  # the same plan as when the campaign was planned (its hash holds)
    assert hosts(plan) == ["local-2"]
    with pytest.raises(K3Error) as exc:  # so `up` refuses it before anything starts: the group's cells stay to run
        api.up(plan, prep.inventory, state_dir=tmp_path)
    assert exc.value.code == "cordoned-node"


# ------------------------------------------------------------------------------------ CLI
def test_cli_cordon_list_uncordon(tmp_path: Path) -> None:
    state = ["-i", str(LOCAL), "--state-dir", str(tmp_path / "state")]
    r = run_cli(["cordon", *state], tmp_path)
    assert (r.code, r.stdout) == (0, "no cordoned nodes in inventory local\n")
    r = run_cli(["cordon", "local-2", *state, "--reason", "fan  failure"], tmp_path)
    assert r.code == 0 and r.stdout.startswith("cordoned local-2 (inventory local): plans skip it until `k3launch uncordon local-2 -i ")
    r = run_cli(["cordon", *state, "--json"], tmp_path)
    assert r.code == 0
    (row,) = r.json()["cordoned"]
    assert (row["node"], row["reason"], row["by"]) == ("local-2", "fan failure", "user")
    r = run_cli(["cordon", *state], tmp_path)
    assert r.code == 0 and r.stdout.startswith("local-2  ") and "user  fan failure" in r.stdout  # off a terminal: one plain line
    r = run_cli(["cordon", "local-2", *state, "--json"], tmp_path)
    assert r.code == 0 and (r.json()["changed"], r.json()["unchanged"]) == ([], ["local-2"])
    assert r.json()["cordoned"][0]["since"] == row["since"]  # the first cordon stays
    plan = run_cli(["plan", "--json", *state, "--strategy", "multi_node_tep", "--nodes", "2"], tmp_path).json()
    assert [h["name"] for h in plan["hosts"]] == ["local-1", "local-3"] and plan["exclude"] == ["local-2"]
    dry = run_cli(["up", "--dry-run", "--json", *state, "--strategy", "multi_node_tep", "--nodes", "2"], tmp_path).json()
    assert {s["node"] for s in dry["steps"]} == {"local-1", "local-3"}
    r = run_cli(["uncordon", "local-2", *state], tmp_path)
    assert (r.code, r.stdout) == (0, "uncordoned local-2 (inventory local): plans may use it again\n")
    r = run_cli(["uncordon", "local-2", *state], tmp_path)
    assert (r.code, r.stdout) == (0, "local-2 was not cordoned\n")
    assert json.loads((tmp_path / "state" / "cordons.json").read_text())["inventories"] == {}


def test_cli_refusals_are_one_line_and_exit_2(tmp_path: Path) -> None:
    state = ["-i", str(LOCAL), "--state-dir", str(tmp_path / "state")]
    r = run_cli(["cordon", "nope", *state], tmp_path)
    assert r.code == 2 and r.stderr == "error: node nope: no such node in inventory local [unknown-node]\nhint: its nodes: local-1, local-2, local-3, local-4\n"
    assert run_cli(["uncordon", "nope", *state, "--json"], tmp_path).error()["code"] == "unknown-node"
    assert run_cli(["cordon", *state, "--reason", "x", "--json"], tmp_path).error()["code"] == "bad-usage"  # --reason without nodes
    assert run_cli(["uncordon", *state, "--json"], tmp_path).error()["code"] == "bad-usage"  # no node to put back
    assert run_cli(["cordon", "local-1", "--json"], tmp_path).error()["code"] == "bad-usage"  # no inventory
    run_cli(["cordon", "local-1", "local-2", "local-3", *state], tmp_path)
    err = run_cli(["plan", "--json", *state, "--strategy", "multi_node_tep", "--nodes", "2"], tmp_path).error()
    assert err["code"] == "too-few-nodes" and "cordoned 3: local-1, local-2, local-3" in err["message"]
    assert err["hint"].startswith("`k3launch uncordon local-1 local-2 local-3 -i ")
    assert not (tmp_path / "state" / "deployments").exists()
