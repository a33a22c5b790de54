"""The simulated engine: admission bounded by --max-num-seqs, a latency model, and P/D roles.

Latency model: a request's first token arrives ``K3LAUNCH_SIM_TTFT_MS`` after it is admitted,
each further token ``K3LAUNCH_SIM_ITL_MS`` later, stretched by ``K3LAUNCH_SIM_BATCH_COST`` for
each other request its rank is decoding (a decode step of a bigger batch takes longer: 0.1
makes a step of 11 requests twice as long; default 0); requests beyond ``--max-num-seqs`` wait
for a slot (and count as ``num_requests_waiting``), so concurrency behaves like a batch limit.
Each request runs in its own HTTP thread, sleeping instead of computing. Like vLLM, every
local DP rank is its own engine with its own --max-num-seqs and its own metric series; a
request goes to the rank named by ``X-data-parallel-rank`` (vllm-router's DP-aware routing) or
round-robin otherwise.

P/D: a ``kv_producer`` given ``do_remote_decode`` prefills (one token), holds the request's KV
blocks and answers with ``kv_transfer_params`` naming its side channel; a ``kv_consumer``
given ``do_remote_prefill`` must reach that side channel (:func:`nixl.fetch`) before decoding.
Under the ``corrupt-pd`` fault such a decode (and only such a decode: not a request it prefills
itself) answers with wrong tokens after the first, as a decode reading a garbled KV cache would.

Fault tolerance (:mod:`k3launch.sim.ft`): while the engine is unhealthy a new request waits
before admission; a fault aborts every request admitted before it (finish reason ``abort``,
with the tokens it had), as vLLM's scheduler does when its busy loop raises.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

from k3launch.sim import nixl
from k3launch.sim.apierror import internal, invalid
from k3launch.sim.ft import FaultTolerance
from k3launch.sim.logs import Logger
from k3launch.sim.metrics import Metrics, render
from k3launch.sim.openai import GenRequest
from k3launch.sim.options import Knobs, ServeOptions
from k3launch.sim.tokens import token
from k3launch.sim.wire import Json


class Rank:
    """One DP engine: its batch slots and its statistics."""

    def __init__(self, rank: int, max_num_seqs: int) -> None:
        self.rank = rank
        self.slots = threading.Semaphore(max_num_seqs)
        self.metrics = Metrics(max_num_seqs)


class Session:
    """One admitted request: holds a --max-num-seqs slot of its rank until :meth:`close`.

    Its ``req.n`` choices decode in lockstep, ``length`` tokens each, in that one slot.
    """

    def __init__(self, engine: Engine, rank: Rank, req: GenRequest, arrival: float, length: int, kv_out: Json | None,
                 epoch: int = 0, corrupt: bool = False) -> None:
        self.engine = engine
        self.epoch = epoch  # the fault epoch it was admitted in: a later fault aborts it
        self.aborted = False
        self.rank = rank
        self.req = req
        self.arrival = arrival
        self.length = length
        self.kv_out = kv_out
        self.corrupt = corrupt  # the corrupt-pd fault hit this request: wrong tokens after the first
        self.produced = 0  # tokens of each choice so far
        self._first: float | None = None
        self._closed = False

    @property
    def finish_reason(self) -> str:
        if self.aborted:
            return "abort"
        return "length" if self.length and self.length >= self.req.max_tokens else "stop"

    def _faulted(self) -> bool:
        ft = self.engine.ft
        if ft is not None and ft.epoch != self.epoch:
            self.aborted = True
        return self.aborted

    def steps(self) -> Iterator[list[tuple[str, int]]]:
        """Yield each decode step's tokens (text, id), one per choice, at the model's pace."""
        e = self.engine
        time.sleep(e.ttft_s)  # prefill (or KV load) of the whole prompt
        self._first = time.monotonic()
        for i in range(self.length):
            if i:
                time.sleep(e.itl_s * (1.0 + e.batch_cost * max(0, self.rank.metrics.running - 1)))
            if self._faulted():
                return
            self.produced += 1
            yield [token(i, c, self.corrupt) for c in range(self.req.n)]

    def outputs(self) -> list[tuple[str, list[int]]]:
        """Every choice's whole text and token ids, once generated."""
        parts: list[list[tuple[str, int]]] = [[] for _ in range(self.req.n)]
        for step in self.steps():
            for choice, tok in zip(parts, step, strict=True):
                choice.append(tok)
        return [("".join(t for t, _ in p), [i for _, i in p]) for p in parts]

    def close(self) -> None:
        """Release the slot and record the request (also when the client went away)."""
        if self._closed:
            return
        self._closed = True
        done = time.monotonic()
        m = self.rank.metrics
        with m.lock:
            m.running -= 1
            m.generation_tokens += self.produced * self.req.n
            if self._first is not None:
                m.ttft.observe(self._first - self.arrival)
                if self.produced > 1:
                    m.itl.observe((done - self._first) / (self.produced - 1))
            if self.produced == self.length:
                m.finished[self.finish_reason] = m.finished.get(self.finish_reason, 0) + 1
            m.e2e.observe(done - self.arrival)
        self.rank.slots.release()


class Engine:
    """Admission, timing and the KV-transfer role of one API server's local DP ranks."""

    def __init__(self, opts: ServeOptions, knobs: Knobs, log: Logger, side: nixl.SideChannel | None,
                 ft: FaultTolerance | None = None) -> None:
        self.opts = opts
        self.log = log
        self.side = side
        self.ft = ft
        self.ranks = {r: Rank(r, opts.max_num_seqs) for r in opts.local_dp_ranks}
        self._rr = itertools.cycle(list(self.ranks))
        self._rr_lock = threading.Lock()
        self.ttft_s = knobs.ttft_ms / 1000.0
        self.itl_s = knobs.itl_ms / 1000.0
        self.batch_cost = knobs.batch_cost
        self.zero_tokens = knobs.fault == "zero-tokens"
        self.empty_after_ready = knobs.fault == "empty-after-ready"
        self.corrupt_pd = knobs.fault == "corrupt-pd"
        self.corrupt_all = knobs.fault == "other-weights"
        self.latch = knobs.fault == "latch"
        self._latched = threading.Event()  # never set: a latched request waits on it until the engine exits
        self._corrupted = False  # the first corrupted answer is logged (once, as empty-after-ready's switch is)
        self._admitted = 0  # completion requests admitted so far (empty-after-ready answers the first one)
        self._admitted_lock = threading.Lock()
        self.label = f"{opts.host_ip or opts.nixl_host} ({knobs.process or 'vllm serve'})"

    def metrics_text(self) -> str:
        return render(self.opts.name, {r: s.metrics for r, s in self.ranks.items()})

    def batch(self) -> float:
        """Requests decoding now, on average per local rank (what the simulated GPUs' draw follows)."""
        running = 0
        for s in self.ranks.values():
            with s.metrics.lock:
                running += s.metrics.running
        return running / len(self.ranks)

    def load(self) -> int:
        total = 0
        for s in self.ranks.values():
            with s.metrics.lock:
                total += s.metrics.running + s.metrics.waiting
        return total

    def pick(self, header: str | None) -> Rank:
        """The engine for a request: the one the router named, else the next in turn.

        vLLM indexes ``X-data-parallel-rank`` into the engines this API server manages, in
        rank order (``core_engines[i]``): on a hybrid-LB node with ranks 8-15, header 0 is
        rank 8. That is what vllm-router 0.1.17 sends (0..n-1, n = engine labels counted).
        A header that is no integer is ignored, as vLLM's ``_get_data_parallel_rank`` does.
        """
        try:
            index = None if header is None else int(header)
        except ValueError:
            index = None
        if index is None:
            with self._rr_lock:
                return self.ranks[next(self._rr)]
        local = list(self.ranks)
        if not 0 <= index < len(local):
            raise invalid(f"data_parallel_rank {index} is out of range [0, {len(local)}).")  # v1/engine/input_processor.py
        return self.ranks[local[index]]

    def open(self, req: GenRequest, dp_rank: str | None = None) -> Session:
        """Admit ``req`` (waiting for a slot), then do its KV transfer; raises :class:`~k3launch.sim.apierror.ApiError`."""
        arrival = time.monotonic()
        rank = self.pick(dp_rank)
        epoch = self.ft.admit() if self.ft is not None else 0  # an unhealthy engine leaves it in its input queue
        m = rank.metrics
        with m.lock:
            m.waiting += 1
        rank.slots.acquire()
        with m.lock:
            m.waiting -= 1
            m.running += 1
            m.prompt_tokens += req.prompt_tokens
        try:
            length, kv_out, pulled = self._kv(req, rank)
        except BaseException:
            with m.lock:
                m.running -= 1
            rank.slots.release()
            raise
        if self._latches():
            self._latched.wait()  # admitted, holding its slot, never a token: /health still answers (a separate thread)
        return Session(self, rank, req, arrival, 0 if self._empty() else length, kv_out, epoch, self._corrupts(pulled))

    def _latches(self) -> bool:
        """Whether this request latches: the ``latch`` fault, after the first request (up's probe)."""
        if not self.latch:
            return False
        with self._admitted_lock:
            self._admitted += 1
            n = self._admitted
        if n == 2:
            self.log.warning("requests are admitted and never scheduled from now on; /health still answers 200 "
                             "(simulated: K3LAUNCH_SIM_FAIL=latch)", src="core.py")
        return n > 1

    def _corrupts(self, pulled: bool) -> bool:
        """Whether this answer is corrupted: the corrupt-pd fault, on a decode that pulled its KV
        cache; other-weights, every answer (a model that is not the one the name says)."""
        if self.corrupt_all:
            return True
        if not (self.corrupt_pd and pulled):
            return False
        with self._admitted_lock:
            first, self._corrupted = not self._corrupted, True
        if first:
            self.log.warning("decoding P/D requests from a corrupted KV cache from now on, with 200 answers "
                             "(simulated: K3LAUNCH_SIM_FAIL=corrupt-pd)", src="nixl_connector.py")
        return True

    def _empty(self) -> bool:
        """Whether this request gets no tokens: always (zero-tokens), or after the first (empty-after-ready)."""
        if self.zero_tokens:
            return True
        if not self.empty_after_ready:
            return False
        with self._admitted_lock:
            self._admitted += 1
            first_empty = self._admitted == 2
            empty = self._admitted > 1
        if first_empty:
            self.log.warning(
                "generating no tokens from now on, with 200 answers (simulated: K3LAUNCH_SIM_FAIL=empty-after-ready)",
                src="gpu_model_runner.py",
            )
        return empty

    def _kv(self, req: GenRequest, rank: Rank) -> tuple[int, Json | None, bool]:
        """(tokens to generate, kv_transfer_params to answer with, whether the KV cache was pulled from a producer)."""
        kv, params = self.opts.kv, req.kv_params
        if kv is None or params is None:
            return req.max_tokens, None, False
        if kv.producer and params.get("do_remote_decode") is True and self.side is not None:
            # A remote decode will continue this request: prefill only, one token, keep the blocks.
            held = self.side.hold(req.request_id, req.prompt_tokens, rank.rank)
            return min(req.max_tokens, 1), held.params(), False
        if kv.consumer and params.get("do_remote_prefill") is True:
            try:
                nixl.fetch(params, self.label, self.log)
            except nixl.KVTransferError as exc:
                with rank.metrics.lock:
                    rank.metrics.kv_failures += 1
                if kv.load_failure_policy == "fail":
                    self.log.error(
                        f"KV load failed for request {req.request_id} (kv_load_failure_policy=fail): {exc}", src="nixl_connector.py"
                    )
                    raise internal(f"KV transfer failed for request {req.request_id}: {exc}") from None
                self.log.warning(
                    f"KV load failed for request {req.request_id}; recomputing the prefill locally "
                    f"(kv_load_failure_policy={kv.load_failure_policy}): {exc}",
                    src="nixl_connector.py",
                )
                return req.max_tokens, None, False
            with rank.metrics.lock:
                rank.metrics.kv_pulls += 1
            return req.max_tokens, None, True
        return req.max_tokens, None, False
