"""How k3launch reaches nodes over SSH: one value every API call that touches a node takes.

``Access`` describes the client, not the deployment: the ``ssh`` and ``local`` backends open
their connections with it, a backend that reaches no node over SSH (``slurm``) ignores it
(:mod:`k3launch.deploy.options`). It is checked when made, with the CLI's bounds, so a NaN or
negative timeout from a script is refused at once rather than waited on forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from k3launch.util.bounds import CONNECT_TIMEOUT


@dataclass(frozen=True)
class Access:
    """How k3launch reaches nodes over SSH (the ``ssh`` and ``local`` backends)."""

    APPLIES_TO: ClassVar[str] = "ssh and local"  # the backends that use it (deploy.options.BackendOptions)
    accept_unknown_hosts: bool = False  # accept (and remember) host keys not in known_hosts; only ever set from an explicit user flag
    connect_timeout: float = 10.0  # seconds to wait for a node's SSH connection (ssh_config's ConnectTimeout wins)

    def __post_init__(self) -> None:
        object.__setattr__(self, "connect_timeout", CONNECT_TIMEOUT.parse("connect_timeout", self.connect_timeout))

    def given(self) -> list[str]:
        return []  # the client's own settings: a backend that reaches no node over SSH has nothing to refuse
