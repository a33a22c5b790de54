"""Inside a supervised Slurm job: its steps, and the one controller's hands on them.

:class:`Steps` are the job's ``srun`` steps, one per process, children of the controller
(:mod:`k3launch.deploy.slurm.injob`, which the job script became on the batch host). A step is
started with the words the job script would give ``k3_step`` (:func:`k3launch.render.sbatch.step_words`,
expanded by bash as the script's own bash would: ``"$K3_ADDR_i"``, ``"$HOME"``), its output in
``<log dir>/<process>.log`` (the previous run's kept as ``<process>.log.1``). It is stopped as the
job script stops steps: SIGTERM to its processes through Slurm (``scancel --signal=TERM JOB.STEP``,
not to ``srun``, which would turn it into TERM and KILL at once), SIGKILL the same way after the
grace, then ``srun`` itself.

:class:`JobWatcher` is the :class:`~k3launch.deploy.base.Watcher` of the one controller
(:mod:`k3launch.deploy.control.loop`) over them: one look is which steps ended (their ``srun``'s exit
code, the log's last lines) and one ``/health`` probe per HTTP process from the batch host (the
job's nodes answer it there, as they answer the login node); a router's worker list and vLLM's
fault-tolerance routes are asked the same way (:mod:`k3launch.deploy.routing`). Nodes are Slurm's:
a lost node ends the job, so nothing here is ever unreachable, nothing is re-placed, and a
restart's CPU use is not read (``stall_after`` does not apply: ``start_timeout`` bounds a start).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from k3launch.deploy import routing
from k3launch.deploy.base import own
from k3launch.deploy.slurm.job import tail_file
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.control.observation import Observation
from k3launch.models.phases import Timeline
from k3launch.models.plan import FaultTolerancePool, Plan, Process
from k3launch.models.record import DeploymentRecord, SlurmRecord
from k3launch.models.reports import LaunchFailed, TeardownReport, error_line
from k3launch.models.supervise import Unit
from k3launch.planning.inventory import SlurmSection
from k3launch.render.sbatch import step_words
from k3launch.render.scripts import shell_join
from k3launch.transport import http
from k3launch.transport.http import probe_all, work_all

KEPT_LOG_LINES = 500
KILL_WAIT_S = 5.0  # after SIGKILL through Slurm: then srun itself is killed
SLURM_CMD_TIMEOUT_S = 30.0


def say(message: str, err: bool = False) -> None:
    """One line of the job's output (``slurm-<job>.out``), as the job library's ``k3_say``."""
    print(f"k3launch: {message}", file=sys.stderr if err else sys.stdout, flush=True)


def expand(words: Sequence[str]) -> list[str]:
    """``words`` as the job script's bash expands them (plan addresses are ``"$K3_ADDR_i"``)."""
    r = subprocess.run(["bash", "-c", "set -u; printf '%s\\0' " + shell_join(words)], capture_output=True, timeout=SLURM_CMD_TIMEOUT_S,
                       check=False)
    if r.returncode != 0:
        raise K3Error("step-words", f"bash could not expand a step's words: {r.stderr.decode(errors='replace').strip()[:300]}",
                      "run the controller inside the job script it came with (it binds K3_ADDR_i)")
    return [w.decode() for w in r.stdout.split(b"\0")[:-1]]


def start_order(plan: Plan) -> list[Process]:
    """Engines, then routers, each in plan order (as the job script starts them)."""
    return [p for p in plan.processes if p.role != "router"] + [p for p in plan.processes if p.role == "router"]


@dataclass
class Step:
    proc: subprocess.Popen[bytes]
    node: int
    host: str


class Steps:
    """The job's steps, one per running process (started by this controller)."""

    def __init__(self, log_dir: Path, job_id: str, slurm: SlurmSection, ident: str, hosts: Sequence[str]) -> None:
        self.log_dir, self.job_id, self.slurm, self.ident, self.hosts = log_dir, job_id, slurm, ident, list(hosts)
        self.running: dict[str, Step] = {}
        self.codes: dict[str, int] = {}  # process -> the exit code of its last step that ended

    def where(self, plan: Plan, pid: str) -> str:
        """``NAME on node I (HOST)``, as the job script names a step."""
        proc = next(p for p in plan.processes if p.id == pid)
        i = step_words(plan, proc, self.slurm, self.ident)[0]
        return f"{pid} on node {i} ({self.hosts[i]})"

    def start(self, plan: Plan, ids: Collection[str], keep_previous: bool) -> None:
        """One ``srun`` step per process of ``ids``, in start order (``keep_previous``: the last log becomes ``.log.1``)."""
        for p in start_order(plan):
            if p.id not in ids:
                continue
            i, words = step_words(plan, p, self.slurm, self.ident)
            host = self.hosts[i]
            argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--kill-on-bad-exit=1", f"--job-name={p.id}", "--overlap",
                    *expand(words)]
            log = self.log_dir / f"{p.id}.log"
            if keep_previous and log.exists():
                os.replace(log, log.with_name(log.name + ".1"))
            with open(log, "wb") as out:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            self.running[p.id] = Step(proc, i, host)
            self.codes.pop(p.id, None)
            say(f"started {p.id} on node {i} ({host})")

    def ended(self) -> dict[str, int]:
        """Process -> exit code of every step that ended (and is not started again yet)."""
        for pid, s in self.running.items():
            code = s.proc.poll()
            if code is not None:
                self.codes[pid] = code
        return {pid: self.codes[pid] for pid in self.running if pid in self.codes}

    def stop(self, ids: Collection[str], grace_s: float) -> list[str]:
        """Stop the steps of ``ids`` (TERM through Slurm, KILL after ``grace_s``); the processes stopped."""
        live = {i: self.running[i] for i in ids if i in self.running and self.running[i].proc.poll() is None}
        if live:
            if not self._signal("TERM", live):
                for s in live.values():
                    s.proc.terminate()  # srun forwards it (without Slurm to ask: the step's forced end)
            self._wait(live, grace_s)
            left = {i: s for i, s in live.items() if s.proc.poll() is None}
            if left:
                self._signal("KILL", left)
                self._wait(left, KILL_WAIT_S)
            for s in live.values():
                if s.proc.poll() is None:
                    s.proc.kill()
                s.proc.wait()
        stopped = [i for i in ids if i in self.running]
        for i in stopped:
            del self.running[i]
        return stopped

    @staticmethod
    def _wait(steps: dict[str, Step], limit: float) -> None:
        t_end = time.monotonic() + limit
        while any(s.proc.poll() is None for s in steps.values()) and time.monotonic() < t_end:
            time.sleep(0.1)

    def _signal(self, signal: str, steps: Collection[str]) -> bool:
        """Signal those steps' processes through Slurm (``scancel --signal``); False when Slurm cannot be asked."""
        if not self.job_id:
            return False
        try:
            r = subprocess.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"], capture_output=True, text=True,
                               timeout=SLURM_CMD_TIMEOUT_S, check=False)
            ids = [w[0] for w in (ln.split(" ", 1) for ln in r.stdout.splitlines()) if len(w) == 2 and w[1] in steps
                   and not w[0].endswith((".batch", ".extern"))]
            if r.returncode != 0 or not ids:
                return False
            return subprocess.run(["scancel", f"--signal={signal}", *ids], capture_output=True, timeout=SLURM_CMD_TIMEOUT_S,
                                  check=False).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


class JobWatcher:
    """The one controller's hands on a supervised job's steps (the :class:`~k3launch.deploy.base.Watcher` protocol)."""

    def __init__(self, rec: SlurmRecord, store: StateStore, steps: Steps, probe_timeout: float = 3.0) -> None:
        self.rec, self.store, self.steps, self.probe_timeout = rec, store, steps, probe_timeout
        self.tails: dict[str, str] = {}  # a step that ended -> its log's last lines (read once)

    def observe(self, now: float) -> Observation:
        plan = self.rec.plan
        ended = self.steps.ended()
        dead: dict[str, str] = {}
        for p in plan.processes:
            if p.id in ended:
                if p.id not in self.tails:
                    self.tails[p.id] = tail_file(self.steps.log_dir / f"{p.id}.log", 30)
                # srun's own last words ("srun: error: NODE: task 0: Exited with exit code 1") say less than the engine's
                said = error_line("\n".join(ln for ln in self.tails[p.id].splitlines() if not ln.startswith("srun: ")))
                dead[p.id] = f"exited with code {ended[p.id]}" + (f": {said}" if said else "")
            elif p.id not in self.steps.running:
                dead[p.id] = "is not running (its last start failed)"
        urls = {p.id: f"http://{p.address}:{p.http_port}" for p in plan.processes if p.http_port is not None and p.id not in dead}
        # a router's /health answers 503 while any of its workers is down: its own life is /liveness
        healthy = probe_all(urls, timeout=self.probe_timeout, paths={p.id: "/liveness" for p in plan.processes if p.role == "router"})
        ranks = {pid for f in plan.fault_tolerance for pid in f.processes}
        ft = routing.ft_status(plan, [p for p in plan.processes if p.id in urls], ranks, self.probe_timeout)
        routers = {p.id for p in plan.processes if p.role == "router"}
        work = work_all({pid: urls[pid] for pid, ok in healthy.items() if ok and pid not in routers}, timeout=self.probe_timeout)
        return Observation(now=now, dead=dead, healthy=healthy, tails={p: self.tails[p] for p in dead if p in self.tails}, ft=ft, work=work)

    def restart(self, unit: Unit, grace_s: float, proceed: Callable[[], bool]) -> list[LaunchFailed]:
        """Stop the unit's steps, then (if ``proceed()`` still says so) start them again on the plan it runs now."""
        self.steps.stop(unit.processes, grace_s)
        if not proceed():
            return []  # `down` arrived meanwhile: it wins
        for pid in unit.processes:
            self.tails.pop(pid, None)
        try:
            self.steps.start(self.rec.plan, unit.processes, keep_previous=True)
        except (OSError, K3Error) as exc:
            return [LaunchFailed(f"could not start {unit.name}'s steps: {getattr(exc, 'message', exc)}",
                                 "see the job's output (`k3launch logs NAME`)", unit.processes[0], code="start-failed")]
        return []

    def restart_timeline(self, unit: str, ready: bool, now: float) -> Timeline | None:
        return None  # a restart inside the job is not tracked phase by phase (docs/slurm.md)

    def stop(self, processes: Sequence[str], grace_s: float) -> TeardownReport:
        return TeardownReport(stopped=self.steps.stop(processes, grace_s), verified="the steps ended")

    def stop_all(self, grace_s: float) -> TeardownReport:
        return self.stop([p.id for p in self.rec.plan.processes], grace_s)

    def keep_logs(self, ids: Sequence[str]) -> list[Path]:
        """``<log dir>/control/logs/<deployment>/<process>.log``: the last lines of each of ``ids``."""
        dest = self.store.logs_dir(self.rec.name)
        out = []
        try:
            dest.mkdir(parents=True, exist_ok=True)
            for pid in ids:
                (dest / f"{pid}.log").write_text(tail_file(self.steps.log_dir / f"{pid}.log", KEPT_LOG_LINES), encoding="utf-8")
                out.append(dest / f"{pid}.log")
        except OSError:
            return out
        return out

    def check(self, plan: Plan, nodes: Sequence[str]) -> list[str]:
        return [f"{n}: nodes are not re-placed inside a Slurm job" for n in nodes]

    def ft_retry(self, pool: FaultTolerancePool) -> str | None:
        return routing.ft_retry(self.rec.plan, pool, self.probe_timeout)

    def reroute(self, router: Process, remove: Sequence[str], add: Sequence[str]) -> str | None:
        return routing.reroute(router, remove, add)

    def workers(self, router: Process) -> list[str] | None:
        return http.list_workers(f"http://{router.address}:{router.http_port}", timeout=self.probe_timeout)

    def adopt(self, plan: Plan, lost: str) -> None:
        """Run on ``plan`` from now on (a rollout's target, or a unit's new processes: each restart renders from it)."""
        self.rec.plan = plan
        self.rec.endpoint = plan.endpoint
        self.store.save(self.rec)

    def note(self, change: Callable[[DeploymentRecord], None]) -> None:
        change(self.rec)
        self.store.save(self.rec)

    def close(self) -> None:
        return None


class JobOps:
    """The job's :class:`~k3launch.deploy.base.SuperviseOps`: one watcher over its steps."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps

    def watcher(self, rec: DeploymentRecord, store: StateStore) -> JobWatcher:
        return JobWatcher(own(rec, SlurmRecord), store, self.steps)
