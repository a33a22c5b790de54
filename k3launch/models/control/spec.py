"""The one controller's data: the desired state commands write, and the memory it keeps.

A deployment's **spec** (:class:`Spec`) is what it should be beyond its plan: the rollout it is
to converge to and the policy its controller follows. Commands never act on a live deployment
themselves: ``rollout``, ``rollout --continue`` / ``--rollback`` and ``supervise`` write a new
spec revision (``<state>/supervise/NAME.spec.json``, owner-only: an ``--on-event`` command may
carry a webhook's token) under the deployment's lock, and the controller
(:mod:`k3launch.deploy.control.loop`) adopts a higher revision at its next look and converges to it
(LeaderWorkerSet's reconcile: a rollout is a spec change). The spec lives beside the record, not
in it, so the controller's own saves of the record (processes, progress) never write an older
spec over a newer one.

The controller's **memory** (:class:`ControlMemory`: each unit's state, restart times within the
policy's window, backoff deadline, the revision it runs) is saved in the record after every look
that changed it, so a controller started again (killed, or another login node) adopts the
deployment with its memory: restart counts and backoff windows go on where they were.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from k3launch.models.access import Access
from k3launch.models.rollout import RolloutState
from k3launch.models.supervise import RestartPolicy


class _Rec(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)


class Spec(_Rec):
    """A deployment's desired state beyond its plan (a revision of it)."""

    revision: int = 0
    rollout: RolloutState | None = None  # the rollout to converge to (None: the running plan as it is)
    policy: RestartPolicy | None = None  # the controller's policy (None: the inventory's ``restart:``)
    hook: str | None = None  # --on-event: a command run with each event as JSON on stdin
    replicas: int | None = None  # serving copies wanted (``scale``; None: as many as the plan has)
    standby: int = 0  # hot standbys wanted beside them
    accept_unknown_hosts: bool = False  # the SSH client settings a detached controller uses (:attr:`access`)
    connect_timeout: float = 10.0

    @property
    def access(self) -> Access:
        """How the controller reaches the nodes: as the command that wrote this revision did."""
        return Access(self.accept_unknown_hosts, self.connect_timeout)
