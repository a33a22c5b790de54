"""``k3launch supervise``: keep a deployment serving until it is taken down.

The loop (every ``poll`` seconds): one look through the backend's :class:`~k3launch.deploy.base.Watcher`,
the decisions of :class:`~k3launch.models.control.decisions.Supervision` (pure), then its actions —
restart a unit, give a unit up, re-place a lost node's units (:class:`Places`), send vLLM's
fault-tolerance ``retry``, or stop everything — and every event appended to the
deployment's event log (:mod:`k3launch.deploy.eventlog`; ``restarted`` and ``restart-failed``
carry the unit's restart timeline, phase by phase, when the watcher tracked it) and handed to ``on_event`` and the
``--on-event`` command (on a thread of its own: a slow hook never delays a detection).

One supervisor per deployment: it holds ``<state>/supervise/NAME.lock`` while it runs (a second
one is refused) and names itself in the record (``supervisor``: host, pid, since, restarts), so
``status`` shows it. It watches, it never owns: stopping it (Ctrl-C, SIGTERM) leaves the
deployment as it is. ``down`` stops it first (:func:`k3launch.deploy.control.process.stop`: a stop
request file any login node sharing the state directory sees, and SIGTERM when on this host), so it never revives what
``down`` is stopping; a request that arrives during a restart is honoured before the unit's
start, and the restart's processes, if any started, are ``down``'s to stop.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from k3launch.deploy import eventlog
from k3launch.deploy.base import SuperviseOps, Watcher
from k3launch.deploy.control.actor import GRACE_S, Actor, Places
from k3launch.deploy.control.exporter import Exporter
from k3launch.deploy.control.process import already_supervised, lock_path, read_spec, refuse_not_ready, stop_path
from k3launch.deploy.readiness import ready_timeout
from k3launch.deploy.rollout import Gate as GateFn
from k3launch.deploy.rollout import running_requests
from k3launch.deploy.state import StateStore, me
from k3launch.errors import K3Error
from k3launch.models.control.actions import Gate, StopAll
from k3launch.models.control.converge import url
from k3launch.models.control.decisions import Supervision
from k3launch.models.control.memory import ControlMemory, UnitState
from k3launch.models.control.observation import Observation
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord, Supervisor
from k3launch.models.rollout import RolloutState
from k3launch.models.supervise import Event, RestartPolicy
from k3launch.render.controller_metrics import Seen, families
from k3launch.util.locks import locked

__all__ = ["CanaryFn", "EventFn", "GateFor", "Places", "supervise"]

EventFn = Callable[[Event], None]
CanaryFn = Callable[[Plan, "Collection[str] | None"], "list[str] | None"]
"""The correctness canary on a plan's targets (None: all; else the targets of these processes and
the router): one line per mismatch (target, prompt, expected, got), or None when there is nothing
to compare with (no baseline recorded)."""
GateFor = Callable[[RolloutState], "GateFn | None"]
"""A rollout's gate beyond health and a completion (the canary), made from the rollout's own settings."""


# ---------------------------------------------------------------------- the loop
class _Run:
    """One controller's watch over one deployment."""

    def __init__(self, rec: DeploymentRecord, store: StateStore, watcher: Watcher, policy: RestartPolicy, on_event: EventFn,
                 hook: str | None, stop: threading.Event, places: Places | None = None, canary: CanaryFn | None = None,
                 gate_for: GateFor | None = None, until_converged: bool = False, exporter: Exporter | None = None) -> None:
        self.rec = rec
        self.exporter = exporter
        self.memory: ControlMemory | None = None  # the memory as the last persist() dumped it
        self.canary_seen: tuple[bool, float] | None = None  # the last replay's outcome, for the metrics
        self.places = places
        self.store = store
        self.watcher = watcher
        self.policy = policy
        self.on_event = on_event
        self.hook = hook
        self.stop = stop
        self.gate_for_ = gate_for
        self.until_converged = until_converged
        self.sup = Supervision(rec.plan, policy, ready_timeout(rec.plan, None))
        self.sup.rollout = rec.rollout
        saved = rec.control
        if saved is not None:  # a controller before this one: its memory goes on (restart counts, windows, rolls)
            self.sup.restore(saved, time.time())
        self.revision = saved.revision if saved is not None else 0
        self.finished = saved.finished if saved is not None else None
        self.actor = Actor(self)
        self.saved = ""
        self.hooks = ThreadPoolExecutor(max_workers=1) if hook else None
        self.kept: set[str] = set()  # processes whose last log lines are kept already
        # the canary replays in a thread of its own: a slow engine must not hold up the looks
        self.canary, self.canary_last, self.canary_bad = canary, time.monotonic(), False
        self.canary_job: Future[list[str] | None] | None = None
        self.canaries = ThreadPoolExecutor(max_workers=1) if canary is not None and policy.canary_interval else None

    def stopping(self) -> bool:
        if self.stop.is_set() or stop_path(self.store, self.rec.name).exists():
            self.stop.set()
        return self.stop.is_set()

    def wait(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def gate_for(self, ro: RolloutState) -> GateFn | None:
        return self.gate_for_(ro) if self.gate_for_ is not None and ro.canary else None

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

    # ------------------------------------------------------------------ the spec and the memory
    def adopt_spec(self) -> None:
        """A spec revision newer than the one adopted: its policy, and the rollout (new, continued
        or rolled back) when that revision brought it."""
        spec = read_spec(self.store, self.rec.name)
        if spec is None:
            return
        self.sup.copies_wanted, self.sup.standby_wanted = spec.replicas, spec.standby  # a scale converges from any look
        if spec.revision <= self.revision:
            return
        self.revision = spec.revision
        if spec.rollout is not None and spec.rollout.revision == spec.revision:
            self.sup.rollout = spec.rollout.model_copy(deep=True)
            self.finished = None
        if spec.policy is not None and spec.policy != self.policy:
            self.policy = self.sup.policy = spec.policy

    def busy(self) -> bool:
        """A roll is under way (a unit between leaving its router and its gate, or a surge)."""
        return self.sup.surging or self.sup.resizing or any(self.sup.memory[u.name].to for u in self.sup.units)

    def settle(self) -> None:
        """A rollout every unit of which runs its target plan: that plan, whole, runs from now on."""
        ro = self.sup.rollout
        if ro is not None and ro.surge and ro.stopped and not ro.rolled() and not self.busy():
            self.sup.rollout, self.finished = None, ro  # a failed surge left the old engines as they were: nothing to continue
            return
        if ro is None or self.busy() or not ro.done():
            return
        target = ro.old if ro.back else ro.new
        with contextlib.suppress(K3Error), self.store.lock(self.rec.name):
            self.watcher.adopt(target, "")  # its origin too: the next rollout plans from it
            self.sup.plan = target
        self.sup.rollout, self.finished = None, ro
        rolled = [u.name for u in ro.units]
        self.emit([Event(time=time.time(), kind="rollout-done", deployment=self.rec.name,
                         reason=f"{' '.join(ro.changes)}{' rolled back' if ro.back else ''}: {', '.join(rolled)}")])

    def persist(self) -> None:
        """The memory and the rollout's progress into the record, when they changed."""
        mem = self.memory = self.sup.dump(self.revision)
        mem.finished = self.finished
        ro = self.sup.rollout
        blob = json.dumps([mem.model_dump(mode="json"), ro.model_dump(mode="json") if ro is not None else None], sort_keys=True)
        if blob == self.saved:
            return

        def change(r: DeploymentRecord) -> None:
            r.control, r.rollout = mem, ro

        self.watcher.note(change)
        self.saved = blob

    def converged(self) -> bool:
        """Nothing left to converge to: no rollout (or one stopped with no unit between two steps),
        and the copies and standbys as the spec wants them, every unit serving."""
        ro = self.sup.rollout
        return not self.busy() and (ro is None or bool(ro.stopped)) and self.sup.scaled()

    # ------------------------------------------------------------------ one look
    def look(self) -> Observation:
        obs = self.watcher.observe(time.time())
        obs.now = time.time()  # events are stamped when the look saw them, not when it began (a silent node costs seconds)
        if not obs.routers:  # each regular router's worker list: membership is observed, not remembered
            self.listed(obs)
        draining = [p for u in self.sup.units if self.sup.state(u.name) is UnitState.DRAINING
                    for p in self.rec.plan.processes if p.id in u.http]
        if draining and not obs.running:
            obs.running = {p.id: running_requests(url(p)) for p in draining}
        return obs

    def listed(self, obs: Observation) -> None:
        got = {r.id: self.watcher.workers(r) for r in self.sup.routers() if obs.healthy.get(r.id)}
        obs.routers = {rid: tuple(urls) if urls is not None else None for rid, urls in got.items()}

    def rejoin(self, obs: Observation) -> None:
        """A unit that passed its gate in this look is back in its router now, not a poll later."""
        self.listed(obs)
        for a in self.sup.routes(obs):
            self.actor.guarded(a)

    def run(self) -> str:
        while not self.stopping():
            t0 = time.monotonic()
            cur = self.store.try_load(self.rec.name)
            if cur is None or cur.state not in ("ready",):
                return "gone" if cur is None else cur.state
            self.adopt_spec()
            obs = self.look()
            events, actions = self.sup.step(obs)
            self.persist()  # before acting: a controller killed mid-action is followed by one that knows what was decided
            self.emit(events)
            for a in actions:
                if self.stopping():
                    break
                if self.actor.guarded(a) == "failed":
                    return "failed"
            if any(isinstance(a, Gate) for a in actions) and not self.stopping():
                self.rejoin(obs)
            self.settle()
            self.persist()
            self.export(obs, acted=bool(actions))
            if self.until_converged and self.converged() and not actions:  # a look with nothing to do: the routers list every serving unit too
                return "converged"
            self._canary(busy=bool(actions) or any(e.kind != "rerouted" for e in events))
            self.stop.wait(max(0.0, self.policy.poll - (time.monotonic() - t0)))
        return "stopped"

    def export(self, obs: Observation, acted: bool) -> None:
        """The metrics a scrape sees until the next look (docs/monitoring.md); after actions, the
        routers' lists as they are now (an action may have added or removed a worker)."""
        if self.exporter is not None:
            if acted and obs.routers:
                self.listed(obs)
            seen = Seen(time=obs.now, out_of_router=self.sup.unlisted(obs), canary=self.canary_seen)
            self.exporter.update(families(self.rec, self.memory, self.sup.rollout, seen))

    def _canary(self, busy: bool) -> None:
        """Collect a finished replay (its mismatches are events), and start the next one every
        ``canary_interval`` on every unit that serves, while nothing is being changed: a degraded
        deployment is watched for correctness too (its serving units, and the router)."""
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
                self.canary_seen = (not found, time.time())
            return
        serving = [p for u in self.sup.units if self.sup.state(u.name) is UnitState.SERVING for p in u.processes]
        if busy or self.busy() or not serving or time.monotonic() - self.canary_last < self.policy.canary_interval:
            return
        every = len(serving) == len(self.rec.plan.processes)
        self.canary_job = self.canaries.submit(self.canary, self.rec.plan, None if every else serving)

    def keep(self, ids: Sequence[str]) -> None:
        todo = [i for i in ids if i not in self.kept]
        if todo:
            self.watcher.keep_logs(todo)
            self.kept.update(todo)

    def stop_all(self, a: StopAll) -> str:
        self.keep(self.sup.failing())
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
              canary: CanaryFn | None = None, gate_for: GateFor | None = None, until_converged: bool = False,
              metrics_listen: str | None = None) -> str:
    """Watch ``name`` until stopped: ``"stopped"`` (asked to), ``"failed"`` (gave up: nothing left
    running), ``"gone"`` (taken down), ``"converged"`` (``until_converged``: the spec's rollout is
    done or stopped), or the state it left ``ready`` for. ``canary``: the correctness check
    replayed every ``policy.canary_interval`` on every serving unit; ``gate_for``: a rollout's
    gate beyond health and a completion; ``metrics_listen``: ADDRESS:PORT to serve k3launch's
    metrics on while it watches (None: none)."""
    stop = stop or threading.Event()
    sdir = store.supervise_dir()
    try:
        sdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise K3Error("state-dir", f"cannot create {sdir}: {exc.strerror or exc}", "pass --state-dir DIR on a writable filesystem") from None
    rec = store.load(name)
    with locked(lock_path(store, name), wait=False, remove=True) as fd:
        if fd is None:
            raise already_supervised(rec)
        stop_path(store, name).unlink(missing_ok=True)  # a stale request of an earlier `down`
        refuse_not_ready(rec)
        watcher = ops.watcher(rec, store)
        ident = me()
        exporter = Exporter(metrics_listen) if metrics_listen else None
        rec.supervisor = Supervisor(host=ident.host, pid=ident.pid, started=ident.started, since=time.time(), detached=detached, policy=policy,
                                    metrics=exporter.address if exporter else "")
        run = _Run(rec, store, watcher, policy, on_event, hook, stop, places, canary, gate_for, until_converged, exporter)
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
            if exporter is not None:
                exporter.close()
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


