"""Invariants every composed :class:`~k3launch.models.plan.Plan` must satisfy.

Shared by the property tests (bundled recipe) and the upstream-tree tests. Each check derives
what it needs from the argv itself (as vLLM would parse it), never from k3launch's own notion of
the layout, so a placement bug cannot hide behind a matching bookkeeping bug.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from k3launch.models.plan import Plan, Process
from k3launch.planning.lint import ERROR, lint
from k3launch.planning.schema import Arg, FlagSchema

ENGINE_ROLES = ("serve", "prefill", "decode")
NIXL_PORT = {"prefill": "5557", "decode": "5558"}
# With --port-base B the side channels are B+16 (prefill) and B+144 (decode), + DP rank.
NIXL_BLOCK_OFFSET = {"prefill": 16, "decode": 144}


def engine_processes(plan: Plan) -> list[Process]:
    return [p for p in plan.processes if p.argv[:2] == ["vllm", "serve"]]


def flags(schema: FlagSchema, proc: Process) -> dict[str, Arg]:
    """The argv of one engine process as vLLM's parser sees it (asserting it is clean)."""
    args, problems = schema.parse(proc.argv[3:])
    assert not problems, f"{proc.id}: schema problems {problems}"
    legacy = [a.written for a in args if a.legacy]
    assert not legacy, f"{proc.id}: legacy spellings reach the command: {legacy}"
    counts = Counter(a.key for a in args)
    dupes = [k for k, n in counts.items() if n > 1]
    assert not dupes, f"{proc.id}: flag keys given more than once: {dupes}"
    out = {a.key: a for a in args}
    both = [k for k, a in out.items() if a.path and a.spec.canonical in out]
    assert not both, f"{proc.id}: dotted sub-key and whole JSON of one flag both given: {both}"
    return out


def _int(args: dict[str, Arg], key: str, default: int) -> int:
    arg = args.get(key)
    return int(arg.value) if arg is not None and arg.value is not None else default


def _str(args: dict[str, Arg], key: str) -> str | None:
    arg = args.get(key)
    return arg.value if arg is not None else None


def _has(args: dict[str, Arg], key: str) -> bool:
    arg = args.get(key)
    return arg is not None and arg.polarity is True


def check_engine(schema: FlagSchema, plan: Plan, proc: Process) -> dict[str, Arg]:
    assert proc.role in ENGINE_ROLES, proc.role
    assert proc.argv[2] == plan.model, f"{proc.id}: model positional {proc.argv[2]!r} != {plan.model!r}"
    args = flags(schema, proc)
    # Placeholders ($HEAD_IP, $IFACE_NAME, ...) are filled from the inventory, never left in.
    leftovers = [t for t in [*proc.argv, *proc.env.values()] if "$" in t]
    assert not leftovers, f"{proc.id}: unfilled placeholders {leftovers}"
    # Provenance: every flag key and env name, last recorded value == what runs.
    for key, arg in args.items():
        prov = proc.provenance.get(key)
        assert prov, f"{proc.id}: no provenance for {key}"
        assert prov[-1].value == arg.shown, f"{proc.id}: {key} runs {arg.shown!r}, provenance ends {prov[-1].value!r}"
    for name, value in proc.env.items():
        prov = proc.provenance.get(name)
        assert prov, f"{proc.id}: no provenance for env {name}"
        assert prov[-1].value == value, f"{proc.id}: env {name}={value!r}, provenance ends {prov[-1].value!r}"
    if proc.http_port is not None:
        assert _int(args, "--port", 8000) == proc.http_port, f"{proc.id}: --port != http_port {proc.http_port}"
    return args


def check_plan(schema: FlagSchema, plan: Plan) -> None:
    engines = engine_processes(plan)
    assert engines, "a plan without engine processes"
    assert all(p.role == "router" for p in plan.processes if p not in engines)
    parsed = {p.id: check_engine(schema, plan, p) for p in engines}

    # Capacity: every pool holds a full copy of the weights.
    assert plan.capacity.fits, plan.capacity
    assert plan.capacity.gpu_memory_gb >= plan.capacity.weights_gb
    for pc in plan.capacity.pools:
        assert pc.fits and pc.gpu_memory_gb >= pc.weights_gb, pc

    # One engine process per node, across the whole plan (so P/D pools are disjoint).
    nodes = [p.node for p in engines]
    assert len(nodes) == len(set(nodes)), f"two engine processes on one node: {nodes}"
    addresses = [p.address for p in engines]
    assert len(addresses) == len(set(addresses)), addresses
    assert sum(pc.nodes for pc in plan.capacity.pools) == plan.nodes == len(engines)

    by_pool: dict[str, list[Process]] = {}
    for p in engines:
        by_pool.setdefault(p.pool or p.role, []).append(p)
    assert sorted(by_pool) == sorted(pc.role for pc in plan.capacity.pools)
    if plan.strategy == "pd_cluster":
        assert sorted(by_pool) == ["decode", "prefill"]
        pre = {p.node for p in by_pool["prefill"]} | {p.address for p in by_pool["prefill"]}
        dec = {p.node for p in by_pool["decode"]} | {p.address for p in by_pool["decode"]}
        assert not pre & dec, f"P/D pools share nodes: {pre & dec}"

    for pc in plan.capacity.pools:
        procs = by_pool[pc.role]
        if pc.parallelism == "replicas":  # independent engines: each a whole copy on its node, all serving HTTP
            for p in procs:
                a = parsed[p.id]
                assert (_int(a, "--tensor-parallel-size", 1), _int(a, "--data-parallel-size", 1)) == (plan.gpus_per_node, 1), p.argv
                assert p.http_port is not None and "--headless" not in p.argv, p.id
            assert (pc.tp, pc.dp, pc.pp) == (plan.gpus_per_node, pc.nodes, 1) and len(procs) == pc.nodes
            continue
        _check_pool(plan, pc.role, pc.nodes, procs, {p.id: parsed[p.id] for p in procs}, (pc.tp, pc.dp, pc.pp))

    _check_router(plan, engines)

    # Planned listening ports: (address, port) unique across the plan.
    used = [(u.address, u.port) for u in getattr(plan, "ports", [])]
    assert len(used) == len(set(used)), f"port clash: {[u for u in used if used.count(u) > 1]}"


def _check_pool(plan: Plan, role: str, n: int, procs: list[Process], parsed: dict[str, dict[str, Arg]],
                reported: tuple[int, int, int]) -> None:
    # GPUs each engine uses: every GPU of its node, or -- one node only -- a single-node TP's smaller
    # size (a CPU profile's ranks are not devices: a declared TP may exceed them).
    g = procs[0].gpus
    assert 0 < g <= plan.gpus_per_node or plan.platform == "cpu", f"{role}: {g} GPUs of {plan.gpus_per_node} per node"
    assert n == 1 or g == plan.gpus_per_node, f"{role}: a multi-node pool uses {g} of {plan.gpus_per_node} GPUs per node"
    assert len(procs) == n, f"{role}: {len(procs)} processes for {n} nodes"
    heads = [p for p in procs if p.head]
    assert len(heads) == 1, f"{role}: {len(heads)} heads"
    head = heads[0]
    layouts = set()
    for p in procs:
        a = parsed[p.id]
        assert p.gpus == g
        tp = _int(a, "--tensor-parallel-size", 1)
        dp = _int(a, "--data-parallel-size", 1)
        pp = _int(a, "--pipeline-parallel-size", 1)
        assert tp * dp * pp == n * g, f"{p.id}: TP{tp} x DP{dp} x PP{pp} != {n} nodes x {g} GPUs"
        layouts.add((tp, dp, pp))
        # Every multi-node rendezvous address is the pool head's.
        for key in ("--master-addr", "--data-parallel-address"):
            if key in a:
                assert _str(a, key) == head.address, f"{p.id}: {key} {_str(a, key)} != head {head.address}"
        if n > 1:
            assert p.env.get("GLOO_SOCKET_IFNAME") and p.env.get("NCCL_SOCKET_IFNAME"), f"{p.id}: no fabric NIC env"
        if plan.strategy == "pd_cluster":
            assert p.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") == p.address, f"{p.id}: NIXL host is not the node's own address"
            # The recipe's side channel (5557/5558), or its slot of the --port-base block.
            want = NIXL_PORT[role] if plan.port_base == 8000 else str(plan.port_base + NIXL_BLOCK_OFFSET[role])
            assert p.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT") == want, f"{p.id}: NIXL side channel port"
            kv = _str(a, "--kv-transfer-config") or ""
            assert "NixlConnector" in kv and ("kv_producer" if role == "prefill" else "kv_consumer") in kv, kv
    assert len(layouts) == 1, f"{role}: processes disagree on the layout {layouts}"
    tp, dp, pp = layouts.pop()
    assert (tp, dp, pp) == reported, f"{role}: argv layout {(tp, dp, pp)} != capacity {reported}"

    if dp > 1:
        # DEP: start ranks 0, local, 2*local, ... cover 0..DP-1 exactly once.
        locals_ = {_int(parsed[p.id], "--data-parallel-size-local", dp) for p in procs}
        assert len(locals_) == 1, locals_
        local = locals_.pop()
        starts = sorted(_int(parsed[p.id], "--data-parallel-start-rank", 0) for p in procs)
        assert starts == list(range(0, dp, local)), f"{role}: DP start ranks {starts} (local {local}, DP {dp})"
        assert local * n == dp
        if n > 1:
            assert all("--data-parallel-address" in parsed[p.id] for p in procs), f"{role}: DP without coordinator address"
        assert _int(parsed[head.id], "--data-parallel-start-rank", 0) == 0
    elif n > 1:
        # Multi-node TP/TEP (/PP): distinct node ranks 0..N-1, non-heads headless, one master.
        ranks = sorted(_int(parsed[p.id], "--node-rank", -1) for p in procs)
        assert ranks == list(range(n)), f"{role}: node ranks {ranks}"
        for p in procs:
            a = parsed[p.id]
            assert _int(a, "--nnodes", 1) == n, f"{p.id}: --nnodes"
            assert "--master-addr" in a, f"{p.id}: no --master-addr"
            is_head = _int(a, "--node-rank", -1) == 0
            assert is_head == p.head, f"{p.id}: head flag disagrees with --node-rank"
            assert _has(a, "--headless") == (not is_head), f"{p.id}: --headless must be set exactly on non-head nodes"
            assert (p.http_port is None) == (not is_head), f"{p.id}: only the head serves HTTP"


def _check_router(plan: Plan, engines: list[Process]) -> None:
    routers = [p for p in plan.processes if p.role == "router"]
    serving = [p for p in engines if p.http_port is not None]
    if plan.strategy == "pd_cluster":
        assert len(routers) == 1, "P/D needs a router"
    if not routers:
        assert len(serving) == 1
        return
    argv = routers[0].argv
    urls: dict[str, list[str]] = {}
    for flag, value in pairwise(argv):
        if flag in ("--prefill", "--decode"):
            urls.setdefault(flag[2:], []).append(value)
    if plan.strategy == "pd_cluster":
        assert "--vllm-pd-disaggregation" in argv
        for role in ("prefill", "decode"):
            want = sorted(f"http://{p.address}:{p.http_port}" for p in serving if p.role == role)
            assert sorted(urls.get(role, [])) == want, f"router {role} URLs {urls.get(role)} != {want}"
    else:
        i = argv.index("--worker-urls")
        got = []
        for tok in argv[i + 1:]:
            if tok.startswith("--"):
                break
            got.append(tok)
        assert sorted(got) == sorted(f"http://{p.address}:{p.http_port}" for p in serving)


def lint_errors(schema: FlagSchema, plan: Plan) -> list[str]:
    out = []
    for p in engine_processes(plan):
        out += [f"{p.id}: {f.code}: {f.message}" for f in lint(schema, p.argv) if f.severity == ERROR]
    return out
