"""Measuring a deployment group's load points: repeats after a warm-up, and SLA searches.

Called by :class:`k3launch.campaign.run.CampaignRunner` once its deployment serves. Per load
point still to do:

* **a fixed point**: with ``repeats: N``, one warm-up run (its raw JSON kept as
  ``...-warmup.json``, no row), then each of the N runs that has no valid row yet, one row each;
* **an SLA search** (``sla:``): replay the search over the rows recorded so far
  (:meth:`Prepared.search`), measure the probe it asks for (a point as above), and again, until
  the search is over; the outcome goes to the run's summary and the log.

Every row is appended as soon as its run ends, so an interrupted search resumes at its next
probe.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from k3launch.campaign import sla
from k3launch.campaign.results import ResultRow, latest, read_rows
from k3launch.models.bench import LoadPoint

if TYPE_CHECKING:
    from k3launch.campaign.bench import BenchRun, EngineFacts
    from k3launch.campaign.file import Campaign
    from k3launch.campaign.matrix import Group
    from k3launch.campaign.prepared import ByCell, Prepared
    from k3launch.campaign.results import Provenance
    from k3launch.models.record import DeploymentRecord


class Runner(Protocol):
    """What measuring needs of the campaign run it measures for (:class:`k3launch.campaign.run.Runner`):
    a protocol, so this module does not import the runner that imports it."""

    p: Prepared
    c: Campaign

    @property
    def out(self) -> Path: ...

    def event(self, msg: str) -> None: ...

    def record_invalid(self, g: Group, load: LoadPoint, reason: str) -> None: ...

    def bench_once(self, rec: DeploymentRecord, ld: LoadPoint, tag: str, *, warmup: bool = False) -> BenchRun: ...

    def _append(self, g: Group, load: LoadPoint, reason: str | None, run: BenchRun | None = None, prov: Provenance | None = None,
                run_index: int = 0, slo: dict[str, float] | None = None) -> ResultRow: ...

    def _provenance(self, g: Group, rec: DeploymentRecord, facts: EngineFacts, run: BenchRun) -> Provenance: ...


class Stray(Exception):
    """A timed-out client could not be stopped: it may still load the deployment."""

    def __init__(self, load: LoadPoint) -> None:
        super().__init__(load.key)
        self.load = load


def slo_figures(run: BenchRun, keys: Sequence[str]) -> dict[str, float]:
    """The SLO statistics of a run by vLLM's result keys (any percentile), read from its result JSON."""
    if run.metrics is None or run.result_file is None or not keys:
        return {}
    try:
        data = json.loads(run.result_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for k in keys:
        v = data.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


def measure(r: Runner, g: Group, rec: DeploymentRecord, facts: EngineFacts, todo: Sequence[LoadPoint]) -> None:
    by_cell = r.p.by_cell(latest(read_rows(r.out), r.c.name))
    for i, ld in enumerate(todo):
        try:
            if r.c.sla is not None:
                _search(r, g, rec, facts, ld, by_cell)
            else:
                _point(r, g, rec, facts, ld, r.p.missing_runs(g.cell_id(ld), by_cell), by_cell)
        except Stray as st:
            # a client still loading the deployment would skew every later figure: stop here
            why = f"not measured: the timed-out client of {st.load.key} could not be stopped in the container"
            if r.c.sla is None:
                for rest in todo[i + 1 :]:
                    r.record_invalid(g, rest, why)
            else:
                r.event(f"group {g.index}: {why}; the SLA searches of {len(todo) - i} load point(s) stop here")
            return


def _point(
    r: Runner, g: Group, rec: DeploymentRecord, facts: EngineFacts, ld: LoadPoint, runs: Sequence[int], by_cell: ByCell
) -> None:
    """The runs ``runs`` of one point, after a warm-up when the campaign asks for one."""
    if not runs:
        return
    rp, cell = r.c.repeats, g.cell_id(ld)
    tag = f"{g.plan_hash[:12]}-{ld.key}"
    if rp.warms_up():
        w = r.bench_once(rec, ld, f"{tag}-warmup", warmup=True)
        r.event(f"cell {cell}: warm-up run " + ("done" if w.error is None else f"failed: {w.error}") + " (not recorded)")
        if w.stray:
            raise Stray(ld)
    keys = list(r.c.sla.slo) if r.c.sla is not None else []
    for i in runs:
        run = r.bench_once(rec, ld, tag if rp.runs == 1 else f"{tag}-run{i}")
        row = r._append(g, ld, run.error, run, r._provenance(g, rec, facts, run), run_index=i, slo=slo_figures(run, keys))
        _remember(by_cell, row)
        if run.stray:
            raise Stray(ld)


def _remember(by_cell: ByCell, row: ResultRow) -> None:
    rows = [x for x in by_cell.get(row.cell, []) if x.run != row.run]
    by_cell[row.cell] = [*rows, row]


def _search(r: Runner, g: Group, rec: DeploymentRecord, facts: EngineFacts, base: LoadPoint, by_cell: ByCell) -> None:
    s = r.c.sla
    assert s is not None
    for _ in range(s.max_probes + 1):  # each pass measures the probe the replay asks for, so this bounds it
        found = r.p.search(g, base, by_cell)
        if found.next_probe is None:
            break
        ld = sla.probe_load(base, s.variable, found.next_probe)
        r.event(f"group {g.index} ({found.deployment}): SLA probe {len(found.capacity.probes) + 1}: {s.variable}={found.next_probe:g}")
        _point(r, g, rec, facts, ld, r.p.missing_runs(g.cell_id(ld), by_cell, attempted=True), by_cell)
    c = found.capacity
    at = "-" if c.capacity is None else f"{c.capacity:g}"
    r.event(
        f"group {g.index} ({found.deployment}) {base.key}: SLA capacity {s.variable}={at} ({c.status}; bracket {c.bracket()}, "
        f"{len(c.probes)} probe(s))"
    )
