"""A campaign expanded and planned (:class:`Prepared`): what a run, a dry run and a report start from.

Besides the matrix it answers, from the rows already recorded, what is left to measure: a cell
without a valid row; with ``repeats: N``, the runs of a point that have no valid row; with
``sla:``, the searches whose replay over the recorded probes still wants a probe
(:mod:`k3launch.campaign.sla`). And it turns rows into what reports show: one row per point
(:mod:`k3launch.campaign.repeats`) and each search's capacity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch import api
from k3launch.campaign import repeats, sla
from k3launch.campaign.file import Campaign, load_campaign
from k3launch.campaign.matrix import (
    Cell,
    DeploymentSpec,
    Group,
    cell_id,
    expand,
    group,
    invalid_reason,
    label,
    plan_hash,
    varying_axes,
    workload_key,
)
from k3launch.campaign.results import ResultRow
from k3launch.errors import K3Error
from k3launch.models.bench import LoadPoint

if TYPE_CHECKING:
    from k3launch.models.cordon import Cordon
    from k3launch.models.plan import Plan
    from k3launch.planning.inventory import Inventory

ByCell = dict[str, list[ResultRow]]  # cell -> its rows, one per run (results.latest)


def sha256_of(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


@dataclass(frozen=True)
class Searched:
    """One SLA search of a deployment group: at one point of the other load axes."""

    group: int
    deployment: str  # the group's label
    base: LoadPoint  # the searched axis at its default
    capacity: sla.Capacity
    next_probe: float | None  # the probe a run would measure next (None: the search is over)

    def as_json(self) -> dict[str, object]:
        c = self.capacity
        return {
            "group": self.group,
            "deployment": self.deployment,
            "load": self.base.key,
            "variable": c.variable,
            "status": c.status,
            "capacity": c.capacity,
            "tolerance": c.tolerance,
            "bracket": [None if p is None else p.value for p in (c.passing, c.failing)],
            "probes": [{"value": p.value, "passed": p.passed, "why": p.why} for p in c.probes],
        }


@dataclass
class Prepared:
    """A campaign expanded and planned: what a run, a dry run and a report all start from."""

    campaign: Campaign
    path: Path
    sha256: str
    inventory: Inventory
    cells: list[Cell]
    plans: dict[str, Plan]  # spec key -> plan (no name, the file's port base): what cells are keyed on
    refused: dict[str, K3Error]  # spec key -> why it cannot be planned
    groups: list[Group]
    varying: list[str]
    port_base: int | None  # what this run's deployments use (--port-base, else the file's)
    excluded: int = 0  # cells of the full product that `exclude` dropped
    workload: str = ""  # the dataset settings' part of every cell id (campaign.workload_key)
    state_dir: Path | None = None  # where the run's deployments are recorded, and cordons read
    # The inventory's cordoned nodes when the campaign was planned: every plan of the run is made
    # with these, so a group's plan keeps its hash; a node cordoned later makes `up` refuse the
    # plans that would use it (the group's cells stay to run) instead of changing them under the run.
    cordons: dict[str, Cordon] = field(default_factory=dict)
    inventory_path: str | None = None  # the inventory's file: what `k3launch uncordon -i` takes

    def cell_ids(self) -> set[str]:
        """The cells of this expansion (a changed file's older rows are not among them; an SLA
        search's probes are not known in advance: see :meth:`current`)."""
        ids = {g.cell_id(ld) for g in self.groups for ld in g.loads}
        return ids | {cell_id(refused_hash(c.spec), c.load, self.workload) for c in self.cells if c.spec.key in self.refused}

    def current(self, rows: Iterable[ResultRow]) -> list[ResultRow]:
        """The rows of this matrix: its cells, and the probes of its SLA searches."""
        ids = self.cell_ids()
        s = self.campaign.sla
        if s is None:
            return [r for r in rows if r.cell in ids]
        default = LoadPoint.model_fields[s.variable].default
        # a probe is its search's base point (the searched axis at its default) with that axis set
        bases = {g.cell_id(ld) for g in self.groups for ld in g.loads}

        def base_of(r: ResultRow) -> str:
            return cell_id(r.cell.split("/", 1)[0], r.load.model_copy(update={s.variable: default}), self.workload)

        return [r for r in rows if r.cell in ids or base_of(r) in bases]

    def still_valid(self, row: ResultRow) -> bool:
        """A row's figures pass the campaign's validity gates as the file says them now."""
        return row.metrics is not None and invalid_reason(row.metrics, self.campaign.validity) is None

    def rejudge(self, row: ResultRow) -> ResultRow:
        """A valid row whose figures fail the gates as they are now: invalid, with the reason and
        without numbers (as a resumed run would measure it again)."""
        if not row.valid or row.metrics is None or self.still_valid(row):
            return row
        why = invalid_reason(row.metrics, self.campaign.validity)
        return row.model_copy(update={"valid": False, "metrics": None, "slo": {}, "reason": f"{why} (by the current validity gates)"})

    def spec_label(self, spec: DeploymentSpec) -> str:
        return label(spec, self.varying)

    # ---- what is left to measure, and what the runs add up to ----------------------------------

    @staticmethod
    def by_cell(rows: Iterable[ResultRow]) -> ByCell:
        out: ByCell = {}
        for r in rows:
            out.setdefault(r.cell, []).append(r)
        return out

    def missing_runs(self, cell: str, by_cell: ByCell, *, attempted: bool = False) -> list[int]:
        """The runs of a point still to measure: without a valid row (``attempted``: without any row)."""
        have = {r.run for r in by_cell.get(cell, []) if attempted or (r.valid and self.still_valid(r))}
        return [i for i in range(self.campaign.repeats.runs) if i not in have]

    def point(self, runs: Sequence[ResultRow]) -> ResultRow:
        v = self.campaign.validity
        slo = self.campaign.sla.slo if self.campaign.sla is not None else None
        return repeats.point(sorted(runs, key=lambda r: r.run), self.campaign.repeats.confidence, v.max_spread, slo)

    def points(self, rows: Iterable[ResultRow]) -> list[ResultRow]:
        """One row per point (medians and intervals of its runs), rows already judged by the gates."""
        return [self.point(rs) for rs in self.by_cell(rows).values()]

    def search(self, g: Group, base: LoadPoint, by_cell: ByCell) -> Searched:
        """Replay the SLA search of ``g`` at ``base`` over the probes recorded in ``by_cell``."""
        s = self.campaign.sla
        assert s is not None

        def verdict(value: float) -> tuple[bool, str] | None:
            cell = g.cell_id(sla.probe_load(base, s.variable, value))
            if self.missing_runs(cell, by_cell, attempted=True):
                return None
            # an invalid probe (failed requests, a spread too wide) counts as missing the SLOs: it is
            # information about this load, not a gap to measure again
            pt = self.point([self.rejudge(r) for r in by_cell[cell]])
            if not pt.valid:
                return False, f"invalid: {pt.reason}"
            return sla.judge(s.slo, {k: repeats.figure(pt, k) for k in s.slo})

        found, nxt = sla.replay(s, verdict)
        return Searched(g.index, self.spec_label(g.specs[0]), base, found, nxt)

    def searches(self, rows: Iterable[ResultRow]) -> list[Searched]:
        by_cell = self.by_cell(rows)
        return [self.search(g, ld, by_cell) for g in self.groups for ld in g.loads] if self.campaign.sla else []

    def todo(self, g: Group, rows: Iterable[ResultRow]) -> list[LoadPoint]:
        """The load points of ``g`` with something left to measure (``rows``: results.latest)."""
        by_cell = self.by_cell(rows)
        if self.campaign.sla is not None:
            return [ld for ld in g.loads if self.search(g, ld, by_cell).next_probe is not None]
        return [ld for ld in g.loads if self.missing_runs(g.cell_id(ld), by_cell)]


def _inventory_path(c: Campaign, path: Path) -> Path:
    if c.inventory is None:
        return api.bundled_inventory("local")
    ref = c.inventory
    if "/" not in ref and not ref.endswith((".yaml", ".yml")):
        return api.bundled_inventory(ref)
    p = Path(ref).expanduser()
    return p if p.is_absolute() else path.parent / p


def _inventory(c: Campaign, path: Path) -> Inventory:
    from k3launch.planning.inventory import Inventory

    inv, _ = api.load(_inventory_path(c, path))
    if not c.engine_env:
        return inv
    data = inv.model_dump()
    data["defaults"]["env"] = {**(inv.defaults.env or {}), **c.engine_env}  # the campaign's engine env wins
    return Inventory.model_validate(data)


def build_plan(inv: Inventory, spec: DeploymentSpec, port_base: int | None, name: str | None = None, *,
               cordons: Mapping[str, Cordon] | None = None, inventory_path: str | None = None) -> Plan:
    """``cordons``: the inventory's cordoned nodes to skip (None: those of the default state directory)."""
    loaded = api.Loaded(inv, inventory_path or inv.name)
    return api.plan(loaded, selection=spec.fields(), name=name, port_base=port_base, cordons=cordons)  # Selection owns the defaults and "all"


def campaign_path(ref: Path) -> Path:
    """A file, or the name of a bundled campaign (``local-demo``)."""
    if ref.exists() or ref.suffix in (".yaml", ".yml") or "/" in str(ref):
        return ref
    from k3launch.util.resources import bundled

    return bundled("campaigns", f"{ref}.yaml") or ref


def prepare(path: Path, *, port_base: int | None = None, state_dir: Path | None = None) -> Prepared:
    """The campaign at ``path`` expanded and planned; plans skip the nodes cordoned in ``state_dir``."""
    path = campaign_path(path)
    c = load_campaign(path)
    inv = _inventory(c, path)
    inv_path = str(_inventory_path(c, path))
    cordons = api.cordoned(inv, state_dir)  # read once: see Prepared.cordons
    cells = expand(c)
    plans: dict[str, Plan] = {}
    refused: dict[str, K3Error] = {}
    for cell in cells:
        key = cell.spec.key
        if key in plans or key in refused:
            continue
        try:
            # the file's port base: a cell is the same cell whatever --port-base a run uses
            plans[key] = build_plan(inv, cell.spec, c.port_base, cordons=cordons, inventory_path=inv_path)
        except K3Error as exc:
            refused[key] = exc
    hashes = {k: plan_hash(p) for k, p in plans.items()}
    specs = list({cell.spec.key: cell.spec for cell in cells}.values())
    full = c.deployment_points() * c.load_points()  # counted, not built again
    workload = workload_key(c.bench.seed, c.bench.random_range_ratio)
    return Prepared(
        c,
        path,
        sha256_of(path) or "",
        inv,
        cells,
        plans,
        refused,
        group(cells, hashes, workload),
        varying_axes(specs),
        port_base if port_base is not None else c.port_base,
        full - len(cells),
        workload,
        state_dir,
        cordons,
        inv_path,
    )


def refused_hash(spec: DeploymentSpec) -> str:
    """A stand-in plan hash for a deployment that has no plan (its cells still get rows)."""
    return "refused-" + hashlib.sha256(spec.key.encode()).hexdigest()
