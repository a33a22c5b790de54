"""Rich rendering of bench results, campaign dry runs, run summaries and reports (people, not scripts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from k3launch.campaign.held import Held, refused_groups
from k3launch.campaign.prepared import Searched
from k3launch.campaign.report import Table
from k3launch.campaign.results import ResultRow
from k3launch.campaign.run import Prepared, Summary
from k3launch.models.bench import BenchMetrics, LoadPoint


def metrics(con: Console, m: BenchMetrics, load: LoadPoint, result: Path | None, client: str) -> None:
    t = RichTable(title=f"{load.key} ({client} client)", show_header=True)
    for h in ("", "mean", "median", "p99"):
        t.add_column(h, justify="right" if h else "left")
    for name in ("ttft", "tpot", "itl", "e2el"):
        vals = [m.stat(s, name) for s in ("mean", "median", "p99")]
        t.add_row(f"{name.upper()} (ms)", *("-" if v is None else f"{v:.2f}" for v in vals))
    con.print(t)
    con.print(f"completed {m.completed}, failed {m.failed}, {m.total_output_tokens} output tokens in {m.duration:.2f}s: "
              f"{m.request_throughput:.2f} req/s, {m.output_throughput:.1f} output tok/s, {m.total_token_throughput:.1f} total tok/s")
    if result is not None:
        con.print(f"result JSON: {result}")


def dry_run(con: Console, prep: Prepared, todo: Mapping[int, int], holds: Sequence[Held] = ()) -> None:
    c = prep.campaign
    t = RichTable(title=f"campaign {c.name}: deployments", show_header=True)
    for h in ("deployment", "group", "plan hash", "strategy", "nodes"):
        t.add_column(h)
    spec_group = {s.key: g for g in prep.groups for s in g.specs}
    for spec in dict.fromkeys(cell.spec for cell in prep.cells):
        plan = prep.plans.get(spec.key)
        g = spec_group.get(spec.key)
        if plan is None or g is None:
            err = prep.refused.get(spec.key)
            t.add_row(prep.spec_label(spec), "-", f"[red]refused: {err.message if err else '?'}[/red]", "", "")
        else:
            t.add_row(prep.spec_label(spec), str(g.index), g.plan_hash[:12], plan.strategy, str(plan.nodes))
    con.print(t)
    loads = dict.fromkeys(cell.load for cell in prep.cells)
    con.print(f"load points ({len(loads)}): " + ", ".join(ld.key for ld in loads))
    g_t = RichTable(title="deployment groups (one engine start each)", show_header=True)
    for h in ("group", "deployment name", "deployments", "cells", "to run"):
        g_t.add_column(h)
    for g in prep.groups:
        g_t.add_row(str(g.index), f"{c.name}-{g.plan_hash[:8]}", "; ".join(prep.spec_label(s) for s in g.specs), str(len(g.loads)), str(todo.get(g.index, 0)))
    con.print(g_t)
    starts = sum(1 for n in todo.values() if n)
    if c.sla is not None:
        slo = ", ".join(f"{k} <= {v:g}" for k, v in c.sla.slo.items())
        con.print(f"SLA search of {c.sla.variable} at each load point ({slo}): from {c.sla.start:g}, at most {c.sla.max_probes} probes "
                  f"up to {c.sla.max:g}, tolerance {c.sla.tolerance:g}")
    if c.repeats.runs > 1 or c.repeats.warms_up():
        con.print(f"each point {c.repeats.runs} time(s)" + (" after an unrecorded warm-up run" if c.repeats.warms_up() else ""))
    con.print(f"{len(prep.cells)} cells ({prep.excluded} excluded), {len(prep.groups)} distinct deployment(s), {len(prep.refused)} refused; "
              f"engine starts needed: [bold]{starts}[/bold] (groups already complete: {len(prep.groups) - starts})")
    if holds:
        con.print("what holds the nodes now ([red]held[/red]: `up` refuses the group as things stand):")
    for hold in holds:
        tag = "[red]held[/red]" if hold.blocking else "[yellow]note[/yellow]"
        where = "" if hold.node == "-" else f" {hold.node}"
        con.print(f"  {tag} group(s) {', '.join(map(str, hold.groups))}{where}: {hold.check}: {escape(hold.detail)}")
    blocked = refused_groups(list(holds))
    if blocked:
        con.print(f"[bold red]{len(blocked)} of the {starts} group(s) to run would be refused now[/bold red] (nothing started, no "
                  "cell recorded): free their nodes first")


def summary(con: Console, s: Summary) -> None:
    not_run = f", {s.not_run} not run" if s.not_run else ""
    con.print(f"{s.cells} cells: {s.skipped} already done, {s.ran} run ({s.valid} valid, {s.invalid} invalid){not_run}; "
              f"engine starts {s.engine_starts}, reused {s.reused}; {s.wall_s:.1f}s")
    for r in s.refused:
        con.print(f"[red]refused[/red] group {r.group} ({escape(r.label)}, {r.name}), {r.cells} cell(s) not run: {r.code}: {escape(r.message)}")
        con.print(f"  hint: {escape(r.hint)}")
    for x in s.sla:
        probes = x["probes"]
        assert isinstance(probes, list)
        bracket = x["bracket"]
        assert isinstance(bracket, list)
        lo, hi = ("-" if v is None else f"{v:g}" for v in bracket)
        con.print(f"SLA capacity of group {x['group']} ({escape(str(x['deployment']))}) at {x['load']}: {x['variable']} = {lo} "
                  f"({x['status']}; passing probe {lo}, lowest failing probe {hi}; {len(probes)} probe(s))")
    con.print(f"results: {s.results}")


def tables(con: Console, ts: Sequence[Table]) -> None:
    for tb in ts:
        t = RichTable(title=tb.title, show_header=True, show_lines=True)
        for h in tb.headers:
            t.add_column(h)
        for row in tb.rows:
            t.add_row(*row)
        con.print(t)


def repeated(con: Console, rows: Sequence[ResultRow]) -> None:
    """Points measured more than once: each figure's median and the confidence interval of the runs' mean."""
    # by deployment, then by load (an SLA search's probes were measured in search order)
    rep = sorted((r for r in rows if r.stats is not None), key=lambda r: (r.group, r.load.max_concurrency or 0, r.load.request_rate, r.load.key))
    if not rep:
        return
    conf = rep[0].stats.confidence if rep[0].stats else 0.95
    t = RichTable(title=f"repeated points: median [{conf:.0%} confidence interval of the mean]", show_header=True)
    for h in ("deployment", "load", "valid runs", "output tok/s", "TPOT p99 ms", "TTFT p99 ms", "spread gate"):
        t.add_column(h)
    for r in rep:
        assert r.stats is not None
        ci = r.stats.ci

        def cell(key: str, digits: int, r: ResultRow = r, ci: dict[str, tuple[float, float]] = ci) -> str:
            m = getattr(r.metrics, key, None) if r.metrics is not None else None
            lo_hi = ci.get(key)
            if m is None:
                return "-" if lo_hi is None else f"[{lo_hi[0]:.{digits}f}, {lo_hi[1]:.{digits}f}]"
            return f"{m:.{digits}f}" + ("" if lo_hi is None else f" [{lo_hi[0]:.{digits}f}, {lo_hi[1]:.{digits}f}]")

        gate = "ok" if r.valid else f"[red]{escape(r.reason or 'invalid')}[/red]"
        t.add_row(r.deployment, r.load.key, str(r.stats.runs), cell("output_throughput", 1), cell("p99_tpot_ms", 2), cell("p99_ttft_ms", 1), gate)
    con.print(t)


def searches(con: Console, found: Sequence[Searched]) -> None:
    """Each SLA search: the capacity it found and the probes that bound it."""
    if not found:
        return
    var = found[0].capacity.variable
    t = RichTable(title=f"SLA capacity: the highest {var} that meets every SLO", show_header=True)
    for h in ("deployment", "load (other axes)", f"capacity ({var})", "status", "bound by: passing probe", "failing probe", "probes"):
        t.add_column(h)
    for s in found:
        c = s.capacity
        at = "-" if c.capacity is None else f"{c.capacity:g}"
        passing = "-" if c.passing is None else f"{c.passing.value:g}: {escape(c.passing.why)}"
        failing = "-" if c.failing is None else f"{c.failing.value:g}: {escape(c.failing.why)}"
        t.add_row(s.deployment, s.base.key, at, c.status, passing, failing, " ".join(f"{p.value:g}{'+' if p.passed else '-'}" for p in c.probes))
    con.print(t)
    con.print(f"tolerance {found[0].capacity.tolerance:g} (relative): the true capacity lies between the passing and the failing probe; "
              "probes in the order run, + met the SLOs, - did not")
