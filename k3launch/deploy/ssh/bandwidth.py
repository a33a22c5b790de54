"""``doctor --bandwidth``: a short NCCL (or RCCL) all-reduce on the planned nodes, against a threshold.

It uses nccl-tests' (rccl-tests') ``all_reduce_perf`` where the node has it, and reads the
``# Avg bus bandwidth`` line it prints:

* on every engine node, over the node's GPUs (``-g GPUS``): NVLink / xGMI inside the node;
* across the nodes of a multi-node plan, one rank per GPU, through ``mpirun`` on the first node
  (``-H addr:gpus,...``), when the first node has both tools: the RDMA fabric.

A node without the tool, the simulated engine and CPU profiles are skipped, each row saying why.
The run is short (64 MB to 1 GB messages, ~10-30 s on real nodes) and bounded by ``timeout``.
"""

from __future__ import annotations

import shlex

from k3launch.deploy.ssh import fabric
from k3launch.deploy.ssh.doctor import node_path
from k3launch.deploy.ssh.fetch import engine_nodes
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.reports import Check
from k3launch.transport.fleet import Fleet

# Defaults well under what healthy systems reach (NVLink all-reduce: hundreds of GB/s; 8 x 400 Gb/s
# RDMA: ~350 GB/s) and well over what a broken one gets (PCIe only: ~20; NCCL over TCP: a few).
MIN_BUSBW_NODE = 100.0
MIN_BUSBW_FABRIC = 40.0
RUN_TIMEOUT_S = 300
ARGS = "-b 64M -e 1G -f 2"


def _node_cmd(gpus: int) -> str:
    return (
        f"if command -v all_reduce_perf >/dev/null 2>&1; then timeout {RUN_TIMEOUT_S} all_reduce_perf {ARGS} -g {gpus} 2>&1; "
        "else echo 'k3: all_reduce_perf not found'; fi"
    )


def _fabric_cmd(plan: Plan, nodes: list[str], gpus: int) -> str:
    hosts = ",".join(f"{next(h.address for h in plan.hosts if h.name == n)}:{gpus}" for n in nodes)
    iface = next((h.iface for h in plan.hosts if h.name == nodes[0] and h.iface), None)
    env = f"-x NCCL_SOCKET_IFNAME={shlex.quote(iface)} " if iface else ""
    run = f"mpirun --allow-run-as-root -np {gpus * len(nodes)} -H {hosts} {env}all_reduce_perf {ARGS} -g 1"
    return (
        f"if ! command -v all_reduce_perf >/dev/null 2>&1; then echo 'k3: all_reduce_perf not found'; "
        f"elif ! command -v mpirun >/dev/null 2>&1; then echo 'k3: mpirun not found'; "
        f"else timeout {RUN_TIMEOUT_S} {run} 2>&1; fi"
    )


def _judge(node: str, name: str, out: str, what: str, threshold: float) -> Check:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    missing = next((ln[4:] for ln in lines if ln.startswith("k3: ")), "")
    if missing:
        return Check(node, name, "skip", f"{missing} on {node}: {what} not measured (nccl-tests or rccl-tests provide it)")
    bw = fabric.busbw(out)
    if bw is None:
        return Check(
            node,
            name,
            "fail",
            f"all_reduce_perf printed no bus bandwidth: {(lines or ['no output'])[-1][:160]}",
            hint="run it by hand on the node: NCCL_DEBUG=INFO all_reduce_perf -b 64M -e 1G -f 2 -g GPUS",
        )
    ok = bw >= threshold
    return Check(
        node,
        name,
        "pass" if ok else "fail",
        f"{what}: {bw:.1f} GB/s bus bandwidth (threshold {threshold:g} GB/s)",
        hint="" if ok else "NCCL_DEBUG=INFO shows the transport it took (NET/Socket means no RDMA); check NVLink/fabric health",
    )


def measure(plan: Plan, fleet: Fleet, min_busbw: float | None = None) -> list[Check]:
    nodes = engine_nodes(plan)
    if plan.engine == "sim" or plan.platform == "cpu":
        why = "simulated engine" if plan.engine == "sim" else f"{plan.hardware} is a CPU profile"
        return [Check(n, "bandwidth", "skip", f"{why}: no GPUs to measure") for n in nodes]
    gpus = {n: max((p.gpus for p in plan.processes if p.node == n), default=0) or 1 for n in nodes}
    per_node = fleet.run_many({n: node_path(plan, fleet, n) + _node_cmd(gpus[n]) for n in nodes}, timeout=RUN_TIMEOUT_S + 30)
    checks = []
    for n in nodes:
        o = per_node[n]
        if isinstance(o, K3Error):
            checks.append(Check(n, "bandwidth", "fail", o.message, o.code))
        else:
            checks.append(_judge(n, "bandwidth", o.stdout, f"all-reduce over {gpus[n]} GPU(s)", min_busbw or MIN_BUSBW_NODE))
    multi = len(nodes) > 1 and any(f in p.argv for p in plan.processes for f in ("--nnodes", "--data-parallel-address"))
    if multi:
        head = nodes[0]
        try:
            r = fleet.run(head, node_path(plan, fleet, head) + _fabric_cmd(plan, nodes, gpus[head]), timeout=RUN_TIMEOUT_S + 30)
            checks.append(
                _judge(head, "bandwidth-fabric", r.stdout, f"all-reduce across {len(nodes)} nodes", min_busbw or MIN_BUSBW_FABRIC)
            )
        except K3Error as exc:
            checks.append(Check(head, "bandwidth-fabric", "fail", exc.message, exc.code))
    return checks
