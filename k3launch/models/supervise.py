"""Supervision, the pure part: restart policy, recovery units, events, and the decisions.

A supervisor (``k3launch supervise``, :mod:`k3launch.deploy.supervisor`) observes a deployment
every ``poll`` seconds and hands what it saw to :class:`Supervision`, which decides — without any
I/O, time passed in — what to restart, when, and when to give up. Everything it decides is an
:class:`Event` (docs/supervise.md has the table of recovery units and the policy).

Recovery units (:func:`units`): vLLM's multi-node engines are fail-stop — one dead rank of a
multi-node TP, TEP or DEP engine stalls every other rank — so the ranks of one engine restart
together (a *group*: stop every rank, start them as ``up`` does), never one rank into a running
group. An engine on one node (a single-node TP engine, a replica, a P/D instance) restarts
alone (an *engine*) while the router routes around it, and so does the router.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from k3launch.models.plan import Plan, Process


class RestartPolicy(BaseModel):
    """The inventory's ``restart:`` section (and ``supervise``'s flags): how a supervisor restarts.

    The n-th restart of a unit within ``window`` seconds waits ``backoff * 2**(n-1)`` seconds
    (capped at ``backoff_max``; the first restart goes at once); a unit that failed
    ``max_restarts`` times within ``window`` is given up. ``never``: the first failure is given up.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["on-failure", "never"] = "on-failure"
    max_restarts: int = Field(default=3, ge=0, le=1000)
    window: float = Field(default=3600.0, gt=0, le=30 * 86400)  # seconds
    backoff: float = Field(default=10.0, ge=0, le=3600)  # seconds before the second restart in the window
    backoff_max: float = Field(default=300.0, ge=0, le=86400)
    unhealthy_after: float = Field(default=60.0, gt=0, le=86400)  # /health failing or silent this long: hung
    node_lost_after: float = Field(default=300.0, gt=0, le=30 * 86400)  # unreachable this long: the node is lost
    poll: float = Field(default=2.0, ge=0.1, le=60)  # seconds between looks
    start_timeout: float | None = Field(default=None, gt=0, le=86400)  # a restarted unit must serve within (None: the plan's ready timeout)
    # Plans of DEP pools on this inventory use vLLM's own fault tolerance (planning reads it: `--fault-tolerance`
    # / `--no-fault-tolerance` override it per plan; docs/supervise.md ("vLLM's own fault tolerance")).
    fault_tolerance: bool = False

    def delay(self, restarts_in_window: int) -> float:
        """Seconds to wait before the next restart, after ``restarts_in_window`` earlier ones."""
        if restarts_in_window <= 0:
            return 0.0
        return float(min(self.backoff * 2 ** (restarts_in_window - 1), self.backoff_max))


EventKind = Literal[
    "watching",  # a supervisor started watching
    "stopped-watching",  # it stopped (Ctrl-C, down, the deployment is gone)
    "detected",  # a unit failed: a process exited, hung, or its node stopped answering
    "backoff",  # the restart waits (exponential backoff)
    "restarting",  # the unit is being stopped and started again
    "restarted",  # the unit serves again (seconds: from the detection)
    "restart-failed",  # a restart attempt failed (start command, exit while starting, not serving in time)
    "gave-up",  # the unit failed too often (max_restarts within window): stopped and left so
    "failed",  # the deployment cannot serve any more: everything stopped, state failed
    "node-unreachable",  # a node stopped answering
    "node-back",  # it answers again
    "node-lost",  # it did not answer for node_lost_after
    "cordoned",  # the lost node is kept out of plans until `k3launch uncordon`
    "replaced",  # the unit was re-placed onto spare nodes
    "hook-failed",  # the --on-event command failed or timed out
]


class Event(BaseModel):
    """One line of a deployment's event log (``k3launch events``)."""

    model_config = ConfigDict(extra="forbid")

    time: float
    kind: EventKind
    deployment: str
    unit: str | None = None
    process: str | None = None
    node: str | None = None
    reason: str = ""
    attempt: int | None = None  # the restart this is about (1: the first in the window)
    seconds: float | None = None  # restarted: from detection to serving; backoff: the wait
    log_tail: str = ""  # the failing process's last log lines


UnitKind = Literal["engine", "group", "router"]


@dataclass(frozen=True)
class Unit:
    """What restarts together: one process, or every rank of one multi-node engine."""

    name: str
    kind: UnitKind
    role: str  # serve, prefill, decode, router
    processes: tuple[str, ...]
    nodes: tuple[str, ...]
    http: tuple[str, ...]  # its processes that serve HTTP (probed for /health)


def _coupled(p: Process) -> bool:
    return p.node_rank is not None or p.dp_start_rank is not None


def units(plan: Plan) -> list[Unit]:
    """The plan's recovery units, in the order ``up`` starts them (engines, then the router)."""
    groups: dict[str, list[Process]] = {}
    out: list[Unit] = []
    for p in plan.processes:
        if p.role != "router" and _coupled(p):
            groups.setdefault(p.pool or p.role, []).append(p)
    done: set[str] = set()
    for p in plan.processes:
        key = p.pool or p.role
        if p.id in done:
            continue
        if p.role != "router" and _coupled(p) and len(groups[key]) > 1:
            members = groups[key]
            done.update(m.id for m in members)
            out.append(_unit(key, "group", members))
        else:
            done.add(p.id)
            out.append(_unit(p.id, "router" if p.role == "router" else "engine", [p]))
    return sorted(out, key=lambda u: u.kind == "router")


def _unit(name: str, kind: UnitKind, procs: Sequence[Process]) -> Unit:
    return Unit(name, kind, procs[0].role, tuple(p.id for p in procs), tuple(dict.fromkeys(p.node for p in procs)),
                tuple(p.id for p in procs if p.http_port is not None))


# ---------------------------------------------------------------------- decisions
@dataclass
class Observation:
    """One look at a deployment: what the backend saw (the supervisor's only input)."""

    now: float
    dead: Mapping[str, str] = field(default_factory=dict)  # process id -> how it ended ("exited with code 1: ...")
    unreachable: Mapping[str, str] = field(default_factory=dict)  # node -> why
    healthy: Mapping[str, bool] = field(default_factory=dict)  # HTTP process id -> /health answered 200 in time
    tails: Mapping[str, str] = field(default_factory=dict)  # dead process id -> its last log lines


class UnitState(StrEnum):
    SERVING = "serving"
    BACKOFF = "backoff"  # failed; restarts at ``until``
    STARTING = "starting"  # restarted; must serve by ``until``
    WAITING_NODE = "waiting-node"  # a node of the unit does not answer
    GAVE_UP = "gave-up"


@dataclass(frozen=True)
class Restart:
    """Stop the unit and start it again (the executor reports back with :meth:`Supervision.started`)."""

    unit: Unit
    attempt: int
    reason: str
    hung: bool = False  # it stopped answering: it will not stop gracefully either


@dataclass(frozen=True)
class GiveUp:
    """Stop the unit for good (failed too often)."""

    unit: Unit
    reason: str
    failing: tuple[str, ...]  # the processes whose last log lines to keep


@dataclass(frozen=True)
class StopAll:
    """The deployment cannot serve any more: stop everything, record ``failed``."""

    reason: str


Action = Restart | GiveUp | StopAll


@dataclass
class _Memory:
    state: UnitState = UnitState.SERVING
    until: float = 0.0
    restarts: deque[float] = field(default_factory=deque)  # times of restarts within the window
    detected: float | None = None  # when the current outage was detected
    reason: str = ""
    failing: tuple[str, ...] = ()
    unhealthy_since: dict[str, float] = field(default_factory=dict)


class Supervision:
    """The decisions of a supervisor over one deployment (no I/O: the caller observes and acts)."""

    def __init__(self, plan: Plan, policy: RestartPolicy, start_timeout: float) -> None:
        self.name = plan.name
        self.policy = policy
        self.start_timeout = policy.start_timeout or start_timeout
        self.units = units(plan)
        self.memory = {u.name: _Memory() for u in self.units}
        self.node_down: dict[str, float] = {}  # node -> since when it does not answer
        self.lost: set[str] = set()
        self.restarts = 0  # restarts done, in all

    def unit(self, name: str) -> Unit:
        return next(u for u in self.units if u.name == name)

    def state(self, name: str) -> UnitState:
        return self.memory[name].state

    def _event(self, now: float, kind: EventKind, unit: Unit | None = None, **kw: object) -> Event:
        return Event(time=now, kind=kind, deployment=self.name, unit=unit.name if unit else None, **kw)

    # ------------------------------------------------------------------ one look
    def step(self, obs: Observation) -> tuple[list[Event], list[Action]]:
        """What to do after one observation: events to record, actions to take (in order)."""
        now = obs.now
        events = self._nodes(obs)
        actions: list[Action] = []
        for u in self.units:
            m = self.memory[u.name]
            if m.state is UnitState.GAVE_UP:
                continue
            down = [n for n in u.nodes if n in obs.unreachable]
            if m.state in (UnitState.SERVING, UnitState.STARTING) and down:
                m.state, m.detected = UnitState.WAITING_NODE, m.detected or now
                m.reason = f"node {down[0]} stopped answering: {obs.unreachable[down[0]]}"
                events.append(self._event(now, "detected", u, node=down[0], reason=m.reason))
                continue
            if m.state is UnitState.WAITING_NODE:
                if not down:  # the node answers again: restart what it ran (its processes may be gone or orphaned)
                    actions += self._fail(u, m, now, m.reason, events, counted=False)
                continue
            failure = self._failure(u, m, obs)
            if failure is not None:
                why, proc, tail = failure
                if m.state is UnitState.STARTING:
                    events.append(self._event(now, "restart-failed", u, process=proc, node=self._node(proc), reason=why,
                                              attempt=len(m.restarts), log_tail=tail))
                    actions += self._fail(u, m, now, why, events, proc=proc)
                else:
                    m.detected = now
                    events.append(self._event(now, "detected", u, process=proc, node=self._node(proc), reason=why, log_tail=tail))
                    actions += self._fail(u, m, now, why, events, proc=proc)
                continue
            if m.state is UnitState.BACKOFF and now >= m.until:
                actions.append(self._restart(u, m, now, events))
            elif m.state is UnitState.STARTING and self._serves(u, obs):
                m.state = UnitState.SERVING
                m.unhealthy_since.clear()
                took = now - (m.detected or now)
                events.append(self._event(now, "restarted", u, reason=f"serving again after {took:.1f}s", seconds=round(took, 3),
                                          attempt=len(m.restarts)))
                m.detected = None
        if not self.can_serve() and not any(isinstance(a, StopAll) for a in actions):
            why = self._why_not()
            events.append(self._event(now, "failed", reason=why))
            actions.append(StopAll(why))
        return events, actions

    def _node(self, proc: str | None) -> str | None:
        if proc is None:
            return None
        return next((u.nodes[u.processes.index(proc)] if len(u.nodes) == len(u.processes) else None
                     for u in self.units if proc in u.processes), None)

    def _nodes(self, obs: Observation) -> list[Event]:
        events = []
        for node, why in sorted(obs.unreachable.items()):
            if node not in self.node_down:
                self.node_down[node] = obs.now
                events.append(self._event(obs.now, "node-unreachable", node=node, reason=why))
            elif node not in self.lost and obs.now - self.node_down[node] >= self.policy.node_lost_after:
                self.lost.add(node)
                events.append(self._event(obs.now, "node-lost", node=node,
                                          reason=f"no answer for {obs.now - self.node_down[node]:.0f}s: {why}"))
        for node in sorted(set(self.node_down) - set(obs.unreachable)):
            since = self.node_down.pop(node)
            self.lost.discard(node)
            events.append(self._event(obs.now, "node-back", node=node, reason=f"answers again after {obs.now - since:.1f}s",
                                      seconds=round(obs.now - since, 3)))
        return events

    def _failure(self, u: Unit, m: _Memory, obs: Observation) -> tuple[str, str | None, str] | None:
        """Why the unit failed in this look (reason, process, its last lines), or None."""
        if m.state in (UnitState.BACKOFF, UnitState.WAITING_NODE):
            return None
        for pid in u.processes:
            if pid in obs.dead:
                return f"{pid} {obs.dead[pid]}", pid, obs.tails.get(pid, "")
        if m.state is UnitState.STARTING:
            if obs.now > m.until:
                return f"not serving {self.start_timeout:g}s after the restart", u.http[0] if u.http else None, ""
            return None
        for pid in u.http:
            ok = obs.healthy.get(pid)
            if ok is None:
                continue
            if ok:
                m.unhealthy_since.pop(pid, None)
                continue
            since = m.unhealthy_since.setdefault(pid, obs.now)
            if obs.now - since >= self.policy.unhealthy_after:
                return f"{pid} hung: /health failing or silent for {obs.now - since:.0f}s", pid, ""
        return None

    def _serves(self, u: Unit, obs: Observation) -> bool:
        return all(obs.healthy.get(pid) is True for pid in u.http)

    def _fail(self, u: Unit, m: _Memory, now: float, why: str, events: list[Event], proc: str | None = None,
              counted: bool = True) -> list[Action]:
        p = self.policy
        while m.restarts and now - m.restarts[0] > p.window:
            m.restarts.popleft()
        m.reason = why
        m.failing = tuple(x for x in (proc,) if x) or u.http[:1]
        if p.policy == "never" or (counted and len(m.restarts) >= p.max_restarts):
            m.state = UnitState.GAVE_UP
            said = "restart policy never" if p.policy == "never" else f"{len(m.restarts)} restarts within {p.window:g}s"
            m.reason = f"{said}; last failure: {why}"
            events.append(self._event(now, "gave-up", u, process=proc, reason=m.reason))
            return [GiveUp(u, m.reason, m.failing)]
        wait = p.delay(len(m.restarts)) if counted else 0.0
        m.state, m.until = UnitState.BACKOFF, now + wait
        if wait > 0:
            events.append(self._event(now, "backoff", u, reason=f"restart {len(m.restarts) + 1} in {wait:g}s", seconds=wait,
                                      attempt=len(m.restarts) + 1))
            return []
        return [self._restart(u, m, now, events, counted)]

    def _restart(self, u: Unit, m: _Memory, now: float, events: list[Event], counted: bool = True) -> Restart:
        if counted:
            m.restarts.append(now)
        m.state, m.until = UnitState.STARTING, now + self.start_timeout
        m.unhealthy_since.clear()
        self.restarts += 1
        attempt = len(m.restarts)
        events.append(self._event(now, "restarting", u, reason=m.reason, attempt=attempt))
        return Restart(u, attempt, m.reason, hung=" hung: " in m.reason)

    # ------------------------------------------------------------------ what the executor reports
    def started(self, unit: Unit, now: float) -> None:
        """The restart's start commands ran: the unit now has ``start_timeout`` to serve."""
        m = self.memory[unit.name]
        m.state, m.until = UnitState.STARTING, now + self.start_timeout

    def start_failed(self, unit: Unit, now: float, why: str, proc: str | None = None, tail: str = "") -> tuple[list[Event], list[Action]]:
        """A restart could not even start the unit (a start command failed, a node refused)."""
        m = self.memory[unit.name]
        events = [self._event(now, "restart-failed", unit, process=proc, node=self._node(proc), reason=why, attempt=len(m.restarts),
                              log_tail=tail)]
        actions = self._fail(unit, m, now, why, events, proc=proc)
        return events, actions

    # ------------------------------------------------------------------ the deployment as a whole
    def can_serve(self) -> bool:
        """Every role keeps a unit that is not given up (a P/D deployment needs both pools), and the router."""
        alive = [u for u in self.units if self.memory[u.name].state is not UnitState.GAVE_UP]
        roles = {u.role for u in self.units}
        return all(any(u.role == r for u in alive) for r in roles)

    def _why_not(self) -> str:
        gone = [u for u in self.units if self.memory[u.name].state is UnitState.GAVE_UP]
        return "; ".join(f"{u.name} given up: {self.memory[u.name].reason}" for u in gone)

    def failing(self) -> tuple[str, ...]:
        """Every process a give-up blamed (their last log lines are kept)."""
        return tuple(pid for u in self.units for pid in self.memory[u.name].failing if self.memory[u.name].state is UnitState.GAVE_UP)

    def summary(self) -> dict[str, str]:
        return {u.name: self.memory[u.name].state.value for u in self.units}


def restarts_of(events: Iterable[Event]) -> int:
    """How many restarts an event log records."""
    return sum(1 for e in events if e.kind == "restarting")
