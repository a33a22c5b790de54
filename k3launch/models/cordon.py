"""Cordoned nodes: nodes of an inventory that plans keep out until ``k3launch uncordon``.

A cordon is kept in the state directory (:mod:`k3launch.deploy.cordons`), keyed by inventory name
and node name; a supervisor sets one on a node it lost, a user with ``k3launch cordon``. Planning
skips cordoned nodes with a ``cordoned`` notice (Slurm: they go to ``sbatch --exclude``). These
types live below every layer that touches them: the state directory writes them, the API returns
them, the CLI shows them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

USER = "user"  # ``by`` of a cordon set at the command line or through the API


def by_supervisor(deployment: str) -> str:
    """``by`` of a cordon a supervisor set on a node of ``deployment`` it lost."""
    return f"supervisor of {deployment}"


class Cordon(BaseModel):
    """One cordoned node: since when (epoch seconds), why, and who set it."""

    # defer_build: `plan` imports this module; its validator is built only when a cordon file is read
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    node: str = Field(min_length=1)
    since: float
    reason: str = ""
    by: str = USER

    def when(self) -> str:
        """``since`` as people read it, in UTC (the login node and the compute nodes may not share a zone)."""
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))

    def describe(self) -> str:
        """``cordoned since <time> (<reason>; by <who>)``: the words of planning's notice."""
        why = "; ".join(x for x in (self.reason, f"by {self.by}") if x)
        return f"cordoned since {self.when()} ({why})"


@dataclass(frozen=True)
class CordonChange:
    """What one ``cordon`` or ``uncordon`` did to an inventory's cordons."""

    inventory: str
    changed: tuple[str, ...]  # nodes this call cordoned (not those cordoned already) or uncordoned
    unchanged: tuple[str, ...]  # nodes it left as they were: cordoned already, or not cordoned
    cordoned: dict[str, Cordon] = field(default_factory=dict)  # the inventory's cordons after the call
    set_aside: Path | None = None  # a damaged cordon file this call renamed aside (its cordons no longer apply)
