"""Which :class:`~k3launch.deploy.base.Backend` runs an inventory's deployments.

One line per backend: the inventory's ``backend`` value and where its implementation lives.
Backends are imported when first used, so a command never pays for backends it does not touch
(``plan`` imports none). :mod:`k3launch.api` is the only caller.
"""

from __future__ import annotations

from functools import cache
from importlib import import_module
from typing import TYPE_CHECKING, cast

from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.deploy.base import Backend

BACKENDS: dict[str, str] = {
    "local": "k3launch.deploy.ssh.backend:SshBackend",  # this machine: the SSH backend's local runner
    "ssh": "k3launch.deploy.ssh.backend:SshBackend",
    "slurm": "k3launch.deploy.slurm.backend:SlurmBackend",
}


@cache
def backend(name: str) -> Backend:
    """The backend registered for ``name`` (an inventory's or a record's ``backend``)."""
    ref = BACKENDS.get(name)
    if ref is None:
        raise K3Error("unknown-backend", f"no backend named {name!r}", f"backends: {', '.join(sorted(BACKENDS))}")
    module, _, cls = ref.partition(":")
    return cast("Backend", getattr(import_module(module), cls)())
