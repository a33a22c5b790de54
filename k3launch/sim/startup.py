"""The sim's engine start-up, logged with vLLM's own lines in vLLM's order, so a log scraper (and
k3launch's live progress, :mod:`k3launch.models.phases`) sees every phase a real engine goes through.

``K3LAUNCH_SIM_LOAD_S`` is shared among the phases as a real start spends it, roughly: loading
the weights (most of it, with vLLM's per-shard progress lines), torch.compile, the KV cache
profile, CUDA graph capture. The lines quote vLLM 0.32's messages (sources named in ``src``).
"""

from __future__ import annotations

import threading
import time

from k3launch.sim.bar import clock
from k3launch.sim.logs import Logger
from k3launch.sim.options import Knobs, ServeOptions
from k3launch.sim.wire import Stopped

SHARDS = 8  # checkpoint shards the simulated weights come in (one progress line each)
WEIGHTS, COMPILE, KV_CACHE, GRAPHS = 0.6, 0.2, 0.05, 0.15  # shares of K3LAUNCH_SIM_LOAD_S
# A real start keeps a core busy throughout (reading and deserializing weights, compiling), and a
# supervisor takes a start that uses no CPU at all for a hung one (RestartPolicy.stall_after):
# the sim works BUSY_S of every BUSY_EVERY_S while it loads (~10% of one core).
BUSY_S, BUSY_EVERY_S = 0.02, 0.2


def _work(done: threading.Event, deadline: float) -> bool:
    """Until ``deadline``, a little CPU work every :data:`BUSY_EVERY_S`; True if ``done`` was set."""
    while True:
        spin = time.monotonic() + BUSY_S
        while time.monotonic() < min(spin, deadline):
            pass
        left = deadline - time.monotonic()
        if done.wait(max(0.0, min(BUSY_EVERY_S - BUSY_S, left))):
            return True
        if left <= 0:
            return False


def distributed_init(log: Logger, o: ServeOptions) -> None:
    """vLLM's line just before ``torch.distributed`` init, which waits for every rank of the group."""
    if o.multi_node_tp:
        rank, addr, port = o.node_rank * (o.tp * o.pp // o.nnodes), o.master_addr, o.master_port
    else:
        rank, addr, port = 0, o.dp_address if o.multi_node_dp else "127.0.0.1", o.dp_rpc_port if o.multi_node_dp else o.master_port
    log.info(
        f"world_size={o.tp * o.pp} rank={rank} local_rank=0 distributed_init_method=tcp://{addr}:{port} backend=nccl",
        src="parallel_state.py",
    )


def _bar(desc: str, n: int, total: int, elapsed: float) -> str:
    """vLLM's bar format for checkpoint shards (it ends each update with a newline)."""
    rate = f"{n / elapsed:.2f}it/s" if elapsed > 0 and n else "?it/s"
    left = (total - n) * elapsed / n if n else 0.0
    return f"{desc}: {100 * n / total:3.0f}% Completed | {n}/{total} [{clock(elapsed)}<{clock(left) if n else '?'}, {rate}]"


def load(log: Logger, o: ServeOptions, k: Knobs, done: threading.Event, t0: float) -> None:
    """Weights, compile, KV cache and CUDA graphs, done ``k.load_s`` after ``t0`` (the start of the
    start-up: the rendezvous counts in, as before); raises Stopped when ``done`` is set."""

    def until(share_end: float) -> None:
        if _work(done, t0 + share_end * k.load_s):
            raise Stopped

    log.info(f"Starting to load model {o.model}...", src="gpu_model_runner.py")
    log.info(f"Loading weights of {o.model} (simulated, {k.load_s:g} s)", src="default_loader.py")
    desc = "Loading safetensors checkpoint shards"
    log.raw(_bar(desc, 0, SHARDS, 0.0))
    for i in range(1, SHARDS + 1):
        until(WEIGHTS * i / SHARDS)
        log.raw(_bar(desc, i, SHARDS, time.monotonic() - t0))
    took = time.monotonic() - t0
    log.info(f"Loading weights took {took:.2f} seconds", src="default_loader.py")
    log.info(f"Model loading took 0.00 GiB memory and {took:.6f} seconds", src="gpu_model_runner.py")
    log.info("Dynamo bytecode transform time: 0.00 s", src="backends.py")
    until(WEIGHTS + COMPILE)
    log.info(f"torch.compile took {COMPILE * k.load_s:.2f} s in total", src="monitor.py")
    log.info("Available KV cache memory: 1.00 GiB", src="gpu_worker.py")
    log.info(
        f"GPU KV cache size: 65,536 tokens, Maximum concurrency for {o.max_model_len or 4096:,} tokens per request: 16.00x",
        src="kv_cache_utils.py",
    )
    until(WEIGHTS + COMPILE + KV_CACHE)  # the KV cache's allocation, then the graphs are captured
    log.raw("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):   0%|          | 0/67 [00:00<?, ?it/s]")
    until(1.0)
    log.info(f"Graph capturing finished in {GRAPHS * k.load_s:.0f} secs, took 0.00 GiB", src="gpu_model_runner.py")
    log.info(f"init engine (profile, create kv cache, warmup model) took {time.monotonic() - t0:.2f} s", src="core.py")
