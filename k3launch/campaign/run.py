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

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch import __version__, api
from k3launch.campaign import bench as benchmod
from k3launch.campaign import points
from k3launch.campaign.benchprogress import BenchProgressFn
from k3launch.campaign.matrix import Group, deployment_name, invalid_reason, plan_hash
from k3launch.campaign.prepared import Prepared as Prepared  # re-exported: callers import these from here
from k3launch.campaign.prepared import build_plan as build_plan
from k3launch.campaign.prepared import campaign_path as campaign_path
from k3launch.campaign.prepared import prepare as prepare
from k3launch.campaign.prepared import refused_hash
from k3launch.campaign.prepared import sha256_of as _sha256
from k3launch.campaign.results import Provenance, ResultRow, append_row, group_lock, latest, make_out, read_rows, write_csv
from k3launch.errors import K3Error
from k3launch.models.bench import LoadPoint

if TYPE_CHECKING:
    from k3launch.models.plan import Plan
    from k3launch.models.record import DeploymentRecord
    from k3launch.models.supervise import Event

EventFn = Callable[[str], None]


@dataclass
class Options:
    out: Path
    state_dir: Path | None = None
    only_group: int | None = None
    client: str | None = None  # overrides the campaign's bench.client
    on_event: EventFn = field(default=lambda msg: None)
    on_progress: BenchProgressFn | None = None  # each load point's requests done of total while it runs
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
    sla: list[dict[str, object]] = field(default_factory=list)  # each SLA search's outcome (Searched.as_json)
    wall_s: float = 0.0
    results: str = ""


class CampaignRunner:
    def __init__(self, prep: Prepared, opts: Options) -> None:
        self.p = prep
        self.c = prep.campaign
        self.o = opts
        self.s = Summary(results=str(opts.out / "results.jsonl"))

    @property
    def out(self) -> Path:
        return self.o.out

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
        rows = latest(read_rows(self.o.out), self.c.name)
        for g in groups:
            todo = self.p.todo(g, rows)  # with repeats: points missing runs; with sla: searches not over
            self.s.cells += len(g.loads)
            self.s.skipped += len(g.loads) - len(todo)
            if not todo:
                self.event(f"group {g.index} ({self._label(g)}): all {len(g.loads)} cells done, skipped")
                self._down_leftover(deployment_name(self.c.name, g.plan_hash))
                continue
            self.s.groups.append(g.index)
            self._group(g, todo)
        rows = latest(read_rows(self.o.out), self.c.name)
        write_csv(self.o.out, self.p.current(rows))
        self.s.sla = [x.as_json() for x in self.p.searches(rows)]
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
                prov: Provenance | None = None, run_index: int = 0, slo: dict[str, float] | None = None) -> ResultRow:
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
                        load=load, valid=valid, reason=reason, metrics=metrics if valid else None, result_file=result, provenance=prov,
                        energy=run.energy if valid and run else None, run=run_index, slo=(slo or {}) if valid else {})
        append_row(self.o.out, row)
        runs = f" run {run_index}" if self.c.repeats.runs > 1 else ""
        self.event(f"cell {row.cell}{runs}: " + ("valid" if valid else f"INVALID: {reason}"))
        return row

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
            self._bench_all(g, api.attached_record(plan, os.environ, self.p.inventory), todo)
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
        from k3launch.models.record import Stage
        from k3launch.models.reports import LaunchFailed

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
        # each point's runs (and warm-up), or each SLA search's probes: k3launch.campaign.points
        points.measure(self, g, rec, benchmod.engine_facts(rec), todo)

    def bench_once(self, rec: DeploymentRecord, ld: LoadPoint, tag: str, *, warmup: bool = False) -> benchmod.BenchRun:
        """One ``vllm bench serve`` run of a load point (a warm-up is measured by nobody: no power samples)."""
        b, s = self.c.bench, self.c.sla
        pct = ",".join(f"{p:g}" for p in [50.0, 99.0, *(s.percentiles() if s else [])])
        return benchmod.run(rec, ld, out_dir=self.o.out / "bench", tag=tag, client=self.o.client or b.client, seed=b.seed,
                            range_ratio=b.random_range_ratio, warmups=b.num_warmups, timeout_s=b.timeout_s, power=not warmup, percentiles=pct,
                            on_progress=self.o.on_progress)

    def _provenance(self, g: Group, rec: DeploymentRecord, facts: benchmod.EngineFacts, run: benchmod.BenchRun) -> Provenance:
        from k3launch.planning.recipes import default_recipes_dir

        plan = rec.plan
        return Provenance(plan_hash=g.plan_hash, deployment=rec.name, recipe=plan.recipe, recipe_file=plan.recipe_file,
                          recipe_sha256=_sha256(default_recipes_dir() / plan.recipe_file), campaign_sha256=self.p.sha256,
                          k3launch_version=__version__, vllm_version=facts.vllm_version, vllm_schema=plan.vllm_version,
                          runtime=facts.runtime, image=facts.image, image_id=facts.image_id, inventory=rec.inventory or "",
                          nodes=rec.machines(), client=run.client, started=run.started, ended=run.ended, timeline=rec.timeline,
                          events=_events_between(rec.name, run.started, run.ended, self.o.state_dir))


def _events_between(name: str, started: str, ended: str, state_dir: Path | None) -> list[Event]:
    """The supervisor's events of ``name`` while one load point ran (ISO times, as the row has them)."""
    from datetime import datetime

    try:
        t0, t1 = datetime.fromisoformat(started).timestamp(), datetime.fromisoformat(ended).timestamp()
    except ValueError:
        return []
    return [e for e in api.events(name, state_dir=state_dir) if t0 <= e.time <= t1]


def named_plan(prep: Prepared, g: Group) -> Plan:
    """The plan of group ``g`` under its deployment name, on this run's port base."""
    name = deployment_name(prep.campaign.name, g.plan_hash)
    def placed(port_base: int | None) -> Plan:  # with the cordons the campaign was planned with
        return build_plan(prep.inventory, g.specs[0], port_base, name, cordons=prep.cordons, inventory_path=prep.inventory_path)

    if plan_hash(placed(prep.campaign.port_base)) != g.plan_hash:
        # names never change what runs; if they did, resume would match the wrong cells
        raise K3Error("plan-changed", f"{name}: the named plan differs from the expanded one", "report this as a k3launch bug")
    return placed(prep.port_base)


def run(prep: Prepared, opts: Options) -> Summary:
    return CampaignRunner(prep, opts).run()


def pending(prep: Prepared, out: Path) -> dict[int, int]:
    """Group index -> cells (with sla: searches) still to run (for the dry run)."""
    rows = latest(read_rows(out), prep.campaign.name)
    return {g.index: len(prep.todo(g, rows)) for g in prep.groups}
