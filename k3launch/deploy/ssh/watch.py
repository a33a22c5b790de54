"""A supervisor's hands on an SSH (or local) deployment: look, restart a unit, stop.

One look is the poll ``up`` uses (one round trip per node: which processes exited, with their
exit codes and last lines; which nodes do not answer — the SSH heartbeat notices a silent host
within its connect timeout) plus one ``/health`` probe per HTTP process, all at once: a probe that
fails or does not answer within ``probe_timeout`` counts toward a hung engine.

A restart stops the unit's processes as ``down`` would (SIGTERM to each process group, SIGKILL
after the grace period: a stopped or hung process dies too), keeps each bare process's previous
log as ``<process>.log.1`` beside the new one, waits for the unit's ports to close, and starts the
processes with the script ``up`` used (:func:`~k3launch.deploy.ssh.launch.start_group`). From that
start until the unit serves again, each look also reads what the unit's logs gained (theirs only,
in the same round trip) and tracks its phases as ``up`` does (:class:`~k3launch.deploy.progress.Restarts`):
the supervisor attaches the timeline to the ``restarted`` (or ``restart-failed``) event.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from k3launch.deploy.progress import Restarts
from k3launch.deploy.routing import ft_retry, ft_status, reroute
from k3launch.deploy.ssh.doctor import doctor
from k3launch.deploy.ssh.launch import start_group, start_steps
from k3launch.deploy.ssh.observe import keep_tails, poll, tail_logs
from k3launch.deploy.ssh.stage import stage
from k3launch.deploy.ssh.teardown import sessions, stop_left_behind, stop_processes, teardown
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.backends import spec as backend_spec
from k3launch.models.control.observation import Observation
from k3launch.models.phases import Timeline
from k3launch.models.plan import FaultTolerancePool, Plan, Process, is_container
from k3launch.models.record import DeploymentRecord, LeftBehind, SshRecord
from k3launch.models.reports import LaunchFailed, TeardownReport, error_line
from k3launch.models.supervise import Unit
from k3launch.render import snippets as remote
from k3launch.transport import http
from k3launch.transport.fleet import Fleet
from k3launch.transport.http import probe_all, work_all
from k3launch.util.polling import poll_until

SILENT_RETRY_S = 5.0  # a silent node is asked again after this, doubling ...
SILENT_RETRY_MAX_S = 60.0  # ... up to this
GRACE_LEFT_S = 5.0  # SIGTERM to SIGKILL for what was left on a lost node: the unit runs elsewhere now
PORTS_FREE_S = 15.0  # after the stop: a port still held then makes the start fail with the engine's own words
KEPT_LOG_LINES = 500


@dataclass
class _Silent:
    """A node that did not answer: asked again only after ``delay`` (a silent host costs a connect
    timeout per try, which would stretch every look of the whole deployment)."""

    why: str
    next_try: float
    delay: float


class SshWatcher:
    """Observe and act on one deployment through one open :class:`Fleet` (kept for the supervisor's
    life; ``connect`` builds it again when a re-placement changes the machines)."""

    def __init__(self, rec: SshRecord, connect: Callable[[SshRecord], Fleet], store: StateStore, probe_timeout: float = 3.0) -> None:
        self.rec = rec
        self.connect = connect
        self.fleet = connect(rec)
        self.store = store
        self.probe_timeout = probe_timeout
        self.silent: dict[str, _Silent] = {}
        self.restarts = Restarts()  # the bring-ups of restarting units

    def _skip(self, now: float) -> dict[str, str]:
        return {n: s.why for n, s in self.silent.items() if now < s.next_try}

    def _heard(self, now: float, asked: set[str], unreachable: Mapping[str, str]) -> None:
        for node in asked:
            if node in unreachable:
                s = self.silent.get(node)
                delay = min(SILENT_RETRY_MAX_S, s.delay * 2) if s else SILENT_RETRY_S
                self.silent[node] = _Silent(unreachable[node], now + delay, delay)
            else:
                self.silent.pop(node, None)

    def observe(self, now: float) -> Observation:
        rec = self.rec
        skip = self._skip(time.monotonic())
        reading = self.restarts.reading()
        pl = poll(rec, self.fleet, skip=skip, cursor=self.restarts.cursor if reading else None, logs_of=reading)
        self._heard(time.monotonic(), {p.node for p in rec.processes.values()} - set(skip), pl.unreachable)
        dead: dict[str, str] = {}
        for pid in pl.dead:
            code = pl.codes.get(pid, "?")
            said = error_line(pl.tails.get(pid, ""))
            dead[pid] = ("exited" if code == "?" else f"exited with code {code}") + (f": {said}" if said else "")
        for p in rec.plan.processes:
            if p.id not in rec.processes and p.node not in pl.unreachable:
                dead.setdefault(p.id, "is not running (its last start failed)")
        urls = {p.id: f"http://{p.address}:{p.http_port}" for p in rec.plan.processes
                if p.http_port is not None and p.id not in dead and p.node not in pl.unreachable}
        # a router's /health answers 503 while any of its workers is down: its own life is /liveness
        routers = {p.id: "/liveness" for p in rec.plan.processes if p.role == "router"}
        healthy = probe_all(urls, timeout=self.probe_timeout, paths=routers)
        if reading:
            self.restarts.update(pl.logs, [pid for pid, ok in healthy.items() if ok])
        ft = self._ft_status([p for p in rec.plan.processes if p.id in urls], {pid for f in rec.plan.fault_tolerance for pid in f.processes})
        reclaimed = self._reclaim()
        unreachable = {**self._still_silent(), **pl.unreachable}
        # only while an engine does not serve (a restart is starting): nothing extra while all is well
        cpu = self._session_cpu(set(dead), set(unreachable)) if not all(healthy.values()) else {}
        # what each engine that answers holds and has generated: an engine up but not serving
        work = work_all({pid: urls[pid] for pid, ok in healthy.items() if ok and pid not in routers}, timeout=self.probe_timeout)
        return Observation(now=now, dead=dead, unreachable=unreachable, healthy=healthy, tails=dict(pl.tails), reclaimed=reclaimed, ft=ft,
                           cpu=cpu, work=work)

    def _session_cpu(self, dead: set[str], silent: set[str]) -> dict[str, tuple[int, str]]:
        """Process id -> (CPU ticks of its session, the leader's state) of every live bare process."""
        by_node = {n: s for n, s in sessions(self.rec.processes, set(self.rec.processes) - dead).items() if n not in silent}
        got = self.fleet.run_many({n: remote.session_cpu(s) for n, s in by_node.items()}, timeout=10) if by_node else {}
        out: dict[str, tuple[int, str]] = {}
        for node, o in got.items():
            if not isinstance(o, K3Error) and o.exit_code == 0:
                for sid, seen in remote.parse_session_cpu(o.stdout).items():
                    if sid in by_node[node]:
                        out[by_node[node][sid]] = seen
        return out

    # ------------------------------------------------------------------ vLLM's fault tolerance
    def _ft_status(self, procs: Sequence[Process], ranks: set[str]) -> dict[str, str]:
        return ft_status(self.rec.plan, procs, ranks, self.probe_timeout)

    def ft_retry(self, pool: FaultTolerancePool) -> str | None:
        """POST ``retry`` to every rank of ``pool`` at once (recovery completes only when every rank got it)."""
        return ft_retry(self.rec.plan, pool, self.probe_timeout)

    # ------------------------------------------------------------------ lost nodes
    def _reclaim(self) -> dict[str, list[str]]:
        """Stop what a re-placement left on a node that answers again (tried with the silent
        nodes' backoff); node -> the processes stopped there."""
        rec = self.rec
        out: dict[str, list[str]] = {}
        t = time.monotonic()
        for node, lb in list(rec.left_behind.items()):
            if node in self._skip(t):
                continue
            report = TeardownReport()
            ids = sorted(lb.processes)
            stop_left_behind(rec, self.fleet, node, GRACE_LEFT_S, report)
            self._heard(time.monotonic(), {node}, report.unreachable)
            if not report.unreachable:
                del rec.left_behind[node]
                self.store.save(rec)
                out[node] = ids
        return out

    def _still_silent(self) -> dict[str, str]:
        """Left-behind nodes not heard from: still unreachable as far as a look can tell."""
        return {n: self.silent[n].why for n in self.rec.left_behind if n in self.silent}

    def adopt(self, plan: Plan, lost: str) -> None:
        """Run on ``plan`` from now on (a re-placement): processes that moved off ``lost`` are kept
        as left behind there (stopped when it answers again, else by ``down``); the fleet is rebuilt."""
        rec = self.rec
        moved = {pid: pr for pid, pr in rec.processes.items() if pr.node == lost}
        if moved:
            held = rec.left_behind.get(lost)
            host = next(h for h in rec.hosts() if h.name == lost)
            rec.left_behind[lost] = LeftBehind(host=host, processes={**(held.processes if held else {}), **moved},
                                               since=held.since if held else time.time())
            for pid in moved:
                del rec.processes[pid]
        rec.plan = plan
        rec.endpoint = plan.endpoint
        self.store.save(rec)
        self.fleet.close()
        self.fleet = self.connect(rec)

    def note(self, change: Callable[[DeploymentRecord], None]) -> None:
        change(self.rec)
        self.store.save(self.rec)

    def reroute(self, router: Process, remove: Sequence[str], add: Sequence[str]) -> str | None:
        return reroute(router, remove, add)

    def workers(self, router: Process) -> list[str] | None:
        return http.list_workers(f"http://{router.address}:{router.http_port}", timeout=self.probe_timeout)

    def check(self, plan: Plan, nodes: Sequence[str]) -> list[str]:
        """The doctor's failures on ``nodes`` for the processes ``plan`` puts there (spares about to be used);
        with staged weights, the copy onto them first (its failure is the one problem then)."""
        sub = plan.model_copy(update={"hosts": [h for h in plan.hosts if h.name in nodes],
                                      "processes": [p for p in plan.processes if p.node in nodes],
                                      "ports": [u for u in plan.ports if u.node in nodes]})
        live = [r.name for r in self.store.list() if r.name != self.rec.name]
        with self.connect(self.rec.model_copy(update={"plan": sub, "left_behind": {}})) as fleet:  # the spares are not in our fleet yet
            if sub.stage is not None:  # their engines read a node-local copy too, as `up` made it: first
                try:
                    stage(sub, fleet, lambda _stage, _message: None)
                except K3Error as exc:
                    return [exc.message]
            report = doctor(sub, fleet, live)
        # every node of a this-machine backend is this machine: the deployment's own running
        # engines are seen from the spares too, and are not leftovers there
        ours = backend_spec(self.rec.backend).this_machine
        return [f"{c.node}: {c.name}: {c.detail}" for c in report.checks if c.status == "fail"
                and not (ours and c.name == "leftovers" and c.detail == f"engines of {self.rec.name} still run")]

    def restart(self, unit: Unit, grace_s: float, proceed: Callable[[], bool]) -> list[LaunchFailed]:
        """Stop the unit, then — if ``proceed()`` still says so — start it as ``up`` did (engines,
        then a router); the record is saved."""
        rec = self.rec
        report = TeardownReport()
        stop_processes(rec, self.fleet, unit.processes, grace_s, report)
        if report.unreachable:
            node, why = next(iter(sorted(report.unreachable.items())))
            return [LaunchFailed(f"could not stop {unit.name}: {why}", "the node must answer before its processes can restart",
                                 code="node-unreachable", node=node)]
        self._keep_previous_logs(unit)
        # a killed engine's shared memory stays in /dev/shm (hundreds of MB a time, restart after restart)
        self.fleet.run_many({n: remote.STALE_SHM for n in unit.nodes}, timeout=20)
        for pid in unit.processes:
            rec.processes.pop(pid, None)
        self.store.save(rec)
        if not proceed():
            return []  # `down` arrived meanwhile: it wins
        self._wait_ports(unit)
        procs = [p for p in rec.plan.processes if p.id in unit.processes]
        self.restarts.start(unit.name, rec.plan, unit.processes)
        failed: list[LaunchFailed] = []
        for group in start_steps(rec.plan):
            mine = [p for p in group if p in procs]
            if mine:
                started, bad = start_group(rec.plan, self.fleet, mine, rec.hf_token_file, ident=rec.deployment_id)
                rec.processes.update(started)
                failed += bad
        self.store.save(rec)
        return failed

    def restart_timeline(self, unit: str, ready: bool, now: float) -> Timeline | None:
        """``unit``'s last restart, phase by phase, until ``now`` (None: none tracked); its tracking ends."""
        return self.restarts.timeline(unit, ready, now)

    def _keep_previous_logs(self, unit: Unit) -> None:
        """The log of the run that failed, kept beside the new one (the start truncates ``<process>.log``)."""
        cmds: dict[str, list[str]] = {}
        for p in self.rec.plan.processes:
            pr = self.rec.processes.get(p.id)
            log = pr.log if pr is not None else ""
            if p.id in unit.processes and log and not is_container(pr.runtime if pr else ""):
                cmds.setdefault(p.node, []).append(f"mv -f {remote.path_word(log)} {remote.path_word(log + '.1')} 2>/dev/null || true")
        if cmds:
            self.fleet.run_many({n: "\n".join(c) for n, c in cmds.items()}, timeout=20)

    def _wait_ports(self, unit: Unit) -> None:
        uses = [u for u in self.rec.plan.ports if u.process in unit.processes]
        nodes = sorted({u.node for u in uses})
        if not nodes:
            return

        def busy() -> list[str]:
            got = self.fleet.run_many({n: remote.LISTENING for n in nodes}, timeout=10)
            out = []
            for u in uses:
                o = got.get(u.node)
                if o is not None and not isinstance(o, K3Error) and remote.port_busy(remote.parse_listening(o.stdout), u.address, u.port):
                    out.append(f"{u.address}:{u.port}")
            return out

        poll_until(busy, lambda b: not b, timeout=PORTS_FREE_S, interval=0.25)

    def stop(self, processes: Sequence[str], grace_s: float) -> TeardownReport:
        report = TeardownReport()
        self.restarts.drop(processes)
        stop_processes(self.rec, self.fleet, processes, grace_s, report)
        return report

    def stop_all(self, grace_s: float) -> TeardownReport:
        """Everything stopped and verified, as ``down`` does; the record stays (state set by the caller)."""
        return teardown(self.rec, self.fleet, self.store, grace_s=grace_s)

    def keep_logs(self, ids: Sequence[str]) -> list[Path]:
        """``<state-dir>/logs/<deployment>/<process>.log``: the last lines of each of ``ids``."""
        started = [i for i in ids if i in self.rec.processes]
        texts = tail_logs(self.rec, self.fleet, started, KEPT_LOG_LINES) if started else {}
        return keep_tails(self.store.logs_dir(self.rec.name), texts)

    def close(self) -> None:
        self.fleet.close()
