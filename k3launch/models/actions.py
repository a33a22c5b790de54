"""What the one controller sees and does: an :class:`Observation` per look, each unit's
:class:`UnitState` and :class:`Memory`, and the :data:`Action` s the decisions
(:mod:`k3launch.models.supervision`, :mod:`k3launch.models.converge`) hand the executor."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from k3launch.models.plan import FaultTolerancePool
from k3launch.models.supervise import Unit


@dataclass
class Observation:
    """One look at a deployment: what the backend saw (the supervisor's only input)."""

    now: float
    dead: Mapping[str, str] = field(default_factory=dict)  # process id -> how it ended ("exited with code 1: ...")
    unreachable: Mapping[str, str] = field(default_factory=dict)  # node -> why
    healthy: Mapping[str, bool] = field(default_factory=dict)  # HTTP process id -> /health answered 200 in time
    tails: Mapping[str, str] = field(default_factory=dict)  # dead process id -> its last log lines
    reclaimed: Mapping[str, Sequence[str]] = field(default_factory=dict)  # lost node answering again -> processes stopped there
    ft: Mapping[str, str] = field(default_factory=dict)  # fault-tolerant rank -> its engine's FT status ("healthy", "unhealthy", ...)
    # process id -> (CPU ticks its whole session used, "state R"): asked only while some engine does not serve
    cpu: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    # regular (non-P/D) router id -> the worker URLs it lists (``/list_workers``); absent or None: not known this look
    routers: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)
    # HTTP process id -> its engine's ``vllm:num_requests_running`` (asked of draining units only; None: unreadable)
    running: Mapping[str, float | None] = field(default_factory=dict)


class UnitState(StrEnum):
    SERVING = "serving"
    BACKOFF = "backoff"  # failed; restarts at ``until``
    STARTING = "starting"  # restarted; must serve by ``until``
    WAITING_NODE = "waiting-node"  # a node of the unit does not answer
    GAVE_UP = "gave-up"
    RECOVERING = "recovering"  # vLLM's own fault tolerance: ranks unhealthy, every process alive; retry sent or due
    DRAINING = "draining"  # a roll: out of the router, its in-flight requests finishing; swapped once drained (or at ``until``)
    GATING = "gating"  # a roll: serves the target plan; the gate (a completion, the canary) decides


@dataclass(frozen=True)
class Restart:
    """Stop the unit and start it again (the executor reports back with :meth:`Supervision.started`)."""

    unit: Unit
    attempt: int
    reason: str
    hung: bool = False  # it stopped answering: it will not stop gracefully either


@dataclass(frozen=True)
class GiveUp:
    """Stop the unit for good (failed too often)."""

    unit: Unit
    reason: str
    failing: tuple[str, ...]  # the processes whose last log lines to keep


@dataclass(frozen=True)
class Replace:
    """A node is lost: cordon it and re-place its units onto spare nodes (the executor reports
    back with :meth:`Supervision.replaced`, or leaves the units waiting for the node)."""

    node: str
    units: tuple[Unit, ...]
    reason: str


@dataclass(frozen=True)
class FtRetry:
    """vLLM's fault tolerance: POST ``retry`` to every rank's API server of ``pool`` (all at once:
    recovery completes only once every rank got it)."""

    unit: Unit
    pool: FaultTolerancePool


@dataclass(frozen=True)
class StopAll:
    """The deployment cannot serve any more: stop everything, record ``failed``."""

    reason: str


@dataclass(frozen=True)
class Route:
    """Make a running (regular) router list the serving units' engines: ``add``, then ``remove``."""

    router: str
    add: tuple[str, ...]
    remove: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Swap:
    """A roll: stop the unit and start it on plan ``to`` (``new``, or ``old`` to undo or roll
    back); the executor reports back with :meth:`Supervision.started` or :meth:`Supervision.start_failed`."""

    unit: Unit
    to: str
    reason: str
    keep_logs: bool = False  # the unit failed its gate on the plan it leaves: its last log lines are kept first


@dataclass(frozen=True)
class Gate:
    """A rolled unit serves its new plan: a real completion and the canary decide whether it stays
    (the executor reports back with :meth:`Supervision.gated`)."""

    unit: Unit


@dataclass(frozen=True)
class Surge:
    """``--surge``: start the whole new set beside the old one, switch the router, stop the old
    set (the executor reports back with :meth:`Supervision.surged`)."""


@dataclass(frozen=True)
class Resize:
    """Run on a plan of ``total`` copies: the ``leaving`` ones (drained) stop, new ones start (the
    executor reports back with ``resized`` or ``resize_failed``: :mod:`k3launch.models.scaling`)."""

    total: int
    leaving: tuple[str, ...]
    reason: str


Action = Restart | GiveUp | Replace | FtRetry | StopAll | Route | Swap | Gate | Surge | Resize


@dataclass
class Memory:
    state: UnitState = UnitState.SERVING
    until: float = 0.0
    restarts: deque[float] = field(default_factory=deque)  # times of restarts within the window
    detected: float | None = None  # when the current outage was detected
    reason: str = ""
    failing: tuple[str, ...] = ()
    last_ok: dict[str, float] = field(default_factory=dict)  # HTTP process -> when its /health last answered 200
    ft_sent: float | None = None  # when the last retry went out
    progress: dict[str, tuple[int, float]] = field(default_factory=dict)  # starting process -> (CPU ticks, since when unchanged)
    to: str = ""  # a roll under way: the plan it is swapped to
    undo: bool = False  # ... to take back a roll that failed its gate
    leaving: bool = False  # its copy is scaled in: out of the router, drained, then stopped
    fresh: bool = False  # a new copy starting (scaled out): its serving is not a restart
    since: float = 0.0  # a roll under way: when it left the router
    drained_s: float = 0.0
