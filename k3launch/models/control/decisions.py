"""A supervisor's decisions over one deployment (pure: no I/O, time passed in).

:class:`Supervision` gets one :class:`Observation` per look and answers with the events to
record and the :class:`Action` s to take (restart a unit, give it up, re-place a lost node's
units, stop everything); the executor (:mod:`k3launch.deploy.control.loop`) reports back what
happened to a restart or a re-placement. Policy, units and events: :mod:`k3launch.models.supervise`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from k3launch.models.control.actions import Action, FtRetry, Gate, GiveUp, Replace, Restart, Route, StopAll, Surge, Swap
from k3launch.models.control.converge import Converge
from k3launch.models.control.memory import ControlMemory, Memory, UnitMemory, UnitState
from k3launch.models.control.observation import Observation
from k3launch.models.control.scaling import Scale
from k3launch.models.plan import Plan
from k3launch.models.rollout import RolloutState
from k3launch.models.supervise import Event, EventKind, RestartPolicy, Unit, units

__all__ = ["Action", "FtRetry", "Gate", "GiveUp", "Memory", "Observation", "Replace", "Restart", "Route", "StopAll", "Supervision",
           "Surge", "Swap", "UnitState"]


FT_MARGIN_S = 15.0  # past the engines' recovery timeout: they die by then; a group restart follows
FT_RETRY_AGAIN_S = 30.0  # a retry that did not take (a rank missed it) is sent again


class Supervision(Scale, Converge):
    """The decisions of a supervisor over one deployment (no I/O: the caller observes and acts)."""

    _newly_lost: list[str]

    def __init__(self, plan: Plan, policy: RestartPolicy, start_timeout: float) -> None:
        self.name = plan.name
        self.policy = policy
        self.start_timeout = policy.start_timeout or start_timeout
        self.plan = plan
        self.units = units(plan)
        self.node_of = {p.id: p.node for p in plan.processes}
        self.rollout: RolloutState | None = None  # the spec's rollout, converged unit by unit (:mod:`k3launch.models.control.converge`)
        self.surging = False  # a --surge is under way (one action: the executor reports back)
        self.copies_wanted: int | None = None  # the spec's copies (None: as the plan has them) (:mod:`k3launch.models.control.scaling`)
        self.standby_wanted = 0
        self.standby: set[str] = set()  # copies serving as hot standbys, out of the router
        self.resizing = False
        self.resize_blocked = 0.0
        self.memory = {u.name: Memory() for u in self.units}
        self.node_down: dict[str, float] = {}  # node -> since when it does not answer
        self.lost: set[str] = set()
        self.restarts = 0  # restarts done, in all
        self.ft = {f.pool: f for f in plan.fault_tolerance}  # group unit name (its pool) -> vLLM's fault tolerance there

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
        replace = [self._replace(n, obs.unreachable.get(n, "")) for n in self._newly_lost]
        actions: list[Action] = [a for a in replace if a.units]
        for node, ids in sorted(obs.reclaimed.items()):
            events.append(self._event(now, "reclaimed", node=node, reason=f"stopped {', '.join(ids)}, left there when the node was lost"))
        for u in self.units:
            m = self.memory[u.name]
            if m.state is UnitState.GAVE_UP:
                continue
            down = [n for n in u.nodes if n in obs.unreachable]
            if down and m.state is UnitState.DRAINING:
                self.abandon(u, m)
                m.state = UnitState.SERVING
            if m.state in (UnitState.SERVING, UnitState.STARTING, UnitState.GATING) and down:
                m.state, m.detected = UnitState.WAITING_NODE, now if m.detected is None else m.detected
                m.reason = f"node {down[0]} stopped answering: {obs.unreachable[down[0]]}"
                events.append(self._event(now, "detected", u, node=down[0], reason=m.reason))
                continue
            if m.state is UnitState.WAITING_NODE:
                if not down:  # the node answers again: restart what it ran (its processes may be gone or orphaned)
                    actions += self._fail(u, m, now, m.reason, events, counted=False)
                continue
            failure = self._failure(u, m, obs)
            if failure is None and u.name in self.ft and m.state in (UnitState.SERVING, UnitState.RECOVERING):
                failure, recovery = self._recovery(u, m, obs, events)
                actions += recovery
            if failure is not None and m.leaving:  # a copy being scaled in: gone is as good as drained
                m.state, m.until = UnitState.DRAINING, now
                continue
            if failure is not None and m.to and self.rolls_forward(m):
                if m.state is UnitState.STARTING:  # the new plan does not start or serve: rolled back, the rollout stops
                    actions += self.roll_failed(u, m, now, failure[0], events, proc=failure[1], tail=failure[2])
                    continue
                self.abandon(u, m)  # failed while draining: repaired on the plan it runs, rolled later
            if failure is not None:
                why, proc, tail = failure
                if m.state is UnitState.STARTING:
                    events.append(self._event(now, "restart-failed", u, process=proc, node=self._node(proc), reason=why,
                                              attempt=len(m.restarts), log_tail=tail))
                    actions += self._fail(u, m, now, why, events, proc=proc)
                else:
                    m.detected = now
                    events.append(self._event(now, "detected", u, process=proc, node=self._node(proc), reason=why, log_tail=tail))
                    self.promote(u, now, events)  # a standby takes its place in the router at once
                    actions += self._fail(u, m, now, why, events, proc=proc)
                continue
            if m.state is UnitState.BACKOFF and now >= m.until:
                actions.append(self._restart(u, m, now, events))
            elif m.state is UnitState.STARTING and self._serves(u, obs) and m.to:
                actions += self.swapped(u, m, now, events)
            elif m.state is UnitState.STARTING and self._serves(u, obs) and m.fresh:
                m.state, m.fresh = UnitState.SERVING, False
                events.append(self._event(now, "scaled", u, reason=f"{u.name} serves (a new copy) after {now - m.since:.1f}s",
                                          seconds=round(now - m.since, 3)))
            elif m.state is UnitState.STARTING and self._serves(u, obs):
                m.state = UnitState.SERVING
                m.last_ok.clear()
                m.progress.clear()
                m.tokens.clear()
                took = now - (now if m.detected is None else m.detected)
                events.append(self._event(now, "restarted", u, reason=f"serving again after {took:.1f}s", seconds=round(took, 3),
                                          attempt=len(m.restarts)))
                m.detected = None
        actions += self.roll(obs, events)
        calm = (self.rollout is None or bool(self.rollout.stopped)) and not self.surging and not any(m.to for m in self.memory.values())
        actions += self.scale(obs, events, calm)
        if not self.can_serve() and not any(isinstance(a, StopAll) for a in actions):
            why = self._why_not()
            events.append(self._event(now, "failed", reason=why))
            actions.append(StopAll(why))
        # router membership first: a unit about to restart or swap leaves its router before it stops
        return events, self.routes(obs) + actions

    def _node(self, proc: str | None) -> str | None:
        return self.node_of.get(proc) if proc else None

    def _replace(self, node: str, why: str) -> Replace:
        waiting = tuple(u for u in self.units if node in u.nodes and self.memory[u.name].state is UnitState.WAITING_NODE)
        return Replace(node, waiting, why)

    def _nodes(self, obs: Observation) -> list[Event]:
        events = []
        self._newly_lost: list[str] = []
        for node, why in sorted(obs.unreachable.items()):
            if node not in self.node_down:
                self.node_down[node] = obs.now
                events.append(self._event(obs.now, "node-unreachable", node=node, reason=why))
            elif node not in self.lost and obs.now - self.node_down[node] >= self.policy.node_lost_after:
                self.lost.add(node)
                self._newly_lost.append(node)
                events.append(self._event(obs.now, "node-lost", node=node,
                                          reason=f"no answer for {obs.now - self.node_down[node]:.0f}s: {why}"))
        for node in sorted(set(self.node_down) - set(obs.unreachable)):
            since = self.node_down.pop(node)
            self.lost.discard(node)
            events.append(self._event(obs.now, "node-back", node=node, reason=f"answers again after {obs.now - since:.1f}s",
                                      seconds=round(obs.now - since, 3)))
        return events

    def _failure(self, u: Unit, m: Memory, obs: Observation) -> tuple[str, str | None, str] | None:
        """Why the unit failed in this look (reason, process, its last lines), or None."""
        if m.state in (UnitState.BACKOFF, UnitState.WAITING_NODE):
            return None
        for pid in u.processes:
            if pid in obs.dead:
                return f"{pid} {obs.dead[pid]}", pid, obs.tails.get(pid, "")
        if m.state is UnitState.STARTING:
            stuck = self._stalled(u, m, obs)
            if stuck is not None:
                return stuck
            if obs.now > m.until:
                return f"not serving {self.start_timeout:g}s after the restart", u.http[0] if u.http else None, ""
            return None
        for pid in u.http:
            ok = obs.healthy.get(pid)
            if ok is None:
                continue
            if ok:
                m.last_ok[pid] = obs.now
                latched = self._latched(pid, m, obs)
                if latched is not None:
                    return latched, pid, ""
                continue
            # silence counts from the last good answer, not from the first failed probe (which itself
            # may have waited out the probe's timeout)
            since = m.last_ok.setdefault(pid, obs.now)
            if obs.now - since >= self.policy.unhealthy_after:
                return f"{pid} hung: /health failing or silent for {obs.now - since:.0f}s", pid, ""
        return None

    def _latched(self, pid: str, m: Memory, obs: Observation) -> str | None:
        """An engine that answers /health and holds requests, and has generated no token for
        ``unhealthy_after``: up but not serving (the clock starts again at every new token, and
        stops while it holds nothing)."""
        got = obs.work.get(pid)
        if got is None or got[0] <= 0:
            m.tokens.pop(pid, None)
            return None
        seen = m.tokens.get(pid)
        if seen is None or seen[0] != got[1]:
            m.tokens[pid] = (got[1], obs.now)
            return None
        if obs.now - seen[1] >= self.policy.unhealthy_after:
            return f"{pid} hung: {got[0]:.0f} request(s) held and no token generated for {obs.now - seen[1]:.0f}s, /health answering"
        return None

    def _stalled(self, u: Unit, m: Memory, obs: Observation) -> tuple[str, str | None, str] | None:
        """A starting process whose session used no CPU for ``stall_after`` seconds never serves (a
        task stuck in the kernel, stopped, or blocked on storage that does not answer): failed now,
        not at ``start_timeout``, which is sized for the slowest honest start. Every look with new
        ticks (or the first one) starts the clock again."""
        limit = self.policy.stall_after
        if not limit or self._serves(u, obs):  # an engine may idle once it serves: that look makes it SERVING
            return None
        for pid in u.processes:
            got = obs.cpu.get(pid)
            if got is None:
                continue
            seen = m.progress.get(pid)
            if seen is None or seen[0] != got[0]:
                m.progress[pid] = (got[0], obs.now)
            elif obs.now - seen[1] >= limit:
                how = f"; {got[1]}" if got[1] else ""
                return f"{pid} hung: no CPU time used for {obs.now - seen[1]:.0f}s while starting{how}", pid, ""
        return None

    def _recovery(self, u: Unit, m: Memory, obs: Observation, events: list[Event]) -> tuple[tuple[str, str | None, str] | None, list[Action]]:
        """vLLM's fault tolerance on a DEP pool whose processes all live: ranks go ``unhealthy``
        while ``/health`` stays 200; once every rank is, ``retry`` goes to all of them (again
        every :data:`FT_RETRY_AGAIN_S`); all ``healthy`` again is a recovery. Not healthy within
        the engines' recovery timeout (+ :data:`FT_MARGIN_S`): a failure, and the group restarts."""
        pool = self.ft[u.name]
        states = [obs.ft.get(pid, "") for pid in u.processes]
        now = obs.now
        if m.state is UnitState.SERVING:
            if not any(st and st != "healthy" for st in states):
                return None, []
            m.state, m.detected, m.ft_sent = UnitState.RECOVERING, now, None
            bad = [pid for pid, st in zip(u.processes, states, strict=True) if st and st != "healthy"]
            m.reason = f"{', '.join(bad)} {states[u.processes.index(bad[0])]} (vLLM fault tolerance; /health stays 200)"
            events.append(self._event(now, "detected", u, process=bad[0], node=self._node(bad[0]), reason=m.reason))
        if all(st == "healthy" for st in states):
            took = now - (now if m.detected is None else m.detected)
            m.state, m.detected, m.ft_sent = UnitState.SERVING, None, None
            events.append(self._event(now, "recovered", u, reason=f"every rank healthy again after {took:.1f}s (vLLM fault tolerance)",
                                      seconds=round(took, 3)))
            return None, []
        if now - (now if m.detected is None else m.detected) > pool.recovery_timeout_s + FT_MARGIN_S:
            m.state = UnitState.SERVING  # the failure path takes it from here
            return (f"vLLM fault tolerance did not recover {u.name} within {pool.recovery_timeout_s}s", u.http[0] if u.http else None, ""), []
        if all(st == "unhealthy" for st in states) and (m.ft_sent is None or now - m.ft_sent >= FT_RETRY_AGAIN_S):
            m.ft_sent = now
            events.append(self._event(now, "ft-retry", u, reason=f"retry sent to {len(u.processes)} rank(s)"))
            return None, [FtRetry(u, pool)]
        return None, []

    def _serves(self, u: Unit, obs: Observation) -> bool:
        return all(obs.healthy.get(pid) is True for pid in u.http)

    def _fail(self, u: Unit, m: Memory, now: float, why: str, events: list[Event], proc: str | None = None,
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

    def _restart(self, u: Unit, m: Memory, now: float, events: list[Event], counted: bool = True) -> Restart:
        if counted:
            m.restarts.append(now)
        self._starting(m, now)
        self.restarts += 1
        attempt = len(m.restarts)
        events.append(self._event(now, "restarting", u, reason=m.reason, attempt=attempt))
        return Restart(u, attempt, m.reason, hung=" hung: " in m.reason)

    def _starting(self, m: Memory, now: float) -> None:
        """A unit (re)started now: ``start_timeout`` to serve (a roll's own, if it set one), and the
        hung and stall clocks start again with its new processes."""
        limit = self.rollout.start_timeout if m.to and self.rollout is not None and self.rollout.start_timeout else self.start_timeout
        m.state, m.until = UnitState.STARTING, now + limit
        m.last_ok.clear()
        m.progress.clear()

    # ------------------------------------------------------------------ what the executor reports
    def started(self, unit: Unit, now: float) -> None:
        """The restart's start commands ran: the unit now has ``start_timeout`` to serve."""
        self._starting(self.memory[unit.name], now)

    def start_failed(self, unit: Unit, now: float, why: str, proc: str | None = None, tail: str = "") -> tuple[list[Event], list[Action]]:
        """A restart could not even start the unit (a start command failed, a node refused)."""
        m = self.memory[unit.name]
        if self.rolls_forward(m):  # the rollout's plan does not even start: back to the plan the unit had
            events: list[Event] = []
            return events, self.roll_failed(unit, m, now, why, events, proc=proc, tail=tail)
        events = [self._event(now, "restart-failed", unit, process=proc, node=self._node(proc), reason=why, attempt=len(m.restarts),
                              log_tail=tail)]
        actions = self._fail(unit, m, now, why, events, proc=proc)
        return events, actions

    def replaced(self, plan: Plan, restarted: Iterable[str], now: float) -> None:
        """The executor re-placed units onto a new plan and restarted ``restarted`` (unit names):
        they have ``start_timeout`` to serve; every unit keeps its restart history by name."""
        self.plan = plan
        self.units = units(plan)
        self.node_of = {p.id: p.node for p in plan.processes}
        old = self.memory
        self.memory = {u.name: old.get(u.name) or Memory() for u in self.units}
        for name in restarted:
            m = self.memory[name]
            self._starting(m, now)
            m.detected = now if m.detected is None else m.detected
            self.restarts += 1

    def resized(self, plan: Plan, started: Sequence[str], now: float) -> list[Event]:
        """The executor ran the deployment on ``plan`` (a copy count changed): ``started`` (unit
        names) are starting; the leaving copies are gone."""
        self.resizing = False
        self.replaced(plan, started, now)
        self.restarts -= len(started)  # new copies are not restarts
        for name in started:
            m = self.memory[name]
            m.fresh, m.detected, m.since = True, None, now
        return [self._event(now, "scaled", reason=f"runs {len(self.copies())} copies")]

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

    # ------------------------------------------------------------------ memory, saved in the record
    def dump(self, revision: int) -> ControlMemory:
        """What a controller started again needs to go on where this one was."""
        return ControlMemory(revision=revision, restarts=self.restarts, node_down=dict(self.node_down), lost=sorted(self.lost),
                             standby=sorted(self.standby), copies=len(self.copies()), scaled=self.scaled(), units={
            u.name: UnitMemory(state=(m := self.memory[u.name]).state.value, until=m.until, restarts=list(m.restarts), detected=m.detected,
                               reason=m.reason, failing=list(m.failing), to=m.to, undo=m.undo, since=m.since, drained_s=m.drained_s,
                               leaving=m.leaving, fresh=m.fresh)
            for u in self.units})

    def restore(self, saved: ControlMemory, now: float) -> None:
        """Adopt a saved memory (a controller killed, or started on another login node). A unit
        caught draining is serving its old plan again (it rolls later); one caught gating gets
        ``start_timeout`` to serve again, then its gate; restart counts and windows go on. Call it
        after setting :attr:`rollout` (a draining unit's roll is given back to it)."""
        self.restarts, self.node_down, self.lost = saved.restarts, dict(saved.node_down), set(saved.lost)
        self.standby = set(saved.standby)
        for u in self.units:
            got = saved.units.get(u.name)
            if got is None:
                continue
            m = self.memory[u.name]
            m.restarts = deque(got.restarts)
            m.until, m.detected, m.reason, m.failing = got.until, got.detected, got.reason, tuple(got.failing)
            m.to, m.undo, m.since, m.drained_s, m.leaving, m.fresh = got.to, got.undo, got.since, got.drained_s, got.leaving, got.fresh
            m.state = UnitState(got.state) if got.state in {s.value for s in UnitState} else UnitState.SERVING
            if m.state is UnitState.DRAINING and m.leaving:
                m.until = now + 10.0  # a leaving copy's drain goes on a little; then it stops
            elif m.state is UnitState.DRAINING:  # never swapped: it runs (and serves) the plan it had; it rolls again
                self.abandon(u, m)
                m.state = UnitState.SERVING
            elif m.state is UnitState.GATING:  # swapped, not gated: serving again is followed by its gate
                self._starting(m, now)

    def summary(self) -> dict[str, str]:
        return {u.name: self.memory[u.name].state.value for u in self.units}


