"""Selection (+ inventory) → :class:`Plan`: every process of the deployment, fully composed.

Placement rules (docs/inventories.md ("Placement rules")): nodes are taken in order; a P/D deployment puts the
prefill pool first and the decode pool on the next, disjoint nodes; within a pool node 0 is the
head (its address is the TP master / DP coordinator of the pool). Multi-node TP/TEP: every node
gets ``--nnodes/--node-rank/--master-addr/--master-port`` and non-head nodes ``--headless``.
DEP: ``--data-parallel-size g·N --data-parallel-size-local g`` and ``--data-parallel-start-rank
i·g``; with hybrid load balancing every node serves HTTP, so a router fronts them. With fault
tolerance (:mod:`k3launch.planning.faulttol`) every DP rank of a DEP pool is a process of its own.

:func:`build_plan` goes in order: resolve the selection, place it on nodes, decide every pool's
size, compose each pool's engines (:mod:`k3launch.planning.pools`), front them with the router,
and total the capacity (:mod:`k3launch.planning.capacity`).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from k3launch.errors import K3Error
from k3launch.models.backends import spec
from k3launch.models.plan import (
    Capacity,
    FaultTolerancePool,
    Host,
    KvOffloadCapacity,
    NoticeOut,
    Plan,
    PoolCapacity,
    Process,
    ProvenanceEntry,
    Role,
    WeightStage,
)
from k3launch.models.recipe import KvOffloadOption
from k3launch.models.selection import Notice, Pool, Resolved, Selection
from k3launch.planning import capacity, cpusets, faulttol, loading, rules, tracing
from k3launch.planning.capacity import NodeMemory
from k3launch.planning.compose import Composed, Locked
from k3launch.planning.faulttol import FaultTolerance
from k3launch.planning.layers import RESERVED, locks_for
from k3launch.planning.layout import recipe_layout, sizes, strip_nvl4_env
from k3launch.planning.placement import (
    LOGIN,
    NO_CORDONS,
    PLACEHOLDER_IFACE,
    Cordoned,
    NodeSpec,
    Ports,
    host_memory,
    inventory_hardware,
    node_spec,
    placeholder_nodes,
    router_node,
    select_nodes,
)
from k3launch.planning.pools import PoolShared, compose_pool, node_sources, pool_shared
from k3launch.planning.porttable import port_table
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.resolve import resolve
from k3launch.planning.router import router_process
from k3launch.planning.schema import FlagSchema, load_schema
from k3launch.util.digest import sha256
from k3launch.util.names import as_name, check_name

if TYPE_CHECKING:  # only plans placed on an inventory load the inventory models
    from k3launch.planning.inventory import Inventory

__all__ = ["LOGIN", "Cordoned", "NodeSpec", "build_plan", "placeholder_nodes"]

GIB_PER_GB = 1e9 / 2**30
def _image(r: Resolved, node: NodeSpec) -> str | None:
    if r.selection.image:  # a user's --image (a rollout's too) is over the inventory's
        return r.selection.image
    if node.image:
        return node.image
    return rules.docker_image(r.recipe, r.variant, r.hardware_id, r.hardware) or r.hardware.image


def build_plan(tree: RecipeTree, sel: Selection, nodes: Sequence[NodeSpec] | None = None, *,
               inventory: Inventory | None = None, exclude: Sequence[str] = (), port_base: int | None = None,
               name: str | None = None, cordoned: Cordoned = NO_CORDONS, keep: Sequence[str] = ()) -> Plan:
    """``cordoned``: the inventory's cordoned nodes (read by the caller: planning does no I/O),
    skipped with a notice and kept out of a Slurm job with the excluded ones. ``keep``: the engine
    nodes, slot by slot, of a plan being re-placed (:func:`~k3launch.planning.placement.select_nodes`)."""
    # A plan is a burst of small acyclic objects (one composed command per node); the cyclic
    # GC would rescan all of them again and again on large inventories, so it waits until done.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_plan(tree, sel, nodes, inventory, exclude, port_base, name, cordoned, keep)
    finally:
        if enabled:
            gc.enable()


def _build_plan(tree: RecipeTree, sel: Selection, nodes: Sequence[NodeSpec] | None, inventory: Inventory | None,
                exclude: Sequence[str], port_base: int | None, name: str | None, cordoned: Cordoned, keep: Sequence[str] = ()) -> Plan:
    # The name becomes a file name, a job name, container names and #SBATCH values: plain words only.
    if name is not None:
        check_name(name, "--name", example="--name k3-tep-lab")  # the error says where the refused name came from
    s, stage, notices = _setup(tree, sel, inventory, exclude, cordoned, port_base)
    placed, kept_out = _placed(s.r, nodes, inventory, exclude, cordoned, keep, notices)
    ft = _fault_tolerance(s.r, s.schema, inventory, notices)
    sized = _sized_pools(s, placed)
    # Every pool runs at the size decided above (a recipe may size its one-node layout itself): the
    # plan is composed from these pools alone, and the router and the totals read them.
    s = s._replace(r=replace(s.r, pools=[u.pool for u in sized]))
    engines = _engines(s, sized, ft, notices)
    _router(s, placed, exclude, cordoned, engines, notices)
    engines = engines._replace(procs=cpusets.bind(engines.procs, placed, inventory, s.r.hardware.vendor_platform, notices))  # CPU engines sharing a machine: cores of their own
    engines = engines._replace(procs=tracing.apply(engines.procs, inventory.observability if inventory else None, s.schema, notices))
    kv_cap = _kv_capacity(s.r, s.kv.host_memory_gib_per_rank if s.kv else None, placed[:s.r.nodes], notices)
    cap = capacity.plan_capacity(capacity.Weights(s.r.weights_gb, s.r.weights_formula, s.r.checkpoint_gb), engines.caps, kv_cap)
    return _plan(s, name, engines, cap, notices, kept_out, stage)


class Setup(NamedTuple):
    """What every pool of a plan is composed from, decided before the first one is."""

    tree: RecipeTree
    r: Resolved
    schema: FlagSchema
    ports: Ports
    kv: KvOffloadOption | None
    locks: list[Locked]
    model_id: str
    reserved: dict[str, str]  # flags placement owns, with why (--set cannot change them)
    inventory: Inventory | None


class Sized(NamedTuple):
    """A pool at the size it runs, what its nodes share, its nodes copy by copy (``--replicas``),
    and the notice of a recipe that sized it."""

    pool: Pool
    shared: PoolShared
    copies: list[list[NodeSpec]]
    notices: list[Notice]


class Engines(NamedTuple):
    """The composed pools: their processes (the router's last), the hosts, capacity rows, fault tolerance."""

    procs: list[Process]
    hosts: list[Host]
    caps: list[PoolCapacity]
    ft_pools: list[FaultTolerancePool]


def _setup(tree: RecipeTree, sel: Selection, inventory: Inventory | None, exclude: Sequence[str], cordoned: Cordoned,
           port_base: int | None) -> tuple[Setup, WeightStage | None, list[Notice]]:
    """The selection resolved (on the inventory's hardware and host memory), its vLLM's schema, the
    ports, and the inventory's weights section checked against that vLLM: (setup, stage, notices)."""
    if inventory is not None:
        sel = sel.model_copy(update={"hardware": inventory_hardware(inventory, sel.hardware)})
    r = resolve(tree, sel, host_memory(inventory, exclude, cordoned) if inventory is not None else None,
                replicas_default=inventory.replicas if inventory is not None else None)
    schema = load_schema(sel.engine_version(inventory.vllm_version if inventory is not None else None))
    ports = Ports.shifted(port_base)
    kv = tree.taxonomy.kv_offload.get(r.kv_offload) if r.kv_offload != "off" else None
    locks = locks_for(r.recipe, r.hardware_id, r.hardware)
    model_id = r.variant.model_id or r.recipe.model.model_id
    stage, notices = loading.check(inventory, schema, model_id, locks)  # the inventory's weights section, against this vLLM
    reserved = dict(RESERVED)
    if r.is_pd:
        reserved["--kv-transfer-config"] = "P/D pools own the NIXL KV transfer config"
    return Setup(tree, r, schema, ports, kv, locks, model_id, reserved, inventory), stage, [*r.notices, *notices]


def _placed(r: Resolved, nodes: Sequence[NodeSpec] | None, inventory: Inventory | None, exclude: Sequence[str], cordoned: Cordoned,
            keep: Sequence[str], notices: list[Notice]) -> tuple[list[NodeSpec], list[str]]:
    """The plan's nodes (the inventory's, the ones given, or placeholders) and the nodes it keeps
    out: ``exclude`` and the cordoned ones, passed on to a Slurm job as sbatch --exclude."""
    kept_out = list(exclude)
    if inventory is not None:
        placed = select_nodes(inventory, r.hardware_id, r.nodes, exclude, cordoned, keep)
        notices.extend(cordoned.notices(inventory, r.hardware_id, exclude))
        kept_out += [n for n in cordoned.kept_out(inventory) if n not in exclude]
        if any(n.placeholder for n in placed):
            notices.append(Notice("placeholder-nodes", f"slurm inventory {inventory.name} has no nodelist: nodes ({placed[0].name}, ...) are bound to the allocation at launch"))
        return placed, kept_out
    if nodes is not None:
        if len(nodes) < r.nodes:
            raise K3Error("too-few-nodes", f"the plan needs {r.nodes} nodes, {len(nodes)} given", "add nodes or shrink the selection")
        return list(nodes), kept_out
    placed = placeholder_nodes(r.nodes)
    notices.append(Notice("placeholder-nodes", f"placed on placeholder nodes ({', '.join(n.name for n in placed)}) with NIC {PLACEHOLDER_IFACE}; pass --inventory for real machines"))
    return placed, kept_out


def _fault_tolerance(r: Resolved, schema: FlagSchema, inventory: Inventory | None, notices: list[Notice]) -> FaultTolerance | None:
    """vLLM's fault tolerance where the selection or the inventory asks for it, checked against this plan."""
    origin = faulttol.requested(r.selection, inventory)
    if origin is None:
        return None
    if r.replicas > 1:
        asked = f"--replicas {r.replicas}" if r.replicas_from == "--replicas" else f"{r.replicas} copies ({r.replicas_from})"
        raise K3Error("replicas", f"{asked} with vLLM's fault tolerance is not supported yet: each copy's DEP pool "
                      "would need its own fault-tolerance group",
                      "drop --replicas, or --no-fault-tolerance" if r.replicas_from == "--replicas" else "--replicas 1, or --no-fault-tolerance")
    ft, ft_notices = faulttol.check(r, schema, origin, inventory.engine if inventory is not None else "vllm")
    notices.extend(ft_notices)
    return ft


def _sized_pools(s: Setup, placed: Sequence[NodeSpec]) -> list[Sized]:
    """Every pool at the size it runs, with its nodes: pool after pool, and within a pool each copy
    (``--replicas``) on nodes of its own -- the same commands but for its own addresses. A size is
    decided before any pool is composed, so each pool is composed once."""
    out: list[Sized] = []
    cursor = 0
    for pool in s.r.pools:
        copies = []
        for _ in range(s.r.replicas):
            copies.append(list(placed[cursor:cursor + pool.nodes]))
            cursor += pool.nodes
        shared = pool_shared(s.tree, s.r, pool, s.schema, s.ports, s.kv)
        runs, notices = _sized(s, shared, pool, copies[0][0])
        out.append(Sized(runs, shared, copies, notices))
    return out


def _engines(s: Setup, sized: Sequence[Sized], ft: FaultTolerance | None, notices: list[Notice]) -> Engines:
    """Compose every pool, copy by copy: each copy's ids are r<k>-<role>-<i> and its pool r<k>-<role>
    (one recovery unit per copy); sizes and capacity are the same for every copy."""
    out = Engines([], [], [], [])
    r = s.r
    for unit in sized:
        pool = unit.pool
        notices.extend(unit.notices)
        pool_ft = ft if ft is not None and pool.role in ft.roles else None
        # fault tolerance is refused with copies: only the one copy can have it
        copies = [compose_pool(unit.shared, pool, copy_nodes, s.schema, s.ports, s.locks, s.reserved, s.inventory, s.model_id,
                                pool_ft if k == 0 else None, r.hardware.vendor_platform) for k, copy_nodes in enumerate(unit.copies)]
        named = ([(f"r{k}-{pool.role}", [one._replace(pid=f"r{k}-{one.pid}") for one in copy]) for k, copy in enumerate(copies)]
                 if r.replicas > 1 else [(pool.role, copies[0])])
        for pool_name, placed_copy in named:
            for one in placed_copy:
                c, node = one.composed, one.node
                notices.extend(c.notices)
                notices.extend(strip_nvl4_env(r, c))
                out.procs.append(_process(one.pid, pool.role, node, one.head, one.http if one.serves else None, c, _image(r, node),
                                          one.node_rank, one.dp_start, one.gpus, pool_name))
                if not any(h.name == node.name for h in out.hosts):
                    out.hosts.append(_host(node, pool.role, pool.gpus_per_node))
        if pool_ft is not None:
            out.ft_pools.append(FaultTolerancePool(pool=pool.role, processes=[one.pid for one in copies[0]],
                                                   recovery_timeout_s=copies[0][0].recovery_timeout or 0, origin=pool_ft.origin))
        tp, dp, pp = sizes(pool)
        if tp & (tp - 1):
            notices.append(Notice("tp-not-power-of-two", f"{pool.role} pool: TP {tp} must divide the model's attention heads or vLLM refuses it; "
                                  "a power of two (other node count, multi_node_tp_pp or DEP) is the safe choice"))
        fit = capacity.pool_fit(r.weights_gb, NodeMemory(r.node_memory_gb), pool, r.hardware)
        out.caps.append(capacity.pool_capacity(fit, pool, (tp, dp, pp)))
    return out


def _router(s: Setup, placed: Sequence[NodeSpec], exclude: Sequence[str], cordoned: Cordoned, e: Engines, notices: list[Notice]) -> None:
    """The router in front of the engines, where the plan needs one. The backend says where it
    lives: the inventory's router.node, or (a scheduler's allocation) the first engine node, since
    the login node may not reach compute nodes' ports."""
    inv = s.inventory
    home = spec(inv.backend).router_home if inv is not None else "inventory"
    rnode = placed[0] if home == "allocation" else router_node(inv, exclude, cordoned)
    router_port = inv.router.port if inv is not None and inv.router.port else None
    router = router_process(s.r, e.procs, notices, rnode, s.ports, router_port, frozenset(p.pool for p in e.ft_pools))
    if router is not None:
        e.procs.append(router)
        if not any(h.name == rnode.name for h in e.hosts):
            e.hosts.append(_host(rnode, "router", 0))


def _plan(s: Setup, name: str | None, e: Engines, cap: Capacity, notices: list[Notice], kept_out: list[str], stage: WeightStage | None) -> Plan:
    r, inv, procs = s.r, s.inventory, e.procs
    table = port_table(procs, s.ports)
    front = next((p for p in procs if p.role == "router"), None) or next(p for p in procs if p.http_port is not None)
    digest = sha256(json.dumps([[p.node, p.argv, p.env] for p in procs], sort_keys=True).encode()).hexdigest()[:6]
    short = {"pd_cluster": "pd"}.get(r.strategy.name, r.strategy.name.replace("single_node_", "").replace("multi_node_", "").replace("_", ""))
    short += f"x{r.replicas}" if r.replicas > 1 else ""
    slug = (r.recipe.meta.slug or r.recipe_id.split("/")[-1]).lower()
    return Plan(
        name=name or as_name(f"{slug}-{short}-{r.hardware_id}-{digest}"), recipe=r.recipe_id, recipe_file=f"models/{r.recipe_id}.yaml",
        model=s.model_id, variant=r.variant_name, hardware=r.hardware_id, strategy=r.strategy.name, nodes=r.nodes,
        gpus_per_node=r.hardware.gpu_count, verified=r.verified, vllm_version=s.schema.version, features=r.features,
        kv_offload=r.kv_offload, advanced=list(r.selection.advanced), sets=list(r.selection.sets), capacity=cap, notices=_dedupe(notices),
        hosts=e.hosts, endpoint=f"http://{front.address}:{front.http_port}", processes=procs, ports=table,
        inventory=inv.name if inv else None, backend=inv.backend if inv else "none", engine=inv.engine if inv else "vllm",
        port_base=s.ports.serve, platform=r.hardware.vendor_platform, exclude=kept_out, fault_tolerance=e.ft_pools,
        replicas=r.replicas, stage=stage,
    )


def _sized(s: Setup, sh: PoolShared, pool: Pool, head: NodeSpec) -> tuple[Pool, list[Notice]]:
    """The pool at the size it runs, decided before it is composed: a recipe that sizes its one-node
    layout itself (after the placement flags, as upstream's order has it) is placed as it asks."""
    r = s.r
    ns = node_sources(sh, pool, 0, head, head, s.ports, s.inventory)
    adapted = recipe_layout(s.schema, ns.sources, ns.placement, s.reserved, pool, r.hardware_id, r.hardware)
    if adapted is None:
        return pool, []
    fit = capacity.pool_fit(r.weights_gb, NodeMemory(r.node_memory_gb), adapted, r.hardware)
    if not fit.fits:
        raise K3Error("does-not-fit", f"{adapted.gpus_per_node} {r.hardware_id} GPUs = {fit.node.gb:g} GB cannot hold the {r.weights_gb:g} GB of weights "
                      "(the recipe sizes this one-node layout itself)", "choose hardware with larger GPUs")
    return adapted, [Notice("recipe-layout", f"{pool.role} pool: the recipe sets its own size on one node: TP x DP = {adapted.gpus_per_node} "
                                             f"of {r.hardware_id}'s {r.hardware.gpu_count} GPUs (placement follows it)")]


def _host(node: NodeSpec, role: Role, gpus: int) -> Host:
    """The plan's view of a placed node: every Host field is the NodeSpec field of that name, but role and GPUs."""
    return Host.model_validate({**{f: getattr(node, f) for f in Host.model_fields if f not in ("role", "gpus")}, "role": role, "gpus": gpus})


def _process(pid: str, role: Role, node: NodeSpec, head: bool, port: int | None, c: Composed, image: str | None,
             node_rank: int | None, dp_start: int | None, gpus: int, pool: str) -> Process:
    prov = {k: [ProvenanceEntry(layer=e.layer, value=e.value, origin=e.origin) for e in v] for k, v in c.provenance.items()}
    return Process(id=pid, role=role, node=node.name, address=node.address, head=head, http_port=port, argv=c.argv,
                   env=c.env, image=image, provenance=prov, pool=pool, node_rank=node_rank, dp_start_rank=dp_start, gpus=gpus)


def _kv_capacity(r: Resolved, gib: float | None, nodes: Sequence[NodeSpec], notices: list[Notice]) -> KvOffloadCapacity | None:
    """What KV offload pins in each node's host RAM (``gib`` per rank), refused where a node's RAM does not hold it."""
    if gib is None:
        return None
    ranks = r.hardware.gpu_count
    need = gib * ranks
    for node in nodes:
        if node.cpu_memory_gb is None:
            if not node.placeholder:
                notices.append(Notice("kv-offload-host-ram", f"{node.name}: host RAM unknown (cpu_memory_gb); {r.kv_offload} KV offload pins {need:g} GiB"))
            continue
        have = node.cpu_memory_gb * GIB_PER_GB
        if not capacity.holds(have, need):
            raise K3Error("kv-offload-host-ram", f"{node.name}: {r.kv_offload} KV offload pins {ranks} ranks x {gib:g} GiB = {need:g} GiB of host RAM, the node has {have:.0f} GiB",
                          "use --kv-offload off, or nodes with more cpu_memory_gb")
    return KvOffloadCapacity(option=r.kv_offload, host_gib_per_rank=gib, ranks_per_node=ranks, host_gib_per_node=need)


def _dedupe(notices: list[Notice]) -> list[NoticeOut]:
    seen: set[tuple[str, str]] = set()
    out: list[NoticeOut] = []
    for n in notices:
        if (n.code, n.message) not in seen:
            seen.add((n.code, n.message))
            out.append(NoticeOut(code=n.code, message=n.message))
    return out


def inventory_hosts(inv: Inventory) -> list[Host]:
    """Every machine of an inventory as a plan host -- drained nodes and the router's node included:
    where a ``down`` without a record looks for a deployment's processes. Not a placement: no
    role but "router" for the router's node, no GPUs."""
    hosts = {n.name: _host(node_spec(inv, n.name, n.address, n.hardware or inv.hardware, n, False, n.ssh_host), "serve", 0) for n in inv.nodes}
    try:
        router = router_node(inv)
    except K3Error:
        return list(hosts.values())  # its node is drained: it is searched as a node all the same
    if router.name not in hosts:
        hosts[router.name] = _host(router, "router", 0)
    return list(hosts.values())
