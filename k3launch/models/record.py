"""What a deployment is: its record (state dir), its lifecycle stages, and its status.

* :class:`Stage` names every lifecycle stage any backend reports; :data:`StageFn` is the one
  callback type that receives them (``(stage, message)``).
* A deployment record is one of two typed variants, told apart by ``backend``:
  :class:`SshRecord` (``ssh`` and ``local``: processes started over SSH or on this machine,
  with the SSH client settings a later ``down`` must reuse) and :class:`SlurmRecord` (one
  sbatch job: :class:`SlurmJob`). Records written before ``backend`` existed are read by the
  presence of their ``slurm`` key.
* :class:`Status` is exactly what ``k3launch status --json`` prints (its JSON schema is
  published as ``docs/status.schema.json``).

Records never hold secrets: plans never contain them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import StrEnum
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from k3launch.models.control.memory import ControlMemory
from k3launch.models.phases import Timeline
from k3launch.models.plan import Host, Plan
from k3launch.models.rollout import RolloutState, RolloutStatus
from k3launch.models.supervise import RestartPolicy


class Stage(StrEnum):
    """A lifecycle stage, as ``up`` reports it (in the order a deployment meets them)."""

    EXCLUDE = "exclude"  # Slurm: nodes left out of the submission
    WEIGHTS = "weights"  # the model staged onto node-local disk (the plan's stage), before the doctor
    DOCTOR = "doctor"  # pre-flight checks passed on every node
    SUBMIT = "submit"  # Slurm: the job was queued
    QUEUED = "queued"  # Slurm: pending, with Slurm's reason
    RUNNING = "running"  # Slurm: the job runs and bound its hosts
    REQUEUE = "requeue"  # Slurm: submitted again without nodes the job's doctor refused
    START = "start"  # processes started on their nodes
    ALIVE = "alive"  # every process runs
    HEALTH = "health"  # an HTTP endpoint answers /health
    COMPLETION = "completion"  # a real completion came back through the public endpoint
    READY = "ready"
    FAILED = "failed"
    TEARDOWN = "teardown"


StageFn = Callable[[Stage, str], None]
"""``(stage, message)``: how a backend reports progress (the CLI prints it, campaigns log it)."""

State = Literal["starting", "ready", "failed", "stopping", "down-incomplete", "interrupted"]
LIVE_STATES = ("starting", "ready", "failed", "stopping", "down-incomplete", "interrupted")
# States a running k3launch command holds a record in; the record names that command (`owner`).
# Read back while the owner is gone (killed `up` or `down`), such a record is "interrupted":
# nothing is known to be healthy, and what was started may still run until a `down`.
TRANSIENT_STATES = ("starting", "stopping")
SshBackendName = Literal["ssh", "local"]
BackendName = Literal["ssh", "local", "slurm"]


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)  # validators built on first use, not at import


class ProcessRecord(Record):
    id: str
    node: str
    runtime: str
    handle: str = ""  # pid (bare/apptainer) or container name (docker/podman); Slurm: "<job>:<process>"
    log: str = ""  # log file on the node (bare/apptainer); containers: `<runtime> logs`
    started: bool = False


class Owner(Record):
    """The k3launch command acting on a deployment while its record is in a transient state."""

    host: str  # this machine's hostname when the record was written
    pid: int
    started: str  # the process's start time (``/proc/PID/stat`` field 22): a reused pid is another process


class SlurmJob(Record):
    """A deployment's Slurm job: where it runs and what it was given."""

    job_id: str
    log_dir: str  # job script, slurm-<job>.out and one <process>.log each (shared with the nodes)
    script: str
    excluded: list[str] = []  # --exclude of the submission
    attempts: int = 1  # submissions (a node refused by the job's doctor step is excluded next time)
    hosts: dict[str, str] = {}  # plan node -> allocated host
    addresses: dict[str, str] = {}  # plan node -> that host's NodeAddr
    supervised: RestartPolicy | None = None  # `up --supervise`: the job restarts failed steps itself under this policy


class Supervisor(Record):
    """Who keeps a deployment serving (``k3launch supervise``): a process on a login node."""

    host: str
    pid: int
    started: str  # the process's start time (``/proc/PID/stat`` field 22): a reused pid is another process
    since: float
    detached: bool  # --detach (a background process) rather than a foreground command
    restarts: int = 0  # restarts it made
    policy: RestartPolicy = RestartPolicy()
    metrics: str = ""  # ADDRESS:PORT where it serves k3launch's metrics (docs/monitoring.md); "": none


class CanaryNote(Record):
    """How ``up``'s correctness canary went (docs/canary.md): the baseline recorded or not, whether
    every target agreed with it, and the line ``up`` printed."""

    recorded: bool
    agree: bool
    message: str


class RecordBase(Record):
    """What every deployment record holds, whatever its backend."""

    name: str
    state: State
    created: float
    updated: float
    inventory: str | None = None
    endpoint: str
    plan: Plan
    processes: dict[str, ProcessRecord] = {}
    unreachable: list[str] = []
    error: str | None = None
    owner: Owner | None = None  # set while the state is transient (TRANSIENT_STATES)
    timeline: Timeline | None = None  # the bring-up, per process and phase (`k3launch timeline`); None before it ran
    supervisor: Supervisor | None = None  # set while a supervisor watches it
    rollout: RolloutState | None = None  # a rollout under way or stopped: both plans, which unit runs which
    canary: CanaryNote | None = None  # up's canary (None: not asked for, or a record older than the canary)
    control: ControlMemory | None = None  # the controller's memory (restart counts, backoff, rolls under way): a new one goes on from it
    # its processes' K3LAUNCH_ID (models.identity); "": a record older than ids (its processes are found by name)
    deployment_id: str = Field("", pattern=r"^(?:[0-9a-f]{8}-[0-9a-f]{6})?$")

    @property
    def job(self) -> SlurmJob | None:
        """The Slurm job running the deployment (None: not a Slurm deployment)."""
        return None

    @property
    def holds_nodes(self) -> bool:
        """Whether k3launch itself arbitrates the nodes (a live record refuses them to others)."""
        return True

    def machines(self) -> list[str]:
        """The machines the deployment runs on (on Slurm the allocated hosts, once bound)."""
        return sorted({p.node for p in self.plan.processes})

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)


def _legacy(data: Any, backend: str) -> Any:
    """Records written before ``backend`` existed carry ``slurm`` (null for ssh/local ones)."""
    if isinstance(data, dict) and "backend" not in data:
        data = {k: v for k, v in data.items() if not (k == "slurm" and v is None)}
        plan = data.get("plan")
        inferred = plan.get("backend") if isinstance(plan, dict) else None
        data["backend"] = backend if backend == "slurm" else (inferred if inferred in ("ssh", "local") else "ssh")
    return data


class LeftBehind(Record):
    """Processes a supervisor re-placed off a node that did not answer: still to be stopped there
    (by the supervisor when the node answers again, else by ``down``)."""

    host: Host
    processes: dict[str, ProcessRecord]
    since: float


class SshRecord(RecordBase):
    """Processes started over SSH (``ssh``) or on this machine (``local``)."""

    backend: SshBackendName = "ssh"
    # the SSH client settings of the `up`: a later `down` must check the same host keys
    ssh_config: str | None = None
    known_hosts: str | None = None
    hf_token_file: str | None = None  # the inventory's token *path* on the nodes (a restart reads it there too); never the token
    left_behind: dict[str, LeftBehind] = {}  # node -> what a re-placement left there (node lost)

    def hosts(self) -> list[Host]:
        """Every machine the deployment may still run on: the plan's, and those it was moved off."""
        names = {h.name for h in self.plan.hosts}
        return [*self.plan.hosts, *(lb.host for n, lb in self.left_behind.items() if n not in names)]

    @model_validator(mode="before")
    @classmethod
    def _old(cls, data: Any) -> Any:
        return _legacy(data, "ssh")


class SlurmRecord(RecordBase):
    """One sbatch job runs every process (Slurm arbitrates its nodes)."""

    backend: Literal["slurm"] = "slurm"
    slurm: SlurmJob

    @model_validator(mode="before")
    @classmethod
    def _old(cls, data: Any) -> Any:
        return _legacy(data, "slurm")

    @property
    def job(self) -> SlurmJob:
        return self.slurm

    @property
    def holds_nodes(self) -> bool:
        return False

    def machines(self) -> list[str]:
        return sorted(set(self.slurm.hosts.values())) if self.slurm.hosts else super().machines()


class OtherRecord(RecordBase):
    """A deployment of any other registered backend (a plug-in, :func:`k3launch.models.backends.register`):
    whatever it must remember beyond the base record it keeps in ``data``, so adding a backend
    needs no new variant here."""

    backend: str
    data: dict[str, Any] = {}


def _kind(data: Any) -> str:
    if isinstance(data, dict):
        backend = data.get("backend")
        if backend == "slurm" or (backend is None and data.get("slurm")):
            return "slurm"
        return "ssh" if backend in (None, "ssh", "local") else "other"
    return "slurm" if isinstance(data, SlurmRecord) else "ssh" if isinstance(data, SshRecord) else "other"


DeploymentRecord = Annotated[
    Annotated[SshRecord, Tag("ssh")] | Annotated[SlurmRecord, Tag("slurm")] | Annotated[OtherRecord, Tag("other")], Discriminator(_kind)
]


@cache
def _records() -> TypeAdapter[SshRecord | SlurmRecord | OtherRecord]:
    # built on first use: `plan` and `--help` never read a record
    return TypeAdapter(DeploymentRecord)


def parse_record(text: str | bytes) -> SshRecord | SlurmRecord | OtherRecord:
    """A record from its JSON (raises pydantic's ValidationError or ValueError)."""
    return _records().validate_json(text)


# ---------------------------------------------------------------------- status
class ProcessStatus(Record):
    id: str
    node: str  # on Slurm the allocated host
    role: str
    alive: bool
    healthy: bool | None  # None: the process serves no HTTP (headless ranks)
    replica: int | None = None  # the copy (--replicas) it belongs to, k of r<k>-...; left out for one copy and for the router


ReplicaState = Literal["serving", "degraded", "down"]


class ReplicaStatus(Record):
    """One copy of the engine (``--replicas``): serving when every process of it is alive and every
    HTTP endpoint healthy, down when none of them is alive, degraded in between."""

    replica: int  # k of its processes' r<k>- ids
    state: ReplicaState
    processes: list[str]


class JobStatus(Record):
    """Slurm: the job behind a deployment."""

    id: str
    state: str  # Slurm's (RUNNING, PENDING, ...), or GONE when Slurm forgot the job
    nodes: list[str]
    reason: str
    log_dir: str


class SupervisorStatus(Record):
    """``status``: who keeps the deployment serving — a supervisor on a login node, or (Slurm) the job itself."""

    host: str  # where it runs (the job: its batch host, "" until it runs)
    pid: int | None  # None: the job supervises itself
    since: float
    restarts: int
    detached: bool
    job: str | None = None  # Slurm: the id of the job that supervises itself


class UnitStatus(Record):
    """``status``: one recovery unit as the controller sees it, and whether its router lists it."""

    name: str
    serving: bool  # every HTTP server of the unit answers /health
    in_router: bool | None = None  # its engines are in the (regular) router's worker list; None: no such router, or it did not answer
    desired: str = "current"  # the plan it should run: "current", or a rollout's "new" / "old"
    running: str = "current"  # the plan it runs: "current", or "old" / "rolling" / "new" during a rollout
    controller: str | None = None  # the controller's state of it (serving, draining, starting, backoff, gave-up, ...); None: no memory
    standby: bool = False  # a hot standby's: serving, kept out of the router on purpose


class Status(Record):
    """A deployment now: exactly what ``k3launch status --json`` prints."""

    name: str
    # the record's state; "degraded" when ready but a process is gone or unhealthy, a serving unit is out of
    # its router or a rollout stopped halfway; "rolling" while a rollout is under way; Slurm: "queued", "ended (STATE)"
    state: str
    endpoint: str
    processes: list[ProcessStatus]
    unreachable: list[str] = []  # nodes that did not answer, with the reason
    job: JobStatus | None = None  # Slurm deployments only
    supervisor: SupervisorStatus | None = None  # who keeps it serving (None: nobody)
    error: str | None = None  # why it failed (state "failed")
    replicas: list[ReplicaStatus] = []  # each copy of the engine (--replicas 2 or more); one copy: left out
    rollout: RolloutStatus | None = None  # a rollout under way or stopped: which unit runs which plan
    units: list[UnitStatus] = []  # each recovery unit: serving, in its router, which plan it runs and should run
    reason: str | None = None  # why the state is not "ready" although the record is (degraded, rolling)

    def as_dict(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        for key in ("job", "error", "rollout", "reason"):
            if data[key] is None:
                del data[key]  # ssh/local status has no job; a deployment that did not fail, no error
        if not data["replicas"]:  # a one-copy deployment's status reads as before copies existed
            del data["replicas"]
        if not data["units"]:  # a Slurm job's: its router is on its allocation, not asked from here
            del data["units"]
        for proc in data["processes"]:
            if proc["replica"] is None:
                del proc["replica"]
        return data

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    @property
    def healthy(self) -> bool:
        """Every process alive and every HTTP endpoint healthy."""
        return _all_well(self.processes)


def _all_well(processes: list[ProcessStatus]) -> bool:
    return all(p.alive and p.healthy is not False for p in processes)


def with_replicas(snap: Status, plan: Plan) -> Status:
    """``snap`` with each process's copy and each copy's state, for a plan of copies; a one-copy
    plan's as it is. Copies come from the plan, not from a backend: every backend reports them alike."""
    if plan.replicas < 2:
        return snap
    copy = {p.id: plan.replica_of(p) for p in plan.processes}
    procs = [p.model_copy(update={"replica": copy.get(p.id)}) for p in snap.processes]
    replicas = []
    for k in range(plan.replicas):
        mine = [p for p in procs if p.replica == k]
        state: ReplicaState = "down" if not any(p.alive for p in mine) else "serving" if _all_well(mine) else "degraded"
        replicas.append(ReplicaStatus(replica=k, state=state, processes=[p.id for p in mine]))
    return snap.model_copy(update={"processes": procs, "replicas": replicas})


def observed_state(record_state: str, processes: list[ProcessStatus]) -> str:
    """A ready deployment with a process gone, or an endpoint that stopped answering /health
    (a vLLM whose EngineCore died answers 503 at once, its API server exits seconds later), is degraded."""
    return "degraded" if record_state == "ready" and not _all_well(processes) else record_state


def status_schema() -> dict[str, Any]:
    """The published JSON schema of ``status --json``."""
    return Status.model_json_schema()
