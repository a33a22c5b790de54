"""The gates of a rollout beyond health and a completion: the correctness canary
(:mod:`k3launch.deploy.canary`) replayed on each restarted unit, and two gates as one."""

from __future__ import annotations

import time
from collections.abc import Sequence

from k3launch.deploy.rollout import Gate
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan, Process


def refuse_stale(st: StateStore, name: str, rebaseline_reasons: Sequence[str], rebaseline: bool) -> None:
    """A change that makes the canary's recorded answers stale (another model, vLLM or
    sampling-relevant flag) is refused unless ``rebaseline``: then the first unit rolled records
    new answers, and every later one is compared with them."""
    from k3launch.deploy import canary as io

    if rebaseline_reasons and not rebaseline and io.load(st, name) is not None:
        raise K3Error("canary-rebaseline", f"this change makes the canary's recorded answers stale ({rebaseline_reasons[0]})",
                      "add --rebaseline (the first unit rolled records new answers, the others are compared with them), "
                      "or --no-canary")


def canary_gate(st: StateStore, name: str, rebaseline: bool) -> Gate | None:
    """The canary as a rollout gate: each restarted unit's targets (its engines, its P/D pairings,
    the router) replay the baseline. None when there is no baseline. ``rebaseline``: the first
    unit that passes records new answers (:func:`refuse_stale` decided that it may)."""
    from k3launch.deploy import canary as io

    if io.load(st, name) is None:
        return None
    fresh = [rebaseline]  # a new baseline is still to be recorded

    def gate(plan: Plan, engines: Sequence[Process]) -> str:
        ids = [e.id for e in engines]
        if fresh[0]:
            mine = plan.model_copy(update={"processes": list(engines)})
            baseline, reports = io.record(mine, name)
            bad = [r for r in reports if r.outcome != "ok"]
            if bad:
                return "canary: the unit's servers disagree: " + "; ".join(f"{r.target} {r.outcome} {r.reason}" for r in bad[:3])
            io.save(st, baseline)
            fresh[0] = False
            return ""
        report = io.check(st, name, plan, only=ids)
        if report is None:
            return ""
        if report.mismatches:
            from k3launch.deploy import eventlog
            from k3launch.models.supervise import Event

            for m in report.mismatches:  # as a supervisor's replay would say it: `k3launch events`, and a hook's pager
                eventlog.append(st, Event(time=time.time(), kind="canary-mismatch", deployment=name, process=ids[0] if ids else None,
                                          reason=f"rollout gate: {m.line()}"))
            return "canary: " + "; ".join(m.line() for m in report.mismatches[:3])
        failed = [r for r in report.targets if r.outcome != "ok"]
        return "canary: " + "; ".join(f"{r.target} {r.outcome}: {r.reason}" for r in failed[:3]) if failed else ""

    return gate


