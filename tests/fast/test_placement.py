"""Plans on real inventories: every example inventory x every strategy that fits there (golden
``plan --json`` output), placement refusals, the port table and ``--port-base``.

Goldens live in ``tests/golden/inventory/<inventory>__<selection>.json``; regenerate after an
intended change with

    K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/fast/test_placement.py

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
from paths import TESTS
from plan_checks import check_plan, engine_processes

from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import Inventory
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.schema import load_schema

GOLDEN = TESTS / "golden" / "inventory"
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
    "h200-pair": ("multi_node_tp", "multi_node_tep", "multi_node_dep"),
    "h200-staged": ("multi_node_tp", "multi_node_tep", "multi_node_dep"),  # the pair's layouts, the weights staged and read its way
    "local": ("single_node_tp", "multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster", "pd_cluster_p1_d1_tep"),
    "mi355x-pair": ("single_node_tp", "multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster_p1_d1_tep"),
    "slurm-b200": ("multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster"),
    "gb300-nvl4x4": ("multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster_p1_d1_tep"),  # floors raise 1+1 to 2+2
    "local-cpu": ("single_node_tp", "multi_node_tp", "multi_node_dep"),  # tiny-llama lists only these three
}
# Options every plan of an inventory starts with: a CPU profile is restricted to recipes that list it.
INVENTORY_ARGS = {"local-cpu": ["--recipe", "k3launch/tiny-llama"]}
# The strategy (and node count) each inventory's default selection lands on.
DEFAULT = {"b300-single": ("single_node_tp", 1), "gb300-nvl4x4": ("multi_node_tp", 2), "h200-pair": ("multi_node_tp", 2),
           "h200-staged": ("multi_node_tp", 2), "local": ("single_node_tp", 1), "mi355x-pair": ("single_node_tp", 1),
           "slurm-b200": ("multi_node_tp", 2), "local-cpu": ("single_node_tp", 1)}
for _inv in EXAMPLES:
    for _sel in SELECTIONS:
        if _sel == "default":
            continue
        if _sel in _FITS[_inv]:
            OUTCOME[(_inv, _sel)] = "plan"
        elif _sel == "multi_node_tp_pp" or _inv == "local-cpu":
            OUTCOME[(_inv, _sel)] = "incompatible-strategy"  # K3 lists no TP+PP
        elif _sel == "single_node_tp":
            OUTCOME[(_inv, _sel)] = "does-not-fit"  # one node of this GPU cannot hold 1680 GB
        elif _sel == "pd_cluster_p1_d1_tep" and _inv in ("h200-pair", "h200-staged", "slurm-b200"):
            OUTCOME[(_inv, _sel)] = "does-not-fit"  # one node per pool cannot hold the weights
        else:
            OUTCOME[(_inv, _sel)] = "too-few-nodes"
GOLDEN_CASES = sorted(f"{i}__{s}" for (i, s), o in OUTCOME.items() if o == "plan")
REFUSED_CASES = sorted(f"{i}__{s}" for (i, s), o in OUTCOME.items() if o != "plan")


def _case(case: str) -> tuple[str, list[str]]:
    inv, sel = case.split("__")
    return inv, [*INVENTORY_ARGS.get(inv, []), *SELECTIONS[sel]]


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
    assert path.is_file(), f"{path} missing: run K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/fast/test_placement.py and review it"
    want = path.read_text(encoding="utf-8")
    if json.loads(want) != plans[case]:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), f"golden/inventory/{case}.json", "now", n=2))
        pytest.fail(f"plan {case} differs from its golden (K3LAUNCH_UPDATE_GOLDEN=1 to accept):\n{diff}")


def test_no_stale_goldens() -> None:
    stored = {p.stem for p in GOLDEN.glob("*.json")}
    assert stored == set(GOLDEN_CASES), f"goldens without a case: {stored - set(GOLDEN_CASES)}; missing: {set(GOLDEN_CASES) - stored}"


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_plan_holds_the_invariants(case: str, plans: dict[str, dict[str, Any]]) -> None:
    plan = Plan.model_validate(plans[case])
    check_plan(load_schema(plan.vllm_version), plan)  # in the spellings of the vLLM the inventory runs (local-cpu: 0.32.0)


CONTRACT = {"recipe": str, "variant": str, "hardware": str, "strategy": str, "nodes": int, "gpus_per_node": int, "verified": bool}
PROCESS = {"id": str, "role": str, "node": str, "address": str, "head": bool, "argv": list, "env": dict, "provenance": dict}


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_design_contract_holds_with_an_inventory(case: str, plans: dict[str, dict[str, Any]]) -> None:
    """docs/design.md ("The plan JSON contract"): the keys other programs rely on, with their types."""
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
            if inv.backend == "slurm":  # inside the allocation, on the first engine node
                assert p["node"] == engines[0].node and p["address"] == engines[0].address
                assert p["argv"][p["argv"].index("--host") + 1] == engines[0].address
                continue
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
    plan = plan_json(example(inv), INVENTORY_ARGS.get(inv, []), home)
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


@pytest.mark.parametrize("exclude", [[], ["--exclude", "a1"], ["--exclude", "h2"]])
def test_too_few_nodes_message_counts_only_nodes_of_the_wanted_hardware(tmp_path: Path, exclude: list[str]) -> None:
    """A node of other hardware counts as that, even when it is also drained or excluded."""
    inv = write_yaml(tmp_path, MIXED)
    err = run_cli(["plan", "--json", "-i", str(inv), "--hardware", "h200", "--strategy", "pd_cluster", *exclude], tmp_path).error()
    usable = 1 if "h2" in exclude else 2
    assert err["code"] == "too-few-nodes" and "needs 4 h200 nodes" in err["message"] and f"{usable} usable" in err["message"], err
    assert "drained" not in err["message"] and "of other hardware 4" in err["message"], err
    assert ("excluded 1" in err["message"]) == ("h2" in exclude), err
    assert f"add {4 - usable} more h200" in err["hint"], err


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
    "pd-decode-one-h200": ("h200-pair", ["--strategy", "pd_cluster", "--prefill-strategy", "tp", "--prefill-nodes", "2",
                                         "--decode-strategy", "tep", "--decode-nodes", "1"], "decode pool", "--decode-nodes 2"),
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


def test_unknown_exclude_is_refused_on_a_slurm_nodelist(home: Path) -> None:
    err = run_cli(["plan", "--json", "-i", str(example("slurm-b200")), "--exclude", "gpu-02", "--exclude", "gpu-99"], home).error()
    assert err["code"] == "unknown-node" and "gpu-99" in err["message"] and "gpu-[01-16]" in err["message"], err
    assert err["hint"]


def test_slurm_exclude_skips_nodelist_names(home: Path) -> None:
    plan = plan_json(example("slurm-b200"), ["--exclude", "gpu-01"], home)
    assert [p["node"] for p in plan["processes"]] == ["gpu-02", "gpu-03"]
    err = run_cli(["plan", "--json", "-i", str(example("slurm-b200")), "--nodes", "17", "--strategy", "multi_node_tp"], home).error()
    assert err["code"] == "too-few-nodes" and "17 b200" in err["message"] and "16 usable" in err["message"]


def test_slurm_without_nodelist_says_its_addresses_are_placeholders(tmp_path: Path) -> None:
    inv = write_yaml(tmp_path, "name: s\nbackend: slurm\nhardware: b200\nslurm: {partition: gpu}\n")
    plan = plan_json(inv, [], tmp_path)
    notes = [n["message"] for n in plan["notices"] if n["code"] == "placeholder-nodes"]
    assert len(notes) == 1 and "slurm-node-0" in notes[0] and "nodelist" in notes[0], plan["notices"]
    assert [h["name"] for h in plan["hosts"] if h["placeholder"]] == ["slurm-node-0", "slurm-node-1"], plan["hosts"]
    # With a nodelist the names are real: no such notice (test_real_addresses_everywhere_a_placeholder_used_to_be).


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


# ------------------------------------------------------------------ --port-base
# Without --port-base the conventional ports; with --port-base B every port lies in B..B+511.
BLOCK = 512
SLOT = {"router http": 3, "router metrics": 4, "tp master": 5, "dp rpc": 6}
HTTP_SLOT = {"serve": 0, "prefill": 1, "decode": 2}
NIXL_SLOT = {"prefill": 16, "decode": 144}
# The ports a default deployment uses (NIXL: 5557/5558 + DP rank, at most 16 x 8 ranks per pool).
DEFAULT_PORTS = {8000, 8001, 8002, 13345, 29000, 29501, *range(5557, 5558 + 128)}
PORT_FLAGS = ("--port", "--master-port", "--data-parallel-rpc-port", "--prometheus-port")
SHIFT_CASES = ["local__pd_cluster", "local__multi_node_dep", "mi355x-pair__multi_node_dep", "h200-pair__multi_node_tp", "slurm-b200__pd_cluster"]
# Accepted bases at the edges of what is allowed: the range ends and both sides of every default port.
EDGE_BASES = [1024, 5045, 5688, 7488, 8003, 12833, 13346, 28488, 29502, 65024]


def _slot(u: dict[str, Any], role: str) -> int:
    """Where a port of ``purpose`` sits in the --port-base block (the documented layout)."""
    purpose = u["purpose"]
    if purpose == "http":
        return HTTP_SLOT[role]
    if purpose.startswith("nixl side channel (dp rank "):
        return NIXL_SLOT[role] + int(purpose.rsplit(" ", 1)[1].rstrip(")"))
    return SLOT[purpose]


def _flag_values(argv: list[str]) -> dict[str, list[str]]:
    """flag -> the words after each of its occurrences (``--prefill`` repeats)."""
    out: dict[str, list[str]] = {}
    for i, tok in enumerate(argv):
        if tok.startswith("--"):
            vals = []
            for nxt in argv[i + 1:]:
                if nxt.startswith("--"):
                    break
                vals.append(nxt)
            out.setdefault(tok, []).append(" ".join(vals))
    return out


def _url_ports(words: str) -> list[tuple[str, int]]:
    return [(a, int(p)) for a, p in re.findall(r"http://([^:/\s]+):(\d+)", words)]


@pytest.mark.parametrize("base", ["0", "-1", "1000", "1023", "65025", "70000"])
def test_port_base_whose_block_leaves_the_port_range_is_refused(base: str, home: Path) -> None:
    err = run_cli(["plan", "--json", "-i", str(example("local")), "--strategy", "pd_cluster", "--port-base", base], home).error()
    assert err["code"] == "bad-port-base" and base in err["message"] and "1024-65535" in err["message"], err
    assert "65024" in err["hint"], err  # the highest base whose block still fits


@pytest.mark.parametrize(("base", "clash"), [(5046, 5557), (5557, 5557), (5600, 5600), (5685, 5685), (7489, 8000), (8000, 8000),
                                             (8002, 8002), (12834, 13345), (13345, 13345), (28489, 29000), (28990, 29000),
                                             (29000, 29000), (29501, 29501)])
def test_port_base_whose_block_overlaps_the_default_ports_is_refused(base: int, clash: int, home: Path) -> None:
    """A compact deployment may never collide with a default one, so its block avoids every default port."""
    assert base <= clash < base + BLOCK and clash in DEFAULT_PORTS
    err = run_cli(["plan", "--json", "-i", str(example("local")), "--strategy", "multi_node_tp", "--port-base", str(base)], home).error()
    assert err["code"] == "bad-port-base" and str(base) in err["message"] and "overlaps" in err["message"], err
    assert str(clash) in err["message"], err
    # The bases the hint suggests are themselves accepted.
    suggested = re.findall(r"\b\d{4,5}\b(?!-)", err["hint"].split("e.g.", 1)[1])
    assert suggested, err["hint"]
    for good in suggested:
        assert plan_json(example("local"), ["--strategy", "multi_node_tp", "--port-base", good], home)["port_base"] == int(good)


@pytest.mark.parametrize("base", EDGE_BASES)
def test_port_base_at_the_edges_keeps_every_port_in_its_block(base: int, home: Path) -> None:
    assert not DEFAULT_PORTS & set(range(base, base + BLOCK)) and 1024 <= base and base + BLOCK - 1 <= 65535
    plan = _plan("local__pd_cluster", home, ("--port-base", str(base)))
    assert plan["port_base"] == base
    assert all(base <= u["port"] < base + BLOCK for u in plan["ports"]), plan["ports"]


@pytest.mark.parametrize("case", SHIFT_CASES)
@pytest.mark.parametrize("base", [1024, 9000, 65024])
def test_port_base_puts_the_whole_deployment_in_one_block(case: str, base: int, plans: dict[str, dict[str, Any]], home: Path) -> None:
    default, compact = plans[case], _plan(case, home, ("--port-base", str(base)))
    assert compact["port_base"] == base
    # The same listeners, each at its documented slot of the block.
    assert [(u["process"], u["purpose"]) for u in default["ports"]] == [(u["process"], u["purpose"]) for u in compact["ports"]]
    role = {p["id"]: p["role"] for p in compact["processes"]}
    for u in compact["ports"]:
        assert u["port"] == base + _slot(u, role[u["process"]]), u
    assert not any(n["code"] == "router-port" for n in compact["notices"]), compact["notices"]
    http = {(p["address"], p["http_port"]): p["role"] for p in compact["processes"] if p["role"] != "router" and p["http_port"]}
    # argv and env change only in port numbers (and the router's URLs); every port word lies in the block.
    for b, m in zip(default["processes"], compact["processes"], strict=True):
        assert (b["id"], b["node"], b["address"]) == (m["id"], m["node"], m["address"])
        fb, fm = _flag_values(b["argv"]), _flag_values(m["argv"])
        head = 1 if m["role"] == "router" else 3  # vllm-router | vllm serve MODEL
        assert m["argv"][:head] == b["argv"][:head] and fb.keys() == fm.keys(), m["id"]
        assert sorted(b["env"]) == sorted(m["env"]), m["id"]
        changed = {k for k in fb if fb[k] != fm[k]}
        env_changed = {k for k in b["env"] if b["env"][k] != m["env"][k]}
        if m["role"] == "router":
            assert changed <= {"--port", "--prometheus-port", "--prefill", "--decode", "--worker-urls"}, changed
            urls = _url_ports(" ".join(v for k in ("--prefill", "--decode", "--worker-urls") for v in fm.get(k, [])))
            assert urls and all(http[(a, p)] in HTTP_SLOT and p == base + HTTP_SLOT[http[(a, p)]] for a, p in urls), urls
            assert [a for a, _ in urls] == [a for a, _ in _url_ports(" ".join(v for k in ("--prefill", "--decode", "--worker-urls")
                                                                              for v in fb.get(k, [])))]
        else:
            assert changed <= set(PORT_FLAGS), (m["id"], changed)
            assert env_changed <= {"VLLM_NIXL_SIDE_CHANNEL_PORT"}, (m["id"], env_changed)
            if "VLLM_NIXL_SIDE_CHANNEL_PORT" in m["env"]:
                assert m["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(base + NIXL_SLOT[m["role"]]), m["id"]
            for flag, want in (("--master-port", 5), ("--data-parallel-rpc-port", 6)):  # heads and the nodes joining them
                assert all(v == str(base + want) for v in fm.get(flag, [])), (m["id"], flag)
            if m["http_port"] is not None:
                assert fm["--port"] == [str(base + HTTP_SLOT[m["role"]])], m["id"]
            else:  # a headless node serves no HTTP: a recipe's --port on it is inert and left as it was
                assert fm.get("--port") == fb.get("--port"), m["id"]
        for flag in PORT_FLAGS:
            listens = flag != "--port" or m["http_port"] is not None
            assert not listens or all(base <= int(v) < base + BLOCK for v in fm.get(flag, [])), (m["id"], flag)
    # The recipe's own P/D ports (8001/8002, NIXL 5557/5558) are overridden, with notices.
    if compact["strategy"] == "pd_cluster":
        notes = [n["message"] for n in compact["notices"] if n["code"] == "overridden"]
        for old, slot in (("--port: 8001", 1), ("--port: 8002", 2), ("VLLM_NIXL_SIDE_CHANNEL_PORT: 5557", 16),
                          ("VLLM_NIXL_SIDE_CHANNEL_PORT: 5558", 144)):
            assert any(old in n and f"by {base + slot}" in n for n in notes), (old, notes)


@pytest.mark.parametrize("case", SHIFT_CASES)
@pytest.mark.parametrize("bases", [*((None, b) for b in EDGE_BASES), (1024, 1536), (9000, 9512), (9000, 30000), (20000, 65024)])
def test_deployments_share_no_port_number_default_or_bases_512_apart(case: str, bases: tuple[int | None, int],
                                                                    plans: dict[str, dict[str, Any]], home: Path) -> None:
    """Compared by port number alone: on the local backend every "node" is this one machine."""
    a, b = (plans[case] if x is None else _plan(case, home, ("--port-base", str(x))) for x in bases)
    used_a, used_b = {u["port"] for u in a["ports"]}, {u["port"] for u in b["ports"]}
    assert not used_a & used_b, sorted(used_a & used_b)
    if bases[0] is None:
        assert used_a <= DEFAULT_PORTS, sorted(used_a - DEFAULT_PORTS)  # the default deployment keeps the conventional ports


def test_bases_21000_apart_do_not_share_a_port(home: Path) -> None:
    """Once a collision: router metrics 29000 of one base was the HTTP port of a base 21000 higher."""
    a, b = (_plan("local__multi_node_dep", home, ("--port-base", str(x))) for x in (9000, 30000))
    assert not {u["port"] for u in a["ports"]} & {u["port"] for u in b["ports"]}


# ------------------------------------------------------------------ the router's port and node
def test_router_on_a_node_that_serves_its_port_moves_with_a_notice(plans: dict[str, dict[str, Any]]) -> None:
    plan = plans["mi355x-pair__multi_node_dep"]
    router = next(p for p in plan["processes"] if p["role"] == "router")
    assert (router["node"], router["http_port"]) == ("mi355x-01", 8001)
    assert router["argv"][router["argv"].index("--port") + 1] == "8001"
    assert plan["endpoint"] == "http://10.3.0.21:8001"
    notes = [n["message"] for n in plan["notices"] if n["code"] == "router-port"]
    assert len(notes) == 1 and "8000" in notes[0] and "8001" in notes[0], notes


def test_compact_router_has_its_own_slot_on_an_engine_node(home: Path) -> None:
    plan = _plan("mi355x-pair__multi_node_dep", home, ("--port-base", "9000"))
    router = next(p for p in plan["processes"] if p["role"] == "router")
    assert (router["node"], router["http_port"]) == ("mi355x-01", 9003) and plan["endpoint"] == "http://10.3.0.21:9003"
    assert router["argv"][router["argv"].index("--prometheus-port") + 1] == "9004"
    assert not any(n["code"] == "router-port" for n in plan["notices"])


def test_pd_router_on_the_prefill_head_keeps_its_port(home: Path) -> None:
    plan = _plan("mi355x-pair__pd_cluster_p1_d1_tep", home)
    router = next(p for p in plan["processes"] if p["role"] == "router")
    prefill = next(p for p in plan["processes"] if p["role"] == "prefill")
    assert router["node"] == prefill["node"] == "mi355x-01" and (router["http_port"], prefill["http_port"]) == (8000, 8001)
    assert not any(n["code"] == "router-port" for n in plan["notices"])
    assert [h["name"] for h in plan["hosts"]] == ["mi355x-01", "mi355x-02"]  # the router's node is not listed twice


def _mi355x(router: str, home: Path) -> Path:
    return write_yaml(home, example("mi355x-pair").read_text().replace("router:\n  node: mi355x-01\n", router), "mi.yaml")


def _local(router: str, home: Path) -> Path:
    return write_yaml(home, example("local").read_text().replace("router:\n  node: login\n  address: 127.0.0.1\n", router), "lo.yaml")


def test_pd_router_port_from_the_inventory_moves_off_an_engine_port(tmp_path: Path) -> None:
    inv = _mi355x("router:\n  node: mi355x-01\n  port: 8001\n", tmp_path)
    plan = plan_json(inv, SELECTIONS["pd_cluster_p1_d1_tep"], tmp_path)
    router = next(p for p in plan["processes"] if p["role"] == "router")
    assert router["http_port"] == 8002  # 8001 is the prefill head's HTTP port on mi355x-01
    assert router["argv"][router["argv"].index("--port") + 1] == "8002" and plan["endpoint"] == "http://10.3.0.21:8002"
    notes = [n["message"] for n in plan["notices"] if n["code"] == "router-port"]
    assert len(notes) == 1 and "8001" in notes[0] and "8002" in notes[0], notes


@pytest.mark.parametrize("port", [8100, 8001])
def test_router_port_from_the_inventory_is_honoured(port: int, tmp_path: Path) -> None:
    """On the login node nothing else listens: router.port is used as given (8001 is prefill's port on local-1, another node)."""
    inv = _local(f"router:\n  node: login\n  address: 127.0.0.1\n  port: {port}\n", tmp_path)
    plan = plan_json(inv, ["--strategy", "pd_cluster"], tmp_path)
    router = next(p for p in plan["processes"] if p["role"] == "router")
    assert (router["node"], router["http_port"]) == ("login", port) and plan["endpoint"] == f"http://127.0.0.1:{port}"
    assert router["argv"][router["argv"].index("--port") + 1] == str(port)
    assert not any(n["code"] == "router-port" for n in plan["notices"])
    check_plan(SCHEMA, Plan.model_validate(plan))


def test_router_address_override_still_avoids_the_nodes_ports(tmp_path: Path) -> None:
    """router.address names how clients reach the router; its node is still one machine with serve-0 on 8000."""
    inv = _mi355x("router:\n  node: mi355x-01\n  address: mi355x-01-public\n", tmp_path)
    plan = plan_json(inv, ["--strategy", "multi_node_dep"], tmp_path)
    router = next(p for p in plan["processes"] if p["role"] == "router")
    assert (router["node"], router["address"], router["http_port"]) == ("mi355x-01", "mi355x-01-public", 8001)
    assert plan["endpoint"] == "http://mi355x-01-public:8001"
    assert any(n["code"] == "router-port" for n in plan["notices"])
    used = [(u["node"], u["port"]) for u in plan["ports"]]
    assert len(used) == len(set(used)), used


def test_login_router_sharing_an_engine_address_moves_off_its_port(tmp_path: Path) -> None:
    inv = _mi355x("router:\n  node: login\n  address: 10.3.0.21\n", tmp_path)
    plan = plan_json(inv, ["--strategy", "multi_node_dep"], tmp_path)
    router = next(p for p in plan["processes"] if p["role"] == "router")
    assert (router["address"], router["http_port"]) == ("10.3.0.21", 8001)
    assert any(n["code"] == "router-port" for n in plan["notices"])


@pytest.mark.parametrize("how", ["drain", "exclude"])
def test_router_never_lands_on_a_drained_or_excluded_node(how: str, tmp_path: Path) -> None:
    data = load_example("local").model_dump(exclude_none=True)
    data["router"] = {"node": "local-4"}
    if how == "drain":
        data["nodes"][3]["drain"] = True
    inv = Inventory.model_validate(data)
    exclude = ("local-4",) if how == "exclude" else ()
    with pytest.raises(K3Error) as exc:
        build_plan(TREE, Selection(strategy="multi_node_dep"), inventory=inv, exclude=exclude)
    assert exc.value.code == "router-node-unavailable", exc.value.as_dict()
    assert "local-4" in exc.value.message and ("drained" if how == "drain" else "excluded") in exc.value.message
    assert "router.node" in exc.value.hint
    # The same through the CLI (exit 2, one JSON error), and the router's node is fine when neither.
    path = write_yaml(tmp_path, example("local").read_text().replace("router:\n  node: login\n  address: 127.0.0.1\n", "router:\n  node: local-4\n")
                      .replace("address: 127.0.0.14}", "address: 127.0.0.14, drain: true}" if how == "drain" else "address: 127.0.0.14}"))
    err = run_cli(["plan", "--json", "-i", str(path), "--strategy", "multi_node_dep", *(["--exclude", "local-4"] if exclude else [])], tmp_path).error()
    assert err["code"] == "router-node-unavailable" and "local-4" in err["message"], err
    plan = build_plan(TREE, Selection(strategy="multi_node_dep"), inventory=inv.model_copy(update={"nodes": load_example("local").nodes}))
    assert next(p for p in plan.processes if p.role == "router").node == "local-4"


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_every_listener_binds_its_own_address(case: str, plans: dict[str, dict[str, Any]]) -> None:
    """Ports are planned per address, so every HTTP listener binds exactly its address (not 0.0.0.0):
    on the local backend all "nodes" are one machine and DEP/P-D ranks share a port number."""
    for p in plans[case]["processes"]:
        if p["http_port"] is not None:
            argv = p["argv"]
            assert "--host" in argv and argv[argv.index("--host") + 1] == p["address"], p["id"]
