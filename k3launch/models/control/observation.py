"""One look at a deployment: what the backend saw (the decisions' only input about the world)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Observation:
    """One look at a deployment: what the backend saw (the supervisor's only input)."""

    now: float
    dead: Mapping[str, str] = field(default_factory=dict)  # process id -> how it ended ("exited with code 1: ...")
    unreachable: Mapping[str, str] = field(default_factory=dict)  # node -> why
    healthy: Mapping[str, bool] = field(default_factory=dict)  # HTTP process id -> /health answered 200 in time
    tails: Mapping[str, str] = field(default_factory=dict)  # dead process id -> its last log lines
    reclaimed: Mapping[str, Sequence[str]] = field(default_factory=dict)  # lost node answering again -> processes stopped there
    ft: Mapping[str, str] = field(default_factory=dict)  # fault-tolerant rank -> its engine's FT status ("healthy", "unhealthy", ...)
    # process id -> (CPU ticks its whole session used, "state R"): asked only while some engine does not serve
    cpu: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    # regular (non-P/D) router id -> the worker URLs it lists (``/list_workers``); absent or None: not known this look
    routers: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)
    # HTTP process id -> its engine's ``vllm:num_requests_running`` (asked of draining units only; None: unreadable)
    running: Mapping[str, float | None] = field(default_factory=dict)
    # healthy engine's HTTP process id -> (requests running or waiting, tokens generated so far), from its /metrics
    work: Mapping[str, tuple[float, float]] = field(default_factory=dict)
