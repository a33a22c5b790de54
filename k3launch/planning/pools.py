"""One pool's engine commands, node by node: the pool's shared sources, each node's own (its
placement flags, environment and resolved placeholders), composed at the pool's final size.

With fault tolerance (:mod:`k3launch.planning.faulttol`) every DP rank of a DEP pool is a process of
its own, checked for what fault tolerance needs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from k3launch.errors import K3Error
from k3launch.models.recipe import KvOffloadOption
from k3launch.models.selection import Pool, Resolved
from k3launch.planning import faulttol, loading
from k3launch.planning.compose import LAYERS, Composed, Locked, Source, compose
from k3launch.planning.faulttol import FaultTolerance, Rank
from k3launch.planning.layers import PoolSources, pool_sources
from k3launch.planning.layout import lb_modes, placement_flags, pool_strategies
from k3launch.planning.placement import NodeSpec, Ports
from k3launch.planning.porttable import flag_value
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.schema import FlagSchema

if TYPE_CHECKING:  # only plans placed on an inventory load the inventory models
    from k3launch.planning.inventory import Inventory

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


def pool_shared(tree: RecipeTree, r: Resolved, pool: Pool, schema: FlagSchema, ports: Ports, kv: KvOffloadOption | None) -> PoolShared:
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


def node_sources(sh: PoolShared, pool: Pool, i: int, node: NodeSpec, head: NodeSpec, ports: Ports, inventory: Inventory | None,
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


def compose_pool(sh: PoolShared, pool: Pool, pool_nodes: Sequence[NodeSpec], schema: FlagSchema, ports: Ports, locks: list[Locked],
                  reserved: dict[str, str], inventory: Inventory | None, model_id: str, ft: FaultTolerance | None = None,
                  platform: str = "cuda") -> list[Placed]:
    """Compose every node's command of one pool, at its final size; with fault tolerance, every DP
    rank's (``<role>-dp<rank>``), each checked for what fault tolerance needs."""
    head = pool_nodes[0]
    out: list[Placed] = []
    for i, node in enumerate(pool_nodes):
        if ft is None:
            ns = node_sources(sh, pool, i, node, head, ports, inventory)
            c = _composed(schema, model_id, ns.sources, locks, reserved, inventory)
            out.append(Placed(node, c, ns.serves, ns.node_rank, ns.dp_start, ns.http, f"{pool.role}-{i}", i == 0, pool.gpus_per_node))
            continue
        for local in range(pool.gpus_per_node):
            rank = i * pool.gpus_per_node + local
            ns = node_sources(sh, pool, i, node, head, ports, inventory, Rank(ft, schema, rank, local, platform))
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
