"""The progress of one bring-up: every process's phase, from the log text each poll brings.

The backends read what each process's log gained since the last poll in the round trips they
already make (:class:`~k3launch.deploy.base.Progress` ``logs``); :func:`~k3launch.deploy.base.run_up`
hands it to a :class:`Tracker`, which classifies the lines (:mod:`k3launch.models.phases`), reports
a :class:`~k3launch.models.phases.BringUp` after every poll (``Events.on_progress``) and builds the
timeline the record keeps. A supervisor's restarts are tracked the same way, one unit at a time
(:class:`Restarts`). Times are this machine's, taken when a poll saw the line: nodes' clocks
never meet, and the resolution is one poll interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from k3launch.deploy.logtail import LogCursor
from k3launch.models.phases import (
    BringUp,
    LogDelta,
    Phase,
    PhaseSpan,
    ProcessProgress,
    ProcessTimeline,
    Timeline,
    classify,
    clean,
    weights_took,
)
from k3launch.models.plan import Plan

ProgressFn = Callable[[BringUp], None]


@dataclass
class _Proc:
    id: str
    node: str
    role: str
    spans: list[tuple[Phase, float]] = field(default_factory=list)  # (phase, start), in order
    percent: float | None = None
    last_line: str = ""
    took: list[float] = field(default_factory=list)  # vLLM's "Loading weights took", per rank

    @property
    def phase(self) -> Phase:
        return self.spans[-1][0]

    def move(self, phase: Phase, percent: float | None, now: float) -> None:
        if phase == self.phase:
            self.percent = percent if percent is not None else self.percent
        elif phase.rank >= self.phase.rank:
            self.spans.append((phase, now))
            self.percent = percent

    def read(self, delta: LogDelta, now: float) -> None:
        # the unfinished line counts for the phase (a bar's percentage) but is not shown: it may be
        # cut anywhere, and is read again, whole, next poll (moving to its phase twice is a no-op)
        whole = delta.text.split("\n")[:-1]
        for i, line in enumerate([*whole, delta.partial]):
            for part in line.split("\r"):  # tqdm's updates of one line
                hit = classify(part)
                if hit is not None:
                    self.move(hit.phase, hit.percent, now)
            if i < len(whole) and (s := weights_took(line)) is not None:  # whole lines only: a partial one is read again
                self.took.append(s)
            shown = clean(line) if i < len(whole) else ""
            if shown:
                self.last_line = shown


@dataclass
class Tracker:
    """Every process's phase during one bring-up (times: epoch seconds of this machine)."""

    plan: Plan
    on_progress: ProgressFn | None = None
    started: float = field(default_factory=time.time)
    _procs: dict[str, _Proc] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.restart(self.started)

    def restart(self, now: float) -> None:
        """Started anew (a Slurm resubmission): the timeline starts over."""
        self.started = now
        self._procs = {p.id: _Proc(p.id, p.node, p.role, [(Phase.STARTING, now)]) for p in self.plan.processes}

    def update(self, logs: Mapping[str, LogDelta], healthy: Collection[str], stage: str, now: float | None = None) -> BringUp:
        """One poll: what each log gained, which endpoints answer /health; reports and returns the snapshot."""
        now = time.time() if now is None else now
        for pid, delta in logs.items():
            if pid in self._procs:
                self._procs[pid].read(delta, now)
        for pid in healthy:
            if pid in self._procs:
                self._procs[pid].move(Phase.HEALTHY, None, now)
        snap = self.snapshot(stage, now)
        if self.on_progress is not None:
            self.on_progress(snap)
        return snap

    def snapshot(self, stage: str, now: float) -> BringUp:
        procs = tuple(ProcessProgress(p.id, p.node, p.role, p.phase, p.spans[-1][1], p.percent, p.last_line) for p in self._procs.values())
        return BringUp(self.started, now, stage, procs)

    def timeline(self, ready: bool, now: float | None = None) -> Timeline:
        """The bring-up so far: each phase ends where the next begins, the last one now. Once the
        deployment serves, a rank that serves no HTTP is done where its last phase began."""
        now = time.time() if now is None else now
        out = []
        for p in self._procs.values():
            ends = [start for _, start in p.spans[1:]] + [now]
            out.append(
                ProcessTimeline(
                    id=p.id,
                    node=p.node,
                    role=p.role,
                    phases=[PhaseSpan(phase=ph, start=start, end=end) for (ph, start), end in zip(p.spans, ends, strict=True)],
                    weights_took=list(p.took),
                )
            )
        return Timeline(started=self.started, ended=now, ready=ready, processes=out)


@dataclass
class Restarts:
    """The bring-ups of a supervisor's restarting units: one :class:`Tracker` per unit, over the
    unit's processes only, from when its new processes start until the unit serves again (or the
    restart fails). The looks read the logs of those processes only (:meth:`reading`), from the
    start: a bare log is truncated by the start, a container's log is the new container's."""

    cursor: LogCursor = field(default_factory=LogCursor)
    _units: dict[str, Tracker] = field(default_factory=dict)

    def start(self, unit: str, plan: Plan, processes: Collection[str], now: float | None = None) -> None:
        """``unit``'s processes are about to start anew: its timeline starts now (a restart before, forgotten)."""
        only = plan.model_copy(update={"processes": [p for p in plan.processes if p.id in processes]})
        self.cursor.forget(processes)
        self._units[unit] = Tracker(only, started=time.time() if now is None else now)

    def reading(self) -> set[str]:
        """The processes whose logs the next look reads (those of restarting units)."""
        return {p.id for t in self._units.values() for p in t.plan.processes}

    def update(self, logs: Mapping[str, LogDelta], healthy: Collection[str], now: float | None = None) -> None:
        """One look: what the restarting processes' logs gained, and which of them answer ``/health``."""
        for t in self._units.values():
            t.update(logs, healthy, "restart", now)

    def timeline(self, unit: str, ready: bool, now: float | None = None) -> Timeline | None:
        """``unit``'s restart so far (None: not tracked), and the tracking ends."""
        t = self._units.pop(unit, None)
        return None if t is None else t.timeline(ready, now)

    def drop(self, processes: Collection[str]) -> None:
        """Stop tracking every unit with one of ``processes`` (stopped for good)."""
        for unit, t in list(self._units.items()):
            if any(p.id in processes for p in t.plan.processes):
                del self._units[unit]
