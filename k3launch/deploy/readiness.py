"""The ``health`` and ``completion`` stages every backend's bring-up ends with, and its deadline.

A deployment is ready when every HTTP endpoint answers ``/health`` 200 and one real completion
came back through its public endpoint (docs/design.md, "The backend seam"). The deadline is
``--ready-timeout``, else the plan's ``VLLM_ENGINE_READY_TIMEOUT_S``, else 1800 s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from k3launch.models.plan import Plan, Process
from k3launch.models.record import Stage, StageFn
from k3launch.models.reports import LaunchFailed
from k3launch.transport import http

DEFAULT_READY_TIMEOUT_S = 1800.0


def ready_timeout(plan: Plan, override: float | None) -> float:
    """``--ready-timeout``, else the plan's ``VLLM_ENGINE_READY_TIMEOUT_S``, else 1800 s."""
    if override is not None:
        return override
    for p in plan.processes:
        v = p.env.get("VLLM_ENGINE_READY_TIMEOUT_S")
        if v and v.isdigit():
            return float(v)
    return DEFAULT_READY_TIMEOUT_S


@dataclass
class Readiness:
    """The ``health`` and ``completion`` stages, shared by every backend: every HTTP endpoint
    answers ``/health`` 200, then one real completion comes back through the public endpoint."""

    processes: Sequence[Process]  # with the addresses the processes really bind
    endpoint: str
    model: str
    on_stage: StageFn
    healthy: set[str] = field(default_factory=set)
    wait_s: float = 0.5  # how long one poll waits for the completion in flight before the next look at the nodes
    _pending: http.InFlight | None = None

    @property
    def missing(self) -> list[str]:
        return [p.id for p in self.processes if p.http_port is not None and p.id not in self.healthy]

    def check(self, t_end: float) -> http.Completion | None:
        """One poll: probe what is not healthy yet; once all are, try the completion."""
        n = sum(1 for p in self.processes if p.http_port is not None)
        todo = {p.id: f"http://{p.address}:{p.http_port}" for p in self.processes if p.id in self.missing}
        for pid, ok in http.probe_all(todo).items():
            if ok:
                self.healthy.add(pid)
                self.on_stage(Stage.HEALTH, f"{pid} healthy ({len(self.healthy)}/{n})")
        if self.missing:
            return None
        # The completion runs beside the polls, not inside one: it may take up to a minute, and a
        # node that stops answering meanwhile must still be noticed by the next poll.
        if self._pending is None:
            timeout = max(5.0, min(60.0, t_end - time.monotonic()))
            self._pending = http.in_background(lambda: http.completion(self.endpoint, self.model, timeout=timeout))
        c = self._pending.wait(self.wait_s)
        if c is None:
            return None
        self._pending = None
        if c.ok:
            self.on_stage(Stage.COMPLETION, f"completion through {self.endpoint}: {c.completion_tokens} tokens in {c.seconds:.2f}s")
            return c
        if c.detail.startswith("no tokens"):
            raise LaunchFailed(f"completion stage: {self.endpoint} answers but generated no tokens ({c.detail})",
                               "the engines answer but generate nothing: read the logs", code="no-tokens")
        return None

    def stage(self) -> Stage:
        return Stage.HEALTH if self.missing else Stage.COMPLETION
