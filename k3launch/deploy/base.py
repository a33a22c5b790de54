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

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from k3launch.deploy.progress import ProgressFn, Tracker
from k3launch.errors import K3Error
from k3launch.models.phases import LogDelta
from k3launch.models.plan import Plan, Process
from k3launch.models.record import DeploymentRecord, RecordBase, Stage, StageFn, Status
from k3launch.transport import http
from k3launch.transport.runners import HOST_KEY_HINT

if TYPE_CHECKING:
    from k3launch.deploy.state import StateStore
    from k3launch.planning.inventory import Inventory

DEFAULT_READY_TIMEOUT_S = 1800.0
# How a rank says it went down *because another did* (torch/gloo/NCCL, vLLM, the simulated engine)
PEER_LOSS = re.compile(r"by peer|peer process|remote process exited|disconnected|lost the connection|lost a member|"
                       r"connection (?:reset|closed|refused)|broken pipe", re.IGNORECASE)


class LaunchFailed(K3Error):
    """``up`` failed: which process (``failing``) on which node, with its last log lines."""

    def __init__(self, message: str, hint: str, failing: str | None = None, log_tail: str = "", code: str = "launch-failed",
                 node: str | None = None) -> None:
        super().__init__(code, message, hint)
        self.failing = failing
        self.log_tail = log_tail
        self.node = node


@dataclass
class TeardownReport:
    """What ``down`` (or the teardown of a failed ``up``) did and found, per node."""

    stopped: list[str] = field(default_factory=list)
    leftovers: dict[str, list[str]] = field(default_factory=dict)  # node -> what remains
    unreachable: dict[str, str] = field(default_factory=dict)  # node -> why
    busy_ports: list[str] = field(default_factory=list)
    verified: str = "no process or container left; planned ports free"  # what a clean report checked
    set_aside: str | None = None  # an unreadable record, renamed NAME.json.corrupt-<time> before the search

    @property
    def clean(self) -> bool:
        return not (self.leftovers or self.unreachable or self.busy_ports)


# The line of a dead engine's log that says why: vLLM's own error (argparse's "vllm: error: ...",
# pydantic's "Value error, ...", an exception line "EngineDeadError: ..."), the last one logged.
_ERROR_LINE = re.compile(r"\b(?:[A-Za-z]*Error|error)\b[:,]")


def error_line(log_tail: str) -> str | None:
    """The last line of ``log_tail`` that states an error, trimmed (None when no line does)."""
    for line in reversed(log_tail.splitlines()):
        text = line.strip()
        if _ERROR_LINE.search(text) and not text.startswith(("Traceback", "For further information")):
            return text if len(text) <= 300 else text[:297] + "..."
    return None


def rank_label(proc: Process) -> str:
    """``node rank 2`` / ``DP ranks 8-15`` / ``router`` — how people name the rank."""
    a = proc.argv

    def flag(name: str) -> str | None:
        return a[a.index(name) + 1] if name in a and a.index(name) + 1 < len(a) else None

    if (r := flag("--node-rank")) is not None:
        return f"{proc.role}, node rank {r}"
    local = flag("--data-parallel-size-local")
    if local and local.isdigit() and flag("--data-parallel-size"):
        start = int(flag("--data-parallel-start-rank") or 0)
        return f"{proc.role}, DP ranks {start}-{start + int(local) - 1}"
    return proc.role


def ready_timeout(plan: Plan, override: float | None) -> float:
    """``--ready-timeout``, else the plan's ``VLLM_ENGINE_READY_TIMEOUT_S``, else 1800 s."""
    if override is not None:
        return override
    for p in plan.processes:
        v = p.env.get("VLLM_ENGINE_READY_TIMEOUT_S")
        if v and v.isdigit():
            return float(v)
    return DEFAULT_READY_TIMEOUT_S


@dataclass
class Readiness:
    """The ``health`` and ``completion`` stages, shared by every backend: every HTTP endpoint
    answers ``/health`` 200, then one real completion comes back through the public endpoint."""

    processes: Sequence[Process]  # with the addresses the processes really bind
    endpoint: str
    model: str
    on_stage: StageFn
    healthy: set[str] = field(default_factory=set)
    wait_s: float = 0.5  # how long one poll waits for the completion in flight before the next look at the nodes
    _pending: http.InFlight | None = None

    @property
    def missing(self) -> list[str]:
        return [p.id for p in self.processes if p.http_port is not None and p.id not in self.healthy]

    def check(self, t_end: float) -> http.Completion | None:
        """One poll: probe what is not healthy yet; once all are, try the completion."""
        n = sum(1 for p in self.processes if p.http_port is not None)
        todo = {p.id: f"http://{p.address}:{p.http_port}" for p in self.processes if p.id in self.missing}
        for pid, ok in http.probe_all(todo).items():
            if ok:
                self.healthy.add(pid)
                self.on_stage(Stage.HEALTH, f"{pid} healthy ({len(self.healthy)}/{n})")
        if self.missing:
            return None
        # The completion runs beside the polls, not inside one: it may take up to a minute, and a
        # node that stops answering meanwhile must still be noticed by the next poll.
        if self._pending is None:
            timeout = max(5.0, min(60.0, t_end - time.monotonic()))
            self._pending = http.in_background(lambda: http.completion(self.endpoint, self.model, timeout=timeout))
        c = self._pending.wait(self.wait_s)
        if c is None:
            return None
        self._pending = None
        if c.ok:
            self.on_stage(Stage.COMPLETION, f"completion through {self.endpoint}: {c.completion_tokens} tokens in {c.seconds:.2f}s")
            return c
        if c.detail.startswith("no tokens"):
            raise LaunchFailed(f"completion stage: {self.endpoint} answers but generated no tokens ({c.detail})",
                               "the engines answer but generate nothing: read the logs", code="no-tokens")
        return None

    def stage(self) -> Stage:
        return Stage.HEALTH if self.missing else Stage.COMPLETION


# ---------------------------------------------------------------------- options and events
@dataclass(frozen=True)
class Access:
    """How k3launch reaches nodes (SSH backends; others ignore it)."""

    accept_unknown_hosts: bool = False  # only ever set from an explicit user flag
    connect_timeout: float = 10.0


@dataclass(frozen=True)
class UpOptions:
    """Everything ``up`` takes besides the plan and the inventory (see ``k3launch up --help``)."""

    ready_timeout: float | None = None
    keep_on_failure: bool = False
    force: bool = False  # use nodes another live deployment holds (ssh/local)
    skip_doctor: bool = False
    access: Access = Access()
    extra_sbatch: tuple[str, ...] = ()  # Slurm only
    queue_timeout: float | None = None  # Slurm only


@dataclass(frozen=True)
class Check:
    """One pre-flight check of one node (``doctor``)."""

    node: str
    name: str
    status: str  # pass | fail | warn | skip
    detail: str = ""
    code: str = ""  # the error code of a failed connection (host-key-unknown, unreachable, ...)
    hint: str = ""  # what fixes a failure, when the check knows better than the generic advice


@dataclass
class DoctorReport:
    """Every check of every node; ``ok`` when none failed."""

    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def failed_nodes(self) -> list[str]:
        return sorted({c.node for c in self.failures()})

    def error(self) -> K3Error:
        """The refusal to raise when not ok: connection problems first, with their own codes."""
        bad = self.failures()
        keys = [c for c in bad if c.code in ("host-key-unknown", "host-key-mismatch")]
        if keys:
            nodes = ", ".join(sorted({c.node for c in keys}))
            if any(c.code == "host-key-mismatch" for c in keys):
                return K3Error("host-key-mismatch", f"host key mismatch on {nodes}: {keys[0].detail}",
                               "the host's key changed: check why before fixing known_hosts")
            return K3Error("host-key-unknown", f"host key of {nodes} not in known_hosts ({keys[0].detail})", HOST_KEY_HINT)
        unreach = [c for c in bad if c.name == "reachable"]
        if unreach:
            return K3Error("unreachable", f"cannot reach {', '.join(sorted({c.node for c in unreach}))}: {unreach[0].detail}",
                           "check the address, ssh config and that sshd runs there; or --exclude the node")
        first = next((c for c in bad if c.hint), bad[0])
        return K3Error("doctor-failed", f"pre-flight checks failed on {', '.join(self.failed_nodes())}: {first.name}: {first.detail}",
                       first.hint or "fix the nodes or --exclude them; --skip-doctor to launch anyway")


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


@dataclass(frozen=True)
class DryRunStep:
    step: str  # engines | router
    node: str
    address: str
    script: str  # exactly what `up` hands to `bash -c` on that node


@dataclass(frozen=True)
class DryRun:
    """What ``up`` would run, without running it: per-node steps, or the sbatch script; and the
    same as standalone files (``render --out``: file name → text, all executable)."""

    name: str
    steps: tuple[DryRunStep, ...] = ()
    sbatch: str | None = None
    files: tuple[tuple[str, str], ...] = ()


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
    """A way of running deployments (docs/design.md, "How to add a backend")."""

    def up(self, plan: Plan, inv: Inventory, inv_path: str, store: StateStore, opts: UpOptions, events: Events) -> DeploymentRecord:
        """Bring ``plan`` up and return once it serves (raises K3Error / LaunchFailed)."""
        ...

    def status(self, rec: DeploymentRecord, access: Access) -> Status: ...

    def logs(self, rec: DeploymentRecord, ids: Sequence[str], lines: int, follow: bool, emit: Emit, access: Access,
             everything: bool = False) -> None:
        """Print each process's last ``lines`` (``everything``: the backend's own log first), then follow."""
        ...

    def down(self, rec: DeploymentRecord, store: StateStore, grace_s: float, access: Access) -> TeardownReport: ...

    def sweep(self, name: str, inv: Inventory, grace_s: float, access: Access) -> TeardownReport:
        """``down`` without a (readable) record: find what runs of deployment ``name`` where ``inv``
        runs deployments (processes by marker, containers by label, jobs by name), stop it, verify."""
        ...

    def dry_run(self, plan: Plan, inv: Inventory | None, store: StateStore, opts: UpOptions) -> DryRun:
        """``inv`` None: a plan on placeholder nodes (no inventory settings such as ``hf_token_file``)."""
        ...


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
