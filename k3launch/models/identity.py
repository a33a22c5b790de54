"""Whose a process is: the identity of a deployment beyond its name.

A name is unique only inside one state directory: two state directories (two users' ``~/.k3launch``,
a CI job's ``K3LAUNCH_STATE_DIR``) may each run a ``k3-demo``. So every deployment gets an id when
``up`` makes its record (``record.deployment_id``): ``<state id>-<6 random hex>``, where the state
id is 8 random hex made once per state directory (its ``id`` file, :meth:`StateStore.state_id
<k3launch.deploy.state.StateStore.state_id>`). Every process carries it as ``K3LAUNCH_ID`` beside
the ``K3LAUNCH_DEPLOYMENT`` name marker, its run directory on the node is
``<workdir>/k3launch/<name>.<id>/<process>`` (``.`` is never part of a name), and a container is
labelled ``k3launch.id=<id>`` and ``k3launch.owner=<state id>``.

Which processes of a name an action touches (:class:`Owned`):

* a record with an id: exactly that id (``down``, a supervisor's restarts);
* a record without one (written before ids existed): every process of the name, as before;
* no record (lost, or never here): the processes of every deployment of *this* state directory,
  i.e. ids starting with its state id -- never another state directory's;
* ``down --any-owner``: every process of the name, whoever started it.

Ids are lowercase hex and ``-`` only, so they are safe as shell words, labels and path parts.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

STATE_ID = re.compile(r"[0-9a-f]{8}")
DEPLOYMENT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{6}")
ID_ENV = "K3LAUNCH_ID"  # the marker beside K3LAUNCH_DEPLOYMENT
ID_LABEL = "k3launch.id"
OWNER_LABEL = "k3launch.owner"
NOBODY = "-"  # an owner no deployment id starts with (ids are hex)
JOB_COMMENT = "k3launch-id="  # a Slurm job's --comment: this, then the deployment id


def new_state_id() -> str:
    """A state directory's id (made once, kept in its ``id`` file)."""
    return secrets.token_hex(4)


def new_suffix() -> str:
    """The random part of a deployment id (tests replace it for deterministic scripts)."""
    return secrets.token_hex(3)


def new_deployment_id(state_id: str) -> str:
    return f"{state_id}-{new_suffix()}"


def owner_of(deployment_id: str) -> str:
    """The state id a deployment id starts with ("" for none)."""
    return deployment_id.split("-", 1)[0] if deployment_id else ""


@dataclass(frozen=True)
class Owned:
    """Which processes of a deployment name count as the deployment's: one deployment's
    (``id``), every deployment of one state directory (``owner``), or -- neither set -- any
    process carrying the name (a record older than ids, or ``down --any-owner``)."""

    id: str = ""
    owner: str = ""

    @classmethod
    def of(cls, deployment_id: str) -> Owned:
        """A record's: exactly its id, or (a record older than ids) anything of its name."""
        return cls(id=deployment_id) if deployment_id else cls()

    @property
    def anyone(self) -> bool:
        return not (self.id or self.owner)

    def glob(self) -> str:
        """A shell ``case`` pattern for ``K3LAUNCH_ID`` ("" matches any process of the name)."""
        return self.id or (f"{self.owner}-*" if self.owner else "")

    def label_filters(self) -> list[str]:
        """``docker/podman ps`` filters, added to the name's label filter (label filters are ANDed)."""
        if self.id:
            return [f"label={ID_LABEL}={self.id}"]
        return [f"label={OWNER_LABEL}={self.owner}"] if self.owner else []

    @classmethod
    def from_state(cls, state_id: str | None) -> Owned:
        """Every deployment of the state directory with id ``state_id``; None (it has no id yet, so
        nothing started from it runs): nothing at all -- never anyone's."""
        return cls(owner=state_id or NOBODY)

    def says(self) -> str:
        """How a report names what was searched for."""
        if self.id:
            return f" (deployment id {self.id})"
        if self.owner:
            return " started from this state directory" + (f" (id {self.owner})" if self.owner != NOBODY else "")
        return ""


ANY = Owned()  # every process of a name: a record older than ids, or `down --any-owner`
