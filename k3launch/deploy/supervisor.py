"""``k3launch supervise``: keep a deployment serving until it is taken down.

The loop (every ``poll`` seconds): one look through the backend's :class:`~k3launch.deploy.base.Watcher`,
the decisions of :class:`~k3launch.models.supervise.Supervision` (pure), then its actions —
restart a unit, give a unit up, or stop everything — and every event appended to the
deployment's event log (:mod:`k3launch.deploy.eventlog`) and handed to ``on_event`` and the
``--on-event`` command (on a thread of its own: a slow hook never delays a detection).

One supervisor per deployment: it holds ``<state>/supervise/NAME.lock`` while it runs (a second
one is refused) and names itself in the record (``supervisor``: host, pid, since, restarts), so
``status`` shows it. It watches, it never owns: stopping it (Ctrl-C, SIGTERM) leaves the
deployment as it is. ``down`` stops it first (:func:`stop`: a stop request file any login node
sharing the state directory sees, and SIGTERM when on this host), so it never revives what
``down`` is stopping; a request that arrives during a restart is honoured before the unit's
start, and the restart's processes, if any started, are ``down``'s to stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from k3launch.deploy import eventlog
from k3launch.deploy.base import SuperviseOps, Watcher
from k3launch.deploy.readiness import ready_timeout
from k3launch.deploy.state import StateStore, _start_time, me
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord, Supervisor
from k3launch.models.supervise import Action, Event, GiveUp, Replace, Restart, RestartPolicy, StopAll, Supervision, units
from k3launch.util.locks import held, locked

GRACE_S = 10.0  # SIGTERM to SIGKILL when a unit restarts
HUNG_GRACE_S = 2.0  # the same for a unit restarted because it hung (a stopped or deadlocked process ignores SIGTERM)
STOP_WAIT_S = 60.0  # how long `down` waits for a supervisor mid-restart before SIGKILL
LOCK_WAIT_S = 30.0  # a restart waits this long for another k3launch command on the deployment
DETACH_WAIT_S = 30.0  # a detached supervisor must have named itself in the record by then

EventFn = Callable[[Event], None]


@dataclass(frozen=True)
class Places:
    """How a supervisor re-places units off a lost node: cordon it in the inventory, plan again
    (the same selection; cordoned nodes and those other deployments hold are skipped)."""

    cordon: Callable[[str, str], None]  # (node, reason)
    replan: Callable[[], Plan]


def lock_path(store: StateStore, name: str) -> Path:
    return store.supervise_dir() / f"{name}.lock"


def stop_path(store: StateStore, name: str) -> Path:
    return store.supervise_dir() / f"{name}.stop"


def log_path(store: StateStore, name: str) -> Path:
    return store.supervise_dir() / f"{name}.log"


def who(info: Supervisor | None) -> str:
    if info is None:
        return "a supervisor"
    return f"the supervisor (pid {info.pid} on {info.host}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info.since))})"


def alive(info: Supervisor) -> bool:
    """Whether ``info``'s process still runs (only knowable on its own host: elsewhere, assume so)."""
    return info.host != socket.gethostname() or _start_time(info.pid) == info.started


# ---------------------------------------------------------------------- the loop
class _Run:
    """One supervisor's watch over one deployment."""

    def __init__(self, rec: DeploymentRecord, store: StateStore, watcher: Watcher, policy: RestartPolicy, on_event: EventFn,
                 hook: str | None, stop: threading.Event, places: Places | None = None) -> None:
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

    def stopping(self) -> bool:
        if self.stop.is_set() or stop_path(self.store, self.rec.name).exists():
            self.stop.set()
        return self.stop.is_set()

    def emit(self, events: Sequence[Event]) -> None:
        for e in events:
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
            events, actions = self.sup.step(self.watcher.observe(time.time()))
            self.emit(events)
            for a in actions:
                if self.stopping():
                    break
                if self.act(a) == "failed":
                    return "failed"
            self.stop.wait(max(0.0, self.policy.poll - (time.monotonic() - t0)))
        return "stopped"

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
        # a unit restarts when any of its processes changed: moved, or its argv names a moved peer (a head, a worker URL)
        changed = [u for u in units(new) if any(before.get(p.id) != p for p in new.processes if p.id in u.processes)]
        with self.store.lock(name):
            self.watcher.adopt(new, a.node)
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

    def _restart(self, a: Restart) -> str:
        name = self.rec.name
        t_end = time.monotonic() + LOCK_WAIT_S
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
            if self.act(b) == "failed":
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


def supervise(name: str, store: StateStore, ops: SuperviseOps, policy: RestartPolicy, *, on_event: EventFn,
              hook: str | None = None, detached: bool = False, stop: threading.Event | None = None, places: Places | None = None) -> str:
    """Watch ``name`` until stopped: ``"stopped"`` (asked to), ``"failed"`` (gave up: nothing left
    running), ``"gone"`` (taken down), or the state it left ``ready`` for."""
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
        run = _Run(rec, store, watcher, policy, on_event, hook, stop, places)
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


# ---------------------------------------------------------------------- around it
def stop(store: StateStore, name: str, wait_s: float = STOP_WAIT_S) -> str | None:
    """Stop ``name``'s supervisor, if one runs (``down`` calls this first); a note saying so, or None."""
    lock = lock_path(store, name)
    if not held(lock):
        stop_path(store, name).unlink(missing_ok=True)
        return None
    rec = store.try_load(name)
    info = rec.supervisor if rec is not None else None
    path = stop_path(store, name)
    with contextlib.suppress(OSError):
        path.touch()
    # a supervisor on this host gets SIGTERM too; one in this very process (a library caller's
    # thread) sees the stop request at its next look
    here = info is not None and info.host == socket.gethostname() and info.pid != os.getpid() and alive(info)
    if here and info is not None:
        with contextlib.suppress(OSError):
            os.kill(info.pid, signal.SIGTERM)
    t_end = time.monotonic() + wait_s
    while held(lock) and time.monotonic() < t_end:
        time.sleep(0.1)
    if held(lock) and here and info is not None:
        with contextlib.suppress(OSError):
            os.kill(info.pid, signal.SIGKILL)
        time.sleep(0.5)
    if held(lock):
        raise K3Error("supervisor-running", f"{who(info)} of {name} did not stop within {wait_s:g}s",
                      f"stop it where it runs (kill {info.pid} on {info.host})" if info else "stop it, then run the command again")
    path.unlink(missing_ok=True)
    return f"stopped {who(info)}"


def detach(store: StateStore, name: str, args: Sequence[str]) -> Supervisor:
    """Start ``k3launch supervise NAME ARGS`` in the background (its own session, output in
    ``<state>/supervise/NAME.log``) and return once it named itself in the record."""
    sdir = store.supervise_dir()
    try:
        sdir.mkdir(parents=True, exist_ok=True)
        out = open(log_path(store, name), "ab")
    except OSError as exc:
        raise K3Error("state-dir", f"cannot write {log_path(store, name)}: {exc.strerror or exc}", "pass --state-dir DIR") from None
    cmd = [sys.executable, "-m", "k3launch", "supervise", name, "--state-dir", str(store.root), "--as-detached", *args]
    with out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    t_end = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < t_end:
        rec = store.try_load(name)
        if rec is not None and rec.supervisor is not None and rec.supervisor.pid == proc.pid:
            return rec.supervisor
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    said = _last_line(log_path(store, name))
    raise K3Error("supervise-failed", f"the detached supervisor of {name} did not start" + (f": {said}" if said else ""),
                  f"run `k3launch supervise {name}` in the foreground to see why")


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""
