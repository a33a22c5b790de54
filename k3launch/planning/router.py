"""The router process of a plan: ``vllm-router`` in front of several HTTP-serving engines.

P/D: ``--vllm-pd-disaggregation`` with one ``--prefill``/``--decode`` URL per serving process
of each pool (the head of a TP/TEP pool, every node of a hybrid-LB DEP pool, every DP rank of a
fault-tolerant DEP pool). Aggregated deployments whose nodes all serve HTTP (DEP with hybrid load
balancing or fault tolerance, independent replicas) get a round-robin router too, so one endpoint
reaches every engine.

Every router is set up for supervision (:func:`_supervision_flags`): an engine that dies is
routed around, and routed to again once it is restarted on the same address and port.
"""

from __future__ import annotations

from collections.abc import Callable

from k3launch.models.plan import Process, ProvenanceEntry
from k3launch.models.selection import Notice, Resolved
from k3launch.planning.placement import NodeSpec, Ports
from k3launch.planning.porttable import process_ports

DEFAULT_READY_TIMEOUT_S = 1800
SUPERVISION = "k3launch supervision: a restarted engine is routed to again"


def router_process(r: Resolved, procs: list[Process], notices: list[Notice], node: NodeSpec, ports: Ports,
                   port: int | None = None, fault_tolerant: frozenset[str] = frozenset()) -> Process | None:
    """``fault_tolerant``: the pools whose every DP rank serves HTTP on its own (``--fault-tolerance``)."""
    serving = [p for p in procs if p.http_port is not None]
    if not r.is_pd and len(serving) <= 1:
        return None
    # A node is one machine whatever address a process binds, and one address may be shared by
    # several nodes of a local inventory: a port is taken if either its node or its address uses it.
    taken = {("node:" + p.node, q) for p in procs for q, _ in process_ports(p)} | {(p.address, q) for p in procs for q, _ in process_ports(p)}
    want = ports.router if ports.compact or not port else port
    if port and ports.compact:
        notices.append(Notice("router-port", f"router.port {port} of the inventory ignored: --port-base puts the router at {ports.router}"))

    def free(start: int) -> int:
        q = start
        while ("node:" + node.name, q) in taken or (node.address, q) in taken:
            q += 1
        return q

    http = free(want)
    if http != want:
        notices.append(Notice("router-port", f"router on {node.name}: port {want} is taken by an engine there; using {http}"))
    taken |= {("node:" + node.name, http), (node.address, http)}
    metrics = free(ports.router_metrics)
    timeout = next((p.env["VLLM_ENGINE_READY_TIMEOUT_S"] for p in procs if "VLLM_ENGINE_READY_TIMEOUT_S" in p.env), str(DEFAULT_READY_TIMEOUT_S))
    policy = r.strategy.router.policy if r.strategy.router else "round_robin"
    argv = ["vllm-router"]
    prov: dict[str, list[ProvenanceEntry]] = {}
    sfile = f"strategies/{r.strategy.name}.yaml"

    def add(flag: str, *vals: str, origin: str = "k3launch placement") -> None:
        argv.append(flag)
        argv.extend(vals)
        prov.setdefault(flag, []).append(ProvenanceEntry(layer="strategy", value=" ".join(vals) or flag, origin=origin))

    if r.is_pd:
        add("--vllm-pd-disaggregation", origin=sfile)
        for p in serving:
            add("--prefill" if p.role == "prefill" else "--decode", f"http://{p.address}:{p.http_port}")
    else:
        add("--worker-urls", *[f"http://{p.address}:{p.http_port}" for p in serving])
        if fault_tolerant:
            notices.append(Notice("router-added", f"every {r.strategy.name} DP rank serves HTTP (one API server per rank, for fault tolerance); "
                                                  f"a vllm-router on {node.name} fronts all {len(serving)}"))
        elif r.replicas > 1:
            notices.append(Notice("router-added", f"{r.replicas} copies of the {r.strategy.name} engine (--replicas): a vllm-router on {node.name} "
                                                  f"fronts their {len(serving)} HTTP servers"))
        else:
            how = "independent replicas" if any(p.parallelism == "replicas" for p in r.pools) else "hybrid load balancing"
            notices.append(Notice("router-added", f"every {r.strategy.name} node serves HTTP ({how}); a vllm-router on {node.name} fronts all {len(serving)}"))
    add("--policy", policy, origin=sfile if r.strategy.router else "k3launch placement")
    add("--host", node.address)
    add("--port", str(http))
    add("--prometheus-port", str(metrics))
    # vllm-router binds its metrics to 127.0.0.1 by default: a Prometheus on another machine could
    # not scrape it (docs/monitoring.md)
    add("--prometheus-host", node.address)
    ov = r.recipe.strategy_overrides.get(r.strategy.name)
    intra = ov.router.get("intra_node_data_parallel_size") if ov is not None else None
    if intra is not None and fault_tolerant:  # each URL is one DP rank's API server
        notices.append(Notice("router-intra-dp", f"router: intra_node_data_parallel_size {intra} of the recipe left out: with fault tolerance "
                                                 "each engine URL is one DP rank"))
    elif intra is not None:  # DP ranks behind each engine URL, as the recipe pins it
        add("--intra-node-data-parallel-size", str(intra), origin=f"models/{r.recipe_id}.yaml strategy_overrides.{r.strategy.name}.router")
    # The router probes workers every 30 s by default: a deployment would look unready for up to
    # 30 s after its last engine came up.
    add("--worker-startup-check-interval", "1")
    add("--worker-startup-timeout-secs", timeout, origin="VLLM_ENGINE_READY_TIMEOUT_S of the engines" if any("VLLM_ENGINE_READY_TIMEOUT_S" in p.env for p in procs) else "k3launch placement")
    _supervision_flags(add, pd=r.is_pd)
    return Process(id="router", role="router", node=node.name, address=node.address, head=True, http_port=http,
                   argv=argv, env={}, image=None, provenance=prov, pool=None, gpus=0)


def _supervision_flags(add: Callable[..., None], pd: bool) -> None:
    """The flags that let the router route around an engine a supervisor restarts on the same
    address and port. Figures: vllm-router 0.1.17, two sim engines, four clients sending small
    completions, one engine killed with SIGKILL and restarted (tests/e2e/local/test_router_supervision.py).

    What takes a worker out and puts it back is the health checker (``GET /health`` of every
    worker each interval): unhealthy after ``--health-failure-threshold`` failed checks in a row,
    healthy again after ``--health-success-threshold`` (2) good ones. The regular router also has
    a per-worker circuit breaker (open after 10 failed sends in a row) and retries a failed send on
    a freshly picked worker; 0.1.17's P/D router has neither: a request paired with a dead
    prefill or decode is a 500 ("Transparent proxy request failed") until the health checker
    takes that worker out, and no breaker ever opened in our P/D runs.
    """
    # Default 60 s. With it a restarted engine got no request for 55 s after its /health answered:
    # nothing re-admitted it but the breaker's 60 s timeout; in P/D every request paired with the
    # dead engine failed until it was back (865 failed requests over a 5.5 s outage). At 1 s the
    # restarted engine serves again 1.5-1.7 s after its /health answers, at the cost of one
    # GET /health per engine per second.
    add("--health-check-interval-secs", "1", origin=SUPERVISION)
    # Default 3 checks in a row. P/D cannot retry, so this is its window of failed requests:
    # 3.0 s (450-580 failed requests) at 3, 1.0 s (155-205) at 1. A hung engine (SIGSTOP) is out
    # after one 5 s check timeout: 6 s instead of 16 s. A falsely failed check costs one engine's
    # share for the 2 s of two good checks, no request.
    add("--health-failure-threshold", "1", origin=SUPERVISION)
    if pd:
        return  # the retry and breaker flags below do nothing in 0.1.17's P/D router
    # Retries: each attempt goes to the worker the policy picks again. vllm-router's default (5
    # attempts, sleeps from 50 ms x1.5, about 0.4 s in all) ends before the health checker's next
    # look at a dead engine (up to 1 s): a policy that picks the same worker again (cache_aware,
    # or round robin when the clients' requests interleave) answered 500 "Request failed: error
    # sending request" to 2 of 3 requests sent right after a kill (two runs). 8 attempts, sleeps from 100 ms
    # x1.5 capped at 1 s: 3.1 s (2.5 s at the jitter's low end), two health-check intervals, and
    # none of them failed. With --disable-retries a kill cost 10 requests. A request to an engine
    # that is up and refuses it (4xx) is not retried; a stream whose headers were sent is not
    # either: the client's stream is cut.
    add("--retry-max-retries", "8", origin=SUPERVISION)
    add("--retry-initial-backoff-ms", "100", origin=SUPERVISION)
    add("--retry-backoff-multiplier", "1.5", origin=SUPERVISION)
    add("--retry-max-backoff-ms", "1000", origin=SUPERVISION)
    # The breaker opens 0.2-0.6 s after a kill (10 failed sends) and, at its default 60 s, keeps
    # the worker out for 60 s from then even when health checks pass: with the 1 s health
    # interval alone, an engine restarted 5 s after its kill was healthy again and still got no
    # request in the 13 s left of the run. 2 s is the health checker's own re-admission time
    # (two good checks), so the breaker is never the slower gate.
    add("--cb-timeout-duration-secs", "2", origin=SUPERVISION)
