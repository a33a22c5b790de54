"""What the lifecycle reports: data only, shared by the backends, the API and the CLI.

:class:`LaunchFailed` (``up`` failed: which process, which node, its last log lines),
:class:`TeardownReport` (what ``down`` stopped and found, per node), :class:`Check` and
:class:`DoctorReport` (the pre-flight checks), :class:`DryRun` (what ``up`` would run). They live
below the backends so that the CLI and campaigns read them without importing any backend
(docs/design.md, "Layers").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from k3launch.errors import HOST_KEY_HINT, K3Error
from k3launch.models.weights import Checkpoint

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
    exited: list[str] = field(default_factory=list)  # processes found dead already: nothing of them was left to stop
    rollout: str | None = None  # the changes of a rollout under way that `down` abandoned
    leftovers: dict[str, list[str]] = field(default_factory=dict)  # node -> what remains
    unreachable: dict[str, str] = field(default_factory=dict)  # node -> why
    busy_ports: list[str] = field(default_factory=list)
    verified: str = "no process or container left; planned ports free"  # what a clean report checked
    set_aside: str | None = None  # an unreadable record, renamed NAME.json.corrupt-<time> before the search
    hint: str = ""  # what the user may still have to do (e.g. search another inventory)
    supervisor: str | None = None  # the supervisor `down` stopped first, if one watched
    # node -> what carries the name but is not this deployment's (a record-less `down`: another
    # state directory's same-named deployment, or one older than deployment ids): left alone
    others: dict[str, list[str]] = field(default_factory=dict)

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
    """Every check of every node; ``ok`` when none failed. ``checkpoint``: the model's size as an
    engine node's checkpoint index gave it, when one did (the load prediction reads it)."""

    checks: list[Check]
    checkpoint: Checkpoint | None = None

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


@dataclass(frozen=True)
class DryRunStep:
    step: str  # weights (a staged plan's copy, on nodes whose copy is not complete) | engines | router
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


@dataclass
class ArrayJob:
    """One submitted Slurm job array: task ``i`` runs deployment ``deployments[i]``."""

    job_id: str
    log_dir: str
    deployments: list[str]  # task index -> deployment name
    script: str

    def result_path(self, task: int) -> Path:
        return Path(self.log_dir) / "results" / f"task-{task}.json"

    def output_path(self, task: int) -> Path:
        return Path(self.log_dir) / f"slurm-{self.job_id}_{task}.out"


@dataclass
class ArrayResult:
    """Every task's state and the result its job wrote."""

    job: ArrayJob
    states: dict[int, str] = field(default_factory=dict)  # task -> Slurm state (missing: Slurm forgot the task)
    results: dict[int, dict[str, object]] = field(default_factory=dict)  # task -> its result JSON
