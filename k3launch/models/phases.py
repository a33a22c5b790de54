"""Where each process of a bring-up is: its phase, read from the engine's own log lines, and the
bring-up timeline built from them.

Pure. :func:`classify` maps one line of a ``vllm serve`` log (vLLM 0.32/0.33; the simulated engine
writes the same lines) to a :class:`Phase`. The patterns are vLLM's own messages, in the order a
process meets them:

* ``starting`` — until the first line below (banner, arguments, engine config);
* ``waiting_for_peers`` — ``world_size=N rank=R ... distributed_init_method=...`` is logged just
  before ``torch.distributed`` init, which blocks until every rank of the group connected (NCCL's
  ``Init START``, torch's c10d connect timeouts, a head waiting for remote engines say the same);
* ``loading_weights`` — ``Starting to load model``, ``Loading safetensors checkpoint shards: 45%
  Completed | ...`` (vLLM's own bar format ends each update with a newline: the percentage is in
  the log), ``Loading weights took``, ``Model loading took``;
* ``compiling`` — torch.compile (``Dynamo bytecode transform time``, ``Compiling a graph for``,
  ``torch.compile took``) and CUDA graph capture (``Capturing CUDA graphs (...): 45%|...``,
  ``Graph capturing finished``); the CPU build's warm-up;
* ``kv_cache`` — ``Available KV cache memory``, ``GPU KV cache size: N tokens`` (between the
  profile run's compile and the graph capture, so ``compiling`` may come twice);
* ``api_server`` — ``Starting vLLM server on``, uvicorn's ``Application startup complete``;
* ``healthy`` — not a log line: the endpoint answered ``/health`` (or, for a rank that serves no
  HTTP, the deployment served its first completion).

``Loading weights took N seconds`` (vLLM's model loader, once per rank that loads) is also kept as
a figure: :func:`weights_took` reads it, the timeline keeps each rank's, and ``timeline`` shows
them beside the predicted load (:mod:`k3launch.planning.loadtime`).

A log may interleave several engines (local DP ranks): a process's phase only moves forward
(``compiling`` and ``kv_cache`` share a rank), so it is the furthest any of its engines reached.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from k3launch.defaults import PROBE_PATHS


class Phase(StrEnum):
    STARTING = "starting"
    WAITING_FOR_PEERS = "waiting_for_peers"
    LOADING_WEIGHTS = "loading_weights"
    COMPILING = "compiling"
    KV_CACHE = "kv_cache"
    API_SERVER = "api_server"
    HEALTHY = "healthy"

    @property
    def label(self) -> str:
        return _LABELS[self]

    @property
    def rank(self) -> int:
        """Order of phases; a process never moves to a lower rank (compiling and KV cache alternate)."""
        return _RANKS[self]


_LABELS = {
    Phase.STARTING: "starting",
    Phase.WAITING_FOR_PEERS: "waiting for peers",
    Phase.LOADING_WEIGHTS: "loading weights",
    Phase.COMPILING: "compiling / CUDA graphs",
    Phase.KV_CACHE: "KV cache allocated",
    Phase.API_SERVER: "API server up",
    Phase.HEALTHY: "healthy",
}
_RANKS = {
    Phase.STARTING: 0,
    Phase.WAITING_FOR_PEERS: 1,
    Phase.LOADING_WEIGHTS: 2,
    Phase.COMPILING: 3,
    Phase.KV_CACHE: 3,
    Phase.API_SERVER: 4,
    Phase.HEALTHY: 5,
}

_PERCENT = re.compile(r":\s*(\d{1,3})%")  # tqdm: "desc:  45% Completed | 45/100" and "desc:  45%|####  | 30/67"
_PATTERNS: tuple[tuple[Phase, re.Pattern[str]], ...] = (
    (
        Phase.WAITING_FOR_PEERS,
        re.compile(
            r"world_size=\d+ rank=\d+ .*distributed_init_method=|NCCL INFO .*Init START|socket has timed out after .* connect to|"
            r"Waiting for \d+ local, [1-9]\d* remote core engine"
        ),
    ),
    (
        Phase.LOADING_WEIGHTS,
        re.compile(
            r"Starting to load model|Loading model from scratch|Loading \S+(?: \S+)? checkpoint shards|Loading weights took|"
            r"Model loading took|Loading model weights took"
        ),
    ),
    (
        Phase.COMPILING,
        re.compile(
            r"Starting torch\.compile|Dynamo bytecode transform time|Compiling a graph for|torch\.compile (?:takes|took)|"
            r"Capturing CUDA graphs|Graph capturing finished|Warming up model for the compilation|Compile and warming up model"
        ),
    ),
    (Phase.KV_CACHE, re.compile(r"Available KV cache memory|KV cache size: [\d,]+ tokens|# (?:GPU|CPU) blocks: \d")),
    (
        Phase.API_SERVER,
        re.compile(
            r"Starting vLLM (?:API )?server|Available routes are|Started server process|Waiting for application startup|"
            r"Application startup complete"
        ),
    ),
)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# a shell's job-control messages ("[1] 12345", "[1]+  Done  cmd"): a wrapper's chatter, not the engine's
_JOB_CONTROL = re.compile(
    r"\[\d+\][+-]?\s+(?:\d+|(?:Done|Exit \d+|Running|Stopped|Killed|Terminated|Hangup|Interrupt|Quit|Aborted|Segmentation fault)\b.*)"
)
LINE_CHARS = 300  # what a progress event keeps of the last log line
# An HTTP server's access-log line for a poll of a probe path, in uvicorn's words (vLLM's, the
# simulated engine's): `127.0.0.1:52814 - "GET /health HTTP/1.1" 200 OK`; the query is not the path.
_PROBE = re.compile(r'\d - "[A-Z]+ (?:' + "|".join(re.escape(p) for p in PROBE_PATHS) + r')(?:\?[^ "]*)? HTTP/[\d.]+" \d{3}\b')


def probe_access(line: str) -> bool:
    """Whether ``line`` is an engine's access-log line for a poll of /health or /metrics."""
    return _PROBE.search(line) is not None


@dataclass(frozen=True)
class Hit:
    """What one log line says: the phase, and how far through it (percent) when it tells."""

    phase: Phase
    percent: float | None = None


def classify(line: str) -> Hit | None:
    """The phase ``line`` marks (None: a line that says nothing about the phase)."""
    for phase, rx in _PATTERNS:
        if rx.search(line):
            pct = _PERCENT.search(line) if phase in (Phase.LOADING_WEIGHTS, Phase.COMPILING) else None
            return Hit(phase, min(100.0, float(pct.group(1))) if pct else None)
    return None


_TOOK = re.compile(r"Loading weights took (\d+(?:\.\d+)?) ?s(?:econds)?\b")


def weights_took(line: str) -> float | None:
    """The seconds of vLLM's ``Loading weights took N seconds`` in ``line`` (None: not that line)."""
    m = _TOOK.search(line)
    return float(m.group(1)) if m else None


def clean(line: str) -> str:
    """A log line as shown: without colour codes, the last of its ``\\r`` updates, trimmed; nothing
    for a shell's job-control message or a probe's access-log line (a poll every few seconds would
    be the last line of every engine that serves)."""
    parts = [p for p in _ANSI.sub("", line).split("\r") if p.strip()]
    text = parts[-1].strip() if parts else ""
    if _JOB_CONTROL.fullmatch(text) or probe_access(text):
        return ""
    return text if len(text) <= LINE_CHARS else text[: LINE_CHARS - 3] + "..."


@dataclass(frozen=True)
class LogDelta:
    """What a process's log gained since the last look: whole lines, then an unfinished last line
    (read again next time: it counts for the phase, but is neither taken as new nor shown)."""

    text: str = ""
    partial: str = ""


# ---------------------------------------------------------------------- live progress
@dataclass(frozen=True)
class ProcessProgress:
    id: str
    node: str
    role: str
    phase: Phase
    since: float  # when the phase began (epoch seconds, this machine's clock)
    percent: float | None = None
    last_line: str = ""


@dataclass(frozen=True)
class BringUp:
    """One progress event of ``up``: every process's phase now (``Events.on_progress``)."""

    started: float  # epoch seconds
    now: float
    stage: str  # the lifecycle stage (alive, health, queued, ...)
    processes: tuple[ProcessProgress, ...]

    @property
    def elapsed(self) -> float:
        return self.now - self.started


# ---------------------------------------------------------------------- the timeline (in the record)
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)


class PhaseSpan(_Model):
    phase: Phase
    start: float  # epoch seconds: when k3launch saw the line (this machine's clock: no skew between nodes)
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class ProcessTimeline(_Model):
    id: str
    node: str
    role: str = ""
    phases: list[PhaseSpan] = []
    weights_took: list[float] = []  # vLLM's "Loading weights took N seconds", one per rank that logged it, in order

    def reached(self) -> float | None:
        """When the process was done: healthy, else the start of its last phase (a rank without HTTP)."""
        done = next((s.start for s in self.phases if s.phase == Phase.HEALTHY), None)
        return done if done is not None else (self.phases[-1].start if self.phases else None)

    def longest(self) -> tuple[Phase, float] | None:
        """The phase it spent longest in before it was done, and its seconds: what it waited for
        (a phase entered twice, compiling around the KV cache: its spans together, as the timeline lists it)."""
        spent: dict[Phase, float] = {}
        for s in self.phases:
            if s.phase != Phase.HEALTHY:
                spent[s.phase] = spent.get(s.phase, 0.0) + s.seconds
        return max(spent.items(), key=lambda kv: kv[1]) if spent else None


class Slowest(_Model):
    process: str
    node: str
    seconds: float  # from the start of the bring-up until it was done
    waited_for: Phase | None
    waited_s: float


class Timeline(_Model):
    """A deployment's bring-up: per process, each phase's start and end (the record keeps it)."""

    started: float
    ended: float
    ready: bool  # the deployment served (False: the bring-up failed)
    processes: list[ProcessTimeline] = []

    def slowest(self) -> Slowest | None:
        done = [(t, p) for p in self.processes if (t := p.reached()) is not None]
        if not done:
            return None
        t, p = max(done, key=lambda x: x[0])
        most = p.longest()
        return Slowest(
            process=p.id,
            node=p.node,
            seconds=round(t - self.started, 3),
            waited_for=most[0] if most else None,
            waited_s=round(most[1], 3) if most else 0.0,
        )

    def as_dict(self) -> dict[str, object]:
        """What ``k3launch timeline --json`` prints: times also relative to the start, and the slowest rank."""

        def span(s: PhaseSpan) -> dict[str, object]:
            return {
                "phase": s.phase.value,
                "start": s.start,
                "end": s.end,
                "start_s": round(s.start - self.started, 3),
                "end_s": round(s.end - self.started, 3),
                "seconds": round(s.seconds, 3),
            }

        slow = self.slowest()
        return {
            "started": self.started,
            "ended": self.ended,
            "ready": self.ready,
            "seconds": round(self.ended - self.started, 3),
            "processes": [
                {"id": p.id, "node": p.node, "role": p.role, "phases": [span(s) for s in p.phases],
                 **({"weights_took": p.weights_took} if p.weights_took else {})}
                for p in self.processes
            ],
            "slowest": slow.model_dump(mode="json") if slow else None,
        }
