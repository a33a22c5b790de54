"""``k3launch supervise``: keep a deployment serving until it is taken down.

The loop (every ``poll`` seconds): one look through the backend's :class:`~k3launch.deploy.base.Watcher`,
the decisions of :class:`~k3launch.models.supervision.Supervision` (pure), then its actions —
restart a unit, give a unit up, re-place a lost node's units (:class:`Places`), send vLLM's
fault-tolerance ``retry``, or stop everything — and every event appended to the
deployment's event log (:mod:`k3launch.deploy.eventlog`; ``restarted`` and ``restart-failed``
carry the unit's restart timeline, phase by phase, when the watcher tracked it) and handed to ``on_event`` and the
``--on-event`` command (on a thread of its own: a slow hook never delays a detection).

One supervisor per deployment: it holds ``<state>/supervise/NAME.lock`` while it runs (a second
one is refused) and names itself in the record (``supervisor``: host, pid, since, restarts), so
``status`` shows it. It watches, it never owns: stopping it (Ctrl-C, SIGTERM) leaves the
deployment as it is. ``down`` stops it first (:func:`k3launch.deploy.supervisors.stop`: a stop
request file any login node sharing the state directory sees, and SIGTERM when on this host), so it never revives what
``down`` is stopping; a request that arrives during a restart is honoured before the unit's
start, and the restart's processes, if any started, are ``down``'s to stop.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from k3launch.deploy import eventlog
from k3launch.deploy.base import SuperviseOps, Watcher
from k3launch.deploy.readiness import ready_timeout
from k3launch.deploy.state import StateStore, me
from k3launch.deploy.supervisors import lock_path, stop_path, who
from k3launch.errors import K3Error
from k3launch.models.plan import Plan, Process
from k3launch.models.record import DeploymentRecord, Supervisor
from k3launch.models.supervise import Event, RestartPolicy, Unit, reroutable, units, worker_urls
from k3launch.models.supervision import Action, FtRetry, GiveUp, Observation, Replace, Restart, StopAll, Supervision
from k3launch.util.locks import locked

GRACE_S = 10.0  # SIGTERM to SIGKILL when a unit restarts
HUNG_GRACE_S = 2.0  # the same for a unit restarted because it hung (a stopped or deadlocked process ignores SIGTERM)
LOCK_WAIT_S = 30.0  # a restart waits this long for another k3launch command on the deployment

EventFn = Callable[[Event], None]
CanaryFn = Callable[[Plan], "list[str] | None"]
"""The correctness canary on a plan: one line per mismatch (target, prompt, expected, got), or
None when there is nothing to compare with (no baseline recorded)."""


@dataclass(frozen=True)
class Places:
    """How a supervisor re-places units off a lost node: cordon it in the inventory, plan again
    (the same selection; cordoned nodes and those other deployments hold are skipped)."""

    cordon: Callable[[str, str], None]  # (node, reason)
    replan: Callable[[], Plan]


# ---------------------------------------------------------------------- the loop
class _Run:
    """One supervisor's watch over one deployment."""

    def __init__(self, rec: DeploymentRecord, store: StateStore, watcher: Watcher, policy: RestartPolicy, on_event: EventFn,
                 hook: str | None, stop: threading.Event, places: Places | None = None, canary: CanaryFn | None = None) -> None:
        self.rec = rec
        self.places = places
        self.store = store
        self.watcher = watcher
        self.policy = policy
        self.on_event = on_event
        self.hook = hook
        self.stop = stop
        self.sup = Supervision(rec.plan, policy, ready_timeout(rec.plan, None))
        self.hooks = ThreadPoolExecutor(max_workers=1) if hook else None
        self.kept: set[str] = set()  # processes whose last log lines are kept already
        self.pending_adds: dict[str, list[tuple[Process, str]]] = {}  # unit -> (router, URL) to add once it serves
        # the canary replays in a thread of its own: a slow engine must not hold up the looks
        self.canary, self.canary_last, self.canary_bad = canary, time.monotonic(), False
        self.canary_job: Future[list[str] | None] | None = None
        self.canaries = ThreadPoolExecutor(max_workers=1) if canary is not None and policy.canary_interval else None

    def stopping(self) -> bool:
        if self.stop.is_set() or stop_path(self.store, self.rec.name).exists():
            self.stop.set()
        return self.stop.is_set()

    def emit(self, events: Sequence[Event]) -> None:
        for e in events:
            if e.kind in ("restarted", "restart-failed") and e.unit and e.timeline is None:
                # the unit's bring-up since its new processes started (a failed one: what it reached)
                e.timeline = self.watcher.restart_timeline(e.unit, e.kind == "restarted", e.time)
            if e.kind == "gave-up" or (e.kind == "failed" and e.unit is None):
                e.reason += f"; last log lines kept in {self.store.logs_dir(self.rec.name)}/"
            eventlog.append(self.store, e)
            self.on_event(e)
            if self.hooks is not None and e.kind != "hook-failed":
                self.hooks.submit(self._hook, e)

    def _hook(self, e: Event) -> None:
        assert self.hook is not None
        why = eventlog.run_hook(self.hook, e)
        if why is not None:
            failed = Event(time=time.time(), kind="hook-failed", deployment=e.deployment, unit=e.unit, reason=f"{why} (event {e.kind})")
            eventlog.append(self.store, failed)
            self.on_event(failed)

    def save(self) -> None:
        cur = self.store.try_load(self.rec.name)
        if cur is None or cur.state == "stopping":
            self.stop.set()  # `down` took over
            return
        self.store.save(self.rec)

    def run(self) -> str:
        while not self.stopping():
            t0 = time.monotonic()
            cur = self.store.try_load(self.rec.name)
            if cur is None or cur.state not in ("ready",):
                return "gone" if cur is None else cur.state
            obs = self.watcher.observe(time.time())
            obs.now = time.time()  # events are stamped when the look saw them, not when it began (a silent node costs seconds)
            events, actions = self.sup.step(obs)
            self.emit(events)
            self._add_workers([e.unit for e in events if e.kind == "restarted" and e.unit])
            for a in actions:
                if self.stopping():
                    break
                if self._guarded(a) == "failed":
                    return "failed"
            self._canary(obs, busy=bool(actions) or any(e.kind != "rerouted" for e in events))
            self.stop.wait(max(0.0, self.policy.poll - (time.monotonic() - t0)))
        return "stopped"

    def _canary(self, obs: Observation, busy: bool) -> None:
        """Collect a finished replay (its mismatches are events), and start the next one every
        ``canary_interval`` while every HTTP process serves and nothing is being restarted."""
        if self.canaries is None or self.canary is None:
            return
        job = self.canary_job
        if job is not None:
            if not job.done():
                return
            self.canary_job, self.canary_last = None, time.monotonic()
            try:
                found = job.result()
            except Exception as exc:  # a bug: said, and the watch goes on
                self.emit([Event(time=time.time(), kind="supervisor-error", deployment=self.rec.name,
                                 reason=f"canary failed: {type(exc).__name__}: {exc}")])
                return
            if found:
                self.emit([Event(time=time.time(), kind="canary-mismatch", deployment=self.rec.name, reason=line) for line in found])
            elif found is not None and self.canary_bad:
                self.emit([Event(time=time.time(), kind="canary-ok", deployment=self.rec.name, reason="every target matches its baseline again")])
            if found is not None:  # None: nothing to compare with (no baseline)
                self.canary_bad = bool(found)
            return
        serving = all(obs.healthy.get(p.id) for p in self.rec.plan.processes if p.http_port) and not obs.dead
        if busy or not serving or time.monotonic() - self.canary_last < self.policy.canary_interval:
            return
        self.canary_job = self.canaries.submit(self.canary, self.rec.plan)

    def _add_workers(self, served: Sequence[str]) -> None:
        for unit in served:
            for router, url in self.pending_adds.pop(unit, []):
                self._reroute(router, [], [url], f"added {url}")

    def _reroute(self, router: Process, remove: Sequence[str], add: Sequence[str], done: str) -> bool:
        """Tell a running router of worker URLs to remove and add; a ``rerouted`` event saying
        ``done``, else a ``supervisor-error`` with the router's words. True when it took."""
        why = self.watcher.reroute(router, remove, add)
        self.emit([Event(time=time.time(), kind="rerouted" if why is None else "supervisor-error", deployment=self.rec.name,
                         unit=router.id, reason=done if why is None else f"router {router.id}: {why}")])
        return why is None

    def _guarded(self, a: Action) -> str:
        """``act``, with an unforeseen error reported as an event: a supervisor that dies leaves
        the deployment unwatched, which is worse than one action not taken."""
        try:
            return self.act(a)
        except K3Error as exc:
            why = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
        except Exception as exc:  # any bug: said, not fatal
            why = f"{type(exc).__name__}: {exc}; report this as a k3launch bug"
        unit = getattr(a, "unit", None)
        self.emit([Event(time=time.time(), kind="supervisor-error", deployment=self.rec.name, unit=unit.name if unit else None,
                         node=getattr(a, "node", None), reason=f"{type(a).__name__.lower()} failed: {why}")])
        return "ok"

    def act(self, a: Action) -> str:
        if isinstance(a, Restart):
            return self._restart(a)
        if isinstance(a, GiveUp):
            self._keep(a.failing)
            self.watcher.stop(a.unit.processes, GRACE_S)
            return "ok"
        if isinstance(a, Replace):
            self._replace(a)
            return "ok"
        if isinstance(a, FtRetry):
            why = self.watcher.ft_retry(a.pool)
            if why is not None:  # not fatal: sent again later, and the recovery timeout falls back to a restart
                self.emit([Event(time=time.time(), kind="supervisor-error", deployment=self.rec.name, unit=a.unit.name,
                                 reason=f"retry: {why}")])
            return "ok"
        return self._stop_all(a)

    def _replace(self, a: Replace) -> None:
        """Cordon the lost node, plan again without it, check the spares, restart what moved."""
        name = self.rec.name
        now = time.time()

        def failed(why: str) -> None:
            self.emit([Event(time=now, kind="replace-failed", deployment=name, node=a.node,
                             reason=f"{why}; waiting for {a.node} to answer again instead")])

        if self.places is None:
            return failed("no inventory to re-plan on (the record names none, or it is gone)")
        try:
            self.places.cordon(a.node, f"lost by the supervisor of {name}: {a.reason}")
        except K3Error as exc:
            return failed(f"could not cordon {a.node}: {exc.message}")
        self.emit([Event(time=now, kind="cordoned", deployment=name, node=a.node,
                         reason=f"kept out of plans until `k3launch uncordon {a.node}`")])
        old = self.rec.plan
        try:
            new = self.places.replan()
        except K3Error as exc:
            return failed(f"no spare node fits: {exc.message}")
        before = {p.id: p for p in old.processes}
        moves = [f"{p.id} {before[p.id].node} -> {p.node}" for p in new.processes if p.id in before and before[p.id].node != p.node]
        if a.node in {p.node for p in new.processes} or not moves:
            return failed("the new plan does not move off the lost node")
        spares = sorted({p.node for p in new.processes if p.id not in before or before[p.id].node != p.node})
        problems = self.watcher.check(new, spares)
        if problems:
            return failed(f"a spare failed the doctor: {problems[0]}")
        # a unit restarts when any of its processes changed: moved, or its argv names a moved peer (a
        # head, a worker URL) -- except a router that only needs other worker URLs: it is told so
        # (no outage for the clients), adding each new URL once its engine serves
        changed = [u for u in units(new) if any(before.get(p.id) != p for p in new.processes if p.id in u.processes)]
        rerouted = [p for p in new.processes if p.id in before and before[p.id] != p and reroutable(before[p.id], p)]
        changed = [u for u in changed if not any(p.id in u.processes for p in rerouted)]
        with self.store.lock(name):
            self.watcher.adopt(new, a.node)
            for r in rerouted:
                gone = [w for w in worker_urls(before[r.id]) if w not in worker_urls(r)]
                self._reroute(r, gone, [], f"removed {', '.join(gone)}")
                for w in worker_urls(r):
                    if w not in worker_urls(before[r.id]):
                        owner = next(u.name for u in units(new) for p in new.processes
                                     if p.id in u.processes and f"//{p.address}:{p.http_port}" in w)
                        self.pending_adds.setdefault(owner, []).append((r, w))
            for u in changed:
                if self.stopping():
                    return None
                bad = self.watcher.restart(u, GRACE_S, lambda: not self.stopping())
                if bad:
                    self.emit([Event(time=time.time(), kind="restart-failed", deployment=name, unit=u.name, process=bad[0].failing,
                                     reason=bad[0].message, log_tail=bad[0].log_tail)])
        self.sup.replaced(new, [u.name for u in changed], time.time())
        self.emit([Event(time=time.time(), kind="replaced", deployment=name, node=a.node,
                         reason=f"{'; '.join(moves)}; restarted: {', '.join(u.name for u in changed)}")])
        return None

    def _out_of_routers(self, unit: Unit) -> None:
        """A unit's engines leave each (regular) router's worker list before it restarts, and come
        back with ``/add_worker`` once it serves (``pending_adds``). Otherwise a head that still
        answers while its group restarts (a TP copy whose other rank died) gets requests until it
        is stopped, then until the router's next health check, and a retry may pick it again: one
        request of 190 failed so. A P/D router cannot add a worker back over HTTP: left alone."""
        if unit.name in self.pending_adds:
            return  # out since an earlier attempt of this restart
        mine = {f"{p.address}:{p.http_port}" for p in self.rec.plan.processes
                if p.id in unit.processes and p.http_port is not None and p.role != "router"}
        for r in self.rec.plan.processes:
            if r.role != "router" or r.id in unit.processes or "--vllm-pd-disaggregation" in r.argv:
                continue
            out = [w for w in worker_urls(r) if w.split("//", 1)[-1].rstrip("/") in mine]
            if out and self._reroute(r, out, [], f"removed {', '.join(out)} while {unit.name} restarts"):
                self.pending_adds.setdefault(unit.name, []).extend((r, w) for w in out)

    def _restart(self, a: Restart) -> str:
        name = self.rec.name
        t_end = time.monotonic() + LOCK_WAIT_S
        self._out_of_routers(a.unit)
        while True:
            try:
                with self.store.lock(name):
                    # a hung engine will not stop on SIGTERM: it gets the SIGKILL sooner
                    grace = HUNG_GRACE_S if a.hung else GRACE_S
                    failed = self.watcher.restart(a.unit, grace, lambda: not self.stopping())
                    if self.rec.supervisor is not None:
                        self.rec.supervisor.restarts += 1
                    self.save()
                break
            except K3Error as exc:
                if exc.code != "deployment-busy" or time.monotonic() > t_end or self.stopping():
                    failed_msg = exc.message
                    events, actions = self.sup.start_failed(a.unit, time.time(), failed_msg)
                    return self._then(events, actions)
                self.stop.wait(1.0)
        if self.stopping():
            return "ok"
        if failed:
            f = failed[0]
            events, actions = self.sup.start_failed(a.unit, time.time(), f.message, f.failing, f.log_tail)
            return self._then(events, actions)
        self.sup.started(a.unit, time.time())
        return "ok"

    def _then(self, events: list[Event], actions: list[Action]) -> str:
        self.emit(events)
        for b in actions:
            if self.stopping():
                return "ok"
            if self._guarded(b) == "failed":
                return "failed"
        if not self.sup.can_serve():
            why = "; ".join(e.reason for e in events if e.kind == "gave-up") or "no unit left to serve"
            self.emit([Event(time=time.time(), kind="failed", deployment=self.rec.name, reason=why)])
            return self._stop_all(StopAll(why))
        return "ok"

    def _keep(self, ids: Sequence[str]) -> None:
        todo = [i for i in ids if i not in self.kept]
        if todo:
            self.watcher.keep_logs(todo)
            self.kept.update(todo)

    def _stop_all(self, a: StopAll) -> str:
        self._keep(self.sup.failing())
        self.watcher.stop_all(GRACE_S)
        self.rec.state = "failed"
        self.rec.error = f"supervisor gave up: {a.reason}; last log lines kept in {self.store.logs_dir(self.rec.name)}/"
        self.store.save(self.rec)  # the teardown above wrote "stopping" itself: not a `down` taking over
        return "failed"

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.shutdown(wait=True)
        if self.canaries is not None:
            self.canaries.shutdown(wait=False, cancel_futures=True)  # a replay in flight ends by its own timeouts


def supervise(name: str, store: StateStore, ops: SuperviseOps, policy: RestartPolicy, *, on_event: EventFn,
              hook: str | None = None, detached: bool = False, stop: threading.Event | None = None, places: Places | None = None,
              canary: CanaryFn | None = None) -> str:
    """Watch ``name`` until stopped: ``"stopped"`` (asked to), ``"failed"`` (gave up: nothing left
    running), ``"gone"`` (taken down), or the state it left ``ready`` for. ``canary``: the
    correctness check replayed every ``policy.canary_interval`` while everything serves."""
    stop = stop or threading.Event()
    sdir = store.supervise_dir()
    try:
        sdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise K3Error("state-dir", f"cannot create {sdir}: {exc.strerror or exc}", "pass --state-dir DIR on a writable filesystem") from None
    rec = store.load(name)
    with locked(lock_path(store, name), wait=False, remove=True) as fd:
        if fd is None:
            raise K3Error("already-supervised", f"{name} is already watched by {who(rec.supervisor)}",
                          "one supervisor per deployment: `k3launch status` shows it; stop it (Ctrl-C, or kill its pid) to start another")
        stop_path(store, name).unlink(missing_ok=True)  # a stale request of an earlier `down`
        if rec.state != "ready":
            raise K3Error("not-ready", f"{name} is {rec.state}: only a ready deployment can be supervised",
                          "wait for `k3launch up` to finish" if rec.state == "starting" else f"`k3launch down {name}`, then `up` again")
        watcher = ops.watcher(rec, store)
        ident = me()
        rec.supervisor = Supervisor(host=ident.host, pid=ident.pid, started=ident.started, since=time.time(), detached=detached, policy=policy)
        run = _Run(rec, store, watcher, policy, on_event, hook, stop, places, canary)
        with store.lock(name):
            run.save()
        run.emit([Event(time=time.time(), kind="watching", deployment=name,
                        reason=f"pid {ident.pid} on {ident.host}; units: {', '.join(u.name for u in run.sup.units)}")])
        outcome = "stopped"
        try:
            outcome = run.run()
        finally:
            run.emit([Event(time=time.time(), kind="stopped-watching", deployment=name, reason=outcome)])
            run.close()
            watcher.close()
            _release(store, name, ident.pid)
        return outcome


def _release(store: StateStore, name: str, pid: int) -> None:
    """Take our name out of the record (unless `down` has it: it deletes the record anyway)."""
    with contextlib.suppress(K3Error):
        with store.lock(name):
            cur = store.try_load(name)
            if cur is not None and cur.supervisor is not None and cur.supervisor.pid == pid and cur.state != "stopping":
                cur.supervisor = None
                store.save(cur)


