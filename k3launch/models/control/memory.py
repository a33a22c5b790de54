"""What the controller remembers of each unit: its :class:`UnitState` and :class:`Memory` while
it runs, and :class:`ControlMemory`, the same saved in the record after every look that changed
it, so that a controller started again (killed, or on another login node) goes on where the last
one was: restart counts and backoff windows, rolls and scaling under way."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from k3launch.models.rollout import RolloutState


class UnitState(StrEnum):
    SERVING = "serving"
    BACKOFF = "backoff"  # failed; restarts at ``until``
    STARTING = "starting"  # restarted; must serve by ``until``
    WAITING_NODE = "waiting-node"  # a node of the unit does not answer
    GAVE_UP = "gave-up"
    RECOVERING = "recovering"  # vLLM's own fault tolerance: ranks unhealthy, every process alive; retry sent or due
    DRAINING = "draining"  # a roll: out of the router, its in-flight requests finishing; swapped once drained (or at ``until``)
    GATING = "gating"  # a roll: serves the target plan; the gate (a completion, the canary) decides


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
    # serving HTTP process holding requests -> (tokens generated, since when unchanged): "up but not serving"
    tokens: dict[str, tuple[float, float]] = field(default_factory=dict)
    to: str = ""  # a roll under way: the plan it is swapped to
    undo: bool = False  # ... to take back a roll that failed its gate
    leaving: bool = False  # its copy is scaled in: out of the router, drained, then stopped
    fresh: bool = False  # a new copy starting (scaled out): its serving is not a restart
    since: float = 0.0  # a roll under way: when it left the router
    drained_s: float = 0.0


class _Rec(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)


class UnitMemory(_Rec):
    """What the controller remembers of one recovery unit (:class:`Memory`, saved)."""

    state: str = "serving"
    until: float = 0.0
    restarts: list[float] = []  # times of restarts within the policy's window
    detected: float | None = None
    reason: str = ""
    failing: list[str] = []
    to: str = ""  # a roll under way: the plan the unit is swapped to ("new", or "old" when rolled back)
    undo: bool = False  # ... to take back a roll that failed its gate
    leaving: bool = False  # its copy is scaled in
    fresh: bool = False  # a new copy, starting
    since: float = 0.0  # a roll under way: when the unit left the router
    drained_s: float = 0.0


class ControlMemory(_Rec):
    """The controller's memory of a deployment, saved in its record."""

    revision: int = 0  # the spec revision adopted last
    restarts: int = 0  # restarts made, in all, by every controller of the deployment
    units: dict[str, UnitMemory] = {}
    node_down: dict[str, float] = {}  # node -> since when it does not answer
    lost: list[str] = []
    finished: RolloutState | None = None  # the last rollout that converged (what its command reports)
    standby: list[str] = []  # copies serving as hot standbys, out of the router
    copies: int = 0  # copies the plan runs
    scaled: bool = True  # the copy count and standbys are as the spec wants, every unit serving
