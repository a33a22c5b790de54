"""The pure part of ``campaign report``: series, Pareto fronts and the per-axis tables.

Input is the latest row of every cell (:func:`k3launch.campaign.results.latest`); output is
plain data that :mod:`k3launch.cli.show_campaign` renders with rich and
:mod:`k3launch.campaign.plots` draws with matplotlib. Invalid cells appear in the tables as
"invalid" and in their own table with the reason; they never enter a series or a front.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from k3launch.campaign.file import LOAD_AXES
from k3launch.campaign.matrix import show
from k3launch.campaign.results import ResultRow
from k3launch.models.bench import LoadPoint


@dataclass(frozen=True)
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Series:
    """One line of a plot: a deployment (and fixed non-concurrency load), ordered by concurrency."""

    name: str
    rows: list[ResultRow]


def concurrency(load: LoadPoint) -> int:
    """Requests in flight at most; an unbounded run can have every prompt in flight."""
    return load.max_concurrency if load.max_concurrency is not None else load.num_prompts


def varying_load_axes(rows: Sequence[ResultRow]) -> list[str]:
    return [a for a in LOAD_AXES if len({getattr(r.load, a) for r in rows}) > 1]


def _load_suffix(load: LoadPoint, axes: Sequence[str]) -> str:
    return " ".join(f"{a}={show(getattr(load, a))}" for a in axes)


def series(rows: Sequence[ResultRow]) -> list[Series]:
    """Valid rows by deployment and every varying load axis except concurrency."""
    valid = [r for r in rows if r.valid and r.metrics is not None]
    other = [a for a in varying_load_axes(valid) if a != "max_concurrency"]
    out: dict[str, list[ResultRow]] = {}
    for r in valid:
        name = " ".join(x for x in (r.deployment, _load_suffix(r.load, other)) if x)
        out.setdefault(name, []).append(r)
    return [Series(n, sorted(rs, key=lambda r: concurrency(r.load))) for n, rs in out.items()]


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: lower latency (x) and higher throughput (y)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def xy(rows: Sequence[ResultRow], x: Callable[[ResultRow], float | None], y: Callable[[ResultRow], float | None]) -> list[tuple[float, float, ResultRow]]:
    out = []
    for r in rows:
        xv, yv = x(r), y(r)
        if xv is not None and yv is not None and math.isfinite(xv) and math.isfinite(yv):
            out.append((xv, yv, r))
    return out


def _cell_text(r: ResultRow | None) -> str:
    if r is None:
        return "-"
    if not r.valid or r.metrics is None:
        return "invalid"
    m = r.metrics
    tpot = m.p99_tpot_ms if m.p99_tpot_ms is not None else math.nan
    ttft = m.p99_ttft_ms if m.p99_ttft_ms is not None else math.nan
    return f"{m.output_throughput:,.0f}\n{tpot:.1f}\n{ttft:.0f}"


def tables(rows: Sequence[ResultRow]) -> list[Table]:
    """One table per varying load axis (columns: its values; rows: deployment × the other load values)."""
    axes = varying_load_axes(rows) or ["max_concurrency"]
    out = []
    for axis in axes:
        others = [a for a in varying_load_axes(rows) if a != axis]
        values = sorted({getattr(r.load, axis) for r in rows}, key=lambda v: math.inf if v is None else v)
        grid: dict[tuple[str, str], dict[object, ResultRow]] = {}
        for r in rows:
            grid.setdefault((r.deployment, _load_suffix(r.load, others)), {})[getattr(r.load, axis)] = r
        body = [[dep, *([rest] if others else []), *(_cell_text(cells.get(v)) for v in values)] for (dep, rest), cells in grid.items()]
        headers = ["deployment", *(["load"] if others else []), *(show(v) for v in values)]
        out.append(Table(f"by {axis} (each cell: output tok/s, TPOT p99 ms, TTFT p99 ms)", headers, body))
    return out


def invalid_table(rows: Sequence[ResultRow]) -> Table | None:
    bad = [r for r in rows if not r.valid]
    if not bad:
        return None
    return Table("invalid cells", ["deployment", "load", "reason"], [[r.deployment, r.load.key, r.reason or "?"] for r in bad])


def p99_latency(r: ResultRow, metric: str) -> float | None:
    """p99 TPOT/ITL of a row, or None when it has no inter-token sample (one output token per
    request): vLLM then writes 0 ms, which would put the cell at the head of every front."""
    m = r.metrics
    if m is None or m.total_output_tokens <= m.completed:
        return None
    return m.stat("p99", metric)


def front_rows(rows: Sequence[ResultRow], metric: str) -> list[ResultRow]:
    """The Pareto front of output throughput against p99 ``metric`` (tpot or itl) over every valid row."""
    pts = xy([r for r in rows if r.valid], lambda r: p99_latency(r, metric), lambda r: r.metrics.output_throughput if r.metrics else None)
    return [pts[i][2] for i in pareto([(x, y) for x, y, _ in pts])]
