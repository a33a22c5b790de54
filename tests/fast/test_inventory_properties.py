"""Random inventories x random selections: a sound placed plan, or a refusal that says why.

Inventories have 1..24 nodes of a random hardware mix (per node, or inventory-wide), random
drains, random IPv4 addresses (or none: the name is the address), random NICs and host RAM, a
router on the login node or on a random node (drained or excluded ones are refused); selections
draw hardware, strategy, node counts, P/D pools, KV offload, ``--exclude`` names and ``--port-base``
(valid bases, and ones whose 512-port block leaves 1024-65535 or overlaps the default ports).

Every draw either raises :class:`K3Error` (code, one-line message, hint) or yields a plan that
satisfies :func:`plan_checks.check_plan` (schema-clean argv, DP ranks 0..DP-1 exactly once,
disjoint P/D pools, unique ports per address) and, checked here independently of k3launch's own
bookkeeping: every engine runs on a non-drained, non-excluded inventory node of the plan's
hardware, taken in inventory order; addresses are the inventory's (no placeholder left);
every listening port read from the argv is in the port table and unique per node and address;
without ``--port-base`` only the conventional ports are used, with ``--port-base B`` every port
sits at its documented slot of ``B .. B+511``.
"""

from __future__ import annotations

import re
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from plan_checks import check_plan

from k3launch.errors import K3Error
from k3launch.models.plan import Plan, Process
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import Inventory
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.schema import load_schema

TREE = RecipeTree()
SCHEMA = load_schema()
HARDWARE = ("b300", "b300", "h200", "gb300", "mi355x", "b200")
STRATEGIES = (None, "single_node_tp", "multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster", "pd_cluster")
PLACEHOLDER = re.compile(r"^(node-\d+|slurm-node-\d+|login)$")
# Every refusal the space below can legitimately produce.
REFUSALS = {
    "too-few-nodes", "mixed-hardware", "unknown-node", "does-not-fit", "single-node-strategy", "pool-too-large",
    "kv-offload-host-ram", "kv-offload-pd", "kv-offload-strategy", "kv-offload-unsupported", "bad-port-base",
    "incompatible-strategy", "pd-nodes", "bad-nodes", "router-node-unavailable",
}
BLOCK = 512
# The ports of a default deployment (NIXL 5557/5558 + DP rank, at most 16 x 8 ranks per pool).
DEFAULT_PORTS = {8000, 8001, 8002, 13345, 29000, 29501, *range(5557, 5558 + 128)}
# Where each purpose sits in a --port-base block (http by role; NIXL + DP rank by role).
SLOT = {"router http": 3, "router metrics": 4, "tp master": 5, "dp rpc": 6}
HTTP_SLOT = {"serve": 0, "prefill": 1, "decode": 2}
NIXL_SLOT = {"prefill": 16, "decode": 144}


def _base_ok(base: int | None) -> bool:
    return base is None or (1024 <= base and base + BLOCK - 1 <= 65535 and not DEFAULT_PORTS & set(range(base, base + BLOCK)))


@st.composite
def inventories(draw: st.DrawFn) -> tuple[Inventory, set[str]]:
    """An inventory, and the names of nodes the router may not use (drained)."""
    n = draw(st.integers(1, 24))
    inv_hw = draw(st.sampled_from((None, *HARDWARE)))
    net, start = draw(st.integers(0, 255)), draw(st.integers(1, 200))  # unique addresses without rejection sampling
    nodes: list[dict[str, Any]] = []
    for i in range(n):
        node: dict[str, Any] = {"name": f"{draw(st.sampled_from(('gpu', 'n', 'h200x', 'tray')))}-{i:02d}"}
        if draw(st.integers(0, 3)):
            node["address"] = f"10.{net}.{(start + i) // 250}.{(start + i) % 250 + 1}"
        if inv_hw is None or draw(st.integers(0, 5)) == 0:
            node["hardware"] = draw(st.sampled_from(HARDWARE))
        if draw(st.integers(0, 4)) == 0:
            node["drain"] = True
        if draw(st.integers(0, 5)) == 0:
            node["iface"] = draw(st.sampled_from(("ib1", "eth2", "enp1s0")))
        if draw(st.integers(0, 5)) == 0:
            node["cpu_memory_gb"] = draw(st.sampled_from((512, 1889, 1890, 4096)))
        nodes.append(node)
    data: dict[str, Any] = {
        "name": "prop", "backend": draw(st.sampled_from(("ssh", "local"))), "nodes": nodes,
        "defaults": {"iface": draw(st.sampled_from(("ib0", "eth0", "lo"))), "cpu_memory_gb": draw(st.sampled_from((1024, 2048, 4096)))},
    }
    if inv_hw is not None:
        data["hardware"] = inv_hw
    if draw(st.booleans()):
        data["router"] = {"node": draw(st.sampled_from(nodes))["name"]}
    return Inventory.model_validate(data), {nd["name"] for nd in nodes if nd.get("drain")}


@st.composite
def selections(draw: st.DrawFn, inv: Inventory, names: list[str]) -> tuple[Selection, tuple[str, ...], int | None]:
    strategy = draw(st.sampled_from(STRATEGIES))
    pd = strategy == "pd_cluster"
    present = sorted({n.hardware or inv.hardware for n in inv.nodes} - {None})  # type: ignore[type-var]
    # Mostly hardware the inventory has (plans), sometimes none (its default or a mix) or any id (refusals).
    hardware = draw(st.sampled_from((None, "any", "present", "present", "present")))
    sel = Selection(
        hardware=draw(st.sampled_from(HARDWARE)) if hardware == "any" else draw(st.sampled_from(present)) if hardware else None,
        strategy=strategy,
        nodes=None if pd else draw(st.one_of(st.none(), st.integers(1, 6))),
        prefill_strategy=draw(st.sampled_from((None, "tp", "tep", "dep"))) if pd else None,
        prefill_nodes=draw(st.one_of(st.none(), st.integers(1, 4))) if pd else None,
        decode_strategy=draw(st.sampled_from((None, "tp", "tep", "dep"))) if pd else None,
        decode_nodes=draw(st.one_of(st.none(), st.integers(1, 4))) if pd else None,
        kv_offload="off" if pd else draw(st.sampled_from(("off", "off", "simple", "off"))),
    )
    exclude = draw(st.lists(st.sampled_from(names), max_size=3, unique=True)) if names else []
    if draw(st.sampled_from((False,) * 10 + (True,) + (False,) * 10)):
        exclude.append("no-such-node")
    kind = draw(st.sampled_from(("none",) * 5 + ("valid",) * 4 + ("bad",)))
    base = None if kind == "none" else draw(st.sampled_from(
        (9000, 12000, 20000, 36000, 1024, 65024, 5045, 29502) if kind == "valid"
        else (100, 1023, 65025, 8000, 7489, 5600, 13000, 29000, 28990)))  # out of range / overlapping the default ports
    return sel, tuple(exclude), base


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _listening(p: Process) -> set[int]:
    """Ports a process listens on, read from its argv/env as vLLM / vllm-router would."""
    if p.role == "router":
        return {int(_flag(p.argv, "--port") or 0), int(_flag(p.argv, "--prometheus-port") or 0)}
    out = set() if "--headless" in p.argv else {int(_flag(p.argv, "--port") or 8000)}
    if _flag(p.argv, "--master-port") and _flag(p.argv, "--node-rank") == "0":
        out.add(int(_flag(p.argv, "--master-port") or 0))
    if _flag(p.argv, "--data-parallel-rpc-port") and "--data-parallel-start-rank" not in p.argv:
        out.add(int(_flag(p.argv, "--data-parallel-rpc-port") or 0))
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" in p.env:
        start, local = int(_flag(p.argv, "--data-parallel-start-rank") or 0), int(_flag(p.argv, "--data-parallel-size-local") or 1)
        out |= {int(p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) + start + k for k in range(local)}
    return out


def _check_refusal(err: K3Error, inv: Inventory, sel: Selection, exclude: tuple[str, ...], base: int | None) -> None:
    event(f"refused {err.code}")
    assert err.code in REFUSALS, f"unexpected refusal {err.code}: {err.message}"
    assert err.message.strip() and "\n" not in err.message and err.hint.strip(), err.as_dict()
    if err.code == "unknown-node":
        assert "no-such-node" in exclude and "no-such-node" in err.message
    if err.code == "bad-port-base":
        assert not _base_ok(base) and str(base) in err.message, (base, err.message)
    if err.code == "router-node-unavailable":
        router = next(n for n in inv.nodes if n.name == inv.router.node)
        assert router.drain or router.name in exclude, err.message
        assert router.name in err.message and ("drained" if router.drain else "excluded") in err.message
    if err.code == "mixed-hardware":
        kinds = {n.hardware for n in inv.nodes if n.hardware}
        assert sel.hardware is None and inv.hardware is None and len(kinds) > 1
    if err.code == "too-few-nodes":
        m = re.search(r"needs (\d+) (\w+) nodes; inventory \S+ has (\d+) usable", err.message)
        assert m, err.message
        hw, have = m[2], int(m[3])
        usable = [n for n in inv.nodes if not n.drain and n.name not in exclude and (n.hardware or inv.hardware or hw) == hw]
        assert have == len(usable) < int(m[1]), (err.message, [n.name for n in usable])
        assert f"add {int(m[1]) - have} more {hw}" in err.hint
        # Why the others are not usable: other hardware first, then drained, then excluded (each node counted once).
        ours = [n for n in inv.nodes if (n.hardware or inv.hardware or hw) == hw]
        counts = (("drained", sum(n.drain for n in ours)), ("excluded", sum(not n.drain and n.name in exclude for n in ours)),
                  ("of other hardware", len(inv.nodes) - len(ours)))
        why = ", ".join(f"{k} {v}" for k, v in counts if v)
        assert err.message.endswith(f"{have} usable" + (f" ({why})" if why else "")), (err.message, why)


def _check_placement(plan: Plan, inv: Inventory, exclude: tuple[str, ...], drained: set[str]) -> None:
    nodes = {n.name: n for n in inv.nodes}
    engines = [p for p in plan.processes if p.role != "router"]
    usable = [n.name for n in inv.nodes if not n.drain and n.name not in exclude and (n.hardware or inv.hardware or plan.hardware) == plan.hardware]
    # Engines sit on the first usable nodes of the plan's hardware, in inventory order, one each.
    assert [p.node for p in engines] == usable[:len(engines)], ([p.node for p in engines], usable)
    for p in plan.processes:
        assert not PLACEHOLDER.match(p.address), (p.id, p.address)
        assert not any("$" in t for t in [*p.argv, *p.env.values()]), p.id
        if p.role == "router":
            want = "127.0.0.1" if inv.router.node == "login" else (nodes[p.node].address or p.node)
            assert p.node == inv.router.node and p.address == want and p.node not in drained | set(exclude)
            continue
        node = nodes[p.node]
        assert not node.drain and p.node not in exclude
        assert (node.hardware or inv.hardware or plan.hardware) == plan.hardware
        assert p.address == (node.address or node.name) == p.env["VLLM_HOST_IP"]
        if "GLOO_SOCKET_IFNAME" in p.env:
            assert p.env["GLOO_SOCKET_IFNAME"] == (node.iface or inv.defaults.iface)
    assert not any(h.placeholder for h in plan.hosts)
    assert not any(n.code == "placeholder-nodes" for n in plan.notices)
    # Ports: what the argv says each process listens on is exactly the table, unique per node and address.
    for p in plan.processes:
        assert {u.port for u in plan.ports if u.process == p.id} == _listening(p), p.id
    per_node = [(u.node, u.port) for u in plan.ports]
    per_addr = [(u.address, u.port) for u in plan.ports]
    assert len(per_node) == len(set(per_node)) and len(per_addr) == len(set(per_addr)), per_node
    assert all(1024 <= u.port <= 65535 for u in plan.ports)
    if plan.kv_offload == "simple":
        for p in engines:
            ram = nodes[p.node].cpu_memory_gb or inv.defaults.cpu_memory_gb
            assert ram is not None and ram * 1e9 / 2**30 >= 220 * plan.gpus_per_node


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_random_inventory_and_selection_plan_soundly_or_refuse(data: st.DataObject) -> None:
    inv, drained = data.draw(inventories())
    sel, exclude, base = data.draw(selections(inv, [n.name for n in inv.nodes]))
    try:
        plan = build_plan(TREE, sel, inventory=inv, exclude=exclude, port_base=base)
    except K3Error as err:
        _check_refusal(err, inv, sel, exclude, base)
        return
    assert _base_ok(base), f"--port-base {base} accepted"
    event(f"plan {plan.strategy} x{plan.nodes}")
    check_plan(SCHEMA, plan)
    _check_placement(plan, inv, exclude, drained)
    if sel.hardware is not None:
        assert plan.hardware == sel.hardware
    assert plan.port_base == (base or 8000)
    role = {p.id: p.role for p in plan.processes}
    if base is None:
        assert {u.port for u in plan.ports} <= DEFAULT_PORTS, sorted({u.port for u in plan.ports} - DEFAULT_PORTS)
    for u in plan.ports if base is not None else ():
        slot = HTTP_SLOT[role[u.process]] if u.purpose == "http" else SLOT.get(u.purpose)
        if u.purpose.startswith("nixl side channel (dp rank "):
            slot = NIXL_SLOT[role[u.process]] + int(u.purpose.rsplit(" ", 1)[1].rstrip(")"))
        assert slot is not None and u.port == base + slot, u
