"""Plans on real inventories: every example inventory x every strategy that fits there (golden
``plan --json`` output), placement refusals, the port table and ``--port-base``.

Goldens live in ``tests/golden/inventory/<inventory>__<selection>.json``; regenerate after an
intended change with

    K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/test_placement.py

and read the diff. Each golden was read by hand when frozen: real addresses from the inventory
in every argv/env/router URL, the inventory's NIC in GLOO/NCCL_SOCKET_IFNAME, heads first in
inventory order, P/D prefill nodes before decode nodes, router on the login node (127.0.0.1)
except for mi355x-pair whose router sits on mi355x-01.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from inventory_helpers import EXAMPLES, PLACEHOLDER, example, inventory_addresses, load_example, plan_json, run_cli, write_yaml
from plan_checks import check_plan, engine_processes

from k3launch.errors import K3Error
from k3launch.inventory import Inventory
from k3launch.plan import build_plan
from k3launch.plan_models import Plan
from k3launch.recipes import RecipeTree
from k3launch.schema import load_schema
from k3launch.selection import Selection

GOLDEN = Path(__file__).parent / "golden" / "inventory"
UPDATE = os.environ.get("K3LAUNCH_UPDATE_GOLDEN") == "1"
SCHEMA = load_schema()
TREE = RecipeTree()

SELECTIONS: dict[str, list[str]] = {
    "default": [],
    "single_node_tp": ["--strategy", "single_node_tp"],
    "multi_node_tp": ["--strategy", "multi_node_tp"],
    "multi_node_tep": ["--strategy", "multi_node_tep"],
    "multi_node_dep": ["--strategy", "multi_node_dep"],
    "pd_cluster": ["--strategy", "pd_cluster"],
    "pd_cluster_p1_d1_tep": ["--strategy", "pd_cluster", "--prefill-nodes", "1", "--decode-strategy", "tep", "--decode-nodes", "1"],
    "multi_node_tp_pp": ["--strategy", "multi_node_tp_pp"],
}
# (inventory, selection) -> what happens: "plan" (golden) or the refusal code. Every pair is listed.
OUTCOME: dict[tuple[str, str], str] = {}
_FITS = {
    "b300-single": ("single_node_tp",),
    "gb300-nvl4x4": ("multi_node_tp", "multi_node_tep", "multi_node_dep"),
    "h200-pair": ("multi_node_tp", "multi_node_tep", "multi_node_dep"),
    "local": ("single_node_tp", "multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster", "pd_cluster_p1_d1_tep"),
    "mi355x-pair": ("single_node_tp", "multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster_p1_d1_tep"),
    "slurm-b200": ("multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster"),
}
# The strategy (and node count) each inventory's default selection lands on.
DEFAULT = {"b300-single": ("single_node_tp", 1), "gb300-nvl4x4": ("multi_node_tp", 2), "h200-pair": ("multi_node_tp", 2),
           "local": ("single_node_tp", 1), "mi355x-pair": ("single_node_tp", 1), "slurm-b200": ("multi_node_tp", 2)}
for _inv in EXAMPLES:
    for _sel in SELECTIONS:
        if _sel == "default":
            continue
        if _sel in _FITS[_inv]:
            OUTCOME[(_inv, _sel)] = "plan"
        elif _sel == "multi_node_tp_pp":
            OUTCOME[(_inv, _sel)] = "incompatible-strategy"  # K3 lists no TP+PP
        elif _sel == "single_node_tp":
            OUTCOME[(_inv, _sel)] = "does-not-fit"  # one node of this GPU cannot hold 1680 GB
        elif _sel == "pd_cluster_p1_d1_tep" and _inv in ("gb300-nvl4x4", "h200-pair", "slurm-b200"):
            OUTCOME[(_inv, _sel)] = "does-not-fit"  # one node per pool cannot hold the weights
        else:
            OUTCOME[(_inv, _sel)] = "too-few-nodes"
GOLDEN_CASES = sorted(f"{i}__{s}" for (i, s), o in OUTCOME.items() if o == "plan")
REFUSED_CASES = sorted(f"{i}__{s}" for (i, s), o in OUTCOME.items() if o != "plan")


def _case(case: str) -> tuple[str, list[str]]:
    inv, sel = case.split("__")
    return inv, SELECTIONS[sel]


def _plan(case: str, home: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    inv, args = _case(case)
    return plan_json(example(inv), [*args, *extra], home)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")  # empty: no ~/.ssh/config


@pytest.fixture(scope="module")
def plans(home: Path) -> dict[str, dict[str, Any]]:
    return {case: _plan(case, home) for case in GOLDEN_CASES}


# ------------------------------------------------------------------ goldens
@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_golden(case: str, plans: dict[str, dict[str, Any]]) -> None:
    path = GOLDEN / f"{case}.json"
    got = json.dumps(plans[case], indent=2, ensure_ascii=False) + "\n"
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(got, encoding="utf-8")
        return
    assert path.is_file(), f"{path} missing: run K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/test_placement.py and review it"
    want = path.read_text(encoding="utf-8")
    if json.loads(want) != plans[case]:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), f"golden/inventory/{case}.json", "now", n=2))
        pytest.fail(f"plan {case} differs from its golden (K3LAUNCH_UPDATE_GOLDEN=1 to accept):\n{diff}")


def test_no_stale_goldens() -> None:
    stored = {p.stem for p in GOLDEN.glob("*.json")}
    assert stored == set(GOLDEN_CASES), f"goldens without a case: {stored - set(GOLDEN_CASES)}; missing: {set(GOLDEN_CASES) - stored}"


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_plan_holds_the_invariants(case: str, plans: dict[str, dict[str, Any]]) -> None:
    check_plan(SCHEMA, Plan.model_validate(plans[case]))


CONTRACT = {"recipe": str, "variant": str, "hardware": str, "strategy": str, "nodes": int, "gpus_per_node": int, "verified": bool}
PROCESS = {"id": str, "role": str, "node": str, "address": str, "head": bool, "argv": list, "env": dict, "provenance": dict}


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_design_contract_holds_with_an_inventory(case: str, plans: dict[str, dict[str, Any]]) -> None:
    """DESIGN.md §4: the keys other programs rely on, with their types."""
    plan = plans[case]
    for key, typ in CONTRACT.items():
        assert isinstance(plan[key], typ), key
    cap = plan["capacity"]
    assert isinstance(cap["weights_gb"], float) and isinstance(cap["gpu_memory_gb"], float) and cap["fits"] is True
    if plan["strategy"] == "pd_cluster":
        assert sorted(p["role"] for p in cap["pools"]) == ["decode", "prefill"]
    assert all(set(n) == {"code", "message"} for n in plan["notices"])
    for p in plan["processes"]:
        for key, typ in PROCESS.items():
            assert isinstance(p[key], typ), (p["id"], key)
        assert p["role"] in ("serve", "prefill", "decode", "router")
        assert p["http_port"] is None or isinstance(p["http_port"], int)
        assert p["image"] is None or isinstance(p["image"], str)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in p["env"].items())
        if p["role"] == "router":
            assert p["argv"][0] == "vllm-router"
        else:
            assert p["argv"][:3] == ["vllm", "serve", plan["model"]]
        for entries in p["provenance"].values():
            assert entries and all({"layer", "value"} <= set(e) for e in entries)


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_real_addresses_everywhere_a_placeholder_used_to_be(case: str, plans: dict[str, dict[str, Any]]) -> None:
    plan = plans[case]
    inv = load_example(case.split("__")[0])
    addrs = inventory_addresses(inv)
    order = [n.name for n in inv.nodes if not n.drain]
    if inv.backend == "slurm":  # the nodelist gpu-[01-16]: names are the addresses
        order = [f"gpu-{i:02d}" for i in range(1, 17)]
        addrs = {n: n for n in order}
    assert plan["inventory"] == inv.name and plan["backend"] == inv.backend and plan["engine"] == inv.engine
    assert not any(n["code"] == "placeholder-nodes" for n in plan["notices"])
    assert not any(h["placeholder"] for h in plan["hosts"])
    engines = engine_processes(Plan.model_validate(plan))
    # Nodes are taken in inventory order: the engines sit on the first N nodes.
    assert [p.node for p in engines] == order[:len(engines)]
    for p in plan["processes"]:
        assert not PLACEHOLDER.match(p["address"]), (p["id"], p["address"])
        if p["role"] == "router":
            want = inv.router.address or (addrs[inv.router.node] if inv.router.node != "login" else "127.0.0.1")
            assert p["address"] == want
            continue
        assert p["address"] == addrs[p["node"]]
        assert p["env"]["VLLM_HOST_IP"] == p["address"]
        if sum(1 for q in plan["processes"] if q["pool"] == p["pool"]) > 1:  # a multi-node pool: the inventory's NIC
            assert p["env"]["GLOO_SOCKET_IFNAME"] == p["env"]["NCCL_SOCKET_IFNAME"] == inv.defaults.iface
        words = " ".join([*p["argv"], *p["env"].values()])
        assert not re.search(r"\bnode-\d+\b|\$[A-Z_]", words), words
    for h in plan["hosts"]:
        assert not PLACEHOLDER.match(h["address"]), h
    assert not re.search(r"//(node-\d+|login)[:/]", plan["endpoint"]), plan["endpoint"]


@pytest.mark.parametrize("inv", EXAMPLES)
def test_default_selection_of_each_inventory(inv: str, home: Path) -> None:
    plan = plan_json(example(inv), [], home)
    assert (plan["strategy"], plan["nodes"]) == DEFAULT[inv]
    assert plan["hardware"] == load_example(inv).hardware


@pytest.mark.parametrize("case", REFUSED_CASES)
def test_selections_that_cannot_fit_an_inventory_are_refused(case: str, home: Path) -> None:
    inv, args = _case(case)
    err = run_cli(["plan", "--json", "-i", str(example(inv)), *args], home).error()
    assert err["code"] == OUTCOME[tuple(case.split("__"))], err  # type: ignore[index]
    assert err["hint"]


# ------------------------------------------------------------------ refusals of placement
MIXED = """name: mix
backend: ssh
defaults: {cpu_memory_gb: 4096, iface: eth0}
nodes:
  - {name: a1, address: 10.0.0.1, hardware: b300}
  - {name: a2, address: 10.0.0.2, hardware: b300, drain: true}
  - {name: h1, address: 10.0.0.3, hardware: h200}
  - {name: a3, address: 10.0.0.4, hardware: b300}
  - {name: h2, address: 10.0.0.5, hardware: h200}
  - {name: a4, address: 10.0.0.6, hardware: b300}
"""


def test_too_few_nodes_skips_drained_and_excluded_and_says_what_is_missing(tmp_path: Path) -> None:
    inv = write_yaml(tmp_path, MIXED)
    # 4 b300 nodes, 1 drained, 2 excluded: 1 usable; DEP on b300 needs 2.
    err = run_cli(["plan", "--json", "-i", str(inv), "--hardware", "b300", "--strategy", "multi_node_dep", "--exclude", "a1",
                   "--exclude", "a4"], tmp_path).error()
    assert err["code"] == "too-few-nodes"
    assert "needs 2 b300 nodes" in err["message"] and "1 usable" in err["message"], err
    assert "drained 1" in err["message"] and "excluded 2" in err["message"], err
    assert "add 1 more b300" in err["hint"], err
    # Drained/excluded nodes are skipped, not failed on: the remaining ones are used in order.
    plan = plan_json(inv, ["--hardware", "b300", "--strategy", "multi_node_dep", "--exclude", "a1"], tmp_path)
    assert [p["node"] for p in plan["processes"] if p["role"] != "router"] == ["a3", "a4"]


@pytest.mark.xfail(strict=True, reason="placement.select_nodes counts a drained/excluded node before looking at its hardware, "
                   "so an h200 refusal blames a drained b300 node ('drained 1')")
def test_too_few_nodes_message_counts_only_nodes_of_the_wanted_hardware(tmp_path: Path) -> None:
    inv = write_yaml(tmp_path, MIXED)
    err = run_cli(["plan", "--json", "-i", str(inv), "--hardware", "h200", "--strategy", "pd_cluster"], tmp_path).error()
    assert err["code"] == "too-few-nodes" and "needs 4 h200 nodes" in err["message"] and "2 usable" in err["message"]
    assert "drained" not in err["message"], err


def test_mixed_hardware_needs_hardware(tmp_path: Path) -> None:
    inv = write_yaml(tmp_path, MIXED)
    err = run_cli(["plan", "--json", "-i", str(inv)], tmp_path).error()
    assert err["code"] == "mixed-hardware" and "b300: 4" in err["message"] and "h200: 2" in err["message"]
    assert "--hardware" in err["hint"]
    plan = plan_json(inv, ["--hardware", "h200"], tmp_path)
    assert plan["hardware"] == "h200" and [p["node"] for p in plan["processes"]] == ["h1", "h2"]


POOL_TOO_SMALL = {
    "single-node-h200": ("h200-pair", ["--strategy", "single_node_tp"], "1 x h200 = 1128 GB", "multi_node_tp"),
    "pd-prefill-one-b200": ("slurm-b200", ["--strategy", "pd_cluster", "--prefill-strategy", "tp", "--prefill-nodes", "1"],
                            "prefill pool", "--prefill-nodes 2"),
    "pd-decode-one-gb300": ("gb300-nvl4x4", ["--strategy", "pd_cluster", "--prefill-nodes", "2", "--decode-strategy", "tep",
                                             "--decode-nodes", "1"], "decode pool", "--decode-nodes 2"),
}


@pytest.mark.parametrize("case", sorted(POOL_TOO_SMALL))
def test_a_pool_that_cannot_hold_the_weights_is_refused(case: str, home: Path) -> None:
    inv, args, msg, hint = POOL_TOO_SMALL[case]
    err = run_cli(["plan", "--json", "-i", str(example(inv)), *args], home).error()
    assert err["code"] == "does-not-fit" and msg in err["message"] and "1680 GB" in err["message"], err
    assert hint in err["hint"], err


KV = """name: kv
backend: ssh
hardware: b300
defaults: {cpu_memory_gb: %s}
nodes:
  - {name: k1, address: 10.0.0.1}
  - {name: k2, address: 10.0.0.2%s}
"""


@pytest.mark.parametrize(("default_gb", "k2", "refused_on"), [
    (1889, "", "k1"),  # 1889 GB = 1759.2 GiB < 8 ranks x 220 GiB = 1760 GiB
    (1890, "", None),  # 1890 GB = 1760.2 GiB: fits
    (4096, ", cpu_memory_gb: 1000", "k2"),  # a node's own value overrides the default
])
def test_simple_kv_offload_needs_ranks_times_220_gib_of_host_ram(tmp_path: Path, default_gb: int, k2: str, refused_on: str | None) -> None:
    inv = write_yaml(tmp_path, KV % (default_gb, k2))
    args = ["--strategy", "multi_node_tep", "--kv-offload", "simple"]
    if refused_on is None:
        plan = plan_json(inv, args, tmp_path)
        kv = plan["capacity"]["kv_offload"]
        assert (kv["option"], kv["ranks_per_node"], kv["host_gib_per_rank"], kv["host_gib_per_node"]) == ("simple", 8, 220, 1760)
        return
    err = run_cli(["plan", "--json", "-i", str(inv), *args], tmp_path).error()
    assert err["code"] == "kv-offload-host-ram" and err["message"].startswith(f"{refused_on}:"), err
    assert "8 ranks x 220 GiB = 1760 GiB" in err["message"] and "cpu_memory_gb" in err["hint"]


def test_unknown_exclude_is_refused(home: Path) -> None:
    err = run_cli(["plan", "--json", "-i", str(example("h200-pair")), "--exclude", "h200-z"], home).error()
    assert err["code"] == "unknown-node" and "h200-z" in err["message"] and "h200-a, h200-b" in err["hint"]


@pytest.mark.xfail(strict=True, reason="placement.select_nodes validates --exclude only against inventory.nodes; a slurm "
                   "nodelist inventory silently ignores an --exclude name that is not in its nodelist")
def test_unknown_exclude_is_refused_on_a_slurm_nodelist(home: Path) -> None:
    err = run_cli(["plan", "--json", "-i", str(example("slurm-b200")), "--exclude", "gpu-99"], home).error()
    assert err["code"] == "unknown-node"


def test_slurm_exclude_skips_nodelist_names(home: Path) -> None:
    plan = plan_json(example("slurm-b200"), ["--exclude", "gpu-01"], home)
    assert [p["node"] for p in plan["processes"]] == ["gpu-02", "gpu-03"]
    err = run_cli(["plan", "--json", "-i", str(example("slurm-b200")), "--nodes", "17", "--strategy", "multi_node_tp"], home).error()
    assert err["code"] == "too-few-nodes" and "17 b200" in err["message"] and "16 usable" in err["message"]


@pytest.mark.xfail(strict=True, reason="placement.select_nodes gives a slurm inventory without nodelist placeholder nodes "
                   "(slurm-node-i, also in --master-addr) without any notice; nothing may change silently")
def test_slurm_without_nodelist_says_its_addresses_are_placeholders(tmp_path: Path) -> None:
    inv = write_yaml(tmp_path, "name: s\nbackend: slurm\nhardware: b200\nslurm: {partition: gpu}\n")
    plan = plan_json(inv, [], tmp_path)
    assert any("slurm-node-0" in n["message"] for n in plan["notices"]), plan["notices"]


@pytest.mark.parametrize("base", ["0", "-1", "1000", "3466", "43523", "70000"])
def test_port_base_out_of_range_is_refused(base: str, home: Path) -> None:
    err = run_cli(["plan", "--json", "-i", str(example("local")), "--strategy", "pd_cluster", "--port-base", base], home).error()
    assert err["code"] == "bad-port-base" and base in err["message"] and "1024-65535" in err["message"]


@pytest.mark.parametrize("base", [3467, 9000, 43522])
def test_port_base_at_the_edges_keeps_every_port_in_range(base: int, home: Path) -> None:
    plan = _plan("local__pd_cluster", home, ("--port-base", str(base)))
    ports = [u["port"] for u in plan["ports"]]
    assert 1024 <= min(ports) and max(ports) <= 65535 and plan["port_base"] == base


# ------------------------------------------------------------------ port table
def _listening(p: dict[str, Any]) -> set[int]:
    """What a process listens on, read from its argv/env as vLLM and vllm-router would."""
    argv = p["argv"]

    def val(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv else None

    if p["role"] == "router":
        return {int(val("--port") or 0), int(val("--prometheus-port") or 0)}
    out = {int(val("--port") or 8000)} if "--headless" not in argv else set()
    if val("--master-port") and val("--node-rank") == "0":
        out.add(int(val("--master-port") or 0))
    if val("--data-parallel-rpc-port") and "--data-parallel-start-rank" not in argv:
        out.add(int(val("--data-parallel-rpc-port") or 0))
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" in p["env"]:
        start, local = int(val("--data-parallel-start-rank") or 0), int(val("--data-parallel-size-local") or 1)
        out |= {int(p["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]) + start + k for k in range(local)}
    return out


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_port_table_lists_every_listening_port(case: str, plans: dict[str, dict[str, Any]]) -> None:
    plan = plans[case]
    procs = {p["id"]: p for p in plan["processes"]}
    table = plan["ports"]
    assert all(set(u) == {"node", "address", "port", "purpose", "process"} for u in table)
    for u in table:
        assert (u["node"], u["address"]) == (procs[u["process"]]["node"], procs[u["process"]]["address"]), u
    for pid, p in procs.items():
        assert {u["port"] for u in table if u["process"] == pid} == _listening(p), pid
        if p["http_port"] is not None:
            assert any(u["port"] == p["http_port"] and u["purpose"].endswith("http") for u in table if u["process"] == pid)
    per_node = [(u["node"], u["port"]) for u in table]
    per_addr = [(u["address"], u["port"]) for u in table]
    assert len(per_node) == len(set(per_node)) and len(per_addr) == len(set(per_addr))


SHIFT_CASES = ["local__pd_cluster", "local__multi_node_dep", "mi355x-pair__multi_node_dep", "h200-pair__multi_node_tp", "slurm-b200__pd_cluster"]


@pytest.mark.parametrize("case", SHIFT_CASES)
def test_port_base_shifts_the_whole_table(case: str, plans: dict[str, dict[str, Any]], home: Path) -> None:
    base, moved = plans[case], _plan(case, home, ("--port-base", "9000"))
    assert moved["port_base"] == 9000
    key = [(u["process"], u["purpose"]) for u in base["ports"]]
    assert key == [(u["process"], u["purpose"]) for u in moved["ports"]]
    assert all(b["port"] + 1000 == m["port"] for b, m in zip(base["ports"], moved["ports"], strict=True))
    # The argv moves with the table: only port numbers differ.
    for b, m in zip(base["processes"], moved["processes"], strict=True):
        diff = [(x, y) for x, y in zip(b["argv"], m["argv"], strict=True) if x != y]
        assert all(y == str(int(x) + 1000) or y.endswith(f":{int(x.rsplit(':', 1)[1]) + 1000}") for x, y in diff), diff


@pytest.mark.parametrize("case", SHIFT_CASES)
@pytest.mark.parametrize("bases", [(8000, 9000), (8000, 10000), (9000, 20000), (4000, 43000)])
def test_two_deployments_with_different_bases_do_not_share_a_port(case: str, bases: tuple[int, int], home: Path) -> None:
    a, b = (_plan(case, home, ("--port-base", str(x))) for x in bases)
    used_a = {(u["address"], u["port"]) for u in a["ports"]}
    used_b = {(u["address"], u["port"]) for u in b["ports"]}
    assert not used_a & used_b, sorted(used_a & used_b)


@pytest.mark.xfail(strict=True, reason="placement.Ports spreads the table over 5557..29501+base offset, so two valid bases "
                   "21000 apart collide (router metrics 29000 of base 8000 == HTTP port of base 29000)")
def test_bases_21000_apart_do_not_share_a_port(home: Path) -> None:
    a, b = (_plan("local__multi_node_dep", home, ("--port-base", str(x))) for x in (8000, 29000))
    used_a = {(u["address"], u["port"]) for u in a["ports"]}
    assert not used_a & {(u["address"], u["port"]) for u in b["ports"]}


@pytest.mark.parametrize(("base", "want"), [(None, 8001), (9000, 9001)])
def test_router_on_a_node_that_serves_its_port_moves_with_a_notice(base: int | None, want: int, home: Path) -> None:
    plan = _plan("mi355x-pair__multi_node_dep", home, () if base is None else ("--port-base", str(base)))
    router = next(p for p in plan["processes"] if p["role"] == "router")
    assert (router["node"], router["http_port"]) == ("mi355x-01", want)
    assert router["argv"][router["argv"].index("--port") + 1] == str(want)
    assert plan["endpoint"] == f"http://10.3.0.21:{want}"
    notes = [n["message"] for n in plan["notices"] if n["code"] == "router-port"]
    assert len(notes) == 1 and str(want - 1) in notes[0] and str(want) in notes[0], notes


def test_pd_router_on_the_prefill_head_keeps_its_port(home: Path) -> None:
    plan = _plan("mi355x-pair__pd_cluster_p1_d1_tep", home)
    router = next(p for p in plan["processes"] if p["role"] == "router")
    prefill = next(p for p in plan["processes"] if p["role"] == "prefill")
    assert router["node"] == prefill["node"] == "mi355x-01" and (router["http_port"], prefill["http_port"]) == (8000, 8001)
    assert not any(n["code"] == "router-port" for n in plan["notices"])
    assert [h["name"] for h in plan["hosts"]] == ["mi355x-01", "mi355x-02"]  # the router's node is not listed twice


def _mi355x(router: str, home: Path) -> Path:
    return write_yaml(home, example("mi355x-pair").read_text().replace("router:\n  node: mi355x-01\n", router), "mi.yaml")


@pytest.mark.xfail(strict=True, reason="inventory.RouterSection.port is accepted but never read: router.router_process always "
                   "starts from Ports.router (8000 + offset)")
def test_pd_router_port_from_the_inventory_moves_off_an_engine_port(tmp_path: Path) -> None:
    inv = _mi355x("router:\n  node: mi355x-01\n  port: 8001\n", tmp_path)
    plan = plan_json(inv, SELECTIONS["pd_cluster_p1_d1_tep"], tmp_path)
    router = next(p for p in plan["processes"] if p["role"] == "router")
    assert router["http_port"] == 8002  # 8001 is the prefill head's HTTP port on mi355x-01
    assert any(n["code"] == "router-port" for n in plan["notices"])


@pytest.mark.xfail(strict=True, reason="placement.router_node replaces the router's address with router.address, and the port "
                   "table/free_port key on address: the router (--host 0.0.0.0) and serve-0 both get port 8000 on mi355x-01")
def test_router_address_override_still_avoids_the_nodes_ports(tmp_path: Path) -> None:
    inv = _mi355x("router:\n  node: mi355x-01\n  address: mi355x-01-public\n", tmp_path)
    plan = plan_json(inv, ["--strategy", "multi_node_dep"], tmp_path)
    used = [(u["node"], u["port"]) for u in plan["ports"]]
    assert len(used) == len(set(used)), used


@pytest.mark.xfail(strict=True, reason="placement.router_node places the router on router.node even when that node is "
                   "drained or --exclude'd")
@pytest.mark.parametrize("how", ["drain", "exclude"])
def test_router_never_lands_on_a_drained_or_excluded_node(how: str, tmp_path: Path) -> None:
    data = load_example("local").model_dump(exclude_none=True)
    data["router"] = {"node": "local-4"}
    if how == "drain":
        data["nodes"][3]["drain"] = True
    inv = Inventory.model_validate(data)
    try:
        plan = build_plan(TREE, Selection(strategy="multi_node_dep"), inventory=inv, exclude=("local-4",) if how == "exclude" else ())
    except K3Error as err:
        assert "local-4" in err.message
        return
    assert all(p.node != "local-4" for p in plan.processes)


@pytest.mark.xfail(strict=True, reason="plan._layout never passes --host: on the local backend every 'node' is this machine, "
                   "so engines (and the router's --host 0.0.0.0) bind all interfaces and DEP/P-D ranks collide on one HTTP port")
@pytest.mark.parametrize("case", ["local__multi_node_dep", "local__pd_cluster"])
def test_local_backend_listeners_bind_their_own_address(case: str, plans: dict[str, dict[str, Any]]) -> None:
    for p in plans[case]["processes"]:
        if p["http_port"] is not None:
            argv = p["argv"]
            assert "--host" in argv and argv[argv.index("--host") + 1] == p["address"], p["id"]
