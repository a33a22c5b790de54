"""What ``up`` and the other lifecycle calls take besides the plan: generic options, and each
backend's own option types (submitit's ``slurm_*`` parameters, as types).

:class:`UpOptions` means the same on every backend. A backend's own options are a type of their
own, handed to the backend when :func:`k3launch.deploy.registry.backend` builds it: a backend
takes the option types it lists in ``OPTIONS`` and never sees the others. Options that describe
the client (how k3launch reaches nodes: :class:`~k3launch.models.access.Access`, a model because
every layer above passes it on) are ignored by a backend that reaches none; options that change
the deployment (:class:`SlurmOptions`) are refused by the others, in the registry, one
``not-supported`` line naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from k3launch.models.supervise import RestartPolicy


class BackendOptions(Protocol):
    APPLIES_TO: ClassVar[str]  # the backends that take it, for the refusal

    def given(self) -> list[str]:
        """The flags set to something other than their defaults that a backend without this type must refuse."""
        ...


@dataclass(frozen=True)
class UpOptions:
    """Everything ``up`` takes besides the plan and the inventory that means the same on every backend."""

    ready_timeout: float | None = None
    keep_on_failure: bool = False
    force: bool = False  # use nodes another live deployment holds (backends whose nodes k3launch arbitrates)
    skip_doctor: bool = False
    supervise: RestartPolicy | None = None  # the deployment supervises itself under this policy (feature self-supervise)


@dataclass(frozen=True)
class SlurmOptions:
    """The job's own settings (the ``slurm`` backend)."""

    APPLIES_TO: ClassVar[str] = "slurm"
    extra_sbatch: tuple[str, ...] = ()  # passed through as #SBATCH lines
    queue_timeout: float | None = None  # bound on the time in the queue (default: wait)

    def given(self) -> list[str]:
        return [f for f, v in (("--extra-sbatch", self.extra_sbatch), ("--queue-timeout", self.queue_timeout)) if v]
