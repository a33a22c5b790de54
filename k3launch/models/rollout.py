"""A rollout as the deployment's record keeps it: both plans and which unit runs which.

A rollout (``k3launch rollout``) changes a live deployment one recovery unit at a time, so for its
whole length the deployment runs two plans at once. The record says so, in order that ``status``
can show it and a stopped rollout can be resumed (``--continue``) or undone (``--rollback``) by a
later command, on this login node or another one:

* ``old`` is the plan the deployment ran before the rollout, ``new`` the one it rolls to; the
  record's own ``plan`` is always what runs now (old for some units, new for the others);
* ``units`` lists the units to roll, in order, each with the plan it runs (``on``), and why its
  last attempt failed its gate, if it did;
* ``stopped`` says why the rollout stopped ("" while the controller rolls it);
* the rollout's parameters (``max_unavailable``, ``drain_timeout``, ``start_timeout``, the canary
  gate) and its ``revision``: a rollout is a change of the deployment's desired state, written by
  the ``rollout`` command (:mod:`k3launch.models.control`) and converged by the one controller
  (:mod:`k3launch.deploy.control.loop`), unit by unit, which records each unit's progress here.

The record drops the rollout once every unit runs the new plan (or, after ``--rollback``, the old:
``back``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from k3launch.models.plan import Plan

On = Literal["old", "rolling", "new"]


class _Rec(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)


class RolloutUnit(_Rec):
    name: str
    processes: list[str]
    on: On = "old"  # "rolling": out of the router and restarting
    failed: str = ""  # why its last attempt failed the gate
    seconds: float = 0.0  # its last roll: from leaving the router to serving the target plan, gated
    drained_s: float = 0.0  # of which waiting for its in-flight requests
    downtime_s: float = 0.0  # no router in front (--allow-downtime): from its stop until it served again


class RolloutState(_Rec):
    old: Plan
    new: Plan
    changes: list[str]  # what was asked, as typed (`--set max-num-seqs=4`, `--image ...`)
    units: list[RolloutUnit]
    started: float
    updated: float
    stopped: str = ""  # why it stopped; "" while the controller rolls it
    surge: bool = False  # --surge: the new set started beside the old one (units: the new set's)
    revision: int = 0  # the spec revision that asked for it (the controller adopts a higher one)
    back: bool = False  # --rollback: the rolled units go back to ``old``, last rolled first
    max_unavailable: int = 1  # units out of the router at once
    drain_timeout: float = 120.0
    start_timeout: float | None = None  # None: the plan's ready timeout
    canary: bool = True  # the gate replays the correctness canary too
    rebaseline: bool = False  # the first unit rolled records the canary anew
    routes: bool = True  # units leave the router while they roll (False: P/D, or no router: in place, --allow-downtime)
    logs: list[str] = []  # the kept log tails of the unit that failed its gate

    @property
    def target(self) -> On:
        """The plan the units roll to: ``new``, or ``old`` for a rollback."""
        return "old" if self.back else "new"

    def pending(self) -> list[str]:
        """The units that do not run the target plan yet, in rollout order."""
        return [u.name for u in self.units if u.on != self.target]

    def rolled(self) -> list[str]:
        """The units that run (or may run: "rolling") the new plan: what ``--rollback`` takes back."""
        return [u.name for u in self.units if u.on != "old"]

    def unit(self, name: str) -> RolloutUnit | None:
        return next((u for u in self.units if u.name == name), None)

    def done(self) -> bool:
        """Every unit runs the target plan."""
        return not self.pending()

    def mark(self, unit: str, on: On, failed: str, now: float) -> None:
        for u in self.units:
            if u.name == unit:
                u.on, u.failed = on, failed
        self.updated = now


class RolloutStatus(_Rec):
    """``status``: a rollout under way (``stopped`` "") or stopped, without its plans."""

    changes: list[str]
    units: list[RolloutUnit]
    stopped: str = ""

    @classmethod
    def of(cls, state: RolloutState) -> RolloutStatus:
        return cls(changes=state.changes, units=state.units, stopped=state.stopped)


def changes_typed(sets: Sequence[str], unsets: Sequence[str], env: Sequence[str], image: str | None,
                  vllm_version: str | None) -> list[str]:
    """The options of a rollout, as a user types them (the record's ``changes``)."""
    return ([f"--set {s}" for s in sets] + [f"--unset {u}" for u in unsets] + [f"--env {e}" for e in env]
            + ([f"--image {image}"] if image else []) + ([f"--vllm-version {vllm_version}"] if vllm_version else []))
