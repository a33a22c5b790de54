"""Selection (+ inventory) → :class:`Plan`: every process of the deployment, fully composed.

Placement rules (docs/inventories.md ("Placement rules")): nodes are taken in order; a P/D deployment puts the
prefill pool first and the decode pool on the next, disjoint nodes; within a pool node 0 is the
head (its address is the TP master / DP coordinator of the pool). Multi-node TP/TEP: every node
gets ``--nnodes/--node-rank/--master-addr/--master-port`` and non-head nodes ``--headless``.
DEP: ``--data-parallel-size g·N --data-parallel-size-local g`` and ``--data-parallel-start-rank
i·g``; with hybrid load balancing every node serves HTTP, so a router fronts them. With fault
tolerance (:mod:`k3launch.planning.faulttol`) every DP rank of a DEP pool is a process of its own.
"""

from __future__ import annotations

import gc
import hashlib
import json
import re
from collections.abc import Sequence
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
)
from k3launch.models.recipe import KvOffloadOption
from k3launch.models.selection import Notice, Pool, Resolved, Selection
from k3launch.planning import capacity, cpusets, faulttol, loading, rules
from k3launch.planning.capacity import NodeMemory
from k3launch.planning.compose import LAYERS, Composed, Locked, Source, compose
from k3launch.planning.faulttol import FaultTolerance, Rank
from k3launch.planning.layers import RESERVED, PoolSources, locks_for, pool_sources
from k3launch.planning.layout import lb_modes, placement_flags, pool_strategies, recipe_layout, sizes, strip_nvl4_env
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
from k3launch.planning.porttable import flag_value, port_table
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.resolve import resolve
from k3launch.planning.router import router_process
from k3launch.planning.schema import FlagSchema, load_schema
from k3launch.util.names import as_name, check_name

if TYPE_CHECKING:  # only plans placed on an inventory load the inventory models
    from k3launch.planning.inventory import Inventory

__all__ = ["LOGIN", "Cordoned", "NodeSpec", "build_plan", "placeholder_nodes"]

GIB_PER_GB = 1e9 / 2**30
_PLACEHOLDER = re.compile(r"\$\{?([A-Z_][A-Z0-9_]*)\}?")


def _substitute(text: str, values: dict[str, str], origin: str) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in values:
            return values[name]
        if re.fullmatch(r"(PREFILL|DECODE)_NODE_\d+", name):
            return values["NODE_IP"]  # upstream's per-rank placeholder: this node's own address
        raise K3Error("unresolved-placeholder", f"{origin}: ${name} has no value in a k3launch plan",
                      "replace the placeholder in the recipe with a literal value")

    return _PLACEHOLDER.sub(repl, text)


def _resolve_source(src: Source, values: dict[str, str]) -> Source:
    args = tuple(_substitute(a, values, src.origin) for a in src.args)
    env = tuple((k, _substitute(v, values, src.origin)) for k, v in src.env)
    return Source(src.layer, src.origin, args, env, src.user)


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
    if inventory is not None:
        sel = sel.model_copy(update={"hardware": inventory_hardware(inventory, sel.hardware)})
    r = resolve(tree, sel, host_memory(inventory, exclude, cordoned) if inventory is not None else None,
                replicas_default=inventory.replicas if inventory is not None else None)
    schema = load_schema(sel.engine_version(inventory.vllm_version if inventory is not None else None))
    ports = Ports.shifted(port_base)
    rf = f"models/{r.recipe_id}.yaml"
    kv = tree.taxonomy.kv_offload.get(r.kv_offload) if r.kv_offload != "off" else None
    locks = locks_for(r.recipe, r.hardware_id, r.hardware)
    model_id = r.variant.model_id or r.recipe.model.model_id
    stage, notices = loading.check(inventory, schema, model_id, locks)  # the inventory's weights section, against this vLLM
    notices = list(r.notices) + notices
    kept_out = list(exclude)  # the plan's `exclude`: passed on to a Slurm job as sbatch --exclude
    if inventory is not None:
        placed = select_nodes(inventory, r.hardware_id, r.nodes, exclude, cordoned, keep)
        notices.extend(cordoned.notices(inventory, r.hardware_id, exclude))
        kept_out += [n for n in cordoned.kept_out(inventory) if n not in exclude]
        if any(n.placeholder for n in placed):
            notices.append(Notice("placeholder-nodes", f"slurm inventory {inventory.name} has no nodelist: nodes ({placed[0].name}, ...) are bound to the allocation at launch"))
    elif nodes is not None:
        placed = list(nodes)
        if len(placed) < r.nodes:
            raise K3Error("too-few-nodes", f"the plan needs {r.nodes} nodes, {len(placed)} given", "add nodes or shrink the selection")
    else:
        placed = placeholder_nodes(r.nodes)
        notices.append(Notice("placeholder-nodes", f"placed on placeholder nodes ({', '.join(n.name for n in placed)}) with NIC {PLACEHOLDER_IFACE}; pass --inventory for real machines"))
    ft = None
    if (origin := faulttol.requested(sel, inventory)) is not None:
        if r.replicas > 1:
            asked = f"--replicas {r.replicas}" if r.replicas_from == "--replicas" else f"{r.replicas} copies ({r.replicas_from})"
            raise K3Error("replicas", f"{asked} with vLLM's fault tolerance is not supported yet: each copy's DEP pool "
                          "would need its own fault-tolerance group",
                          "drop --replicas, or --no-fault-tolerance" if r.replicas_from == "--replicas" else "--replicas 1, or --no-fault-tolerance")
        ft, ft_notices = faulttol.check(r, schema, origin, inventory.engine if inventory is not None else "vllm")
        notices.extend(ft_notices)
    reserved = dict(RESERVED)
    if r.is_pd:
        reserved["--kv-transfer-config"] = "P/D pools own the NIXL KV transfer config"
    procs: list[Process] = []
    hosts: list[Host] = []
    pool_caps: list[PoolCapacity] = []
    cursor = 0
    pools: list[Pool] = []
    ft_pools: list[FaultTolerancePool] = []
    mem = NodeMemory(r.node_memory_gb)
    # Each copy (``--replicas``) is composed alone on nodes of its own: the same commands but for
    # its own addresses (--master-addr, --data-parallel-address), its ids r<k>-<role>-<i> and its
    # pool r<k>-<role> (one recovery unit per copy). Sizes and capacity are the same for every copy.
    for pool in r.pools:
        pool_nodes, cursor = placed[cursor:cursor + pool.nodes], cursor + pool.nodes
        shared = _pool_shared(tree, r, pool, schema, ports, kv)
        pool = _sized(shared, r, pool, mem, pool_nodes[0], schema, ports, reserved, inventory, notices)
        pool_ft = ft if ft is not None and pool.role in ft.roles else None
        composed = _compose_pool(shared, pool, pool_nodes, schema, ports, locks, reserved, inventory, model_id, pool_ft, r.hardware.vendor_platform)
        copies = [composed]
        for _ in range(1, r.replicas):  # fault tolerance is refused with copies: none of them has a pool_ft
            copy_nodes, cursor = placed[cursor:cursor + pool.nodes], cursor + pool.nodes
            copies.append(_compose_pool(shared, pool, copy_nodes, schema, ports, locks, reserved, inventory, model_id, None,
                                        r.hardware.vendor_platform))
        named = ([(f"r{k}-{pool.role}", [one._replace(pid=f"r{k}-{one.pid}") for one in copy]) for k, copy in enumerate(copies)]
                 if r.replicas > 1 else [(pool.role, composed)])
        pools.append(pool)
        for pool_name, placed_copy in named:
            for one in placed_copy:
                c, node = one.composed, one.node
                notices.extend(c.notices)
                notices.extend(strip_nvl4_env(r, c))
                procs.append(_process(one.pid, pool.role, node, one.head, one.http if one.serves else None, c, _image(r, node),
                                      one.node_rank, one.dp_start, one.gpus, pool_name))
                if not any(h.name == node.name for h in hosts):
                    hosts.append(_host(node, pool.role, pool.gpus_per_node))
        if pool_ft is not None:
            ft_pools.append(FaultTolerancePool(pool=pool.role, processes=[one.pid for one in composed],
                                               recovery_timeout_s=composed[0].recovery_timeout or 0, origin=pool_ft.origin))
        tp, dp, pp = sizes(pool)
        if tp & (tp - 1):
            notices.append(Notice("tp-not-power-of-two", f"{pool.role} pool: TP {tp} must divide the model's attention heads or vLLM refuses it; "
                                  "a power of two (other node count, multi_node_tp_pp or DEP) is the safe choice"))
        memory = pool.copy_nodes * capacity.pool_node_memory(mem, pool, r.hardware).gb
        pool_caps.append(PoolCapacity(role=pool.role, parallelism=pool.parallelism, nodes=pool.nodes, gpus=pool.gpus,
                                      gpu_memory_gb=memory, weights_gb=r.weights_gb,
                                      fits=memory >= r.weights_gb, tp=tp, dp=dp, pp=pp))
    r.pools = pools  # a recipe-sized one-node pool replaced the resolved one: the router and the totals read these
    # The backend says where the router lives: the inventory's router.node, or (a scheduler's
    # allocation) the first engine node, since the login node may not reach compute nodes' ports.
    home = spec(inventory.backend).router_home if inventory is not None else "inventory"
    rnode = placed[0] if home == "allocation" else router_node(inventory, exclude, cordoned)
    router_port = inventory.router.port if inventory is not None and inventory.router.port else None
    router = router_process(r, procs, notices, rnode, ports, router_port, frozenset(p.pool for p in ft_pools))
    if router is not None:
        procs.append(router)
        if not any(h.name == rnode.name for h in hosts):
            hosts.append(_host(rnode, "router", 0))
    procs = cpusets.bind(procs, placed, inventory, r.hardware.vendor_platform, notices)  # CPU engines sharing a machine: cores of their own
    kv_cap = _kv_capacity(r, kv.host_memory_gib_per_rank if kv else None, placed[:r.nodes], notices)
    cap = Capacity(weights_gb=r.weights_gb, formula=r.weights_formula, checkpoint_gb=r.checkpoint_gb, gpu_memory_gb=min(p.gpu_memory_gb for p in pool_caps),
                   fits=all(p.fits for p in pool_caps), pools=pool_caps, kv_offload=kv_cap)
    table = port_table(procs, ports)
    front = next((p for p in procs if p.role == "router"), None) or next(p for p in procs if p.http_port is not None)
    digest = hashlib.sha256(json.dumps([[p.node, p.argv, p.env] for p in procs], sort_keys=True).encode()).hexdigest()[:6]
    short = {"pd_cluster": "pd"}.get(r.strategy.name, r.strategy.name.replace("single_node_", "").replace("multi_node_", "").replace("_", ""))
    short += f"x{r.replicas}" if r.replicas > 1 else ""
    slug = (r.recipe.meta.slug or r.recipe_id.split("/")[-1]).lower()
    return Plan(
        name=name or as_name(f"{slug}-{short}-{r.hardware_id}-{digest}"), recipe=r.recipe_id, recipe_file=rf, model=model_id,
        variant=r.variant_name, hardware=r.hardware_id, strategy=r.strategy.name, nodes=r.nodes, gpus_per_node=r.hardware.gpu_count,
        verified=r.verified, vllm_version=schema.version, features=r.features, kv_offload=r.kv_offload, advanced=list(sel.advanced),
        sets=list(sel.sets), capacity=cap, notices=_dedupe(notices), hosts=hosts, endpoint=f"http://{front.address}:{front.http_port}",
        processes=procs, ports=table, inventory=inventory.name if inventory else None,
        backend=inventory.backend if inventory else "none", engine=inventory.engine if inventory else "vllm", port_base=ports.serve,
        platform=r.hardware.vendor_platform, exclude=kept_out, fault_tolerance=ft_pools, replicas=r.replicas, stage=stage,
    )


class Placed(NamedTuple):
    """One engine process's composed command and where placement put it: one per node, or, with
    fault tolerance, one per DP rank."""

    node: NodeSpec
    composed: Composed
    serves: bool  # serves HTTP
    node_rank: int | None
    dp_start: int | None
    http: int
    pid: str
    head: bool
    gpus: int
    recovery_timeout: int | None = None  # fault tolerance: engine_recovery_timeout_sec as it runs


class PoolShared(NamedTuple):
    """What every node of one pool shares, whatever its size: its layers' sources and how it serves."""

    src: PoolSources
    hybrid: bool  # hybrid or external load balancing: every DEP node serves HTTP
    hybrid_lb: bool  # hybrid load balancing itself (a fault-tolerant pool turns it off)
    recipe_port: str | None
    http: int
    nixl_env: str | None


class NodeSources(NamedTuple):
    """One node's sources in compose order, its placement flags among them."""

    sources: list[Source]
    placement: list[str]  # the layout flags placement wrote (sizes, ranks, addresses)
    serves: bool
    node_rank: int | None
    dp_start: int | None
    http: int


def _pool_shared(tree: RecipeTree, r: Resolved, pool: Pool, schema: FlagSchema, ports: Ports, kv: KvOffloadOption | None) -> PoolShared:
    # The sources depend on the pool's role, layout and node count, never on its GPUs per node:
    # they hold for the pool a recipe resizes (_sized) too.
    rf, sf = f"models/{r.recipe_id}.yaml", f"strategies/{r.strategy.name}.yaml"
    src = pool_sources(r, pool, rf, sf, tree.taxonomy.advanced, (kv.args, kv.env) if kv else None, schema, pool_strategies(tree.strategies, pool))
    own = [*src.pre, *src.layout]
    recipe_port = flag_value([t for s in own for t in s.args], "--port")
    http = ports.http_for(pool.role) if ports.compact or not recipe_port else int(recipe_port)
    nixl_env = next((v for s in own for k, v in s.env if k == "VLLM_NIXL_SIDE_CHANNEL_PORT"), None)
    lb = lb_modes(schema, own)
    return PoolShared(src, any(lb.values()), lb["--data-parallel-hybrid-lb"], recipe_port, http, nixl_env)


def _node_sources(sh: PoolShared, pool: Pool, i: int, node: NodeSpec, head: NodeSpec, ports: Ports, inventory: Inventory | None,
                  rank: Rank | None = None) -> NodeSources:
    """Node ``i``'s sources (or, with fault tolerance, one DP rank's on it): the pool's, k3launch's
    placement flags and the node's env, placeholders resolved."""
    http, origin = sh.http, "k3launch placement"
    if rank is None:
        toks, serves, node_rank, dp_start = placement_flags(pool, i, head, sh.hybrid, ports)
    else:
        toks, serves, node_rank, dp_start = faulttol.rank_flags(rank.schema, pool, rank.rank, head, ports, sh.hybrid_lb), True, None, rank.rank
        http, origin = ports.rank_http(pool.role, sh.http, rank.local), rank.ft.placement_origin()
    sized = list(toks)
    env: list[tuple[str, str]] = [("VLLM_HOST_IP", node.address)]
    if pool.nodes > 1:
        env += [("GLOO_SOCKET_IFNAME", node.iface), ("NCCL_SOCKET_IFNAME", node.iface)]
    if sh.nixl_env is not None and ports.compact:
        env.append(("VLLM_NIXL_SIDE_CHANNEL_PORT", str(ports.nixl_for(pool.role))))
    if rank is not None:
        env += faulttol.rank_env(rank.platform, rank.local)
    if serves and (sh.recipe_port is None or ports.compact or http != sh.http):
        toks += ["--port", str(http)]
    if serves:
        # Bind the planned address, not every interface: ports are planned per address.
        toks += ["--host", node.address]
    placement = Source("strategy", origin, tuple(toks), tuple(env))
    extra = [Source("strategy", f"inventory {inventory.name} env", (), node.env)] if inventory is not None and node.env else []
    values = {"IFACE_NAME": node.iface, "NODE_IP": node.address, "HEAD_IP": head.address}
    src = sh.src
    sources = [*[_resolve_source(s, values) for s in (*src.pre, placement, *(src.quiet if serves else ()), *src.layout)], *extra, *[_resolve_source(s, values) for s in src.post],
               *loading.sources(inventory, node), *[_resolve_source(s, values) for s in src.tail]]
    if rank is not None:  # after the hardware layer: its all-to-all must not undo fault tolerance's
        cut = next((k for k, s in enumerate(sources) if LAYERS.index(s.layer) > LAYERS.index("hardware")), len(sources))
        sources.insert(cut, faulttol.source(rank.ft, rank.schema, sources[:cut]))
    return NodeSources(sources, sized, serves, node_rank, dp_start, http)


def _sized(sh: PoolShared, r: Resolved, pool: Pool, mem: NodeMemory, head: NodeSpec, schema: FlagSchema, ports: Ports,
           reserved: dict[str, str], inventory: Inventory | None, notices: list[Notice]) -> Pool:
    """The pool at the size it runs, decided before it is composed: a recipe that sizes its one-node
    layout itself (after the placement flags, as upstream's order has it) is placed as it asks."""
    ns = _node_sources(sh, pool, 0, head, head, ports, inventory)
    adapted = recipe_layout(schema, ns.sources, ns.placement, reserved, pool, r.hardware_id, r.hardware)
    if adapted is None:
        return pool
    notices.append(Notice("recipe-layout", f"{pool.role} pool: the recipe sets its own size on one node: TP x DP = {adapted.gpus_per_node} "
                          f"of {r.hardware_id}'s {r.hardware.gpu_count} GPUs (placement follows it)"))
    have = capacity.pool_node_memory(mem, adapted, r.hardware)
    if not capacity.fits(r.weights_gb, have, adapted.copy_nodes):
        raise K3Error("does-not-fit", f"{adapted.gpus_per_node} {r.hardware_id} GPUs = {have.gb:g} GB cannot hold the {r.weights_gb:g} GB of weights "
                      "(the recipe sizes this one-node layout itself)", "choose hardware with larger GPUs")
    return adapted


def _compose_pool(sh: PoolShared, pool: Pool, pool_nodes: Sequence[NodeSpec], schema: FlagSchema, ports: Ports, locks: list[Locked],
                  reserved: dict[str, str], inventory: Inventory | None, model_id: str, ft: FaultTolerance | None = None,
                  platform: str = "cuda") -> list[Placed]:
    """Compose every node's command of one pool, at its final size; with fault tolerance, every DP
    rank's (``<role>-dp<rank>``), each checked for what fault tolerance needs."""
    head = pool_nodes[0]
    out: list[Placed] = []
    for i, node in enumerate(pool_nodes):
        if ft is None:
            ns = _node_sources(sh, pool, i, node, head, ports, inventory)
            c = _composed(schema, model_id, ns.sources, locks, reserved, inventory)
            out.append(Placed(node, c, ns.serves, ns.node_rank, ns.dp_start, ns.http, f"{pool.role}-{i}", i == 0, pool.gpus_per_node))
            continue
        for local in range(pool.gpus_per_node):
            rank = i * pool.gpus_per_node + local
            ns = _node_sources(sh, pool, i, node, head, ports, inventory, Rank(ft, schema, rank, local, platform))
            c = _composed(schema, model_id, ns.sources, locks, reserved, inventory)
            if local:  # the node's first rank says once that the pool's port moved; the others' own ports are the point
                c.notices = faulttol.without_port_overrides(c.notices)
            out.append(Placed(node, c, ns.serves, ns.node_rank, ns.dp_start, ns.http, f"{pool.role}-dp{rank}", rank == 0, 1,
                              faulttol.verify(ft, pool.role, c, schema)))
    return out


def _composed(schema: FlagSchema, model_id: str, sources: list[Source], locks: list[Locked], reserved: dict[str, str],
              inventory: Inventory | None) -> Composed:
    c = compose(schema, ["vllm", "serve", model_id], sources, locks, reserved)
    c.notices += loading.verify(inventory, c, locks, loading.known_formats(schema.version))  # how the weights load
    return c


def _host(node: NodeSpec, role: Role, gpus: int) -> Host:
    """The plan's view of a placed node: every Host field is the NodeSpec field of that name, but role and GPUs."""
    return Host.model_validate({**{f: getattr(node, f) for f in Host.model_fields if f not in ("role", "gpus")}, "role": role, "gpus": gpus})


def _process(pid: str, role: Role, node: NodeSpec, head: bool, port: int | None, c: Composed, image: str | None,
             node_rank: int | None, dp_start: int | None, gpus: int, pool: str) -> Process:
    prov = {k: [ProvenanceEntry(layer=e.layer, value=e.value, origin=e.origin) for e in v] for k, v in c.provenance.items()}
    return Process(id=pid, role=role, node=node.name, address=node.address, head=head, http_port=port, argv=c.argv,
                   env=c.env, image=image, provenance=prov, pool=pool, node_rank=node_rank, dp_start_rank=dp_start, gpus=gpus)


def _kv_capacity(r: Resolved, gib: float | None, nodes: Sequence[NodeSpec], notices: list[Notice]) -> KvOffloadCapacity | None:
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
        if have < need:
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
