"""``campaign report``'s one self-contained HTML file: ``DIR/report.html``.

Everything is inside the file — the plots as inline SVG, a few lines of CSS and of JavaScript
(click a column's header to sort the table by it) — so it can be mailed, attached to a ticket or
opened from a shared file system without a server. Sections: the plots; every valid cell with
each figure's unit in its column's header; the invalid cells with their reasons; the published
reference points; per deployment, its plan and the provenance of its rows, one click away
(``<details>``). :func:`render` is pure; :func:`write_report` draws the plots and writes the file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from html import escape
from pathlib import Path

from k3launch.campaign.report import Context, cells_table, columns, invalid_table
from k3launch.campaign.results import ResultRow

REPORT = "report.html"

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3;cursor:pointer;user-select:none}td:first-child,td:nth-child(2),th:first-child{text-align:left}
th.asc::after{content:" \\25B2"}th.desc::after{content:" \\25BC"}td.bad{color:#a00}
pre{background:#f7f7f7;padding:.6em;overflow:auto;max-height:30em;font-size:12px}
details{margin:.4em 0}summary{cursor:pointer;font-weight:600}.plot svg{max-width:100%;height:auto}
.note{color:#666}
"""

# Sort a table by the clicked column: numbers by data-v (blank cells last), the rest as text.
JS = """
document.querySelectorAll("table.sortable th").forEach((th, col) => th.addEventListener("click", () => {
  const body = th.closest("table").tBodies[0], asc = !th.classList.contains("asc");
  th.parentNode.querySelectorAll("th").forEach(h => h.classList.remove("asc", "desc"));
  th.classList.add(asc ? "asc" : "desc");
  const key = tr => { const c = tr.cells[col], v = c.dataset.v; return v === undefined ? c.textContent : (v === "" ? null : +v); };
  [...body.rows].sort((a, b) => {
    const x = key(a), y = key(b);
    if (x === null || y === null) return x === y ? 0 : (x === null ? 1 : -1);
    return (typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y))) * (asc ? 1 : -1);
  }).forEach(tr => body.appendChild(tr));
}));
"""


def _cells(rows: Sequence[ResultRow], ctx: Context) -> str:
    valid = [r for r in rows if r.valid and r.metrics is not None]
    figs = columns(valid, ctx)
    head = "".join(f"<th>{escape(h)}</th>" for h in cells_table(valid, ctx).headers)
    body = []
    for r in valid:
        tds = [f"<td>{escape(r.deployment)}</td>", f"<td>{escape(r.load.key)}</td>"]
        for f in figs:
            v = f.get(r, ctx)
            ok = v is not None and math.isfinite(v)
            energy_figure = f.label.startswith(("energy", "GPU power"))
            why = r.energy.reason if energy_figure and r.energy is not None else None  # the cell says why it has no figure
            title = f' title="{escape(why or "")}"' if not ok and why else ""
            tds.append(f'<td data-v="{v if ok else ""}"{title}>{escape(format(v, f.fmt)) if ok else "-"}</td>')
        body.append("<tr>" + "".join(tds) + "</tr>")
    return f'<table class="sortable"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "sortable") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _deployments(rows: Sequence[ResultRow], ctx: Context) -> str:
    """Per deployment group: what it is in one line, its plan and its rows' provenance on a click."""
    out = []
    groups: dict[int, list[ResultRow]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    for g, rs in sorted(groups.items()):
        plan = ctx.plans.get(g)
        what = f"{plan.strategy}, {plan.nodes} node(s), {ctx.gpus(rs[0])} GPU(s), {plan.model}" if plan is not None else "no plan"
        valid = sum(r.valid for r in rs)
        parts = [f"<details><summary>{escape(rs[0].deployment or '(base)')} — {escape(what)}; {valid} of {len(rs)} cell(s) valid</summary>"]
        provs = {r.provenance.plan_hash: r.provenance for r in rs if r.provenance is not None}
        for p in provs.values():
            parts.append("<p>provenance</p><pre>" + escape(json.dumps(p.model_dump(), indent=2)) + "</pre>")
        if plan is not None:
            parts.append("<details><summary>plan</summary><pre>" + escape(plan.to_json()) + "</pre></details>")
        parts.append("</details>")
        out.append("".join(parts))
    return "\n".join(out)


def render(
    campaign: str, rows: Sequence[ResultRow], ctx: Context, plots: Sequence[tuple[str, str]], *, description: str = "", generated: str = ""
) -> str:
    """The whole report as one HTML document; ``plots``: (title, inline SVG)."""
    valid = sum(r.valid for r in rows)
    price = f"; price {ctx.price.amount:g} {escape(ctx.price.currency)} per GPU-hour" if ctx.price is not None else ""
    sections = [
        f"<h1>Campaign {escape(campaign)}</h1>",
        f"<p>{escape(description)}</p>" if description else "",
        f'<p class="note">{len(rows)} cell(s), {valid} valid, {len(rows) - valid} invalid{price}. {escape(generated)}</p>',
        "<h2>Plots</h2>",
        *(f'<div class="plot" title="{escape(title)}">{body}</div>' for title, body in plots),
        "<h2>Cells</h2><p class='note'>Click a column's header to sort by it.</p>",
        _cells(rows, ctx),
    ]
    bad = invalid_table(rows)
    if bad is not None:
        sections += ["<h2>Invalid cells</h2>", _table(bad.headers, bad.rows)]
    if ctx.references:
        refs = [[r.label, r.metric, f"{r.x:g}", f"{r.y:g}"] for r in ctx.references]
        sections += ["<h2>Published reference points</h2>", _table(["label", "metric", "x (ms)", "y (tok/s/GPU)"], refs)]
    sections += ["<h2>Deployments</h2>", _deployments(rows, ctx)]
    body = "\n".join(s for s in sections if s)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(campaign)}: campaign report</title>'
        f"<style>{CSS}</style></head><body>\n{body}\n<script>{JS}</script></body></html>\n"
    )


def write_report(out: Path, campaign: str, rows: Sequence[ResultRow], ctx: Context, *, description: str = "", generated: str = "") -> Path:
    """Draw the plots and write ``out/report.html`` (whole or not at all: a reader never sees half)."""
    from k3launch.campaign import plots

    figs = plots.figures(rows, campaign, ctx)
    try:
        svgs = [(stem.replace("_", " "), plots.svg(fig)) for stem, fig in figs]
    finally:
        plots.close(figs)
    path = out / REPORT
    tmp = path.with_name(f".{REPORT}.{os.getpid()}.tmp")
    tmp.write_text(render(campaign, rows, ctx, svgs, description=description, generated=generated), encoding="utf-8")
    tmp.replace(path)
    return path
