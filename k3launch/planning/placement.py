"""Placement inputs: which machines a plan uses, and the port numbers it plans.

Nodes are taken in inventory order, skipping drained ones, ``--exclude``d ones and cordoned ones
(``k3launch cordon``), keeping only those of the selected hardware. Ports are planned, not hoped
for: every port a process listens on is in the plan's port table, two processes on one address
never share one, and ``--port-base`` shifts the whole table so two deployments can share a cluster.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import field, replace
from typing import TYPE_CHECKING

from k3launch.errors import K3Error
from k3launch.models.backends import spec
from k3launch.planning.capacity import HostMemory
from k3launch.util.records import record

if TYPE_CHECKING:  # imported where an inventory is used: a plan without one never loads the inventory models
    from k3launch.models.selection import Notice  # (and `check_port_base` never loads the selection model)
    from k3launch.planning.inventory import Inventory, NodeSettings

PLACEHOLDER_IFACE = "ib0"
DEFAULT_PORT_BASE = 8000


@record
class NodeSpec:
    """A machine to place processes on: an inventory node (settings merged) or a placeholder."""

    name: str
    address: str
    iface: str = PLACEHOLDER_IFACE
    placeholder: bool = False
    hardware: str | None = None
    runtime: str = "docker"
    user: str | None = None
    ssh_port: int | None = None
    identity_file: str | None = None
    cpu_memory_gb: float | None = None
    cpus: str | None = None  # a CPU list (planning.cpusets)
    hf_cache: str = "~/.cache/huggingface"
    shm_size: str = "64g"
    image: str | None = None
    workdir: str | None = None
    python: str | None = None
    ssh_host: str | None = None
    venv: str | None = None
    compile_cache: str | None = None  # None: the default directory (models.caches)
    env: tuple[tuple[str, str], ...] = ()


@record
class Ports:
    """Every port k3launch plans.

    Without ``--port-base`` the conventional ports are used (vLLM 8000, P/D 8001/8002, NIXL
    5557/5558 + DP rank, DP RPC 13345, TP master 29501, router 8000 + metrics 29000). With
    ``--port-base B`` every port of the deployment lies in one block ``B .. B+511``: HTTP B,
    prefill B+1, decode B+2, router B+3, router metrics B+4, TP master B+5, DP RPC B+6, NIXL
    prefill B+16 + rank, NIXL decode B+144 + rank (P/D pools have at most 16 x 8 ranks). Two
    deployments whose bases are at least 512 apart never collide, and a block may not overlap
    the conventional ports of a default deployment.

    A fault-tolerant DEP pool runs one API server per DP rank: its node's ranks listen on the
    pool's HTTP port + the rank's index on the node (8000-8007), or, with ``--port-base``, on
    B+272 + index (serve and prefill pools) and B+400 + index (decode), clear of the rest.
    """

    serve: int = 8000
    prefill: int = 8001
    decode: int = 8002
    master: int = 29501
    dp_rpc: int = 13345
    nixl_prefill: int = 5557
    nixl_decode: int = 5558
    router: int = 8000
    router_metrics: int = 29000
    compact: bool = False  # True: every port from --port-base's block, recipe ports overridden

    BLOCK = 512

    def http_for(self, role: str) -> int:
        return {"prefill": self.prefill, "decode": self.decode}.get(role, self.serve)

    def nixl_for(self, role: str) -> int:
        return self.nixl_decode if role == "decode" else self.nixl_prefill

    def rank_http(self, role: str, pool_http: int, local: int) -> int:
        """The HTTP port of the ``local``-th DP rank of a node of a fault-tolerant pool whose
        HTTP port is ``pool_http`` (each rank has its own API server)."""
        base = self.serve + (400 if role == "decode" else 272) if self.compact else pool_http
        return base + local

    @classmethod
    def shifted(cls, base: int | None) -> Ports:
        if base is None:
            return cls()
        if base < 1024 or base + cls.BLOCK - 1 > 65535:
            raise K3Error("bad-port-base", f"--port-base {base}: its block {base}-{base + cls.BLOCK - 1} leaves 1024-65535",
                          f"choose a base between 1024 and {65536 - cls.BLOCK}")
        d = cls()
        conventional = {d.serve, d.prefill, d.decode, d.master, d.dp_rpc, d.router_metrics, *range(d.nixl_prefill, d.nixl_prefill + 130)}
        block = range(base, base + cls.BLOCK)
        clash = sorted(p for p in conventional if p in block)
        if clash:
            raise K3Error("bad-port-base", f"--port-base {base}: its block {base}-{base + cls.BLOCK - 1} overlaps the default ports ({clash[0]})",
                          "choose a base whose 512-port block avoids 5557-5686, 8000-8002, 13345, 29000 and 29501, e.g. 9000 or 20000")
        return cls(serve=base, prefill=base + 1, decode=base + 2, router=base + 3, router_metrics=base + 4, master=base + 5,
                   dp_rpc=base + 6, nixl_prefill=base + 16, nixl_decode=base + 144, compact=True)


@record
class Cordoned:
    """The cordoned nodes of the inventory a plan is placed on (``k3launch cordon``), as planning
    needs them: the API reads them from the state directory, since planning does no I/O."""

    why: Mapping[str, str] = field(default_factory=dict)  # node -> "cordoned since <time> (<reason>; by <who>)"
    inventory: str = "INVENTORY"  # what `-i` names the inventory by in the hint (the path it was loaded from)

    def __contains__(self, node: object) -> bool:
        return node in self.why

    def hint(self, nodes: Sequence[str]) -> str:
        them = "it" if len(nodes) == 1 else "them"
        return f"`k3launch uncordon {' '.join(nodes)} -i {shlex.quote(self.inventory)}` puts {them} back"

    def kept_out(self, inv: Inventory) -> list[str]:
        """The cordoned nodes a plan on ``inv`` keeps out, in inventory order: its nodes; or, on a
        scheduler's inventory, the nodelist's (``sbatch --exclude`` refuses names Slurm does not
        know), or any name when there is no nodelist (Slurm picks among all its nodes)."""
        if inv.nodes:
            return [n.name for n in inv.nodes if n.name in self.why]
        if inv.slurm is not None and inv.slurm.nodelist:
            from k3launch.planning.inventory import expand_nodelist

            return [n for n in expand_nodelist(inv.slurm.nodelist) if n in self.why]
        return sorted(self.why)

    def notices(self, inv: Inventory, hardware: str, exclude: Sequence[str]) -> list[Notice]:
        """One ``cordoned`` notice per node placement skipped for its cordon alone (not drained,
        not excluded, of the plan's hardware)."""
        from k3launch.models.selection import Notice

        skipped = {n.name for n in inv.nodes if not n.drain and (n.hardware or inv.hardware or hardware) == hardware}
        return [Notice("cordoned", f"node {n} {self.why[n]}: skipped; {self.hint([n])}")
                for n in self.kept_out(inv) if n not in exclude and (not inv.nodes or n in skipped)]


NO_CORDONS = Cordoned()


def placeholder_nodes(count: int) -> list[NodeSpec]:
    return [NodeSpec(f"node-{i}", f"node-{i}", PLACEHOLDER_IFACE, True) for i in range(count)]


LOGIN = NodeSpec("login", "login", PLACEHOLDER_IFACE, True, runtime="bare")


def inventory_hardware(inv: Inventory, asked: str | None) -> str | None:
    """The hardware a plan on ``inv`` uses: the one asked for, or the inventory's only one."""
    if asked is not None:
        return asked
    if inv.hardware is not None:
        return inv.hardware
    kinds = Counter(n.hardware for n in inv.nodes if n.hardware is not None)
    if len(kinds) > 1:
        mix = ", ".join(f"{k}: {v}" for k, v in kinds.items())
        raise K3Error("mixed-hardware", f"inventory {inv.name} mixes GPU models ({mix})", "pass --hardware to pick one")
    return next(iter(kinds), None)


# A node's settings as placement knows them: NodeSettings' fields under the same names (``port``
# is the SSH port), with these defaults when neither the node nor ``defaults`` sets them.
SETTING_NAMES = {"port": "ssh_port"}
SETTING_DEFAULTS: dict[str, object] = {"iface": PLACEHOLDER_IFACE, "hf_cache": "~/.cache/huggingface", "shm_size": "64g"}


def node_spec(inv: Inventory, name: str, address: str | None, hw: str | None, over: NodeSettings | None, placeholder: bool,
          ssh_host: str | None = None) -> NodeSpec:
    """The node's settings: its own, else the inventory's ``defaults``, else placement's defaults."""
    from k3launch.planning.inventory import NodeSettings

    d = inv.defaults
    values: dict[str, object] = {**SETTING_DEFAULTS, "runtime": spec(inv.backend).default_runtime}
    for key in NodeSettings.model_fields:
        v = getattr(over, key, None) if over is not None else None
        if v is None:
            v = getattr(d, key)
        if v is not None and key != "env":
            values[SETTING_NAMES.get(key, key)] = v
    env = {**(d.env or {}), **((over.env or {}) if over is not None else {})}
    if inv.weights is not None and inv.weights.stage is not None:  # the engines read the staged copy (planning.loading)
        values["hf_cache"] = inv.weights.stage
    return NodeSpec(name=name, address=address or name, placeholder=placeholder, hardware=hw, ssh_host=ssh_host,
                    env=tuple(env.items()), **values)  # type: ignore[arg-type]


def select_nodes(inv: Inventory, hardware: str, count: int, exclude: Sequence[str] = (), cordoned: Cordoned = NO_CORDONS,
                 keep: Sequence[str] = ()) -> list[NodeSpec]:
    """The first ``count`` usable nodes of ``hardware``, or a refusal saying what is missing.
    ``keep``: the node each slot had in the plan being re-placed; a slot keeps its node while it is
    usable, and only the others take spares (nodes ``keep`` does not name), in inventory order."""
    unknown = [x for x in exclude if x not in {n.name for n in inv.nodes}] if inv.nodes else []
    if unknown:
        raise K3Error("unknown-node", f"--exclude {unknown[0]}: no such node in inventory {inv.name}", "node names: " + ", ".join(n.name for n in inv.nodes))
    if spec(inv.backend).scheduler_nodes and not inv.nodes:
        assert inv.slurm is not None
        if inv.slurm.nodelist:
            from k3launch.planning.inventory import expand_nodelist

            all_names = expand_nodelist(inv.slurm.nodelist)
            bad = [x for x in exclude if x not in all_names]
            if bad:
                raise K3Error("unknown-node", f"--exclude {bad[0]}: not in slurm.nodelist {inv.slurm.nodelist}", "exclude nodes of the nodelist")
            names = [n for n in all_names if n not in exclude and n not in cordoned]
            nodes = [node_spec(inv, n, None, hardware, None, False) for n in names]
        else:
            nodes = [node_spec(inv, f"slurm-node-{i}", None, hardware, None, True) for i in range(count)]
        if len(nodes) < count:
            held = [n for n in cordoned.kept_out(inv) if n not in exclude]
            why = f" ({len(held)} cordoned: {', '.join(held)})" if held else ""
            raise K3Error("too-few-nodes", f"the plan needs {count} {hardware} nodes; nodelist {inv.slurm.nodelist} has {len(nodes)} usable{why}",
                          (cordoned.hint(held) + "; or " if held else "") + f"widen slurm.nodelist by {count - len(nodes)} nodes or shrink the selection")
        return nodes[:count]
    usable: list[NodeSpec] = []
    drained = excluded = other = 0
    held = []
    for n in inv.nodes:
        hw = n.hardware or inv.hardware
        if hw is not None and hw != hardware:
            other += 1
        elif n.drain:
            drained += 1
        elif n.name in exclude:
            excluded += 1
        elif n.name in cordoned:
            held.append(n.name)
        else:
            usable.append(node_spec(inv, n.name, n.address, hw or hardware, n, False, n.ssh_host))
    if len(usable) < count:
        counts = (("drained", drained), ("excluded", excluded), ("of other hardware", other))
        why = ", ".join([f"{k} {v}" for k, v in counts if v] + ([f"cordoned {len(held)}: {', '.join(held)}"] if held else []))
        raise K3Error(
            "too-few-nodes",
            f"the plan needs {count} {hardware} nodes; inventory {inv.name} has {len(usable)} usable" + (f" ({why})" if why else ""),
            (cordoned.hint(held) + "; or " if held else "")
            + f"add {count - len(usable)} more {hardware} node(s) to the inventory, or choose a smaller selection",
        )
    return _keeping(usable, keep, count) if keep else usable[:count]


def _keeping(usable: Sequence[NodeSpec], keep: Sequence[str], count: int) -> list[NodeSpec]:
    """Slot by slot, the node ``keep`` names if usable, else the next spare: re-placing a lost node
    moves only what ran there, never another copy onto the lost one's slot."""
    by_name = {n.name: n for n in usable}
    spares = [n for n in usable if n.name not in set(keep)]
    out: list[NodeSpec] = []
    for i in range(count):
        want = by_name.get(keep[i]) if i < len(keep) else None
        out.append(want if want is not None else spares.pop(0))  # enough: len(usable) >= count was checked
    return out


def host_memory(inv: Inventory, exclude: Sequence[str] = (), cordoned: Cordoned = NO_CORDONS) -> HostMemory:
    """The ``cpu_memory_gb`` of every usable node (not drained, excluded or cordoned), per hardware id:
    what a CPU profile's capacity is checked against."""
    default = inv.defaults.cpu_memory_gb
    nodes: dict[str, list[float | None]] = {}
    if not inv.nodes:  # Slurm without nodes: every allocated node has the defaults
        nodes[inv.hardware or ""] = [default]
    for n in inv.nodes:
        if not n.drain and n.name not in exclude and n.name not in cordoned:
            nodes.setdefault(n.hardware or inv.hardware or "", []).append(n.cpu_memory_gb if n.cpu_memory_gb is not None else default)
    return HostMemory(inv.name, nodes)


def router_node(inv: Inventory | None, exclude: Sequence[str] = (), cordoned: Cordoned = NO_CORDONS) -> NodeSpec:
    if inv is None:
        return LOGIN
    if inv.router.node == "login":
        return replace(LOGIN, address=inv.router.address or "127.0.0.1", placeholder=False)
    node = next(n for n in inv.nodes if n.name == inv.router.node)
    if node.drain or node.name in exclude:
        raise K3Error("router-node-unavailable", f"router.node {node.name} is {'drained' if node.drain else 'excluded'}",
                      "set router.node to another node or to login")
    if node.name in cordoned:
        raise K3Error("router-node-unavailable", f"router.node {node.name} is {cordoned.why[node.name]}",
                      f"{cordoned.hint([node.name])}, or set router.node to another node or to login")
    spec = node_spec(inv, node.name, node.address, node.hardware or inv.hardware, node, False, node.ssh_host)
    return replace(spec, address=inv.router.address or spec.address)
