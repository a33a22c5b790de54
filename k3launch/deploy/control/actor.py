"""The controller's hands: each :data:`~k3launch.models.control.actions.Action` of the decisions, carried
out through the backend's :class:`~k3launch.deploy.base.Watcher`.

There is one choreography for every change of a unit, whether a restart, a re-placement or a roll: its
engines leave their router (a :class:`~k3launch.models.control.actions.Route` the decisions put first,
so no new request reaches them), it is stopped and started (on the plan the action names), it
must serve (the next looks), a roll is gated (a completion, the canary), and it is back in its
router (the membership the next look computes: :mod:`k3launch.models.control.converge`). Router changes
go through :meth:`Actor.route` alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from k3launch.deploy.base import Watcher
from k3launch.deploy.rollout import GRACE_S as ROLL_GRACE_S
from k3launch.deploy.rollout import Gate as GateFn
from k3launch.deploy.rollout import Roller, shutdown_timeout, with_processes
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.control.actions import Action, FtRetry, Gate, GiveUp, Replace, Resize, Restart, Route, StopAll, Surge, Swap
from k3launch.models.control.converge import url
from k3launch.models.control.decisions import Supervision
from k3launch.models.control.memory import UnitState
from k3launch.models.control.scaling import copy_of
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord
from k3launch.models.rollout import RolloutState
from k3launch.models.supervise import Event, Unit, reroutable, units
from k3launch.transport import http

GRACE_S = 10.0  # SIGTERM to SIGKILL when a unit restarts
HUNG_GRACE_S = 2.0  # the same for a unit restarted because it hung (a stopped or deadlocked process ignores SIGTERM)
LOCK_WAIT_S = 30.0  # a restart waits this long for another k3launch command on the deployment
SHUTDOWN_MARGIN_S = 10.0
PD_REJOIN_S = 60.0  # a P/D router takes a restarted instance back by its own health checks within this


@dataclass(frozen=True)
class Places:
    """How a controller re-places units off a lost node: cordon it in the inventory, plan again
    (the same selection; cordoned nodes and those other deployments hold are skipped)."""

    cordon: Callable[[str, str], None]  # (node, reason)
    replan: Callable[[], Plan]
    resize: Callable[[int], Plan] | None = None  # the plan with this many copies, every existing copy on its nodes


class Host(Protocol):
    """What the actor needs of the loop that owns it."""

    rec: DeploymentRecord
    store: StateStore
    watcher: Watcher
    sup: Supervision
    places: Places | None

    def emit(self, events: Sequence[Event]) -> None: ...

    def stopping(self) -> bool: ...

    def keep(self, ids: Sequence[str]) -> None: ...

    def stop_all(self, a: StopAll) -> str: ...

    def gate_for(self, ro: RolloutState) -> GateFn | None: ...

    def wait(self, seconds: float) -> None: ...


def event(rec: DeploymentRecord, kind: str, **kw: object) -> Event:
    return Event(time=time.time(), kind=kind, deployment=rec.name, **kw)


class Actor:
    """Carries out one look's actions (``act``) and feeds their outcome back to the decisions."""

    def __init__(self, host: Host) -> None:
        self.h = host

    # ------------------------------------------------------------------ dispatch
    def guarded(self, a: Action) -> str:
        """``act``, with an unforeseen error reported as an event: a controller that dies leaves
        the deployment unwatched, which is worse than one action not taken."""
        try:
            return self.act(a)
        except K3Error as exc:
            why = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
        except Exception as exc:  # any bug: said, not fatal
            why = f"{type(exc).__name__}: {exc}; report this as a k3launch bug"
        unit = getattr(a, "unit", None)
        self.h.emit([event(self.h.rec, "supervisor-error", unit=unit.name if unit else None, node=getattr(a, "node", None),
                           reason=f"{type(a).__name__.lower()} failed: {why}")])
        return "ok"

    def act(self, a: Action) -> str:
        h = self.h
        if isinstance(a, Route):
            self.route(a.router, a.remove, a.add, a.reason)
            return "ok"
        if isinstance(a, Restart):
            return self.change(a.unit, None, HUNG_GRACE_S if a.hung else GRACE_S)
        if isinstance(a, Swap):
            return self.swap(a)
        if isinstance(a, Gate):
            return self.gate(a.unit)
        if isinstance(a, Surge):
            return self.surge()
        if isinstance(a, Resize):
            return self.resize(a)
        if isinstance(a, GiveUp):
            h.keep(a.failing)
            h.watcher.stop(a.unit.processes, GRACE_S)
            return "ok"
        if isinstance(a, Replace):
            self.replace(a)
            return "ok"
        if isinstance(a, FtRetry):
            why = h.watcher.ft_retry(a.pool)
            if why is not None:  # not fatal: sent again later, and the recovery timeout falls back to a restart
                h.emit([event(h.rec, "supervisor-error", unit=a.unit.name, reason=f"retry: {why}")])
            return "ok"
        return h.stop_all(a)

    def then(self, events: list[Event], actions: list[Action]) -> str:
        """Record what the decisions said of an outcome, and carry out what they asked next."""
        self.h.emit(events)
        for b in actions:
            if self.h.stopping():
                return "ok"
            if self.guarded(b) == "failed":
                return "failed"
        if not self.h.sup.can_serve():
            why = "; ".join(e.reason for e in events if e.kind == "gave-up") or "no unit left to serve"
            self.h.emit([event(self.h.rec, "failed", reason=why)])
            return self.h.stop_all(StopAll(why))
        return "ok"

    # ------------------------------------------------------------------ the router
    def route(self, router_id: str, remove: Sequence[str], add: Sequence[str], done: str) -> str | None:
        """The one place a running router's worker list changes (restarts, rolls, scaling, standbys,
        a surge's switch); a ``rerouted`` event saying ``done``, else a ``supervisor-error`` with the
        router's words. None when it took, else why not."""
        h = self.h
        router = next((p for p in h.rec.plan.processes if p.id == router_id), None)
        if router is None:
            return f"no router {router_id} in the plan"
        # added first, then removed: a router never lists fewer serving engines than it must
        why = (h.watcher.reroute(router, [], add) if add else None) or (h.watcher.reroute(router, remove, []) if remove else None)
        h.emit([event(h.rec, "rerouted" if why is None else "supervisor-error", unit=router.id,
                      reason=done if why is None else f"router {router.id}: {why}")])
        return why

    # ------------------------------------------------------------------ stop and start a unit
    def change(self, unit: Unit, plan: Plan | None, grace: float, keep_logs: bool = False) -> str:
        """Stop ``unit`` and start it again, on ``plan`` (a roll) or on the plan it runs; the
        decisions are told whether it started."""
        h = self.h
        t_end = time.monotonic() + LOCK_WAIT_S
        if keep_logs:
            ro = h.sup.rollout
            kept = [str(p) for p in h.watcher.keep_logs(list(unit.processes))]
            if ro is not None:
                ro.logs = kept
        while True:
            try:
                with h.store.lock(h.rec.name):
                    if plan is not None:
                        h.watcher.adopt(plan, "")
                        h.sup.plan = plan
                    failed = h.watcher.restart(unit, grace, lambda: not h.stopping())
                    if h.rec.supervisor is not None:
                        h.rec.supervisor.restarts += 1
                    h.store.save(h.rec)
                break
            except K3Error as exc:
                if exc.code != "deployment-busy" or time.monotonic() > t_end or h.stopping():
                    return self.then(*h.sup.start_failed(unit, time.time(), exc.message))
                h.wait(1.0)
        if h.stopping():
            return "ok"
        if failed:
            f = failed[0]
            return self.then(*h.sup.start_failed(unit, time.time(), f.message, f.failing, f.log_tail))
        h.sup.started(unit, time.time())
        return "ok"

    def swap(self, a: Swap) -> str:
        """A roll's stop and start: the unit's processes as the rollout's ``a.to`` plan has them."""
        ro = self.h.sup.rollout
        if ro is None:
            return "ok"
        running = self.h.rec.plan
        plan = with_processes(running, ro.new if a.to == "new" else ro.old, a.unit.processes)
        # the stop is of what runs now: the grace its own --shutdown-timeout asks for
        asked = [shutdown_timeout(p) for p in running.processes if p.id in a.unit.processes]
        grace = max([ROLL_GRACE_S, *(s + SHUTDOWN_MARGIN_S for s in asked if s)])
        return self.change(a.unit, plan, grace, keep_logs=a.keep_logs)

    def gate(self, unit: Unit) -> str:
        """A rolled unit serves: a real completion from each of its engines, the router's own
        completion where it was not told (P/D), then the canary."""
        h = self.h
        ro = h.sup.rollout
        plan = h.rec.plan
        engines = [p for p in plan.processes if p.id in unit.http and p.role != "router"]
        why = ""
        for p in engines:
            c = http.completion(url(p), plan.model, timeout=60.0)
            if not c.ok:
                why = f"{p.id} serves /health but its completion failed: {c.detail}"
                break
        router = next((p for p in plan.processes if p.role == "router"), None)
        if not why and router is not None and not h.sup.routers() and engines:
            # P/D: the router pairs with the unit again by its own health checks (about a second); until then it refuses
            t_end = time.monotonic() + (ro.start_timeout if ro is not None and ro.start_timeout else PD_REJOIN_S)
            while not (c := http.completion(url(router), plan.model, timeout=60.0)).ok and time.monotonic() < t_end and not h.stopping():
                h.wait(0.5)
            why = "" if c.ok else f"the router does not serve through {unit.name}: {c.detail}"
        fn = h.gate_for(ro) if ro is not None and engines else None
        if not why and fn is not None:
            why = fn(plan, engines)
        return self.then(*h.sup.gated(unit, why, time.time()))

    def surge(self) -> str:
        """``--surge``: the whole new set beside the old one, gated, the router switched, the old set drained and stopped."""
        from k3launch.deploy.readiness import ready_timeout
        from k3launch.planning.surge import beside

        h = self.h
        ro = h.sup.rollout
        assert ro is not None
        current = h.rec.plan
        new_units = [u for u in units(ro.new) if u.kind != "router"]
        old_units = [u for u in units(current) if u.kind != "router"]
        roller = Roller(h.watcher, current, ro.new, drain_timeout=ro.drain_timeout, start_timeout=ro.start_timeout or ready_timeout(ro.new, None),
                        gate=h.gate_for(ro), route=lambda r, remove, add: self.route(r.id, remove, add, "--surge: " + "; ".join(
                            [f"added {', '.join(add)}"] * bool(add) + [f"removed {', '.join(remove)}"] * bool(remove))))
        with h.store.lock(h.rec.name):
            result = roller.surge(beside(current, ro.new), ro.new, new_units, old_units)
        now = time.time()
        if result.ok:
            h.sup.replaced(ro.new, [], now)
            for u in new_units:  # started and gated by the surge: serving, not starting
                h.sup.memory[u.name].state = UnitState.SERVING
        else:
            ro.logs = result.logs
        took = max((r.seconds for r in result.rolled), default=0.0)
        h.emit(h.sup.surged(result.ok, result.reason, now, failed=result.failed, seconds=took))
        return "ok"

    def start(self, started: Sequence[Unit]) -> bool:
        """Start units on the plan the watcher runs (under the caller's lock); one that does not
        start is a ``restart-failed`` event, and the looks that follow decide. False: stopping."""
        h = self.h
        for u in started:
            if h.stopping():
                return False
            bad = h.watcher.restart(u, GRACE_S, lambda: not h.stopping())
            if bad:
                h.emit([event(h.rec, "restart-failed", unit=u.name, process=bad[0].failing, reason=bad[0].message, log_tail=bad[0].log_tail)])
        return True

    # ------------------------------------------------------------------ a copy count
    def resize(self, a: Resize) -> str:
        """Run on a plan of ``a.total`` copies: the leaving ones (drained) stop and leave the
        record, new ones start on free nodes the doctor passed; the router is told, not restarted
        (the membership of the next looks)."""
        h = self.h
        if h.places is None or h.places.resize is None:
            return self.then(h.sup.resize_failed("no inventory to plan the copies on (the record names none, or it is gone)", time.time()), [])
        try:
            new = h.places.resize(a.total)
        except K3Error as exc:
            return self.then(h.sup.resize_failed(f"no free node fits: {exc.message}", time.time()), [])
        before = {p.id: p for p in h.rec.plan.processes}
        gone = [p.id for p in h.rec.plan.processes if copy_of(p.id) in a.leaving]
        fresh = sorted({p.node for p in new.processes if p.id not in before})
        problems = h.watcher.check(new, fresh) if fresh else []
        if problems:
            return self.then(h.sup.resize_failed(f"a free node failed the doctor: {problems[0]}", time.time()), [])
        started = [u for u in units(new) if u.kind != "router" and not set(u.processes) & set(before)]
        with h.store.lock(h.rec.name):
            if gone:
                h.watcher.stop(gone, GRACE_S)

                def drop(r: DeploymentRecord) -> None:
                    for i in gone:
                        r.processes.pop(i, None)

                h.watcher.note(drop)
            h.watcher.adopt(new, "")
            self.start(started)
        h.emit(h.sup.resized(new, [u.name for u in started], time.time()))
        return "ok"

    # ------------------------------------------------------------------ a lost node
    def replace(self, a: Replace) -> None:
        """Cordon the lost node, plan again without it, check the spares, restart what moved."""
        h = self.h
        name = h.rec.name

        def failed(why: str) -> None:
            h.emit([event(h.rec, "replace-failed", node=a.node, reason=f"{why}; waiting for {a.node} to answer again instead")])

        if h.places is None:
            return failed("no inventory to re-plan on (the record names none, or it is gone)")
        try:
            h.places.cordon(a.node, f"lost by the supervisor of {name}: {a.reason}")
        except K3Error as exc:
            return failed(f"could not cordon {a.node}: {exc.message}")
        h.emit([event(h.rec, "cordoned", node=a.node, reason=f"kept out of plans until `k3launch uncordon {a.node}`")])
        old = h.rec.plan
        try:
            new = h.places.replan()
        except K3Error as exc:
            return failed(f"no spare node fits: {exc.message}")
        before = {p.id: p for p in old.processes}
        moves = [f"{p.id} {before[p.id].node} -> {p.node}" for p in new.processes if p.id in before and before[p.id].node != p.node]
        if a.node in {p.node for p in new.processes} or not moves:
            return failed("the new plan does not move off the lost node")
        spares = sorted({p.node for p in new.processes if p.id not in before or before[p.id].node != p.node})
        problems = h.watcher.check(new, spares)
        if problems:
            return failed(f"a spare failed the doctor: {problems[0]}")
        # a unit restarts when any of its processes changed: moved, or its argv names a moved peer (a
        # head) -- except a router that only needs other worker URLs: the membership of the next
        # looks takes the moved engines out and adds them once they serve (no outage for the clients)
        rerouted = {p.id for p in new.processes if p.id in before and before[p.id] != p and reroutable(before[p.id], p)}
        changed = [u for u in units(new) if any(before.get(p.id) != p for p in new.processes if p.id in u.processes)
                   and not set(u.processes) & rerouted]
        with h.store.lock(name):
            h.watcher.adopt(new, a.node)
            if not self.start(changed):
                return None
        h.sup.replaced(new, [u.name for u in changed], time.time())
        h.emit([event(h.rec, "replaced", node=a.node, reason=f"{'; '.join(moves)}; restarted: {', '.join(u.name for u in changed)}")])
        return None
