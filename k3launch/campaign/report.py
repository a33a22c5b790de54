"""The pure part of ``campaign report``: series, Pareto fronts, the per-axis tables and the
table of every cell.

Input is the latest row of every cell (:func:`k3launch.campaign.results.latest`) and a
:class:`Context` (each group's GPUs and plan, the inventory's price, the campaign's published
reference points); output is plain data that :mod:`k3launch.cli.show_campaign` renders with
rich, :mod:`k3launch.campaign.plots` draws with matplotlib and :mod:`k3launch.campaign.html`
writes as one HTML file. Every number is labelled with its unit. Invalid cells appear in the
tables as "invalid" and in their own table with the reason; they never enter a series or a front.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from k3launch.campaign.energy import cost_per_million
from k3launch.campaign.file import LOAD_AXES, Reference
from k3launch.campaign.matrix import show
from k3launch.campaign.results import ResultRow
from k3launch.models.bench import LoadPoint

if TYPE_CHECKING:
    from k3launch.models.plan import Plan
    from k3launch.planning.inventory import GpuHourPrice

LATENCIES = ("tpot", "itl", "ttft")  # what a front is drawn against (their p99)


@dataclass(frozen=True)
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Context:
    """What the rows alone do not say: each deployment group's plan (and so its GPUs), the
    inventory's price per GPU-hour, the published points to draw beside the measured ones."""

    plans: Mapping[int, Plan] = field(default_factory=dict)  # group index -> its plan
    price: GpuHourPrice | None = None
    references: Sequence[Reference] = ()

    def gpus(self, r: ResultRow) -> int | None:
        plan = self.plans.get(r.group)
        return plan_gpus(plan) if plan is not None else None


def plan_gpus(plan: Plan) -> int:
    """GPUs a deployment occupies: every engine node's (the router takes none)."""
    engines = {p.node for p in plan.processes if p.role != "router"}
    return sum(h.gpus for h in plan.hosts if h.name in engines)


def per_gpu(r: ResultRow, ctx: Context) -> float | None:
    """Output tokens/s per GPU of the deployment; without a known GPU count, None."""
    g = ctx.gpus(r)
    return r.metrics.output_throughput / g if r.metrics is not None and g else None


def cost(r: ResultRow, ctx: Context) -> float | None:
    """What a million output tokens cost at the inventory's price per GPU-hour."""
    g = ctx.gpus(r)
    if ctx.price is None or r.metrics is None or not g:
        return None
    return cost_per_million(g, ctx.price.amount, r.metrics.total_output_tokens, r.metrics.duration)


def latency(r: ResultRow, metric: str) -> float | None:
    """p99 of ``metric`` (tpot, itl, ttft) of a row; see :func:`p99_latency` for TPOT and ITL."""
    if metric == "ttft":
        return r.metrics.p99_ttft_ms if r.metrics is not None else None
    return p99_latency(r, metric)


def front(
    rows: Sequence[ResultRow], x: Callable[[ResultRow], float | None], y: Callable[[ResultRow], float | None]
) -> list[tuple[float, float, ResultRow]]:
    """The Pareto front of ``rows`` (lower x, higher y), ordered by x: a line through it only goes forward."""
    pts = xy(rows, x, y)
    return sorted((pts[i] for i in pareto([(a, b) for a, b, _ in pts])), key=lambda p: (p[0], -p[1]))


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


def xy(
    rows: Sequence[ResultRow], x: Callable[[ResultRow], float | None], y: Callable[[ResultRow], float | None]
) -> list[tuple[float, float, ResultRow]]:
    out = []
    for r in rows:
        xv, yv = x(r), y(r)
        if xv is not None and yv is not None and math.isfinite(xv) and math.isfinite(yv):
            out.append((xv, yv, r))
    return out


@dataclass(frozen=True)
class Column:
    """One number of a cell: its label with the unit, how to get it, how to write it."""

    label: str
    get: Callable[[ResultRow, Context], float | None]
    fmt: str


def _m(name: str) -> Callable[[ResultRow, Context], float | None]:
    return lambda r, ctx: getattr(r.metrics, name, None) if r.metrics is not None else None


def _e(name: str) -> Callable[[ResultRow, Context], float | None]:
    return lambda r, ctx: getattr(r.energy, name) if r.energy is not None and r.energy.valid else None


def columns(rows: Sequence[ResultRow], ctx: Context) -> list[Column]:
    """The figures of a report; per GPU, energy and cost only where some row has them."""
    out = [Column("output (tok/s)", _m("output_throughput"), ",.0f")]
    if any(per_gpu(r, ctx) is not None for r in rows):
        out.append(Column("output per GPU (tok/s)", per_gpu, ",.1f"))
    out += [
        Column("TPOT p99 (ms)", _m("p99_tpot_ms"), ".1f"),
        Column("ITL p99 (ms)", _m("p99_itl_ms"), ".1f"),
        Column("TTFT p99 (ms)", _m("p99_ttft_ms"), ",.0f"),
    ]
    if any(r.energy is not None and r.energy.valid for r in rows):
        out += [
            Column("energy/output token (J)", _e("j_per_output_token"), ".3g"),
            Column("energy/token (J)", _e("j_per_total_token"), ".3g"),
            Column("GPU power (W)", _e("mean_watts"), ",.0f"),
        ]
    if ctx.price is not None and any(cost(r, ctx) is not None for r in rows):
        out.append(Column(f"cost/M output tokens ({ctx.price.currency})", cost, ",.3g"))
    return out


def figure_text(f: Column, r: ResultRow, ctx: Context) -> str:
    v = f.get(r, ctx) if r.valid else None
    return "-" if v is None or not math.isfinite(v) else format(v, f.fmt)


def tables(rows: Sequence[ResultRow], ctx: Context | None = None) -> list[Table]:
    """One table per varying load axis (columns: its values; rows: deployment × the other load
    values × each figure, labelled with its unit)."""
    ctx = ctx or Context()
    figs = columns([r for r in rows if r.valid], ctx)
    axes = varying_load_axes(rows) or ["max_concurrency"]
    out = []
    for axis in axes:
        others = [a for a in varying_load_axes(rows) if a != axis]
        values = sorted({getattr(r.load, axis) for r in rows}, key=lambda v: math.inf if v is None else v)
        grid: dict[tuple[str, str], dict[object, ResultRow]] = {}
        for r in rows:
            grid.setdefault((r.deployment, _load_suffix(r.load, others)), {})[getattr(r.load, axis)] = r
        body = []
        for (dep, rest), cells in grid.items():
            for i, f in enumerate(figs):
                first = i == 0
                texts = [_cell(cells.get(v), f, ctx, first) for v in values]
                body.append([dep if first else "", *([rest if first else ""] if others else []), f.label, *texts])
        headers = ["deployment", *(["load"] if others else []), "figure (unit)", *(show(v) for v in values)]
        out.append(Table(f"by {axis}", headers, body))
    return out


def _cell(r: ResultRow | None, f: Column, ctx: Context, first: bool) -> str:
    if r is None:
        return "-" if first else ""
    if not r.valid or r.metrics is None:
        return "invalid" if first else ""
    return figure_text(f, r, ctx)


def cells_table(rows: Sequence[ResultRow], ctx: Context) -> Table:
    """Every valid cell on one line, each column one figure with its unit (the HTML report sorts it)."""
    valid = [r for r in rows if r.valid and r.metrics is not None]
    figs = columns(valid, ctx)
    body = [[r.deployment, r.load.key, *(figure_text(f, r, ctx) for f in figs)] for r in valid]
    return Table("every valid cell", ["deployment", "load", *(f.label for f in figs)], body)


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
