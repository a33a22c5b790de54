"""The plan's port table: every (address, port) a process listens on, checked for collisions.

Which ports a vLLM process listens on follows from its argv and env: its HTTP port; the TP
master port on a multi-node TP head; the DP RPC port on a multi-node DP head; and, for P/D, one
NIXL side-channel port per DP rank at ``VLLM_NIXL_SIDE_CHANNEL_PORT + dp_rank`` on the rank's
own node. The router adds its HTTP and Prometheus ports.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3launch.errors import K3Error
from k3launch.models.plan import PortUse, Process
from k3launch.planning.placement import Ports


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    val = None
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            val = argv[i + 1]
        elif tok.startswith(flag + "="):
            val = tok.split("=", 1)[1]
    return val


def process_ports(p: Process) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    if p.role == "router":
        out.append((int(flag_value(p.argv, "--port") or 0), "router http"))
        metrics = flag_value(p.argv, "--prometheus-port")
        if metrics:
            out.append((int(metrics), "router metrics"))
        return out
    if p.http_port is not None:
        out.append((p.http_port, "http"))
    if p.node_rank == 0 and "--master-port" in p.argv:
        out.append((int(flag_value(p.argv, "--master-port") or 0), "tp master"))
    if p.dp_start_rank == 0 and "--data-parallel-rpc-port" in p.argv:
        out.append((int(flag_value(p.argv, "--data-parallel-rpc-port") or 0), "dp rpc"))
    nixl = p.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    if nixl is not None:
        local = int(flag_value(p.argv, "--data-parallel-size-local") or 1)
        start = p.dp_start_rank or 0
        out.extend((int(nixl) + start + k, f"nixl side channel (dp rank {start + k})") for k in range(local))
    return out


def port_table(procs: Sequence[Process], ports: Ports) -> list[PortUse]:
    table: list[PortUse] = []
    seen: dict[tuple[str, int], PortUse] = {}
    for p in procs:
        for port, purpose in process_ports(p):
            use = PortUse(node=p.node, address=p.address, port=port, purpose=purpose, process=p.id)
            # per address (several nodes may share a machine) and per node (one machine, any address)
            clash = seen.get((p.address, port)) or seen.get(("node:" + p.node, port))
            if clash is not None:
                raise K3Error("port-conflict", f"{p.address}:{port} is planned twice: {clash.process} ({clash.purpose}) and {p.id} ({purpose})",
                              "use --port-base to move this deployment's ports, or give the nodes distinct addresses")
            seen[(p.address, port)] = use
            seen[("node:" + p.node, port)] = use
            table.append(use)
    return table
