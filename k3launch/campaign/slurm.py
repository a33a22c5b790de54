"""``k3launch campaign run FILE --out DIR --slurm-array``: one job array task per deployment group.

For a campaign whose inventory's backend runs job arrays (Slurm). Every group with cells still to
run becomes one array task (:func:`k3launch.api.submit_array`; one array per shape, at most
``limit`` tasks at once): the task's job starts the group's deployment inside its allocation,
waits until it serves, then runs ``k3launch campaign run FILE --out DIR --group N --attached``
on its batch host, which runs the group's missing load points against that deployment and
appends its rows to ``DIR/results.jsonl`` (flock + fsync: tasks share the file), and the job
ends. ``DIR`` must be on a filesystem the compute nodes share. Groups whose cells are all valid
are not submitted (resume), so running the command again submits only what is missing.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from k3launch import api
from k3launch.campaign.results import done_cells, latest, make_out, read_rows, write_csv
from k3launch.campaign.run import Prepared, named_plan
from k3launch.errors import K3Error
from k3launch.models.backends import Feature, spec
from k3launch.models.plan import Plan
from k3launch.models.reports import ArrayJob, ArrayResult


class ArrayInterrupted(Exception):
    """Ctrl-C while waiting: the arrays keep running (their rows still land in the results file)."""

    def __init__(self, jobs: list[str]) -> None:
        super().__init__(", ".join(jobs))
        self.jobs = jobs


@dataclass
class ArraySummary:
    submitted: list[int] = field(default_factory=list)  # group indexes
    skipped: list[int] = field(default_factory=list)  # groups already done
    jobs: list[str] = field(default_factory=list)
    tasks: dict[int, dict[str, object]] = field(default_factory=dict)  # group -> its task's result
    valid: int = 0
    invalid: int = 0
    results: str = ""


def task_argv(prep: Prepared, out: Path, group: int, client: str | None) -> list[str]:
    argv = [sys.executable, "-m", "k3launch", "campaign", "run", str(prep.path.resolve()), "--out", str(out.resolve()),
            "--group", str(group), "--attached", "--json"]
    if prep.port_base is not None:
        argv += ["--port-base", str(prep.port_base)]
    return argv + (["--client", client] if client else [])


def submit(prep: Prepared, out: Path, *, limit: int | None = None, client: str | None = None, wait: bool = True,
           timeout_s: float = 24 * 3600.0, on_event: Callable[[str], None] = lambda m: None) -> ArraySummary:
    inv = prep.inventory
    if not spec(inv.backend).supports(Feature.ARRAYS):
        raise K3Error("not-supported", f"--slurm-array needs a campaign on a slurm inventory; {inv.name} is {inv.backend}",
                      "set `inventory:` in the campaign file to a slurm inventory, or submit "
                      "`k3launch campaign run FILE --out DIR --group $SLURM_ARRAY_TASK_ID` as an array job yourself")
    make_out(out)
    done = done_cells(read_rows(out), prep.campaign.name, prep.still_valid)
    s = ArraySummary(results=str(out / "results.jsonl"))
    flying = in_flight(out, inv.backend)
    plans: list[Plan] = []
    for g in prep.groups:
        if all(g.cell_id(ld) in done for ld in g.loads):
            s.skipped.append(g.index)
            continue
        if g.plan_hash in flying:
            on_event(f"group {g.index}: task {flying[g.plan_hash]} of an earlier submission still runs it; not submitted again")
            s.skipped.append(g.index)
            continue
        plans.append(named_plan(prep, g))
        s.submitted.append(g.index)
    if not plans:
        on_event("every group is done; nothing to submit")
        return s
    group_of = {p.name: gi for p, gi in zip(plans, s.submitted, strict=True)}
    jobs: list[ArrayJob] = api.submit_array(
        plans, inv, work=lambda i, p: task_argv(prep, out, group_of[p.name], client), concurrency=limit, log_dir=out / "slurm",
        name=f"k3c-{prep.campaign.name}", ready_timeout=prep.campaign.ready_timeout or api.ready_timeout(plans[0]))
    s.jobs = [j.job_id for j in jobs]
    _remember(out, {prep.groups[group_of[d]].plan_hash: f"{j.job_id}_{t}" for j in jobs for t, d in enumerate(j.deployments)})
    for j in jobs:
        on_event(f"array job {j.job_id}: {len(j.deployments)} task(s) (groups {', '.join(str(group_of[d]) for d in j.deployments)}); "
                 f"logs in {j.log_dir}")
    if not wait:
        return s
    try:
        for j in jobs:
            res: ArrayResult = api.wait_array(j, timeout=timeout_s, backend=inv.backend)
            for t, r in res.results.items():
                gi = group_of[j.deployments[t]]
                s.tasks[gi] = r
                on_event(f"group {gi} (task {t} of {j.job_id}, {res.states.get(t, 'GONE')}): " + ("ok" if r.get("ok") else f"FAILED: {r.get('error')}"))
    except KeyboardInterrupt:
        raise ArrayInterrupted(s.jobs) from None
    failed = [g for g, r in s.tasks.items() if not r.get("ok")]
    _record_failed(prep, out, failed, s.tasks)
    current = prep.cell_ids()
    rows = [r for r in latest(read_rows(out), prep.campaign.name) if r.cell in current]
    write_csv(out, rows)
    s.valid = sum(r.valid for r in rows)
    s.invalid = sum(not r.valid for r in rows)
    if failed:
        on_event(f"groups {', '.join(map(str, failed))} did not finish; their logs: {shlex.quote(str(out / 'slurm'))}; run again to resume")
    return s


def _record_failed(prep: Prepared, out: Path, groups: list[int], tasks: dict[int, dict[str, object]]) -> None:
    """Cells of a group whose task wrote no row (its deployment never served) get invalid rows with the reason."""
    from k3launch.campaign.run import CampaignRunner, Options

    done = {r.cell for r in latest(read_rows(out), prep.campaign.name)}
    runner = CampaignRunner(prep, Options(out=out))
    for gi in groups:
        g = prep.groups[gi]
        for ld in g.loads:
            if g.cell_id(ld) not in done:
                runner.record_invalid(g, ld, f"deployment failed (array task): {tasks[gi].get('error')}")


def _arrays_file(out: Path) -> Path:
    return out / "slurm" / "arrays.json"


def _remember(out: Path, tasks: dict[str, str]) -> None:
    """plan hash -> "<job>_<task>" of every group submitted from this DIR (read by in_flight)."""
    path = _arrays_file(out)
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        known = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**known, **tasks}, indent=1, sort_keys=True))


def in_flight(out: Path, backend: str = "slurm") -> dict[str, str]:
    """Groups an earlier --slurm-array submission (e.g. with --no-wait) still runs: plan hash -> task."""
    try:
        known: dict[str, str] = json.loads(_arrays_file(out).read_text())
    except (OSError, ValueError):
        return {}
    if not known:
        return {}
    active = api.active_array_tasks(sorted({t.split("_")[0] for t in known.values()}), backend=backend)
    return {h: t for h, t in known.items() if t in active or f"{t.split('_')[0]}_*" in active}
