"""What holds a campaign's nodes now, for ``campaign run --dry-run``.

A group's ``up`` is refused, before anything starts, when its nodes are held: by a live
deployment of the state directory (``nodes-in-use``: the rule of
:func:`k3launch.api.nodes_in_use`), or by what runs on the nodes (the pre-flight checks of
:func:`k3launch.api.doctor`: another deployment's engines, busy
planned ports, an unreachable node, ...). The dry run asks both, read-only, for the groups still
to run — the doctor once per distinct placement (groups on the same nodes and ports share one) —
so a run that would start nothing says so before it is started. Slurm inventories are not
checked: Slurm arbitrates their nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch import api
from k3launch.campaign.run import Prepared, named_plan
from k3launch.errors import K3Error
from k3launch.models.access import Access
from k3launch.models.backends import Feature, spec

if TYPE_CHECKING:
    from k3launch.models.plan import Plan


@dataclass(frozen=True)
class Held:
    """One finding on the nodes of some groups."""

    groups: list[int]
    node: str  # "-": not one node's
    check: str  # nodes-in-use, leftover (the campaign's own deployment), or a doctor check (leftovers, ports, reachable, ...)
    detail: str
    blocking: bool  # `up` refuses these groups as things stand (else a note)


def held(prep: Prepared, todo: Mapping[int, int], state_dir: Path | None = None, access: Access = Access()) -> list[Held]:
    """Findings for the groups with cells still to run (``todo``: group index -> cells to run)."""
    traits = spec(prep.inventory.backend)
    if not traits.holds_nodes:
        return []
    records = {r.name: r for r in api.deployments(state_dir)}
    in_use = api.nodes_in_use(state_dir)
    root = api.state_root(state_dir)
    found: dict[tuple[str, str, str, bool], list[int]] = {}
    placements: dict[tuple[object, ...], tuple[Plan, list[int]]] = {}
    for g in prep.groups:
        if not todo.get(g.index):
            continue
        try:
            plan = named_plan(prep, g)
        except K3Error:
            continue  # the run records its cells as not planned
        own = records.get(plan.name)
        if own is not None:
            # an interrupted run's deployment of this group: reused, or taken down before the up
            found.setdefault(
                (
                    "-",
                    "leftover",
                    f"{plan.name} is in the state dir ({own.state}): the run reuses it when ready and healthy, else takes it down first",
                    False,
                ),
                [],
            ).append(g.index)
        for h in plan.hosts:  # what `up` refuses first: a node a live deployment of the state dir holds
            holder = in_use.get(h.address)
            if h.gpus and holder is not None and holder != plan.name:
                found.setdefault(
                    (h.name, "nodes-in-use", f"{h.address} is held by live deployment {holder} (in {root})", True), []
                ).append(g.index)
        if own is None:  # its own processes would be leftovers by name until the run takes them down
            key = (tuple((h.name, h.address) for h in plan.hosts), tuple((u.node, u.address, u.port) for u in plan.ports))
            placements.setdefault(key, (plan, []))[1].append(g.index)
    for plan, groups in placements.values() if traits.supports(Feature.DOCTOR) else ():
        try:
            checks = api.doctor(plan, prep.inventory, state_dir=state_dir, access=access).checks
        except K3Error as exc:
            found.setdefault(("-", exc.code, exc.message, True), []).extend(groups)
            continue
        for c in checks:
            if c.status == "fail" or (c.status == "warn" and c.name == "leftovers"):
                found.setdefault((c.node, c.name, c.detail, c.status == "fail"), []).extend(groups)
    return [Held(sorted(set(gs)), node, check, detail, blocking) for (node, check, detail, blocking), gs in found.items()]


def refused_groups(holds: list[Held]) -> list[int]:
    """The groups `up` would refuse as things stand."""
    return sorted({g for h in holds if h.blocking for g in h.groups})
