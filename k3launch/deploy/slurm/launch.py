"""The Slurm backend of ``up``/``status``/``logs``/``down``: one sbatch job per deployment.

``up`` writes the job script (:mod:`k3launch.render.sbatch`) to the deployment's log directory,
submits it, and watches the job from the login node, stage by stage: ``submit`` → ``queued``
(Slurm's pending reason) → ``running`` (the hosts the job bound, read from its output) →
``doctor`` (the job's own pre-flight step passed on every node) → ``alive`` (one running step
per process) → ``health`` (every HTTP endpoint answers ``/health``) → ``completion`` (one real
completion through the public endpoint) → ``ready``. The readiness deadline counts from the
moment the job runs; the time in the queue is bounded separately (``queue_timeout``).

Fail fast: the job script ends the job when any step exits; ``up`` sees the job leave RUNNING
within one poll and reports the process and node the job named, with that process's last log
lines. A node the job's doctor step refuses (GPUs not visible, engine missing, a planned port
taken) is recorded in ``<state dir>/slurm-bad-nodes.json`` and the job is submitted again
without it (``max_attempts``); recorded doctor failures are excluded automatically from later
submissions for a day. Nodes where a rank died are recorded too (shown, not excluded).

The log directory must be on a filesystem the login node shares with the compute nodes (home
directories usually are): ``up`` reads the job's output there, ``logs`` reads the process logs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k3launch.deploy.slurm.client import NEVER_RUNS, JobInfo, SlurmClient
from k3launch.deploy.slurm.job import JobOutput, bad_nodes, bind_plan, parse_output, read_file, record_bad_node, tail_file
from k3launch.deploy.slurm.ops import cancel_job
from k3launch.deploy.ssh.launch import LaunchFailed, Readiness, rank_label, ready_timeout
from k3launch.deploy.ssh.observe import PEER_LOSS
from k3launch.deploy.state import DeploymentRecord, ProcessRecord, SlurmJob, StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.planning.inventory import Inventory
from k3launch.render.sbatch import make_sbatch_string, node_order
from k3launch.transport import http as health

POLL_S = 0.5
SLURM_UNAVAILABLE_S = 60.0  # squeue failing this long (slurmctld down or unreachable) fails up
OUTPUT_VISIBLE_S = 90.0  # NFS caches a missing file's absence for up to 60 s (acdirmax)
DEFAULT_MAX_ATTEMPTS = 2


def poll_interval(elapsed_s: float) -> float:
    """0.5 s for the first minute, then 2 s, then 5 s after ten: a K3 load takes tens of minutes,
    and every poll is an RPC to slurmctld, which the whole cluster shares."""
    return POLL_S if elapsed_s < 60 else 2.0 if elapsed_s < 600 else 5.0


StageFn = Callable[[str, str], None]


# What may stand in an `#SBATCH --output=` path: sbatch's directive parser cuts at white space,
# quotes and '#', and Slurm expands '%' patterns in file names.
_SAFE_PATH = re.compile(r"[A-Za-z0-9._/+,:@=~-]+")


def log_dir_for(store: StateStore, inv: Inventory, name: str) -> str:
    """Absolute: slurmd resolves a relative --output against the job's working directory."""
    assert inv.slurm is not None
    base = inv.slurm.log_dir
    d = (Path(base).expanduser().resolve() if base else store.root.expanduser().resolve() / "slurm") / name
    if not _SAFE_PATH.fullmatch(str(d)):
        raise K3Error("bad-log-dir", f"log directory {str(d)!r} cannot stand on an #SBATCH line (white space, quotes, '#' or '%')",
                      "set slurm.log_dir in the inventory to a plain path on a shared filesystem")
    return str(d)


class _DoctorRefused(Exception):
    def __init__(self, failed: dict[str, str]) -> None:
        super().__init__(", ".join(failed))
        self.failed = failed


@dataclass
class SlurmLaunch:
    plan: Plan
    inv: Inventory
    store: StateStore
    inventory: str | None = None
    on_stage: StageFn = field(default=lambda s, m: None)
    on_failure: Callable[[LaunchFailed], None] = field(default=lambda e: None)
    extra_sbatch: Sequence[str] = ()
    client: SlurmClient = field(default_factory=SlurmClient)
    queue_timeout: float | None = None
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    doctor: bool = True  # the job's doctor step (and, with it, the automatic exclusion of refused nodes)

    def script(self, log_dir: str, exclude: Sequence[str]) -> str:
        assert self.inv.slurm is not None
        return make_sbatch_string(self.plan, self.inv.slurm, log_dir, self.extra_sbatch, exclude, doctor=self.doctor,
                                  hf_token_file=self.inv.hf_token_file)

    def submit(self, rec: DeploymentRecord, exclude: Sequence[str]) -> str:
        log_dir = Path(rec.slurm.log_dir if rec.slurm else "")
        try:
            log_dir.mkdir(parents=True, exist_ok=True)  # before sbatch: slurmd opens --output there
            path = log_dir / "job.sbatch"
            path.write_text(self.script(str(log_dir), exclude))
            (log_dir / "plan.json").write_text(self.plan.to_json() + "\n")
        except OSError as exc:
            raise K3Error("log-dir", f"cannot write the job script to {log_dir}: {exc.strerror}", "set slurm.log_dir in the inventory") from None
        return self.client.sbatch(str(path), str(log_dir), job_name=f"k3-{self.plan.name}")

    # ------------------------------------------------------------------ up
    def up(self, *, timeout: float | None = None, keep_on_failure: bool = False, use_bad_nodes: bool = True) -> DeploymentRecord:
        now = time.time()
        log_dir = log_dir_for(self.store, self.inv, self.plan.name)
        rec = DeploymentRecord(name=self.plan.name, state="starting", created=now, updated=now, inventory=self.inventory,
                               endpoint=self.plan.endpoint, plan=self.plan,
                               slurm=SlurmJob(job_id="", log_dir=log_dir, script=str(Path(log_dir) / "job.sbatch")))
        assert rec.slurm is not None
        assert self.inv.slurm is not None
        exclude = list(dict.fromkeys([*self.plan.exclude, *self.client.outside(self.inv.slurm.partition, self.inv.slurm.nodelist)]))
        if use_bad_nodes:
            auto = sorted(h for h, v in bad_nodes(self.store).items() if v.get("kind") == "doctor" and h not in exclude)
            if auto:
                self.on_stage("exclude", f"excluding node(s) that failed the doctor step in the last day: {', '.join(auto)}")
                exclude += auto
        try:
            while True:
                rec.slurm.excluded = exclude
                rec.slurm.job_id = self.submit(rec, exclude)
                self.store.save(rec)
                self.on_stage("submit", f"job {rec.slurm.job_id} submitted (script {rec.slurm.script})")
                try:
                    self.wait_ready(rec, ready_timeout(self.plan, timeout))
                    break
                except _DoctorRefused as exc:
                    for host, why in exc.failed.items():
                        record_bad_node(self.store, host, why, "doctor", self.plan.name)
                    bad = ", ".join(f"{h} ({w})" for h, w in exc.failed.items())
                    if rec.slurm.attempts >= self.max_attempts:
                        raise LaunchFailed(f"the job's doctor step refused {bad}", "fix those nodes, or --exclude them; they are excluded "
                                           "automatically for a day", code="doctor-failed", node=next(iter(exc.failed))) from None
                    self.on_stage("requeue", f"doctor refused {bad}; submitting again without them")
                    exclude = [*exclude, *exc.failed]
                    rec.slurm.attempts += 1
        except (K3Error, KeyboardInterrupt) as exc:
            rec.state = "failed"
            rec.error = exc.message if isinstance(exc, K3Error) else "interrupted"
            if rec.slurm.job_id:
                self.store.save(rec)
            self.on_stage("failed", rec.error)
            if isinstance(exc, LaunchFailed):
                if exc.node and exc.code == "process-exited":
                    record_bad_node(self.store, exc.node, exc.message, "rank-died", self.plan.name)
                self.on_failure(exc)
            if rec.slurm.job_id and not keep_on_failure:
                self.on_stage("teardown", f"cancelling job {rec.slurm.job_id}")
                report = cancel_job(rec, self.store, client=self.client)
                if report.clean:
                    self.store.delete(rec.name)
                    self.on_stage("teardown", "done: job gone, no step left")
                else:
                    self.on_stage("teardown", f"incomplete ({'; '.join(x for v in report.leftovers.values() for x in v)}); "
                                  f"record kept: run `k3launch down {rec.name}`")
            if not rec.slurm.job_id:
                self.store.delete(rec.name)  # nothing was submitted: no record, and no lock file left behind
            raise
        rec.state = "ready"
        rec.error = None
        self.store.save(rec)
        self.on_stage("ready", f"{self.plan.name} serving at {rec.endpoint} (job {rec.slurm.job_id})")
        return rec

    def _bind(self, rec: DeploymentRecord, out: JobOutput, info: JobInfo) -> Plan:
        assert rec.slurm is not None
        order = node_order(self.plan)
        rec.slurm.hosts = {n: out.hosts[i][0] for i, n in enumerate(order)}
        rec.slurm.addresses = {n: out.hosts[i][1] for i, n in enumerate(order)}
        bound = bind_plan(self.plan, rec.slurm.addresses)
        rec.endpoint = bound.endpoint
        for p in self.plan.processes:
            rec.processes[p.id] = ProcessRecord(id=p.id, node=p.node, runtime="slurm", handle=f"{rec.slurm.job_id}:{p.id}",
                                                log=str(Path(rec.slurm.log_dir) / f"{p.id}.log"), started=True)
        self.store.save(rec)
        hosts = ", ".join(f"{n}={rec.slurm.hosts[n]} ({rec.slurm.addresses[n]})" for n in order)
        self.on_stage("running", f"job {info.job_id} running on {hosts}")
        return bound

    def _ended(self, rec: DeploymentRecord, info: JobInfo, stage: str) -> Exception:
        assert rec.slurm is not None
        log_dir = Path(rec.slurm.log_dir)
        out_path = log_dir / f"slurm-{info.job_id}.out"
        out = parse_output(read_file(out_path))
        if out.doctor_failed:
            return _DoctorRefused(out.doctor_failed)
        if out.step_exit is not None:
            # the cause: the first to end whose last lines do not blame a lost peer (as for ssh)
            tails = {pid: tail_file(log_dir / f"{pid}.log", 30) for pid, _, _ in out.step_exits}
            pid, host, rc = next((e for e in out.step_exits if not PEER_LOSS.search(tails[e[0]])), out.step_exits[0])
            proc = next((p for p in self.plan.processes if p.id == pid), None)
            label = rank_label(proc) if proc else pid
            others = [e[0] for e in out.step_exits if e[0] != pid]
            then = f"; {', '.join(others)} exited too" if others else ""
            return LaunchFailed(f"{pid} ({label}) on {host} exited with code {rc} during {stage}{then}; job {info.job_id} ended",
                                "its last log lines are above; fix the cause and run `k3launch up` again", pid,
                                tails[pid], code="process-exited", node=host)
        why = f"{info.state}" + (f", {info.reason}" if info.reason else "") + (f", exit {info.exit_code}" if info.exit_code else "")
        code = "job-cancelled" if info.state.startswith("CANCELLED") else "job-ended"
        return LaunchFailed(f"job {info.job_id} ended ({why}) during {stage}", f"see {out_path}", None, tail_file(out_path, 20), code=code)

    def _may_still_run(self, reason: str) -> bool:
        """PartitionNodeLimit also means "some of the nodes it may use are down or drained": only
        a request larger than the partition can ever give never runs."""
        if reason != "PartitionNodeLimit":
            return False
        assert self.inv.slurm is not None
        size = self.client.partition_nodes(self.inv.slurm.partition)
        return size is not None and len(node_order(self.plan)) <= size

    def wait_ready(self, rec: DeploymentRecord, deadline_s: float) -> health.Completion:
        assert rec.slurm is not None
        job = rec.slurm.job_id
        out_path = Path(rec.slurm.log_dir) / f"slurm-{job}.out"
        t_queue = time.monotonic()
        t_end: float | None = None
        t_running = 0.0
        stage, reason = "queued", None
        ready: Readiness | None = None  # once the job bound its hosts
        http = [p for p in self.plan.processes if p.http_port is not None]
        t_unavailable: float | None = None
        while True:
            t_poll = time.monotonic()
            try:
                info = self.client.job(job)
                t_unavailable = None
            except K3Error as exc:
                # a busy slurmctld times out now and then: that says nothing about the job
                if exc.code != "slurm-unavailable":
                    raise
                t_unavailable = t_unavailable or t_poll
                if t_poll - t_unavailable > SLURM_UNAVAILABLE_S:
                    raise
                time.sleep(POLL_S)
                continue
            if not info.active or info.state == "COMPLETING":
                # COMPLETING: its processes are being cleaned up; the final state (CANCELLED,
                # FAILED, ...) says why it ended, and the job's last lines reach its output file
                t_final = time.monotonic() + 10
                while info.state == "COMPLETING" and time.monotonic() < t_final:
                    time.sleep(0.2)
                    info = self.client.job(job)
                time.sleep(0.2)
                raise self._ended(rec, info, stage)
            if info.state == "PENDING":
                if info.reason != reason:
                    reason = info.reason
                    self.on_stage("queued", f"job {job} pending ({reason or 'no reason given'})")
                if info.reason in NEVER_RUNS and not self._may_still_run(info.reason):
                    raise LaunchFailed(f"job {job} can never start: Slurm keeps it pending with reason {info.reason}",
                                       "ask for fewer nodes or less time, or use another partition/account (see `sinfo`, `sacctmgr show assoc`)",
                                       code="job-never-runs")
                if self.queue_timeout is not None and time.monotonic() - t_queue > self.queue_timeout:
                    raise LaunchFailed(f"job {job} still pending after {self.queue_timeout:g}s ({info.reason})",
                                       "raise --queue-timeout, or ask for fewer nodes / another partition", code="queue-timeout")
            elif info.state == "RUNNING":
                if t_end is None:
                    t_end, t_running, stage = time.monotonic() + deadline_s, time.monotonic(), "running"
                out = parse_output(read_file(out_path))
                if ready is None and not out_path.exists() and time.monotonic() - t_running > OUTPUT_VISIBLE_S:
                    raise LaunchFailed(f"job {job} runs, but its output {out_path} does not appear on this machine",
                                       "slurm.log_dir must be on a filesystem the login node shares with the compute nodes",
                                       code="log-dir-not-shared")
                if ready is None and len(out.hosts) >= len(node_order(self.plan)):
                    bound = self._bind(rec, out, info)
                    ready = Readiness(bound.processes, bound.endpoint, self.plan.model, self.on_stage)
                    stage = "doctor"
                if stage == "doctor" and out.doctor_ok:
                    self.on_stage("doctor", f"{len(out.hosts)} node(s) ok (GPUs visible, engine found, ports free)")
                    stage = "alive"
                if stage == "alive":
                    steps = self.client.steps(job)
                    if all(p.id in steps for p in self.plan.processes):
                        self.on_stage("alive", f"all {len(self.plan.processes)} steps running")
                        stage = "health"
                if stage in ("health", "completion") and ready is not None:
                    c = ready.check(t_end)
                    if c is not None:
                        return c
                    stage = ready.stage()
                if time.monotonic() > t_end:
                    missing = ready.missing if ready else [p.id for p in http]
                    raise LaunchFailed(f"not ready {deadline_s:g}s after job {job} started (stage {stage}; not healthy: {', '.join(missing) or 'none'})",
                                       "raise --ready-timeout if loads are slow, or check `k3launch logs`", missing[0] if missing else None,
                                       tail_file(Path(rec.slurm.log_dir) / f"{missing[0]}.log", 30) if missing else "", code="not-ready")
            time.sleep(max(0.0, poll_interval(t_poll - t_queue) - (time.monotonic() - t_poll)))


