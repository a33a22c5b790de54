"""Selection (+ nodes) → :class:`Plan`: every process of the deployment, fully composed.

Placement rules (README "Placement"): nodes are taken in order; a P/D deployment puts the
prefill pool first and the decode pool on the next, disjoint nodes; within a pool node 0 is the
head (its address is the TP master / DP coordinator of the pool). Multi-node TP/TEP: every node
gets ``--nnodes/--node-rank/--master-addr/--master-port`` and non-head nodes ``--headless``.
DEP: ``--data-parallel-size g·N --data-parallel-size-local g`` and ``--data-parallel-start-rank
i·g``; with hybrid load balancing every node serves HTTP, so a router fronts them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from k3launch.compose import Composed, Notice, Source, compose
from k3launch.errors import K3Error
from k3launch.layers import RESERVED, locks_for, pool_sources
from k3launch.plan_models import (
    Capacity,
    Host,
    KvOffloadCapacity,
    NoticeOut,
    Plan,
    PoolCapacity,
    Process,
    ProvenanceEntry,
)
from k3launch.recipes import RecipeTree
from k3launch.resolve import resolve
from k3launch.schema import load_schema
from k3launch.selection import Pool, Resolved, Selection

MASTER_PORT = 29501
DP_RPC_PORT = 13345
SERVE_PORT = 8000
ROUTER_PORT = 8000
ROUTER_PROMETHEUS_PORT = 29000
DEFAULT_READY_TIMEOUT_S = 1800
PLACEHOLDER_IFACE = "ib0"


@dataclass(frozen=True)
class NodeSpec:
    """A machine to place processes on (an inventory node, or a placeholder)."""

    name: str
    address: str
    iface: str = PLACEHOLDER_IFACE
    placeholder: bool = False


def placeholder_nodes(count: int) -> list[NodeSpec]:
    return [NodeSpec(f"node-{i}", f"node-{i}", PLACEHOLDER_IFACE, True) for i in range(count)]


LOGIN = NodeSpec("login", "login", PLACEHOLDER_IFACE, True)

_PLACEHOLDER = re.compile(r"\$\{?([A-Z_][A-Z0-9_]*)\}?")


def _substitute(text: str, values: dict[str, str], origin: str) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in values:
            return values[name]
        if re.fullmatch(r"(PREFILL|DECODE)_NODE_\d+", name):
            return values["NODE_IP"]
        raise K3Error("unresolved-placeholder", f"{origin}: ${name} has no value in a k3launch plan",
                      "replace the placeholder in the recipe with a literal value")

    return _PLACEHOLDER.sub(repl, text)


def _resolve_source(src: Source, values: dict[str, str]) -> Source:
    args = tuple(_substitute(a, values, src.origin) for a in src.args)
    env = tuple((k, _substitute(v, values, src.origin)) for k, v in src.env)
    return Source(src.layer, src.origin, args, env, src.user)


def _layout(pool: Pool, i: int, head: NodeSpec, hybrid: bool) -> tuple[list[str], bool, int | None, int | None]:
    """Placement flags of node ``i`` of ``pool``: (tokens, serves_http, node_rank, dp_start_rank)."""
    g, n, par = pool.gpus_per_node, pool.nodes, pool.parallelism
    if par in ("tp", "tep", "tp_pp"):
        tp = g if par == "tp_pp" else g * n
        toks = ["--tensor-parallel-size", str(tp)]
        if par == "tp_pp":
            toks += ["--pipeline-parallel-size", str(n)]
        if n == 1:
            return toks, True, None, None
        toks += ["--nnodes", str(n), "--node-rank", str(i), "--master-addr", head.address, "--master-port", str(MASTER_PORT)]
        if i > 0:
            toks.append("--headless")
        return toks, i == 0, i, None
    local = g if par == "dep" else 1
    tp = 1 if par == "dep" else g
    dp = local * n
    toks = ["--tensor-parallel-size", str(tp), "--data-parallel-size", str(dp), "--data-parallel-size-local", str(local)]
    if n == 1:
        return toks, True, None, 0
    toks += ["--data-parallel-address", head.address, "--data-parallel-rpc-port", str(DP_RPC_PORT)]
    if i > 0:
        toks += ["--data-parallel-start-rank", str(i * local)]
        if not hybrid:
            toks.append("--headless")
    return toks, i == 0 or hybrid, None, i * local


def _hybrid(pre: Sequence[Source]) -> bool:
    return any(t in ("--data-parallel-hybrid-lb", "-dph", "--data-parallel-external-lb", "-dpe") for s in pre for t in s.args)


def _image(r: Resolved) -> str | None:
    vb = r.variant.hardware_overrides.get(r.hardware_id)
    if vb is not None and vb.docker_image:
        return vb.docker_image
    brand = r.hardware.brand.lower()
    return r.recipe.model.docker_image.get(brand) or r.hardware.image


def build_plan(tree: RecipeTree, sel: Selection, nodes: Sequence[NodeSpec] | None = None) -> Plan:
    r = resolve(tree, sel)
    schema = load_schema(sel.vllm_version)
    rf = f"models/{r.recipe_id}.yaml"
    sf = f"strategies/{r.strategy.name}.yaml"
    kv = tree.taxonomy.kv_offload.get(r.kv_offload) if r.kv_offload != "off" else None
    kv_args = (kv.args, kv.env) if kv is not None else None
    locks = locks_for(r.recipe, r.hardware_id, r.hardware)
    model_id = r.variant.model_id or r.recipe.model.model_id
    program = ["vllm", "serve", model_id]
    placed = list(nodes) if nodes is not None else placeholder_nodes(r.nodes)
    if len(placed) < r.nodes:
        raise K3Error("too-few-nodes", f"the plan needs {r.nodes} nodes, {len(placed)} given", "add nodes or shrink the selection")
    notices = list(r.notices)
    if nodes is None:
        notices.append(Notice("placeholder-nodes", f"placed on placeholder nodes node-0..node-{r.nodes - 1} with NIC {PLACEHOLDER_IFACE}; pass --inventory for real addresses"))
    reserved = dict(RESERVED)
    if r.is_pd:
        reserved["--kv-transfer-config"] = "P/D pools own the NIXL KV transfer config"
    procs: list[Process] = []
    hosts: list[Host] = []
    pool_caps: list[PoolCapacity] = []
    cursor = 0
    image = _image(r)
    for pool in r.pools:
        pool_nodes = placed[cursor:cursor + pool.nodes]
        cursor += pool.nodes
        pre, post, tail = pool_sources(r, pool, rf, sf, tree.taxonomy.advanced, kv_args)
        hybrid = _hybrid(pre)
        head = pool_nodes[0]
        for i, node in enumerate(pool_nodes):
            toks, serves, node_rank, dp_start = _layout(pool, i, head, hybrid)
            env: list[tuple[str, str]] = [("VLLM_HOST_IP", node.address)]
            if pool.nodes > 1:
                env += [("GLOO_SOCKET_IFNAME", node.iface), ("NCCL_SOCKET_IFNAME", node.iface)]
            if serves and not any(t == "--port" for s in pre for t in s.args):
                toks += ["--port", str(SERVE_PORT)]
            placement = Source("strategy", "k3launch placement", tuple(toks), tuple(env))
            values = {"IFACE_NAME": node.iface, "NODE_IP": node.address, "HEAD_IP": head.address}
            sources = [_resolve_source(s, values) for s in (*pre, placement, *post, *tail)]
            c = compose(schema, program, sources, locks, reserved)
            notices.extend(c.notices)
            port = c.value("--port")
            procs.append(_process(f"{pool.role}-{i}", pool.role, node, i == 0, int(port) if serves and port else None,
                                  c, image, node_rank, dp_start, pool.gpus_per_node))
            hosts.append(Host(name=node.name, address=node.address, role=pool.role, gpus=pool.gpus_per_node, placeholder=node.placeholder))
        tp, dp, pp = _sizes(pool)
        pool_caps.append(PoolCapacity(role=pool.role, parallelism=pool.parallelism, nodes=pool.nodes, gpus=pool.gpus,
                                      gpu_memory_gb=pool.nodes * r.hardware.vram_gb, weights_gb=r.weights_gb,
                                      fits=pool.nodes * r.hardware.vram_gb >= r.weights_gb, tp=tp, dp=dp, pp=pp))
    router = _router(r, procs, notices)
    if router is not None:
        procs.append(router)
    endpoint = _endpoint(procs)
    cap = Capacity(
        weights_gb=r.weights_gb, formula=r.weights_formula,
        gpu_memory_gb=min(p.gpu_memory_gb for p in pool_caps), fits=all(p.fits for p in pool_caps), pools=pool_caps,
        kv_offload=_kv_capacity(r, kv.host_memory_gib_per_rank if kv else None),
    )
    return Plan(
        recipe=r.recipe_id, recipe_file=rf, model=model_id, variant=r.variant_name, hardware=r.hardware_id,
        strategy=r.strategy.name, nodes=r.nodes, gpus_per_node=r.hardware.gpu_count, verified=r.verified,
        vllm_version=schema.version, features=r.features, kv_offload=r.kv_offload, advanced=list(sel.advanced),
        sets=list(sel.sets), capacity=cap, notices=_dedupe(notices), hosts=hosts, endpoint=endpoint, processes=procs,
    )


def _sizes(pool: Pool) -> tuple[int, int, int]:
    g, n = pool.gpus_per_node, pool.nodes
    return {
        "tp": (g * n, 1, 1), "tep": (g * n, 1, 1), "dep": (1, g * n, 1), "tp_pp": (g, 1, n), "tp_dp": (g, n, 1),
    }[pool.parallelism]


def _process(pid: str, role: str, node: NodeSpec, head: bool, port: int | None, c: Composed, image: str | None,
             node_rank: int | None, dp_start: int | None, gpus: int) -> Process:
    prov = {k: [ProvenanceEntry(layer=e.layer, value=e.value, origin=e.origin) for e in v] for k, v in c.provenance.items()}
    return Process(id=pid, role=role, node=node.name, address=node.address, head=head, http_port=port, argv=c.argv,
                   env=c.env, image=image, provenance=prov, pool=role, node_rank=node_rank, dp_start_rank=dp_start, gpus=gpus)


def _router(r: Resolved, procs: list[Process], notices: list[Notice]) -> Process | None:
    serving = [p for p in procs if p.http_port is not None]
    if not r.is_pd and len(serving) <= 1:
        return None
    timeout = next((p.env["VLLM_ENGINE_READY_TIMEOUT_S"] for p in procs if "VLLM_ENGINE_READY_TIMEOUT_S" in p.env), str(DEFAULT_READY_TIMEOUT_S))
    policy = r.strategy.router.policy if r.strategy.router else "round_robin"
    argv = ["vllm-router"]
    prov: dict[str, list[ProvenanceEntry]] = {}

    def add(flag: str, *vals: str, origin: str = "k3launch placement") -> None:
        argv.append(flag)
        argv.extend(vals)
        prov.setdefault(flag, []).append(ProvenanceEntry(layer="strategy", value=" ".join(vals) or flag, origin=origin))

    if r.is_pd:
        add("--vllm-pd-disaggregation", origin=f"strategies/{r.strategy.name}.yaml")
        for p in serving:
            add("--prefill" if p.role == "prefill" else "--decode", f"http://{p.address}:{p.http_port}")
    else:
        add("--worker-urls", *[f"http://{p.address}:{p.http_port}" for p in serving])
        notices.append(Notice("router-added", f"every {r.strategy.name} node serves HTTP (hybrid load balancing); a vllm-router on the login node fronts all {len(serving)}"))
    add("--policy", policy, origin=f"strategies/{r.strategy.name}.yaml" if r.strategy.router else "k3launch placement")
    add("--host", "0.0.0.0")
    add("--port", str(ROUTER_PORT))
    add("--prometheus-port", str(ROUTER_PROMETHEUS_PORT))
    # The router probes workers every 30 s by default: a deployment would look unready for
    # up to 30 s after the last engine came up.
    add("--worker-startup-check-interval", "1")
    add("--worker-startup-timeout-secs", timeout)
    return Process(id="router", role="router", node=LOGIN.name, address=LOGIN.address, head=True, http_port=ROUTER_PORT,
                   argv=argv, env={}, image=None, provenance=prov, pool=None, gpus=0)


def _endpoint(procs: list[Process]) -> str:
    router = next((p for p in procs if p.role == "router"), None)
    front = router or next(p for p in procs if p.http_port is not None)
    return f"http://{front.address}:{front.http_port}"


def _kv_capacity(r: Resolved, gib: float | None) -> KvOffloadCapacity | None:
    if gib is None:
        return None
    ranks = r.hardware.gpu_count
    return KvOffloadCapacity(option=r.kv_offload, host_gib_per_rank=gib, ranks_per_node=ranks, host_gib_per_node=gib * ranks)


def _dedupe(notices: list[Notice]) -> list[NoticeOut]:
    seen: set[tuple[str, str]] = set()
    out: list[NoticeOut] = []
    for n in notices:
        if (n.code, n.message) not in seen:
            seen.add((n.code, n.message))
            out.append(NoticeOut(code=n.code, message=n.message))
    return out
