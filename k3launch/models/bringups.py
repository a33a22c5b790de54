"""Two bring-ups side by side, phase by phase (``k3launch timeline NAME --compare OTHER``), and a
bring-up read back from the JSON ``k3launch timeline NAME --json`` printed.

Pure. :func:`compare` matches the processes of two :class:`~k3launch.models.phases.Timeline`\\ s by
id and gives, per process and phase (in :class:`~k3launch.models.phases.Phase` order), the seconds
in each, the difference (NAME − OTHER: negative is faster) and the ratio (NAME / OTHER: 0.45 took
45% of OTHER's time); then when each process was done, and the bring-up's total (time to ready, or
to the failure). A phase entered twice (compiling and KV cache alternate) counts its spans together;
``healthy`` is not a phase that costs time: a process's end is its ``done`` row. Processes in one
bring-up only are listed apart.

A record keeps the timeline of its ``up`` only: a clean ``down`` deletes the record, and a
rollout records none. A supervisor's restart records the unit's timeline in its ``restarted`` (or
``restart-failed``) event (:func:`restarts` finds them; :func:`narrow` cuts a whole deployment's
bring-up to the restarted unit's processes, to compare the two). So a bring-up is kept by saving its
JSON (``timeline NAME --json > cold.json``), and :func:`read_saved` reads that back — or a copy of a
deployment record (``deployments/NAME.json``), whose ``timeline`` it takes.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from k3launch.errors import K3Error, plain
from k3launch.models.phases import Phase, PhaseSpan, ProcessTimeline, Timeline
from k3launch.models.supervise import Event

COMPARED = tuple(p for p in Phase if p != Phase.HEALTHY)  # the phases that take time; a process's end is its `done`
WRITTEN_BY = "a file `k3launch timeline NAME --json` wrote"
SAVE_HINT = "save a bring-up with `k3launch timeline NAME --json > FILE` while NAME is up"


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


@dataclass(frozen=True)
class Delta:
    """Seconds of one thing in NAME and in OTHER (None: not there)."""

    name_s: float | None
    other_s: float | None

    @property
    def diff_s(self) -> float | None:
        return None if self.name_s is None or self.other_s is None else self.name_s - self.other_s

    @property
    def ratio(self) -> float | None:
        return None if self.name_s is None or not self.other_s else self.name_s / self.other_s

    def as_dict(self) -> dict[str, float | None]:
        return {"name_s": _r(self.name_s), "other_s": _r(self.other_s), "diff_s": _r(self.diff_s), "ratio": _r(self.ratio)}


@dataclass(frozen=True)
class PhaseDelta:
    phase: Phase
    delta: Delta


@dataclass(frozen=True)
class ProcessDelta:
    """One process in both bring-ups (matched by id)."""

    id: str
    role: str
    node: str  # where it ran in NAME
    other_node: str  # ... and in OTHER
    phases: tuple[PhaseDelta, ...]  # in Phase order: those either bring-up's process entered
    done: Delta  # from its bring-up's start until it was done (healthy; a rank without HTTP: its last phase began)

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "role": self.role, "node": self.node, "other_node": self.other_node,
                "phases": [{"phase": p.phase.value, **p.delta.as_dict()} for p in self.phases], "done": self.done.as_dict()}


@dataclass(frozen=True)
class Alone:
    """A process in one bring-up only."""

    id: str
    role: str
    node: str
    done_s: float | None

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "role": self.role, "node": self.node, "done_s": _r(self.done_s)}


@dataclass(frozen=True)
class Comparison:
    name: str  # how NAME and OTHER are called (a deployment's name, a file's path)
    other: str
    ready: bool  # NAME's bring-up served (False: it failed, and its phases stop there)
    other_ready: bool
    total: Delta  # from the start until it served (or failed)
    processes: tuple[ProcessDelta, ...]  # in NAME's order
    only_name: tuple[Alone, ...]
    only_other: tuple[Alone, ...]
    other_deployment: str | None = None  # the deployment OTHER's bring-up was of (when known)

    def as_dict(self) -> dict[str, object]:
        """What ``k3launch timeline NAME --compare OTHER --json`` prints."""
        return {"name": self.name, "other": self.other, "other_deployment": self.other_deployment, "ready": self.ready, "other_ready": self.other_ready,
                "total": self.total.as_dict(), "processes": [p.as_dict() for p in self.processes],
                "only_name": [a.as_dict() for a in self.only_name], "only_other": [a.as_dict() for a in self.only_other]}


def phase_seconds(p: ProcessTimeline) -> dict[Phase, float]:
    """Seconds a process spent in each phase it entered (a phase entered twice: its spans added)."""
    out: dict[Phase, float] = {}
    for s in p.phases:
        out[s.phase] = out.get(s.phase, 0.0) + s.seconds
    return out


def _done(tl: Timeline, p: ProcessTimeline) -> float | None:
    t = p.reached()
    return None if t is None else t - tl.started


def compare(tl: Timeline, other: Timeline, name: str = "name", other_name: str = "other", other_deployment: str | None = None) -> Comparison:
    """``tl`` (NAME) against ``other`` (OTHER), process by process and phase by phase."""
    theirs = {p.id: p for p in other.processes}
    ours = {p.id for p in tl.processes}
    matched = []
    for p in tl.processes:
        q = theirs.get(p.id)
        if q is None:
            continue
        a, b = phase_seconds(p), phase_seconds(q)
        phases = tuple(PhaseDelta(ph, Delta(a.get(ph), b.get(ph))) for ph in COMPARED if ph in a or ph in b)
        matched.append(ProcessDelta(p.id, p.role or q.role, p.node, q.node, phases, Delta(_done(tl, p), _done(other, q))))
    return Comparison(
        name=name,
        other=other_name,
        ready=tl.ready,
        other_ready=other.ready,
        total=Delta(tl.ended - tl.started, other.ended - other.started),
        processes=tuple(matched),
        only_name=tuple(Alone(p.id, p.role, p.node, _done(tl, p)) for p in tl.processes if p.id not in theirs),
        only_other=tuple(Alone(q.id, q.role, q.node, _done(other, q)) for q in other.processes if q.id not in ours),
        other_deployment=other_deployment,
    )


# ---------------------------------------------------------------------- a supervisor's restarts
def restarts(events: Iterable[Event]) -> list[Event]:
    """The restarts an event log recorded with their timeline (``restarted``, ``restart-failed``), the last first."""
    return [e for e in reversed(list(events)) if e.kind in ("restarted", "restart-failed") and e.timeline is not None]


def in_brief(tl: Timeline) -> str:
    """One line for ``k3launch events``: the seconds the slowest process spent in each phase, in order."""
    slow = tl.slowest()
    p = next((q for q in tl.processes if slow is not None and q.id == slow.process), None)
    if p is None:
        return ""
    spent = ", ".join(f"{ph.label} {s:.1f}s" for ph, s in phase_seconds(p).items() if ph != Phase.HEALTHY)
    return f"{p.id}: {spent}" if spent else ""


def no_restart(name: str) -> K3Error:
    """The refusal for a deployment whose event log holds no restart timeline."""
    return K3Error("no-restart-timeline", f"{name} has no recorded restart timeline",
                   f"a supervisor (`k3launch supervise {name}`) records one each time it restarts a unit, "
                   f"on the SSH and local backends; `k3launch events {name}` lists what it did")


def narrow(tl: Timeline, ids: Collection[str]) -> Timeline:
    """``tl`` with only the processes ``ids`` names (a deployment's ``up`` against one unit's
    restart). A bring-up that served ends when the last of them was done."""
    kept = [p for p in tl.processes if p.id in ids]
    done = [t for p in kept if (t := p.reached()) is not None]
    return tl.model_copy(update={"processes": kept, "ended": max(done) if tl.ready and done else tl.ended})


# ---------------------------------------------------------------------- a saved bring-up
@dataclass(frozen=True)
class Saved:
    """A bring-up read back: the timeline, and the deployment it was of (when the file says)."""

    timeline: Timeline
    deployment: str | None = None


def no_timeline(name: str, state: str) -> K3Error:
    """The refusal for a deployment whose record keeps no timeline."""
    return K3Error("no-timeline", f"{name} has no bring-up timeline ({state})",
                   "it is recorded by `up` from this version on; bring the deployment up again to get one")


def _only(data: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """``data`` with ``model``'s fields only: the JSON adds times from the start, the slowest rank, events, ..."""
    return {k: v for k, v in data.items() if k in model.model_fields}


def _process(p: object) -> object:
    if not isinstance(p, dict):
        return p  # refused by the model, with its place
    out = _only(p, ProcessTimeline)
    if isinstance(out.get("phases"), list):
        out["phases"] = [_only(s, PhaseSpan) if isinstance(s, dict) else s for s in out["phases"]]
    return out


def _project(data: dict[str, Any]) -> dict[str, Any]:
    out = _only(data, Timeline)
    if isinstance(out.get("processes"), list):
        out["processes"] = [_process(p) for p in out["processes"]]
    return out


def read_saved(text: str, source: str) -> Saved:
    """The bring-up in ``text``: what ``k3launch timeline NAME --json`` printed, or a deployment
    record; ``source`` names it in refusals (``not-a-timeline``, ``no-timeline``)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise K3Error("not-a-timeline", f"{source} is not JSON ({exc.msg}, line {exc.lineno})", SAVE_HINT) from None
    if not isinstance(data, dict):
        raise K3Error("not-a-timeline", f"{source} holds JSON, but not a bring-up timeline (a {type(data).__name__})", SAVE_HINT)
    if isinstance(data.get("error"), dict):
        said = data["error"].get("message", "")
        raise K3Error("not-a-timeline", f"{source} holds a k3launch error, not a timeline: {said}", SAVE_HINT)
    name = data.get("name") if isinstance(data.get("name"), str) else None
    if "timeline" in data and "started" not in data:  # a deployment record
        if data["timeline"] is None:
            raise no_timeline(f"{source} ({name or 'a deployment record'})", str(data.get("state", "?")))
        data = data["timeline"]
        if not isinstance(data, dict):
            raise K3Error("not-a-timeline", f"{source}: its timeline is not an object", SAVE_HINT)
    missing = [k for k in ("started", "ended", "ready", "processes") if k not in data]
    if missing:
        raise K3Error("not-a-timeline", f"{source} holds JSON, but not a bring-up timeline (no {', '.join(missing)})", SAVE_HINT)
    try:
        tl = Timeline.model_validate(_project(data))
    except ValidationError as exc:
        first = exc.errors()[0]
        at = ".".join(str(x) for x in first["loc"])
        raise K3Error("not-a-timeline", f"{source}: not a valid bring-up timeline ({at}: {plain(first['msg'])})", SAVE_HINT) from None
    return Saved(tl, name)
