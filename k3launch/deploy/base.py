"""The one lifecycle seam: what every backend implements, and the ``up`` skeleton they share.

A :class:`Backend` (``up``, ``status``, ``logs``, ``down``, ``dry_run``) is chosen by the
inventory's ``backend`` through :mod:`k3launch.deploy.registry`, and called only by
:mod:`k3launch.api`. Its ``up`` builds a :class:`Launch` — the backend's hooks for one bring-up —
and hands it to :func:`run_up`, the skeleton every backend shares (docs/design.md, "The backend
seam"):

1. ``launch.start()``: start what runs (processes over SSH, or an sbatch job) and save the record;
2. poll every :meth:`Launch.poll_interval` seconds: ``launch.poll()`` raises :class:`LaunchFailed`
   at the first sign of failure (fail fast: a dead rank, a silent node, a job that ended) and
   says when the engines serve HTTP; from then on :class:`Readiness` probes every ``/health``,
   then one real completion through the public endpoint;
3. the readiness deadline counts from the moment the deployment runs (a job's time in the queue
   is bounded separately);
4. on failure: the record says ``failed``, the ``failed`` stage and ``on_failure`` are reported
   *before* the teardown (which may take a while), and everything started is torn down unless
   ``keep_on_failure``; the record is deleted once nothing is left;
5. on success the record says ``ready``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from k3launch.deploy.options import UpOptions
from k3launch.deploy.progress import ProgressFn, Tracker
from k3launch.deploy.readiness import Readiness
from k3launch.errors import K3Error
from k3launch.models.caches import CacheDir
from k3launch.models.identity import Owned
from k3launch.models.phases import LogDelta, Timeline
from k3launch.models.plan import FaultTolerancePool, Plan, Process
from k3launch.models.record import DeploymentRecord, RecordBase, Stage, StageFn, Status
from k3launch.models.reports import ArrayJob, ArrayResult, DoctorReport, DryRun, LaunchFailed, TeardownReport
from k3launch.models.weights import FetchProgress, NodeWeights, Probe, Source
from k3launch.transport import http

if TYPE_CHECKING:
    from pathlib import Path

    from k3launch.deploy.state import StateStore
    from k3launch.models.control.observation import Observation
    from k3launch.models.power import Sampler
    from k3launch.models.supervise import Unit
    from k3launch.planning.inventory import Inventory
    from k3launch.transport.fleet import Fleet


def no_op(*_: object) -> None:
    """The default of every event callback."""
    return None


@dataclass(frozen=True)
class Events:
    """Where ``up`` reports progress: stages, the doctor's table, the failure (before teardown), phases."""

    on_stage: StageFn = no_op
    on_doctor: Callable[[DoctorReport], None] = no_op
    on_failure: Callable[[LaunchFailed], None] = no_op
    on_progress: ProgressFn = no_op


Emit = Callable[[str], None]
R = TypeVar("R", bound=RecordBase)


def own(rec: DeploymentRecord, kind: type[R]) -> R:
    """``rec`` as the record variant of the backend it was handed to (the registry routes by
    ``rec.backend``, so anything else is a bug, reported as such)."""
    if not isinstance(rec, kind):
        raise K3Error("wrong-backend", f"{rec.name} is a {rec.backend} deployment, not a {kind.__name__}", "report this as a k3launch bug")
    return rec


# ---------------------------------------------------------------------- the seam
class Backend(Protocol):
    """A way of running deployments: the lifecycle every backend has (docs/design.md, "How to add a
    backend"). A backend is built by the registry with the option types it lists in ``OPTIONS``
    (:mod:`k3launch.deploy.options`); what it supports beyond the lifecycle it declares as
    :class:`~k3launch.models.backends.Feature` s in its registry entry, and implements as the
    protocols below (:class:`NodeOps`, :class:`PowerOps`, :class:`ArrayOps`)."""

    OPTIONS: ClassVar[tuple[type, ...]]

    def up(self, plan: Plan, inv: Inventory, inv_path: str, store: StateStore, opts: UpOptions, events: Events) -> DeploymentRecord:
        """Bring ``plan`` up and return once it serves (raises K3Error / LaunchFailed)."""
        ...

    def status(self, rec: DeploymentRecord) -> Status: ...

    def logs(self, rec: DeploymentRecord, ids: Sequence[str], lines: int, follow: bool, emit: Emit, everything: bool = False) -> None:
        """Print each process's last ``lines`` (``everything``: the backend's own log first), then follow."""
        ...

    def down(self, rec: DeploymentRecord, store: StateStore, grace_s: float) -> TeardownReport: ...

    def sweep(self, name: str, inv: Inventory, grace_s: float, owned: Owned) -> TeardownReport:
        """``down`` without a (readable) record: find what runs of deployment ``name`` where ``inv``
        runs deployments (processes by marker, containers by label, jobs by name) -- only what
        ``owned`` says is the deployment's (:mod:`k3launch.models.identity`) -- stop it, verify."""
        ...

    def dry_run(self, plan: Plan, inv: Inventory | None, store: StateStore, opts: UpOptions) -> DryRun:
        """``inv`` None: a plan on placeholder nodes (no inventory settings such as ``hf_token_file``)."""
        ...


class NodeOps(Protocol):
    """Commands on a plan's nodes outside the lifecycle: features ``doctor``, ``weights``, ``fleet``."""

    def doctor(self, plan: Plan, inv: Inventory, live: Sequence[str], bandwidth: bool, min_busbw: float | None) -> DoctorReport:
        """The pre-flight checks ``up`` runs (``live``: the state directory's deployments, not leftovers)."""
        ...

    def weights_check(self, plan: Plan, inv: Inventory) -> list[NodeWeights]: ...

    def weights_fetch(self, plan: Plan, inv: Inventory, source: Source, on_progress: Callable[[FetchProgress], None] | None,
                      interval: float) -> list[NodeWeights]: ...

    def weights_probe(self, plan: Plan, inv: Inventory, path: str | None, size: int, timeout_s: float) -> list[Probe]:
        """Each engine node's read throughput of its weight source (``path``, else where its engine looks)."""
        ...

    def fleet(self, rec: DeploymentRecord) -> Fleet:
        """The nodes of a live deployment, for commands on them (a context manager: closed on exit)."""
        ...


class PowerOps(Protocol):
    """Feature ``power``: GPU power readings of a deployment's engine nodes while a load runs."""

    def power_sampler(self, rec: DeploymentRecord) -> Sampler: ...


class ArrayOps(Protocol):
    """Feature ``arrays``: one allocation per plan, as one job array per shape."""

    def submit_array(self, plans: Sequence[Plan], inv: Inventory, log_dir: str, work: Callable[[int, Plan], Sequence[str]] | None,
                     concurrency: int | None, name: str, extra: Sequence[str], ready_timeout: float) -> list[ArrayJob]: ...

    def wait_array(self, job: ArrayJob, timeout: float) -> ArrayResult: ...

    def active_tasks(self, job_ids: Sequence[str]) -> set[str]:
        """``<job>_<task>`` of every task of these arrays still pending or running (unknown jobs: none)."""
        ...

    def attached_record(self, plan: Plan, env: Mapping[str, str], inventory: str | None) -> DeploymentRecord:
        """Inside an array task's allocation: the record of the deployment the task's job brought up."""
        ...


class Watcher(Protocol):
    """A supervisor's hands on one live deployment (feature ``supervise``), open for its whole watch."""

    def observe(self, now: float) -> Observation:
        """One look: exited processes, silent nodes, ``/health`` of every HTTP process."""
        ...

    def restart(self, unit: Unit, grace_s: float, proceed: Callable[[], bool]) -> list[LaunchFailed]:
        """Stop the unit's processes and, if ``proceed()`` still says so, start them again as ``up``
        did (the record saved); what failed to start."""
        ...

    def restart_timeline(self, unit: str, ready: bool, now: float) -> Timeline | None:
        """The last restart of ``unit``, phase by phase, until ``now`` (None: not tracked); its tracking ends."""
        ...

    def stop(self, processes: Sequence[str], grace_s: float) -> TeardownReport: ...

    def stop_all(self, grace_s: float) -> TeardownReport:
        """Everything stopped and verified, as ``down`` does (the record stays)."""
        ...

    def keep_logs(self, ids: Sequence[str]) -> list[Path]:
        """The last log lines of ``ids``, kept in the state directory (as a failed ``up`` keeps them)."""
        ...

    def check(self, plan: Plan, nodes: Sequence[str]) -> list[str]:
        """The doctor's failures on ``nodes`` for what ``plan`` puts there (spares about to be used)."""
        ...

    def ft_retry(self, pool: FaultTolerancePool) -> str | None:
        """vLLM's fault tolerance: POST ``retry`` to every rank of ``pool``; None, or what failed."""
        ...

    def reroute(self, router: Process, remove: Sequence[str], add: Sequence[str]) -> str | None:
        """Tell the running router of moved engines (remove, then add worker URLs); None, or why not."""
        ...

    def workers(self, router: Process) -> list[str] | None:
        """The worker URLs a running (regular) router lists (``/list_workers``); None if it does not answer."""
        ...

    def adopt(self, plan: Plan, lost: str) -> None:
        """Run on ``plan`` from now on; what ran on ``lost`` is left behind (stopped when it answers)."""
        ...

    def note(self, change: Callable[[DeploymentRecord], None]) -> None:
        """Apply ``change`` to the record the watcher keeps, and save it (what a rollout records
        beside the processes: the watcher's own saves must not write an older copy over it)."""
        ...

    def close(self) -> None: ...


class CacheOps(Protocol):
    """Feature ``caches``: the compile/JIT cache directories engines keep on an inventory's nodes."""

    def caches(self, inv: Inventory, nodes: Sequence[str], clear: Sequence[str], clear_all: bool) -> tuple[list[CacheDir], dict[str, str]]:
        """After removing the ``clear`` keys (or all): each node's directories, and node -> why it could not be read."""
        ...


class CanaryOps(Protocol):
    """Feature ``canary``: where a live deployment's HTTP servers answer, as this machine reaches
    them (the correctness canary asks each of them: :mod:`k3launch.deploy.canary`)."""

    def served_plan(self, rec: DeploymentRecord) -> Plan:
        """``rec``'s plan with the addresses its processes really bind (a Slurm job's allocated hosts)."""
        ...


class SuperviseOps(Protocol):
    """Feature ``supervise``: keep a deployment serving (:mod:`k3launch.deploy.control.loop` drives it)."""

    def watcher(self, rec: DeploymentRecord, store: StateStore) -> Watcher: ...


@dataclass(frozen=True)
class Progress:
    """What one poll of a bring-up saw (failures are raised, not returned)."""

    running: bool  # the deployment runs: the readiness deadline counts from the first such poll
    serving: Sequence[Process] | None = None  # processes to probe (with their real addresses), once started
    endpoint: str = ""
    stage: Stage = Stage.START  # the backend's own stage while nothing serves yet
    restarted: bool = False  # started anew (Slurm: resubmitted): deadline and probes start over
    logs: Mapping[str, LogDelta] = field(default_factory=dict)  # process id -> what its log gained since the last poll


class Launch(Protocol):
    """One backend's hooks for one bring-up, driven by :func:`run_up`."""

    @property
    def plan(self) -> Plan: ...

    @property
    def record(self) -> DeploymentRecord: ...

    @property
    def on_stage(self) -> StageFn: ...

    def start(self) -> None:
        """Start what runs and save the record (raises on failure)."""
        ...

    def poll(self, stage: Stage | None) -> Progress:
        """One look (``stage``: the readiness stage reached, None before); raise LaunchFailed on failure."""
        ...

    def poll_interval(self, elapsed_s: float) -> float: ...

    def not_ready(self, deadline_s: float, stage: Stage, missing: list[str]) -> LaunchFailed: ...

    def started(self) -> bool:
        """Whether anything may run (nothing submitted or started: the record just goes)."""
        ...

    def failed(self, exc: LaunchFailed) -> None:
        """Backend bookkeeping of a failure (Slurm: the node where a rank died)."""
        ...

    def teardown(self, exc: BaseException) -> TeardownReport:
        """Stop what was started (reporting TEARDOWN stages); the record is deleted when clean."""
        ...


def wait_ready(launch: Launch, deadline_s: float, tracker: Tracker | None = None) -> http.Completion:
    """Poll until the deployment serves a completion (LaunchFailed otherwise), tracking each process's phase."""
    tracker = tracker or Tracker(launch.plan)
    t0 = time.monotonic()
    t_end: float | None = None
    ready: Readiness | None = None
    while True:
        t_poll = time.monotonic()
        p = launch.poll(ready.stage() if ready else None)
        if p.restarted:
            t_end, ready = None, None
        if p.running and t_end is None:
            t_end = time.monotonic() + deadline_s
            tracker.restart(time.time())  # the timeline, like the deadline, counts from when the deployment runs
        c = None
        if p.serving is not None and t_end is not None:
            ready = ready or Readiness(p.serving, p.endpoint, launch.plan.model, launch.on_stage)
            c = ready.check(t_end)
        tracker.update(p.logs, ready.healthy if ready else (), str(ready.stage() if ready else p.stage))
        if c is not None:
            return c
        if t_end is not None and time.monotonic() > t_end:
            missing = ready.missing if ready else [q.id for q in launch.plan.processes if q.http_port is not None]
            raise launch.not_ready(deadline_s, ready.stage() if ready else p.stage, missing)
        # a fixed cadence: the round trips and probes of this poll are part of the interval
        time.sleep(max(0.0, launch.poll_interval(t_poll - t0) - (time.monotonic() - t_poll)))


def run_up(launch: Launch, store: StateStore, deadline_s: float, keep_on_failure: bool,
           on_failure: Callable[[LaunchFailed], None] = no_op, on_progress: ProgressFn = no_op) -> DeploymentRecord:
    """The ``up`` skeleton every backend shares (module docstring); the record keeps the bring-up's timeline."""
    rec = launch.record
    tracker = Tracker(launch.plan, on_progress)
    try:
        launch.start()
        wait_ready(launch, deadline_s, tracker)
    except (K3Error, KeyboardInterrupt) as exc:
        rec.state = "failed"
        rec.error = exc.message if isinstance(exc, K3Error) else "interrupted"
        rec.timeline = tracker.timeline(ready=False)
        if launch.started():
            store.save(rec)
        launch.on_stage(Stage.FAILED, rec.error)  # now, not after a teardown that may take a while
        if isinstance(exc, LaunchFailed):
            launch.failed(exc)
            on_failure(exc)
        if not launch.started():
            store.delete(rec.name)  # nothing was started: no record, and no lock file left behind
        elif not keep_on_failure and launch.teardown(exc).clean:
            store.delete(rec.name)
        raise
    rec.state = "ready"
    rec.error = None
    rec.timeline = tracker.timeline(ready=True)
    store.save(rec)
    launch.on_stage(Stage.READY, f"{launch.plan.name} serving at {rec.endpoint}" + _job_note(rec))
    return rec


def _job_note(rec: DeploymentRecord) -> str:
    return f" (job {rec.job.job_id})" if rec.job is not None else ""
