"""``status``'s view of each recovery unit: serving or not, listed by its router or not, and the
plan it runs against the plan it should run; and the rule that a deployment is never ``ready``
while a serving unit is out of its router or a unit runs a plan it should not."""

from __future__ import annotations

from k3launch.models.control.converge import url
from k3launch.models.control.scaling import copy_of
from k3launch.models.record import DeploymentRecord, Status, UnitStatus
from k3launch.models.supervise import units
from k3launch.transport import http


def unit_states(rec: DeploymentRecord, snap: Status, ask_router: bool = True) -> tuple[list[UnitStatus], str | None]:
    """Each unit of ``rec``'s plan, and why ``snap``'s ``ready`` does not hold (None: it does).
    ``ask_router``: read each regular router's worker list from here (``/list_workers``)."""
    healthy = {p.id: bool(p.healthy) for p in snap.processes}
    plan = rec.plan
    pd = any(p.role in ("prefill", "decode") for p in plan.processes)
    router = next((p for p in plan.processes if p.role == "router"), None)
    listed = None
    if ask_router and router is not None and not pd and healthy.get(router.id):
        got = http.list_workers(url(router))
        listed = {u.rstrip("/") for u in got} if got is not None else None
    ro = rec.rollout
    memory = rec.control.units if rec.control is not None else {}
    standby = set(rec.control.standby) if rec.control is not None else set()
    out = []
    for u in units(plan):
        mine = [url(p) for p in plan.processes if p.id in u.http and p.role != "router"]
        ru = ro.unit(u.name) if ro is not None else None
        out.append(UnitStatus(
            name=u.name, serving=all(healthy.get(pid, False) for pid in u.http),
            in_router=None if listed is None or not mine or u.kind == "router" else all(m in listed for m in mine),
            desired=ro.target if ru is not None and ro is not None else "current", running=ru.on if ru is not None else "current",
            controller=memory[u.name].state if u.name in memory else None, standby=copy_of(u.name) in standby))
    if snap.state != "ready":
        return out, None
    if ro is not None and not ro.stopped:
        return out, f"rolling: {' '.join(ro.changes)} ({sum(u.on == ro.target for u in ro.units)} of {len(ro.units)} unit(s) on the target plan)"
    if ro is not None:
        return out, f"degraded: a rollout stopped halfway ({ro.stopped}); `k3launch rollout {rec.name} --continue` or `--rollback`"
    outside = [s.name for s in out if s.serving and s.in_router is False and not s.standby]
    if outside:
        return out, f"degraded: {', '.join(outside)} serve(s) but the router does not list it"
    return out, None
