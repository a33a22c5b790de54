"""Plans of a surge rollout (``k3launch rollout --surge``): the new engines beside the old ones.

A surge starts the new plan's engines on spare nodes while the old ones still serve, then
switches the router over. For that while both sets run under one deployment, so the new set's
processes need ids (and pools, hence recovery units) of their own: process ids name log
directories, the markers teardown finds processes by, and the record's entries. The new set is
a *generation*: ``serve-0`` becomes ``serve-0-g1``, and the next surge turns ``serve-0-g1`` into
``serve-0-g2``. The router keeps its id: it is not surged, only told of the new workers.
"""

from __future__ import annotations

import re

from k3launch.models.plan import Plan, PortUse, Process

_GEN = re.compile(r"-g(\d+)$")


def generation(plan: Plan) -> int:
    """The generation of ``plan``'s engines (0: never surged)."""
    gens = [int(m.group(1)) for p in plan.processes if p.role != "router" and (m := _GEN.search(p.id))]
    return max(gens, default=0)


def _next(name: str, gen: int) -> str:
    return f"{_GEN.sub('', name)}-g{gen}"


def renamed(plan: Plan, gen: int) -> Plan:
    """``plan`` with every engine process (and its pool and ports) in generation ``gen``."""
    ids = {p.id: _next(p.id, gen) for p in plan.processes if p.role != "router"}

    def one(p: Process) -> Process:
        if p.id not in ids:
            return p
        return p.model_copy(update={"id": ids[p.id], "pool": _next(p.pool, gen) if p.pool else p.pool})

    ports = [u.model_copy(update={"process": ids.get(u.process, u.process)}) for u in plan.ports]
    return plan.model_copy(update={"processes": [one(p) for p in plan.processes], "ports": ports})


def beside(old: Plan, new: Plan) -> Plan:
    """Both sets at once: ``old`` as it runs (its router included) plus ``new``'s engines, with
    the hosts and ports of both. What the record holds while the new set starts and is gated."""
    engines = [p for p in new.processes if p.role != "router"]
    hosts = [*old.hosts, *(h for h in new.hosts if h.name not in {x.name for x in old.hosts})]
    ports: list[PortUse] = [*old.ports, *(u for u in new.ports if u.process in {p.id for p in engines})]
    return old.model_copy(update={"processes": [*old.processes, *engines], "hosts": hosts, "ports": ports})
