"""``k3launch campaign run``: each distinct deployment up once, all its load points, down, next.

The order of work, per deployment group (cells with the same plan hash, see
:mod:`k3launch.campaign.matrix`):

1. skip the group when every cell has a valid row in ``DIR/results.jsonl`` (resume);
2. a deployment of the same name left by an interrupted run is reused if it is ready and
   healthy, otherwise taken down first — an engine start is the expensive step, so it is never
   repeated without need;
3. ``api.up`` (one engine start), then one ``vllm bench serve`` per missing load point, each
   appended as a row as soon as it ends (a crash loses at most the load point in progress);
4. ``api.down``, also on errors and Ctrl-C/SIGTERM.

A deployment that cannot be planned, or was started and failed, yields invalid rows with the
reason; one refused before anything started (nodes held, a failed pre-flight check) yields no
rows (its cells were not attempted: the summary says why). The campaign goes on with the next
group. Deployment names are ``<campaign>-<plan hash prefix>``, the same on every run and machine.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch import __version__, api
from k3launch.campaign import bench as benchmod
from k3launch.campaign.file import Campaign, load_campaign
from k3launch.campaign.matrix import (
    Cell,
    DeploymentSpec,
    Group,
    cell_id,
    deployment_name,
    deployment_specs,
    expand,
    group,
    invalid_reason,
    label,
    load_points,
    plan_hash,
    varying_axes,
    workload_key,
)
from k3launch.campaign.results import Provenance, ResultRow, append_row, done_cells, group_lock, latest, make_out, read_rows, write_csv
from k3launch.errors import K3Error
from k3launch.models.bench import LoadPoint

if TYPE_CHECKING:
    from k3launch.models.plan import Plan
    from k3launch.models.record import DeploymentRecord
    from k3launch.planning.inventory import Inventory

EventFn = Callable[[str], None]


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


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

    def cell_ids(self) -> set[str]:
        """The cells of this expansion (a changed file's older rows are not among them)."""
        ids = {g.cell_id(ld) for g in self.groups for ld in g.loads}
        return ids | {cell_id(refused_hash(c.spec), c.load, self.workload) for c in self.cells if c.spec.key in self.refused}

    def still_valid(self, row: ResultRow) -> bool:
        """A row's figures pass the campaign's validity gates as the file says them now."""
        return row.metrics is not None and invalid_reason(row.metrics, self.campaign.validity) is None

    def rejudge(self, row: ResultRow) -> ResultRow:
        """A valid row whose figures fail the gates as they are now: invalid, with the reason and
        without numbers (as a resumed run would measure it again)."""
        if not row.valid or row.metrics is None or self.still_valid(row):
            return row
        why = invalid_reason(row.metrics, self.campaign.validity)
        return row.model_copy(update={"valid": False, "metrics": None, "reason": f"{why} (by the current validity gates)"})

    def spec_label(self, spec: DeploymentSpec) -> str:
        return label(spec, self.varying)


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


def build_plan(inv: Inventory, spec: DeploymentSpec, port_base: int | None, name: str | None = None) -> Plan:
    return api.plan(inv, selection=spec.fields(), name=name, port_base=port_base)  # Selection owns the defaults and "all"


def campaign_path(ref: Path) -> Path:
    """A file, or the name of a bundled campaign (``local-demo``)."""
    if ref.exists() or ref.suffix in (".yaml", ".yml") or "/" in str(ref):
        return ref
    from k3launch.util.resources import bundled

    return bundled("campaigns", f"{ref}.yaml") or ref


def prepare(path: Path, *, port_base: int | None = None) -> Prepared:
    path = campaign_path(path)
    c = load_campaign(path)
    inv = _inventory(c, path)
    cells = expand(c)
    plans: dict[str, Plan] = {}
    refused: dict[str, K3Error] = {}
    for cell in cells:
        key = cell.spec.key
        if key in plans or key in refused:
            continue
        try:
            # the file's port base: a cell is the same cell whatever --port-base a run uses
            plans[key] = build_plan(inv, cell.spec, c.port_base)
        except K3Error as exc:
            refused[key] = exc
    hashes = {k: plan_hash(p) for k, p in plans.items()}
    specs = list({cell.spec.key: cell.spec for cell in cells}.values())
    full = len(deployment_specs(c)) * len(load_points(c))
    workload = workload_key(c.bench.seed, c.bench.random_range_ratio)
    return Prepared(c, path, _sha256(path) or "", inv, cells, plans, refused, group(cells, hashes, workload), varying_axes(specs),
                    port_base if port_base is not None else c.port_base, full - len(cells), workload)


def refused_hash(spec: DeploymentSpec) -> str:
    """A stand-in plan hash for a deployment that has no plan (its cells still get rows)."""
    return "refused-" + hashlib.sha256(spec.key.encode()).hexdigest()


@dataclass
class Options:
    out: Path
    state_dir: Path | None = None
    only_group: int | None = None
    client: str | None = None  # overrides the campaign's bench.client
    on_event: EventFn = field(default=lambda msg: None)
    # Inside a job array task (--slurm-array): the task's own job started the group's deployment;
    # use it as it is (no up, no down).
    attached: bool = False


@dataclass(frozen=True)
class Refusal:
    """A group whose deployment was refused before anything of it started: its cells did not run."""

    group: int
    name: str  # the deployment name
    label: str  # its axis values
    cells: int
    code: str
    message: str
    hint: str


@dataclass
class Summary:
    cells: int = 0
    skipped: int = 0  # already valid in the results file
    ran: int = 0
    valid: int = 0
    invalid: int = 0
    not_run: int = 0  # cells of refused groups: no row written, a later run tries them again
    engine_starts: int = 0  # launches that started something (processes, a job), whatever came of them
    reused: int = 0
    groups: list[int] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    wall_s: float = 0.0
    results: str = ""


class CampaignRunner:
    def __init__(self, prep: Prepared, opts: Options) -> None:
        self.p = prep
        self.c = prep.campaign
        self.o = opts
        self.s = Summary(results=str(opts.out / "results.jsonl"))

    def event(self, msg: str) -> None:
        self.o.on_event(msg)
        with (self.o.out / "campaign.log").open("a", encoding="utf-8") as f:
            f.write(f"{benchmod.now_iso()} {msg}\n")

    def run(self) -> Summary:
        t0 = time.monotonic()
        make_out(self.o.out)
        groups = self.p.groups
        if self.o.only_group is not None:
            if not 0 <= self.o.only_group < len(groups):
                raise K3Error("bad-group", f"--group {self.o.only_group}: the campaign has {len(groups)} deployment group(s) (0-{len(groups) - 1})",
                              "see `k3launch campaign run FILE --dry-run`")
            groups = [groups[self.o.only_group]]
        else:
            self._record_refused()
        done = done_cells(read_rows(self.o.out), self.c.name, self.p.still_valid)
        for g in groups:
            todo = [ld for ld in g.loads if g.cell_id(ld) not in done]
            self.s.cells += len(g.loads)
            self.s.skipped += len(g.loads) - len(todo)
            if not todo:
                self.event(f"group {g.index} ({self._label(g)}): all {len(g.loads)} cells done, skipped")
                self._down_leftover(deployment_name(self.c.name, g.plan_hash))
                continue
            self.s.groups.append(g.index)
            self._group(g, todo)
        current = self.p.cell_ids()
        write_csv(self.o.out, [r for r in latest(read_rows(self.o.out), self.c.name) if r.cell in current])
        self.s.wall_s = time.monotonic() - t0
        return self.s

    def _label(self, g: Group) -> str:
        return self.p.spec_label(g.specs[0])

    def _record_refused(self) -> None:
        for cell in self.p.cells:
            err = self.p.refused.get(cell.spec.key)
            if err is None:
                continue
            self.s.cells += 1
            self._append(Group(-1, refused_hash(cell.spec), (cell.spec,), (cell.load,), self.p.workload),
                         cell.load, f"plan refused ({err.code}): {err.message}")

    def _append(self, g: Group, load: LoadPoint, reason: str | None, run: benchmod.BenchRun | None = None,
                prov: Provenance | None = None) -> None:
        metrics = run.metrics if run is not None else None
        if reason is None and metrics is not None:
            reason = invalid_reason(metrics, self.c.validity)
        if reason is None and metrics is None:
            reason = "no figures"
        valid = reason is None
        self.s.ran += 1 if run is not None else 0
        self.s.valid += valid
        self.s.invalid += not valid
        spec = g.specs[0]
        result = str(run.result_file.relative_to(self.o.out)) if run is not None and run.result_file is not None else None
        row = ResultRow(campaign=self.c.name, cell=g.cell_id(load), group=g.index, deployment=self.p.spec_label(spec), axes=dict(spec.axes),
                        load=load, valid=valid, reason=reason, metrics=metrics if valid else None, result_file=result, provenance=prov)
        append_row(self.o.out, row)
        self.event(f"cell {row.cell}: " + ("valid" if valid else f"INVALID: {reason}"))

    def record_invalid(self, g: Group, load: LoadPoint, reason: str) -> None:
        """An invalid row for a cell that never ran (its deployment failed elsewhere)."""
        self._append(g, load, reason)

    def _plan(self, g: Group) -> Plan:
        return named_plan(self.p, g)

    def _reuse(self, name: str, want: str) -> DeploymentRecord | None:
        """A ready, healthy deployment of this group left by an interrupted run; else tear it down."""
        rec = api.record(name, self.o.state_dir)
        if rec is None:
            return None
        if rec.state == "ready" and plan_hash(rec.plan) == want:
            try:
                healthy = api.status(name, state_dir=self.o.state_dir).healthy
            except K3Error:
                healthy = False  # a node that does not answer: not reusable, take it down below
            if healthy:
                self.event(f"{name}: reusing the deployment an interrupted run left (ready, all processes healthy)")
                self.s.reused += 1
                return rec
        self.event(f"{name}: a deployment of that name is left over ({rec.state}); taking it down first")
        report = api.down(name, state_dir=self.o.state_dir)
        if not report.clean:
            raise K3Error("leftover-deployment", f"{name}: the leftover deployment could not be taken down cleanly",
                          f"`k3launch down {name}` and check its nodes, then run the campaign again")
        return None

    def _down_leftover(self, name: str) -> None:
        """A run killed while taking a finished group down leaves it up: finish the job."""
        if api.record(name, self.o.state_dir) is not None:
            report = api.down(name, state_dir=self.o.state_dir)
            self.event(f"{name}: left over by an interrupted run, taken down" + ("" if report.clean else " INCOMPLETE"))

    def _group(self, g: Group, todo: Sequence[LoadPoint]) -> None:
        # One process per deployment group at a time: two runs of one campaign (or a run and an
        # array task) would measure the same deployment at once, or take it down under each other.
        with group_lock(self.o.out, g.plan_hash) as lock:
            if lock is None:
                if self.o.only_group is not None:
                    raise K3Error("campaign-busy", f"group {g.index} of {self.c.name} is being run by another process (lock in {self.o.out})",
                                  "wait for it; its rows land in the same results file")
                self.event(f"group {g.index} ({self._label(g)}): another process is running it; skipped")
                return
            self._group_locked(g, todo)

    def _group_locked(self, g: Group, todo: Sequence[LoadPoint]) -> None:
        lbl = self._label(g)
        try:
            plan = self._plan(g)
        except K3Error as exc:
            for ld in todo:
                self._append(g, ld, f"plan refused ({exc.code}): {exc.message}")
            return
        name = plan.name
        self.event(f"group {g.index} ({lbl}): {len(todo)} load point(s) on {name}")
        if self.o.attached:
            from k3launch.deploy.slurm.job import attached_record

            self._bench_all(g, attached_record(plan, os.environ, self.p.inventory.name), todo)
            return
        rec = self._reuse(name, plan_hash(plan))
        if rec is None:
            rec = self._up(g, plan, todo)
            if rec is None:
                return
        try:
            self._bench_all(g, rec, todo)
        finally:
            report = api.down(name, state_dir=self.o.state_dir)
            self.event(f"{name}: down" + ("" if report.clean else " INCOMPLETE (see `k3launch status`)"))

    def _up(self, g: Group, plan: Plan, todo: Sequence[LoadPoint]) -> DeploymentRecord | None:
        """``api.up`` of the group's deployment; None when it does not serve (counted as it happened)."""
        from k3launch.deploy.base import LaunchFailed
        from k3launch.models.record import Stage

        name, t0, stages = plan.name, time.monotonic(), set[Stage]()

        def on_stage(stage: Stage, msg: str) -> None:
            stages.add(stage)
            self.event(f"{name}: {stage}: {msg}")

        try:
            rec = api.up(plan, self.p.inventory, state_dir=self.o.state_dir, ready_timeout=self.c.ready_timeout, on_stage=on_stage)
        except K3Error as exc:
            if isinstance(exc, LaunchFailed) or Stage.START in stages:  # it was launched: its failure is the deployment's
                self.s.engine_starts += 1
                for ld in todo:
                    self._append(g, ld, f"deployment failed ({exc.code}): {exc.message}")
            else:  # refused before anything started (nodes held, a pre-flight check): nothing measured, the cells stay to run
                self.s.refused.append(Refusal(g.index, name, self._label(g), len(todo), exc.code, exc.message, exc.hint))
                self.s.not_run += len(todo)
                self.event(f"group {g.index} ({self._label(g)}): {name} refused ({exc.code}): {exc.message}; {len(todo)} cell(s) not run")
            return None
        self.s.engine_starts += 1
        self.event(f"{name}: up in {time.monotonic() - t0:.1f}s")
        return rec

    def _bench_all(self, g: Group, rec: DeploymentRecord, todo: Sequence[LoadPoint]) -> None:
        facts = benchmod.engine_facts(rec)
        b = self.c.bench
        for i, ld in enumerate(todo):
            run = benchmod.run(rec, ld, out_dir=self.o.out / "bench", tag=f"{g.plan_hash[:12]}-{ld.key}", client=self.o.client or b.client,
                               seed=b.seed, range_ratio=b.random_range_ratio, warmups=b.num_warmups, timeout_s=b.timeout_s)
            self._append(g, ld, run.error, run, self._provenance(g, rec, facts, run))
            if run.stray:
                # a client still loading the deployment would skew every later figure: stop here
                for rest in todo[i + 1:]:
                    self._append(g, rest, f"not measured: the timed-out client of {ld.key} could not be stopped in the container")
                return

    def _provenance(self, g: Group, rec: DeploymentRecord, facts: benchmod.EngineFacts, run: benchmod.BenchRun) -> Provenance:
        from k3launch.planning.recipes import default_recipes_dir

        plan = rec.plan
        return Provenance(plan_hash=g.plan_hash, deployment=rec.name, recipe=plan.recipe, recipe_file=plan.recipe_file,
                          recipe_sha256=_sha256(default_recipes_dir() / plan.recipe_file), campaign_sha256=self.p.sha256,
                          k3launch_version=__version__, vllm_version=facts.vllm_version, vllm_schema=plan.vllm_version,
                          runtime=facts.runtime, image=facts.image, image_id=facts.image_id, inventory=rec.inventory or "",
                          nodes=rec.machines(), client=run.client, started=run.started, ended=run.ended)


def named_plan(prep: Prepared, g: Group) -> Plan:
    """The plan of group ``g`` under its deployment name, on this run's port base."""
    name = deployment_name(prep.campaign.name, g.plan_hash)
    if plan_hash(build_plan(prep.inventory, g.specs[0], prep.campaign.port_base, name)) != g.plan_hash:
        # names never change what runs; if they did, resume would match the wrong cells
        raise K3Error("plan-changed", f"{name}: the named plan differs from the expanded one", "report this as a k3launch bug")
    return build_plan(prep.inventory, g.specs[0], prep.port_base, name)


def run(prep: Prepared, opts: Options) -> Summary:
    return CampaignRunner(prep, opts).run()


def pending(prep: Prepared, out: Path) -> dict[int, int]:
    """Group index -> cells still to run (for the dry run)."""
    done = done_cells(read_rows(out), prep.campaign.name, prep.still_valid)
    return {g.index: sum(g.cell_id(ld) not in done for ld in g.loads) for g in prep.groups}
