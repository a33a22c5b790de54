"""k3launch's own metrics: a controller's view of its deployment (docs/monitoring.md): pure.

Read from the controller's memory after every look (units, restarts, lost nodes, standbys), its
rollout, the record's bring-up timeline, and from what the look saw (the routers'
worker lists, the canary's last result). The alert rules (:mod:`k3launch.render.alerts`) read
these names; :mod:`k3launch.deploy.control.exporter` serves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from k3launch.models.control.memory import ControlMemory, UnitState
from k3launch.models.record import DeploymentRecord
from k3launch.models.rollout import RolloutState


@dataclass(frozen=True)
class Family:
    name: str  # a counter's name without ``_total``
    kind: Literal["gauge", "counter"]
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


@dataclass(frozen=True)
class Seen:
    """What one look saw beyond the record."""

    time: float  # when the look was made
    out_of_router: int | None = None  # serving units a router does not list (None: no regular router)
    canary: tuple[bool, float] | None = None  # the last replay: every target agreed, when; None: none yet


def families(rec: DeploymentRecord, mem: ControlMemory | None, ro: RolloutState | None, seen: Seen) -> list[Family]:
    """``mem`` and ``ro``: the controller's memory and rollout as of the look (the record's copy
    of them is written through the backend, and may lag)."""
    d = {"deployment": rec.name}
    units = mem.units if mem is not None else {}
    wanted = [u for u in units.values() if not u.leaving]
    states: dict[str, int] = {s.value: 0 for s in UnitState}
    for u in units.values():
        states[u.state] = states.get(u.state, 0) + 1
    out = [
        Family("k3launch_units_desired", "gauge", "Units (copies, standbys, pools) the deployment's spec wants.", [(d, float(len(wanted)))]),
        Family("k3launch_units_serving", "gauge", "Units that serve.", [(d, float(sum(u.state == UnitState.SERVING for u in wanted)))]),
        Family("k3launch_units", "gauge", "Units by the controller's state of them.",
               [({**d, "state": s}, float(n)) for s, n in sorted(states.items())]),
        Family("k3launch_units_given_up", "gauge", "Units the controller gave up: nothing restarts them.", [(d, float(states[UnitState.GAVE_UP]))]),
        Family("k3launch_standbys", "gauge", "Copies waiting as hot standbys, out of the router.", [(d, float(len(mem.standby) if mem else 0))]),
        Family("k3launch_restarts", "counter", "Restarts made by every controller of the deployment.", [(d, float(mem.restarts if mem else 0))]),
        Family("k3launch_nodes_lost", "gauge", "Nodes lost: unreachable past node_lost_after.", [(d, float(len(mem.lost) if mem else 0))]),
        Family("k3launch_last_look_timestamp_seconds", "gauge", "When the controller last looked at every process.", [(d, seen.time)]),
        Family("k3launch_rollout_active", "gauge", "1 while a rollout is under way (not stopped).",
               [(d, 1.0 if ro is not None and not ro.stopped else 0.0)]),
    ]
    if seen.out_of_router is not None:
        out.append(Family("k3launch_units_out_of_router", "gauge", "Serving units a router does not list.", [(d, float(seen.out_of_router))]))
    if ro is not None:
        out += [
            Family("k3launch_rollout_units_pending", "gauge", "Units not on the rollout's target plan yet.", [(d, float(len(ro.pending())))]),
            Family("k3launch_rollout_progress_timestamp_seconds", "gauge", "When a unit of the rollout last changed plan.", [(d, ro.updated)]),
        ]
    if seen.canary is not None:
        agree, when = seen.canary
        out += [
            Family("k3launch_canary_agree", "gauge", "1 when every target's answers matched the canary baseline in the last replay.",
                   [(d, 1.0 if agree else 0.0)]),
            Family("k3launch_canary_timestamp_seconds", "gauge", "When the last canary replay ended.", [(d, when)]),
        ]
    tl = rec.timeline
    if tl is not None and tl.ready:
        # the bring-up's wall time, its slowest rank's phases, and the weight loads vLLM reported
        out.append(Family("k3launch_bringup_seconds", "gauge", "The last bring-up: from its start until every process served.",
                          [(d, max(0.0, tl.ended - tl.started))]))
        spent: dict[str, float] = {}
        loads = [t for p in tl.processes for t in p.weights_took]
        for p in tl.processes:
            for span in p.phases:
                spent[span.phase] = max(spent.get(span.phase, 0.0), span.seconds)
        out.append(Family("k3launch_bringup_phase_seconds", "gauge", "The last bring-up: the longest any process spent in each phase.",
                          [({**d, "phase": str(ph)}, v) for ph, v in sorted(spent.items())]))
        if loads:
            out.append(Family("k3launch_weights_load_seconds", "gauge", "The last bring-up: the slowest rank's weight load, as vLLM logged it.",
                              [(d, max(loads))]))
    return out
