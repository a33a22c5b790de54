"""What the decisions hand the executor (:mod:`k3launch.deploy.control.actor`), one look at a time."""

from __future__ import annotations

from dataclasses import dataclass

from k3launch.models.plan import FaultTolerancePool
from k3launch.models.supervise import Unit


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
    executor reports back with ``resized`` or ``resize_failed``: :mod:`k3launch.models.control.scaling`)."""

    total: int
    leaving: tuple[str, ...]
    reason: str


Action = Restart | GiveUp | Replace | FtRetry | StopAll | Route | Swap | Gate | Surge | Resize
