"""Converging to the spec, the pure part: rollouts unit by unit, and router membership.

A rollout is desired state (:class:`~k3launch.models.rollout.RolloutState`, from the spec), and
these decisions move the deployment towards it one look at a time, beside the restart decisions
of :class:`~k3launch.models.control.decisions.Supervision` (which this is a part of). Each unit of the
rollout goes:

1. ``draining``: out of the router (the membership below takes it out), its in-flight requests
   finishing, until its engines report no running request or ``drain_timeout`` passes;
2. :class:`Swap` to the target plan (stop, start), then ``starting`` until it serves;
3. ``gating``: a real completion and the canary (:class:`Gate`); passed, it is ``serving`` on
   the target plan and back in the router; failed (or it never served), it swaps back to the
   plan it had and the rollout stops there, for ``--continue`` or ``--rollback``.

A unit starts rolling only while every other unit serves, at most ``max_unavailable`` at a time;
a unit that fails meanwhile is repaired by the restart decisions, and the rollout waits for it.
A copy in the router that starts rolling hands its place to a hot standby that serves, if there
is one (:mod:`k3launch.models.control.scaling`): it rolls as the standby, and the router never lists fewer
copies than it did.
One without a regular router in front (P/D, or one engine with ``--allow-downtime``) swaps in
place.

**Router membership is observed state.** Each look carries what every regular router lists
(``/list_workers``); the desired list is the engines of every unit that serves. A serving unit
missing from its router is added back, and a listed worker that should not be there (its unit
restarts, drains or was given up; an address the plan does not have) is removed. vllm-router's
P/D mode cannot add a worker over HTTP, so its membership is left to its own health checks.
"""

from __future__ import annotations

from k3launch.models.control.actions import Action, Gate, Route, Surge, Swap
from k3launch.models.control.memory import Memory, UnitState
from k3launch.models.control.observation import Observation
from k3launch.models.plan import Plan, Process
from k3launch.models.rollout import RolloutState
from k3launch.models.supervise import Event, EventKind, Unit

_IN_ROUTER = (UnitState.SERVING, UnitState.RECOVERING)


def url(p: Process) -> str:
    return f"http://{p.address}:{p.http_port}"


def _norm(u: str) -> str:
    return u.rstrip("/")


def pd(plan: Plan) -> bool:
    return any(p.role in ("prefill", "decode") for p in plan.processes)


class Converge:
    """The rollout and routing half of :class:`~k3launch.models.control.decisions.Supervision`."""

    name: str
    plan: Plan
    units: list[Unit]
    memory: dict[str, Memory]
    rollout: RolloutState | None
    surging: bool
    start_timeout: float

    def _event(self, now: float, kind: EventKind, unit: Unit | None = None, **kw: object) -> Event:
        raise NotImplementedError

    def _starting(self, m: Memory, now: float) -> None:
        raise NotImplementedError

    def out_of_router(self, u: Unit) -> bool:
        """Serving but not the router's (a standby, a leaving copy: :mod:`k3launch.models.control.scaling`)."""
        return False

    def promote(self, u: Unit, now: float, events: list[Event], then: str = "restarts") -> None:
        """A standby takes ``u``'s place in the router (:mod:`k3launch.models.control.scaling`)."""

    # ------------------------------------------------------------------ who serves behind which router
    def routers(self) -> list[Process]:
        """The routers whose worker list is the controller's to keep (not P/D: vllm-router 0.1.17
        cannot add a P/D worker over HTTP)."""
        return [] if pd(self.plan) else [p for p in self.plan.processes if p.role == "router"]

    def urls(self, u: Unit) -> list[str]:
        """The worker URLs of a unit's engines, as a router lists them."""
        return [url(p) for p in self.plan.processes if p.id in u.http and p.role != "router"]

    def routed(self, u: Unit) -> bool:
        return bool(self.urls(u)) and bool(self.routers())

    def routes(self, obs: Observation) -> list[Action]:
        """What each regular router must add and remove to list exactly the serving units' engines."""
        out: list[Action] = []
        want = {_norm(x) for u in self.units if self.memory[u.name].state in _IN_ROUTER and not self.out_of_router(u) for x in self.urls(u)}
        for r in self.routers():
            listed = obs.routers.get(r.id)
            if listed is None or not obs.healthy.get(r.id, True):
                continue  # not known this look, or the router itself is down (its restart lists every worker)
            have = {_norm(x) for x in listed}
            add = tuple(sorted(want - have))
            remove = tuple(sorted(x for x in listed if _norm(x) not in want))
            if add or remove:
                said = [f"removed {x} {self._why_out(x)}" for x in remove] + ([f"added {', '.join(add)}"] if add else [])
                out.append(Route(r.id, add, remove, "; ".join(said)))
        return out

    def unlisted(self, obs: Observation) -> int | None:
        """Units that should be in the regular routers and are not listed by one of them, as this
        look saw the routers (None: no regular router, or none answered)."""
        lists = [obs.routers.get(r.id) for r in self.routers()]
        known = [{_norm(x) for x in listed} for listed in lists if listed is not None]
        if not known:
            return None
        want = [u for u in self.units if self.memory[u.name].state in _IN_ROUTER and not self.out_of_router(u) and self.urls(u)]
        return sum(any(_norm(x) not in have for have in known for x in self.urls(u)) for u in want)

    def _why_out(self, worker: str) -> str:
        owner = next((u for u in self.units if _norm(worker) in {_norm(x) for x in self.urls(u)}), None)
        if owner is None:
            return "(not an engine of the plan)"
        state = self.memory[owner.name].state
        if self.memory[owner.name].leaving:
            return f"while {owner.name} leaves (scaled in)"
        if self.out_of_router(owner):
            return f"({owner.name} is a standby)"
        return {UnitState.DRAINING: f"while {owner.name} drains for a roll", UnitState.GAVE_UP: f"({owner.name} was given up)",
                UnitState.WAITING_NODE: f"while {owner.name} waits for its node"}.get(state, f"while {owner.name} restarts")

    # ------------------------------------------------------------------ a rollout, unit by unit
    def rolls_forward(self, m: Memory) -> bool:
        """The unit is on its way to the rollout's target (not taking a failed roll back)."""
        return self.rollout is not None and bool(m.to) and not m.undo

    def _other(self) -> str:
        assert self.rollout is not None
        return "new" if self.rollout.back else "old"

    def abandon(self, u: Unit, m: Memory) -> None:
        """A unit failed while draining, on the plan it still runs: the restart decisions repair
        it there, and it rolls again later."""
        m.to, m.undo = "", False
        ru = self.rollout.unit(u.name) if self.rollout is not None else None
        if ru is not None and ru.on == "rolling":
            ru.on = self._other()  # type: ignore[assignment]

    def roll_failed(self, u: Unit, m: Memory, now: float, why: str, events: list[Event], proc: str | None = None,
                    tail: str = "") -> list[Action]:
        """The target plan did not start, serve or pass the gate: back to the plan the unit had; the rollout stops."""
        ro = self.rollout
        assert ro is not None
        ru = ro.unit(u.name)
        if ru is not None:
            ru.failed = why
        ro.stopped = ro.stopped or f"{u.name} failed its gate: {why}"
        events.append(self._event(now, "roll-failed", u, process=proc, reason=f"{why}; back to the {self._other()} plan", log_tail=tail))
        m.to, m.undo = self._other(), True
        return [self._swap(u, m, now, f"{u.name} failed its gate", keep=True)]

    def _swap(self, u: Unit, m: Memory, now: float, why: str, keep: bool = False) -> Swap:
        self._starting(m, now)
        return Swap(u, m.to, why, keep_logs=keep)

    def swapped(self, u: Unit, m: Memory, now: float, events: list[Event]) -> list[Action]:
        """A swapped unit serves: the target plan goes to its gate; a taken-back one is done."""
        if not m.undo:
            m.state = UnitState.GATING
            return [Gate(u)]
        ru = self.rollout.unit(u.name) if self.rollout is not None else None
        if ru is not None:
            ru.on = m.to  # type: ignore[assignment]
        m.state, m.to, m.undo = UnitState.SERVING, "", False
        m.last_ok.clear()
        events.append(self._event(now, "rolled-back", u, reason=f"serving the plan it had again after {now - m.since:.1f}s",
                                  seconds=round(now - m.since, 3)))
        return []

    def gated(self, u: Unit, why: str, now: float) -> tuple[list[Event], list[Action]]:
        """The executor's gate of a unit: passed (``why`` empty), it serves the target plan."""
        m = self.memory[u.name]
        events: list[Event] = []
        if why:
            return events, self.roll_failed(u, m, now, why, events)
        ro = self.rollout
        ru = ro.unit(u.name) if ro is not None else None
        took = now - m.since
        if ro is not None and ru is not None:
            ru.on, ru.failed = ro.target, ""
            ru.seconds, ru.drained_s = round(took, 3), round(m.drained_s, 3)
            ru.downtime_s = 0.0 if ro.routes and self.routed(u) else round(took, 3)
        m.state, m.to, m.undo = UnitState.SERVING, "", False
        m.last_ok.clear()
        events.append(self._event(now, "rolled", u, reason=f"serves the new plan, gated, after {took:.1f}s", seconds=round(took, 3)))
        return events, []

    def surged(self, ok: bool, why: str, now: float, failed: str = "", seconds: float = 0.0) -> list[Event]:
        """The executor's surge ended (on success it calls ``replaced`` with the new plan first);
        ``failed``: the new set's units that did not pass, comma separated."""
        ro = self.rollout
        self.surging = False
        if ro is None:
            return []
        bad = set(failed.split(", ")) if failed else set()
        for ru in ro.units:
            ru.on = "new" if ok else "old"
            ru.failed = why if ru.name in bad else ""
            ru.seconds = round(seconds, 3) if ok else 0.0
        if ok:
            return [self._event(now, "rolled", reason=f"the new set serves: {', '.join(u.name for u in ro.units)}")]
        ro.stopped = why
        return [self._event(now, "roll-failed", reason=why)]

    def roll(self, obs: Observation, events: list[Event]) -> list[Action]:
        """The rollout's next steps: drained units swap; while every other unit serves, up to
        ``max_unavailable`` more start rolling."""
        ro, now = self.rollout, obs.now
        if ro is None:
            return []
        out: list[Action] = []
        for u in self.units:
            m = self.memory[u.name]
            if m.state is UnitState.DRAINING and not m.leaving:
                left = [obs.running.get(pid) for pid in u.http]
                if all(n is None or n == 0 for n in left) or now >= m.until:
                    m.drained_s = now - m.since
                    out.append(self._swap(u, m, now, f"drained in {m.drained_s:.1f}s"))
        if ro.stopped or self.surging or not ro.pending():
            return out
        busy = [u.name for u in self.units if self.memory[u.name].to]
        calm = all(self.memory[u.name].state is UnitState.SERVING for u in self.units if u.name not in busy)
        if ro.surge:
            if calm and not busy:
                self.surging = True
                for ru in ro.units:
                    ru.on = "rolling"
                events.append(self._event(now, "rolling", reason=f"--surge: starting {', '.join(ro.pending())} beside the running engines"))
                out.append(Surge())
            return out
        by_name = {u.name: u for u in self.units}
        todo = [n for n in ro.pending() if n not in busy and n in by_name]
        while calm and todo and len(busy) < max(1, ro.max_unavailable):
            u, m = by_name[todo[0]], self.memory[todo.pop(0)]
            rolling = ro.unit(u.name)
            assert rolling is not None
            rolling.on, rolling.failed = "rolling", ""
            m.to, m.undo, m.since, m.drained_s = ro.target, False, now, 0.0
            busy.append(u.name)
            if ro.routes and self.routed(u):
                self.promote(u, now, events, "rolls")  # a copy in the router leaves it: a standby that serves takes its place
                m.state, m.until = UnitState.DRAINING, now + ro.drain_timeout
                events.append(self._event(now, "rolling", u, reason="out of the router, draining"))
            else:
                events.append(self._event(now, "rolling", u, reason="restarting in place (no router takes it out)"))
                out.append(self._swap(u, m, now, "in place"))
        return out
