"""Rich rendering of bench results, campaign dry runs, run summaries and reports (people, not scripts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from k3launch.campaign.held import Held, refused_groups
from k3launch.campaign.report import Table
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
    con.print(f"results: {s.results}")


def tables(con: Console, ts: Sequence[Table]) -> None:
    for tb in ts:
        t = RichTable(title=tb.title, show_header=True, show_lines=True)
        for h in tb.headers:
            t.add_column(h)
        for row in tb.rows:
            t.add_row(*row)
        con.print(t)
