"""DEP plans with vLLM's engine fault tolerance (``--fault-tolerance``, or the inventory's
``restart.fault_tolerance``): one process and API server per DP rank, the flags vLLM 0.33.0 needs,
their provenance, the router in front of every rank, what the plan tells a supervisor, and one
test per refusal. The golden plan is ``tests/golden/b300_multi_node_dep_2_fault_tolerance.json``
(tests/fast/test_golden.py); test_ft_plan_e2e.py brings one up on the simulated engine."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from inventory_helpers import ROOT, example, run_cli, write_yaml

from k3launch import api
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.selection import Selection
from k3launch.models.supervise import units
from k3launch.planning.build import build_plan
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.schema import load_schema
from k3launch.sim import cli as sim_cli
from k3launch.sim import options as sim_options

TREE = RecipeTree()
OPT_IN = "k3launch fault tolerance (--fault-tolerance)"
DEP2 = {"hardware": "b300", "strategy": "multi_node_dep", "nodes": 2}


def _plan(**kw: Any) -> Plan:
    return build_plan(TREE, Selection(**{**DEP2, **kw}))


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _refused(code: str, **kw: Any) -> K3Error:
    with pytest.raises(K3Error) as info:
        _plan(**kw)
    assert info.value.code == code, (info.value.code, info.value.message)
    assert "\n" not in info.value.message and info.value.hint
    return info.value


# ------------------------------------------------------------------ the plan
def test_every_dp_rank_is_its_own_process_with_its_own_api_server() -> None:
    plan = _plan(fault_tolerance=True)
    engines = [p for p in plan.processes if p.role != "router"]
    assert [p.id for p in engines] == [f"serve-dp{r}" for r in range(16)]
    assert [p.dp_start_rank for p in engines] == list(range(16)) and all(p.gpus == 1 for p in engines)
    assert [p.head for p in engines] == [True] + [False] * 15
    for p in engines:
        r, node = p.dp_start_rank, "node-0" if p.dp_start_rank < 8 else "node-1"
        assert p.node == node and p.http_port == 8000 + r % 8
        a = p.argv
        assert (_flag(a, "--data-parallel-rank"), _flag(a, "--data-parallel-size"), _flag(a, "--data-parallel-size-local")) == (str(r), "16", "1")
        assert (_flag(a, "--data-parallel-address"), _flag(a, "--data-parallel-rpc-port")) == ("node-0", "13345")
        assert (_flag(a, "--port"), _flag(a, "--host")) == (str(p.http_port), node)
        assert "--enable-fault-tolerance" in a and _flag(a, "--all2all-backend") == "deepep_low_latency"
        # one load-balancing mode only (vLLM refuses hybrid next to external), no start rank, no headless rank
        assert "--no-data-parallel-hybrid-lb" in a and "--data-parallel-hybrid-lb" not in a
        assert "--data-parallel-start-rank" not in a and "--headless" not in a and "--api-server-count" not in a
        assert p.env["CUDA_VISIBLE_DEVICES"] == str(r % 8)
        assert p.env["VLLM_USE_RUST_FRONTEND"] == "0"  # vllm-rs serves no /fault_tolerance routes
    # each added flag names the opt-in
    prov = engines[9].provenance
    for key in ("--enable-fault-tolerance", "--all2all-backend", "VLLM_USE_RUST_FRONTEND"):
        assert (prov[key][-1].layer, prov[key][-1].origin) == ("hardware", OPT_IN), key
    for key in ("--data-parallel-rank", "--data-parallel-size-local", "--data-parallel-hybrid-lb", "--port", "CUDA_VISIBLE_DEVICES"):
        assert prov[key][-1].origin == "k3launch placement, one process per DP rank for fault tolerance (--fault-tolerance)", key
    assert prov["VLLM_USE_RUST_FRONTEND"][0].origin.endswith("hardware_overrides.blackwell")


def test_the_router_fronts_every_rank_and_ports_are_planned() -> None:
    plan = _plan(fault_tolerance=True)
    router = plan.processes[-1]
    urls = router.argv[router.argv.index("--worker-urls") + 1:router.argv.index("--policy")]
    assert urls == [f"http://node-{r // 8}:{8000 + r % 8}" for r in range(16)]
    assert plan.endpoint == "http://login:8000"
    http = sorted((u.address, u.port) for u in plan.ports if u.purpose == "http")
    assert len(http) == 16 and len(set(http)) == 16
    assert [(u.process, u.port) for u in plan.ports if u.purpose == "dp rpc"] == [("serve-dp0", 13345)]
    assert any(n.code == "router-added" and "DP rank serves HTTP" in n.message for n in plan.notices)
    assert [h.name for h in plan.hosts] == ["node-0", "node-1", "login"] and plan.hosts[0].gpus == 8


def test_what_the_plan_tells_a_supervisor() -> None:
    plan = _plan(fault_tolerance=True)
    (ft,) = plan.fault_tolerance
    assert ft.pool == "serve" and ft.processes == [f"serve-dp{r}" for r in range(16)]
    assert (ft.recovery_timeout_s, ft.status, ft.apply, ft.origin) == (120, "/fault_tolerance/status", "/fault_tolerance/apply", "--fault-tolerance")
    # the ranks restart together: a dead rank process cannot rejoin a running group
    groups = [u for u in units(plan) if u.kind == "group"]
    assert len(groups) == 1 and list(groups[0].processes) == ft.processes and list(groups[0].http) == ft.processes
    # the engines' own timeout, however it was set
    for sets, want in ((("fault-tolerance-config.engine_recovery_timeout_sec=300",), 300),
                       (('fault-tolerance-config={"engine_recovery_timeout_sec": 45}',), 45)):
        assert _plan(fault_tolerance=True, sets=sets).fault_tolerance[0].recovery_timeout_s == want


def test_off_by_default_and_the_key_is_left_out() -> None:
    plan = _plan()
    assert plan.fault_tolerance == [] and "fault_tolerance" not in json.loads(plan.to_json())
    assert "fault_tolerance" not in plan.model_dump(mode="json")
    assert all("--enable-fault-tolerance" not in p.argv for p in plan.processes)
    assert "fault_tolerance" in _plan(fault_tolerance=True).model_dump(mode="json")


def test_an_ft_capable_backend_a_recipe_or_set_chose_is_kept() -> None:
    plan = _plan(fault_tolerance=True, sets=("all2all-backend=nixl_ep",))
    p = plan.processes[0]
    assert _flag(p.argv, "--all2all-backend") == "nixl_ep" and p.provenance["--all2all-backend"][-1].origin == "--set all2all-backend=nixl_ep"


def test_hopper_keeps_its_front_end_untouched() -> None:
    p = build_plan(TREE, Selection(hardware="h200", strategy="multi_node_dep", nodes=2, fault_tolerance=True)).processes[0]
    assert "VLLM_USE_RUST_FRONTEND" not in p.env and _flag(p.argv, "--moe-backend") == "marlin"


def test_pd_only_the_dep_pool_is_fault_tolerant() -> None:
    plan = build_plan(TREE, Selection(strategy="pd_cluster", fault_tolerance=True), port_base=9000)
    prefill = [p for p in plan.processes if p.role == "prefill"]
    decode = [p for p in plan.processes if p.role == "decode"]
    assert [p.id for p in prefill] == ["prefill-0"] and "--enable-fault-tolerance" not in prefill[0].argv
    assert [p.id for p in decode] == [f"decode-dp{r}" for r in range(16)]
    assert [p.http_port for p in decode] == [9400 + r % 8 for r in range(16)]  # --port-base: B+400 + rank index
    nixl = sorted(u.port for u in plan.ports if u.process.startswith("decode") and "nixl" in u.purpose)
    assert nixl == [9144 + r for r in range(16)]  # side channel + DP rank, as before
    # the decode role's deepep_v2 gives way, with a notice, to an all-to-all fault tolerance can run with
    assert all(_flag(p.argv, "--all2all-backend") == "deepep_low_latency" for p in decode)
    assert any(n.message == "--all2all-backend: deepep_v2 (hardware) overridden by deepep_low_latency (hardware)" for n in plan.notices)
    assert [n.message for n in plan.notices if n.message.startswith("--port: ")] == [
        "--port: 8001 (strategy) overridden by 9001 (strategy)", "--port: 8002 (strategy) overridden by 9400 (strategy)"]
    assert [f.pool for f in plan.fault_tolerance] == ["decode"]
    router = plan.processes[-1].argv
    assert router.count("--decode") == 16 and router.count("--prefill") == 1
    assert any(n.code == "fault-tolerance" and n.message.startswith("prefill pool (tep) runs without") for n in plan.notices)


def test_the_inventory_opts_in_and_the_selection_wins(tmp_path: Path) -> None:
    inv = yaml.safe_load(example("local").read_text())
    inv["restart"] = {"fault_tolerance": True}
    path = write_yaml(tmp_path, yaml.safe_dump(inv))
    plan = api.plan(path, strategy="multi_node_dep", state_dir=tmp_path / "state")
    assert plan.fault_tolerance[0].origin == "inventory local restart.fault_tolerance"
    p = plan.processes[3]
    assert p.provenance["--enable-fault-tolerance"][-1].origin == "k3launch fault tolerance (inventory local restart.fault_tolerance)"
    assert (p.address, p.http_port) == ("127.0.0.11", 8003)
    off = api.plan(path, strategy="multi_node_dep", fault_tolerance=False, state_dir=tmp_path / "state")
    assert off.fault_tolerance == [] and len(off.processes) == 3
    # the switch on the command line, both ways
    res = run_cli(["plan", "--json", "-i", str(path), "--strategy", "multi_node_dep", "--no-fault-tolerance", "--state-dir", str(tmp_path)], tmp_path)
    assert res.code == 0 and "fault_tolerance" not in res.json()
    res = run_cli(["plan", "--json", "-i", str(example("local")), "--strategy", "multi_node_dep", "--fault-tolerance",
                   "--state-dir", str(tmp_path)], tmp_path)
    assert res.code == 0 and len(res.json()["fault_tolerance"][0]["processes"]) == 16


# ------------------------------------------------------------------ refusals
def test_refused_when_no_pool_is_dep() -> None:
    err = _refused("ft-not-dep", strategy="multi_node_tep", fault_tolerance=True)
    assert "serve tep" in err.message and "multi_node_dep" in err.hint
    _refused("ft-not-dep", strategy="pd_cluster", nodes=None, decode_strategy="tep", fault_tolerance=True)


def test_refused_on_a_vllm_without_the_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = tmp_path / "schemas" / "0.26.0"
    old.mkdir(parents=True)
    src = ROOT / "k3launch" / "data" / "vllm" / "0.32.0"
    flags = json.loads((src / "serve-flags.json").read_text())
    flags["vllm_version"] = "0.26.0"
    flags["actions"] = [a for a in flags["actions"] if "fault_tolerance" not in str(a.get("dest"))]
    (old / "serve-flags.json").write_text(json.dumps(flags))
    shutil.copy(src / "env-vars.json", old / "env-vars.json")
    monkeypatch.setenv("K3LAUNCH_SCHEMA_DIR", str(tmp_path / "schemas"))
    assert load_schema("0.26.0").lookup("--enable-fault-tolerance") is None
    err = _refused("ft-unsupported-version", fault_tolerance=True, vllm_version="0.26.0")
    assert "vLLM 0.26.0 has no --enable-fault-tolerance" in err.message and "0.32.0" in err.hint
    assert _plan(vllm_version="0.26.0").fault_tolerance == []  # without the opt-in the version plans as before


def test_refused_on_rocm() -> None:
    err = _refused("ft-platform", hardware="mi355x", fault_tolerance=True)
    assert "mi355x" in err.message and "CUDA" in err.message


def test_refused_for_a_dense_model() -> None:
    with pytest.raises(K3Error) as info:
        build_plan(TREE, Selection(recipe="k3launch/tiny-llama", strategy="multi_node_dep", nodes=2, fault_tolerance=True))
    assert info.value.code == "ft-not-moe" and "multi_node_replicas" in info.value.hint


@pytest.fixture
def moe_cpu_tree(tmp_path: Path) -> Iterator[RecipeTree]:
    """The bundled tree with tiny-llama declared a MoE: a MoE recipe on a CPU profile."""
    root = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes", root)
    f = root / "models" / "k3launch" / "tiny-llama.yaml"
    f.write_text(f.read_text().replace("architecture: dense", "architecture: moe"))
    yield RecipeTree(root)


def test_refused_on_cpu_but_planned_for_the_simulated_engine(moe_cpu_tree: RecipeTree, tmp_path: Path) -> None:
    sel = Selection(recipe="k3launch/tiny-llama", strategy="multi_node_dep", nodes=2, fault_tolerance=True)
    with pytest.raises(K3Error) as info:
        build_plan(moe_cpu_tree, sel)
    assert info.value.code == "ft-platform" and "CPU build" in info.value.message
    inv = yaml.safe_load(example("local-cpu").read_text())
    inv["engine"] = "sim"
    from k3launch.planning.inventory import load_inventory

    plan = build_plan(moe_cpu_tree, sel, inventory=load_inventory(write_yaml(tmp_path, yaml.safe_dump(inv))))
    assert [p.id for p in plan.processes] == ["serve-dp0", "serve-dp1", "router"] and plan.platform == "cpu"
    assert all("CUDA_VISIBLE_DEVICES" not in p.env and _flag(p.argv, "--all2all-backend") == "deepep_low_latency"
               for p in plan.processes[:2])


@pytest.mark.parametrize(("sets", "words"), [
    (("all2all-backend=allgather_reducescatter",), "--all2all-backend is allgather_reducescatter (advanced: --set all2all-backend="),
    (("api-server-count=2",), "--api-server-count is 2"),
])
def test_refused_when_a_later_layer_undoes_it(sets: tuple[str, ...], words: str) -> None:
    assert words in _refused("ft-conflict", fault_tolerance=True, sets=sets).message


@pytest.mark.parametrize("flag", ["enable-fault-tolerance", "data-parallel-rank=3"])
def test_the_layout_flags_are_not_set_by_hand(flag: str) -> None:
    _refused("reserved-flag", fault_tolerance=True, sets=(flag,))


def test_a_refusal_is_one_line_and_exit_2(tmp_path: Path) -> None:
    res = run_cli(["plan", "--fault-tolerance"], tmp_path)
    assert res.code == 2 and res.stderr.startswith("error: fault tolerance (--fault-tolerance) is for DEP pools") and "\nhint: " in res.stderr
    assert run_cli(["plan", "--json", "--hardware", "mi355x", "--strategy", "multi_node_dep", "--fault-tolerance"], tmp_path).error()["code"] == "ft-platform"


# ------------------------------------------------------------------ the simulated engine's own check
def test_the_sim_refuses_two_load_balancing_modes_as_vllm_does() -> None:
    words = ["m", "--enable-fault-tolerance", "--all2all-backend", "deepep_low_latency", "--data-parallel-size", "2",
             "--data-parallel-rank", "1", "--data-parallel-hybrid-lb"]
    opts = sim_cli.parse_serve(load_schema("0.33.0"), words, {})
    with pytest.raises(sim_options.SimConfigError) as info:
        sim_options.check(opts, sim_options.Knobs.from_env({}))
    assert str(info.value).startswith("Cannot use more than one data parallel load balancing mode.")
    # what a fault-tolerant plan writes starts
    plan = _plan(fault_tolerance=True)
    p = plan.processes[9]
    opts = sim_cli.parse_serve(load_schema("0.33.0"), p.argv[2:], p.env)
    sim_options.check(opts, sim_options.Knobs.from_env({}))
    assert (opts.dp_rank, opts.dp_local, opts.external_lb, opts.hybrid_lb, opts.ft.enabled) == (9, 1, True, False, True)


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status, json.loads(r.read())
