"""The Slurm backend of ``up``/``status``/``logs``/``down``: one sbatch job per deployment.

``up`` writes the job script (:mod:`k3launch.render.sbatch`) to the deployment's log directory,
submits it, and watches the job from the login node, stage by stage: ``submit`` → ``queued``
(Slurm's pending reason) → ``running`` (the hosts the job bound, read from its output) →
``doctor`` (the job's own pre-flight step passed on every node) → ``alive`` (one running step
per process) → ``health`` (every HTTP endpoint answers ``/health``) → ``completion`` (one real
completion through the public endpoint) → ``ready``. The readiness deadline counts from the
moment the job runs; the time in the queue is bounded separately (``queue_timeout``).
:class:`SlurmLaunch` is this backend's set of hooks for the shared ``up`` skeleton
(:func:`k3launch.deploy.base.run_up`).

Fail fast: the job script ends the job when any step exits; ``up`` sees the job leave RUNNING
within one poll and reports the process and node the job named, with that process's last log
lines. A node the job's doctor step refuses (GPUs not visible, engine missing, a planned port
taken) is recorded in ``<state dir>/slurm-bad-nodes.json`` and the job is submitted again
without it (``max_attempts``); recorded doctor failures are excluded automatically from later
submissions for a day. Nodes where a rank died are recorded too (shown, not excluded).

The log directory must be on a filesystem the login node shares with the compute nodes (home
directories usually are): ``up`` reads the job's output there, ``logs`` reads the process logs.

``supervise`` (``up --supervise``): the job script hands over to its own controller instead of
failing fast (:mod:`k3launch.deploy.slurm.injob`, run by the interpreter ``up`` runs under), which
writes its events to ``<log dir>/events.jsonl``; a previous job's file there is moved to
``events.jsonl.1`` first. Such a job is ready once its controller says it supervises (the line
``supervising NAME``) and a completion succeeds: a rank that dies before that fails the bring-up.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k3launch.deploy import eventlog
from k3launch.deploy.base import Progress, run_up
from k3launch.deploy.logtail import LogCursor
from k3launch.deploy.logtail import read_file as read_log
from k3launch.deploy.readiness import ready_timeout
from k3launch.deploy.slurm.client import NEVER_RUNS, JobInfo, SlurmClient
from k3launch.deploy.slurm.job import JobOutput, bad_nodes, bind_plan, parse_output, read_file, record_bad_node, tail_file
from k3launch.deploy.slurm.ops import cancel_job
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import ProcessRecord, SlurmJob, SlurmRecord, Stage, StageFn
from k3launch.models.reports import PEER_LOSS, LaunchFailed, TeardownReport, error_line
from k3launch.models.supervise import RestartPolicy
from k3launch.planning.inventory import Inventory
from k3launch.render.sbatch import make_sbatch_string, node_order
from k3launch.util.polling import poll_until

POLL_S = 0.5
SLURM_UNAVAILABLE_S = 60.0  # squeue failing this long (slurmctld down or unreachable) fails up
OUTPUT_VISIBLE_S = 90.0  # NFS caches a missing file's absence for up to 60 s (acdirmax)
DEFAULT_MAX_ATTEMPTS = 2


def poll_interval(elapsed_s: float) -> float:
    """0.5 s for the first minute, then 2 s, then 5 s after ten: a K3 load takes tens of minutes,
    and every poll is an RPC to slurmctld, which the whole cluster shares."""
    return POLL_S if elapsed_s < 60 else 2.0 if elapsed_s < 600 else 5.0


# What may stand in an `#SBATCH --output=` path: sbatch's directive parser cuts at white space,
# quotes and '#', and Slurm expands '%' patterns in file names.
_SAFE_PATH = re.compile(r"[A-Za-z0-9._/+,:@=~-]+")


def log_dir_for(store: StateStore, inv: Inventory, name: str) -> str:
    """Absolute: slurmd resolves a relative --output against the job's working directory."""
    base = inv.slurm.log_dir if inv.slurm is not None else None
    d = (Path(base).expanduser().resolve() if base else store.slurm_dir().resolve()) / name
    if not _SAFE_PATH.fullmatch(str(d)):
        raise K3Error("bad-log-dir", f"log directory {str(d)!r} cannot stand on an #SBATCH line (white space, quotes, '#' or '%')",
                      "set slurm.log_dir in the inventory to a plain path on a shared filesystem")
    return str(d)


def job_policy(plan: Plan, policy: RestartPolicy | None) -> RestartPolicy | None:
    """The policy the job follows: a restarted unit must serve within ``start_timeout``, by default the
    plan's ready timeout (as for a supervisor on a login node)."""
    if policy is None or policy.start_timeout is not None:
        return policy
    return policy.model_copy(update={"start_timeout": ready_timeout(plan, None)})


@dataclass
class SlurmLaunch:
    """One ``up`` on Slurm: submit, then watch the job from the login node (the shared skeleton's hooks)."""

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
    use_bad_nodes: bool = True  # exclude nodes the job's doctor refused in the last day
    supervise: RestartPolicy | None = None  # the job restarts failed steps itself (`up --supervise`)
    record: SlurmRecord = field(init=False)
    # what the polls have seen of the current submission
    _exclude: list[str] = field(default_factory=list, init=False)
    _t_queue: float = field(default=0.0, init=False)
    _running: bool = field(default=False, init=False)
    _t_running: float = field(default=0.0, init=False)
    _stage: Stage = field(default=Stage.QUEUED, init=False)
    _reason: str | None = field(default=None, init=False)
    _bound: Plan | None = field(default=None, init=False)
    _watched: bool = field(default=False, init=False)  # a supervised job's controller said it watches (from then on, it restarts)
    _t_unavailable: float | None = field(default=None, init=False)
    _cursor: LogCursor = field(default_factory=LogCursor, init=False)  # how far each process log was read (live progress)

    def __post_init__(self) -> None:
        now = time.time()
        self.supervise = job_policy(self.plan, self.supervise)
        self.record = SlurmRecord(name=self.plan.name, state="starting", created=now, updated=now, inventory=self.inventory,
                                  endpoint=self.plan.endpoint, plan=self.plan, deployment_id=self.store.new_deployment_id(),
                                  slurm=SlurmJob(job_id="", log_dir="", script="", supervised=self.supervise))

    @property
    def slurm(self) -> SlurmJob:
        return self.record.slurm

    def script(self, log_dir: str, exclude: Sequence[str]) -> str:
        assert self.inv.slurm is not None
        return make_sbatch_string(self.plan, self.inv.slurm, log_dir, self.extra_sbatch, exclude, doctor=self.doctor,
                                  hf_token_file=self.inv.hf_token_file, supervise=self.supervise, ident=self.record.deployment_id)

    def submit(self, rec: SlurmRecord, exclude: Sequence[str]) -> str:
        log_dir = Path(rec.slurm.log_dir)
        try:
            log_dir.mkdir(parents=True, exist_ok=True)  # before sbatch: slurmd opens --output there
            path = log_dir / "job.sbatch"
            path.write_text(self.script(str(log_dir), exclude))
            (log_dir / "plan.json").write_text(self.plan.to_json() + "\n")
        except OSError as exc:
            raise K3Error("log-dir", f"cannot write the job script to {log_dir}: {exc.strerror}", "set slurm.log_dir in the inventory") from None
        return self.client.sbatch(str(path), str(log_dir), job_name=f"k3-{self.plan.name}")

    # ------------------------------------------------------------------ hooks of run_up
    def start(self) -> None:
        assert self.inv.slurm is not None
        log_dir = log_dir_for(self.store, self.inv, self.plan.name)
        self.slurm.log_dir, self.slurm.script = log_dir, str(Path(log_dir) / "job.sbatch")
        eventlog.rotate_file(Path(log_dir) / eventlog.JOB_EVENTS)  # a previous job's events are not this one's
        exclude = list(dict.fromkeys([*self.plan.exclude, *self.client.outside(self.inv.slurm.partition, self.inv.slurm.nodelist)]))
        if self.use_bad_nodes:
            auto = sorted(h for h, v in bad_nodes(self.store).items() if v.get("kind") == "doctor" and h not in exclude)
            if auto:
                self.on_stage(Stage.EXCLUDE, f"excluding node(s) that failed the doctor step in the last day: {', '.join(auto)}")
                exclude += auto
        self._submit(exclude)

    def _submit(self, exclude: list[str]) -> None:
        self._exclude = exclude
        self.slurm.excluded = exclude
        self.slurm.job_id = self.submit(self.record, exclude)
        self.store.save(self.record)
        self.on_stage(Stage.SUBMIT, f"job {self.slurm.job_id} submitted (script {self.slurm.script})")
        self._t_queue, self._running, self._stage, self._reason, self._bound = time.monotonic(), False, Stage.QUEUED, None, None
        self._cursor = LogCursor()  # the new job writes its logs anew

    def started(self) -> bool:
        return bool(self.slurm.job_id)

    def poll_interval(self, elapsed_s: float) -> float:
        return poll_interval(time.monotonic() - self._t_queue)

    def failed(self, exc: LaunchFailed) -> None:
        if exc.node and exc.code == "process-exited":
            record_bad_node(self.store, exc.node, exc.message, "rank-died", self.plan.name)

    def teardown(self, exc: BaseException) -> TeardownReport:
        self.on_stage(Stage.TEARDOWN, f"cancelling job {self.slurm.job_id}")
        report = cancel_job(self.record, self.store, client=self.client)
        if report.clean:
            self.on_stage(Stage.TEARDOWN, "done: job gone, no step left")
        else:
            self.on_stage(Stage.TEARDOWN, f"incomplete ({'; '.join(x for v in report.leftovers.values() for x in v)}); "
                          f"record kept: run `k3launch down {self.record.name}`")
        return report

    def not_ready(self, deadline_s: float, stage: Stage, missing: list[str]) -> LaunchFailed:
        return LaunchFailed(f"not ready {deadline_s:g}s after job {self.slurm.job_id} started (stage {stage}; not healthy: {', '.join(missing) or 'none'})",
                            # the job's log directory outlives the teardown (`k3launch logs` does not)
                            f"raise --ready-timeout if loads are slow, or read the logs in {self.slurm.log_dir}", missing[0] if missing else None,
                            tail_file(Path(self.slurm.log_dir) / f"{missing[0]}.log", 30) if missing else "", code="not-ready")

    def up(self, *, timeout: float | None = None, keep_on_failure: bool = False, use_bad_nodes: bool = True) -> SlurmRecord:
        """Submit and wait until the deployment serves (the shared skeleton with this backend's hooks)."""
        self.use_bad_nodes = use_bad_nodes
        run_up(self, self.store, ready_timeout(self.plan, timeout), keep_on_failure, self.on_failure)
        return self.record

    # ------------------------------------------------------------------ one poll
    def poll(self, stage: Stage | None) -> Progress:
        job = self.slurm.job_id
        try:
            info = self.client.job(job)
            self._t_unavailable = None
        except K3Error as exc:
            # a busy slurmctld times out now and then: that says nothing about the job
            now = time.monotonic()
            if exc.code != "slurm-unavailable" or now - (self._t_unavailable or now) > SLURM_UNAVAILABLE_S:
                raise
            self._t_unavailable = self._t_unavailable or now
            return self._progress()
        cur = stage or self._stage
        if not info.active or info.state == "COMPLETING":
            return self._job_ended(info, cur)
        if info.state == "PENDING":
            self._pending(info)
        elif info.state == "RUNNING":
            self._advance(info)
        return self._progress()

    def _progress(self) -> Progress:
        # a supervised job serves once its controller watches: a rank that dies earlier ends the job (its bring-up
        # fails fast), so a deployment `up` called ready is one whose every later failure is restarted
        serving = self._bound is not None and self._stage in (Stage.HEALTH, Stage.COMPLETION) and (self.supervise is None or self._watched)
        # live progress: what each process log in the shared log directory gained since the last poll
        logs = {p.id: read_log(Path(self.slurm.log_dir) / f"{p.id}.log", self._cursor, p.id) for p in self.plan.processes} if self._bound else {}
        return Progress(running=self._running, serving=self._bound.processes if serving and self._bound else None,
                        endpoint=self._bound.endpoint if self._bound else "", stage=self._stage, logs=logs)

    def _pending(self, info: JobInfo) -> None:
        job = info.job_id
        if info.reason != self._reason:
            self._reason = info.reason
            self.on_stage(Stage.QUEUED, f"job {job} pending ({info.reason or 'no reason given'})")
        if info.reason in NEVER_RUNS and not self._may_still_run(info.reason):
            raise LaunchFailed(f"job {job} can never start: Slurm keeps it pending with reason {info.reason}",
                               "ask for fewer nodes or less time, or use another partition/account (see `sinfo`, `sacctmgr show assoc`)",
                               code="job-never-runs")
        if self.queue_timeout is not None and time.monotonic() - self._t_queue > self.queue_timeout:
            raise LaunchFailed(f"job {job} still pending after {self.queue_timeout:g}s ({info.reason})",
                               "raise --queue-timeout, or ask for fewer nodes / another partition", code="queue-timeout")

    def _advance(self, info: JobInfo) -> None:
        """RUNNING: bound hosts → doctor passed → every step running → (health, by the skeleton)."""
        job = info.job_id
        if not self._running:
            self._running, self._t_running, self._stage = True, time.monotonic(), Stage.RUNNING
        out_path = Path(self.slurm.log_dir) / f"slurm-{job}.out"
        out = parse_output(read_file(out_path))
        self._watched = out.supervising
        if self._bound is None and not out_path.exists() and time.monotonic() - self._t_running > OUTPUT_VISIBLE_S:
            raise LaunchFailed(f"job {job} runs, but its output {out_path} does not appear on this machine",
                               "slurm.log_dir must be on a filesystem the login node shares with the compute nodes",
                               code="log-dir-not-shared")
        if self._bound is None and len(out.hosts) >= len(node_order(self.plan)):
            self._bound = self._bind(out, info)
            self._stage = Stage.DOCTOR
        if self._stage == Stage.DOCTOR and out.doctor_ok:
            gpus = "a CPU plan: no GPUs to check" if self.plan.platform == "cpu" else "GPUs visible"
            self.on_stage(Stage.DOCTOR, f"{len(out.hosts)} node(s) ok ({gpus}, engine found, ports free)")
            self._stage = Stage.ALIVE
        if self._stage == Stage.ALIVE:
            steps = self.client.steps(job)
            if all(p.id in steps for p in self.plan.processes):
                self.on_stage(Stage.ALIVE, f"all {len(self.plan.processes)} steps running")
                self._stage = Stage.HEALTH

    def _job_ended(self, info: JobInfo, stage: Stage) -> Progress:
        # COMPLETING: its processes are being cleaned up; the final state (CANCELLED, FAILED, ...)
        # says why it ended, and the job's last lines reach its output file
        if info.state == "COMPLETING":
            info = poll_until(lambda: self.client.job(info.job_id), lambda i: i.state != "COMPLETING", timeout=10, interval=0.2)
        time.sleep(0.2)
        refused = parse_output(read_file(Path(self.slurm.log_dir) / f"slurm-{info.job_id}.out")).doctor_failed
        if not refused:
            raise self._ended(info, stage)
        for host, why in refused.items():
            record_bad_node(self.store, host, why, "doctor", self.plan.name)
        bad = ", ".join(f"{h} ({w})" for h, w in refused.items())
        if self.slurm.attempts >= self.max_attempts:
            raise LaunchFailed(f"the job's doctor step refused {bad}", "fix those nodes, or --exclude them; they are excluded "
                               "automatically for a day", code="doctor-failed", node=next(iter(refused)))
        self.on_stage(Stage.REQUEUE, f"doctor refused {bad}; submitting again without them")
        self.slurm.attempts += 1
        self._submit([*self._exclude, *refused])
        return Progress(running=False, stage=Stage.QUEUED, restarted=True)

    def _bind(self, out: JobOutput, info: JobInfo) -> Plan:
        rec = self.record
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
        self.on_stage(Stage.RUNNING, f"job {info.job_id} running on {hosts}")
        return bound

    def _ended(self, info: JobInfo, stage: str) -> LaunchFailed:
        log_dir = Path(self.slurm.log_dir)
        out_path = log_dir / f"slurm-{info.job_id}.out"
        out = parse_output(read_file(out_path))
        if out.step_exit is not None:
            # the cause: the first to end whose last lines do not blame a lost peer (as for ssh)
            tails = {pid: tail_file(log_dir / f"{pid}.log", 30) for pid, _, _ in out.step_exits}
            pid, host, rc = next((e for e in out.step_exits if not PEER_LOSS.search(tails[e[0]])), out.step_exits[0])
            proc = next((p for p in self.plan.processes if p.id == pid), None)
            label = proc.rank_label() if proc else pid
            others = [e[0] for e in out.step_exits if e[0] != pid]
            then = f"; {', '.join(others)} exited too" if others else ""
            said = error_line(tails[pid])
            return LaunchFailed(f"{pid} ({label}) on {host} exited with code {rc} during {stage}{then}; job {info.job_id} ended"
                                + (f": {said}" if said else ""),
                                "its last log lines are above; fix the cause and run `k3launch up` again", pid,
                                tails[pid], code="process-exited", node=host)
        if out.prepare_failed:
            host, path = next(iter(out.prepare_failed.items()))
            return LaunchFailed(f"job {info.job_id} could not make {path} on {host} (a container's bind source or a compile cache)",
                                "set `compile_cache:` (`off`: none) or `hf_cache:` in the inventory to a directory the nodes can write; "
                                f"mkdir's own error is in {log_dir / 'prepare.log'}", code="prepare-failed", node=host)
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
