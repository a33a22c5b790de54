"""Plots of a campaign (matplotlib, Agg: no display needed on a login node), as PNG files and as
the inline SVG of the HTML report.

* ``throughput_vs_{tpot,itl,ttft}_p99.png``: output tokens/s per GPU (per deployment when its
  GPUs are not known) against the p99 latency. Each deployment's Pareto front is its line, in
  latency order, so it never runs backwards; the points it dominates are hollow and unconnected;
  every point is labelled with its load (``c16``: concurrency 16), the labels placed so that no
  two overlap and none covers a point (:func:`place_labels`). The front over all deployments is a
  dashed step line; the campaign's published reference points are stars on the same axes;
* ``ttft_vs_concurrency.png``: p99 (solid) and mean (dotted) TTFT against concurrency.
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch.campaign.report import LATENCIES, Context, Series, concurrency, front, latency, per_gpu, series, xy
from k3launch.campaign.results import ResultRow

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in points (1/72 inch) from the figure's corner
LABEL_GAP = 4.5  # points between a label and its point: beyond the marker's radius
MARKER_HALF = 3.5  # half the side of the box a point's marker occupies, in points
FONT_SIZE = 7


def overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _candidates(w: float, h: float, gap: float, step: float, rings: int) -> list[tuple[float, float]]:
    """Lower-left offsets of a w x h label around its point: the four corners and above and
    below, then the same six moved outwards ring by ring."""
    base = [
        ((gap, gap), (1, 1)),
        ((gap, -h - gap), (1, -1)),
        ((-w - gap, gap), (-1, 1)),
        ((-w - gap, -h - gap), (-1, -1)),
        ((-w / 2, gap), (0, 1)),
        ((-w / 2, -h - gap), (0, -1)),
    ]
    return [(dx + sx * r * step, dy + sy * r * step) for r in range(rings) for (dx, dy), (sx, sy) in base]


def place_labels(
    anchors: Sequence[tuple[float, float]],
    sizes: Sequence[tuple[float, float]],
    avoid: Sequence[Box] = (),
    gap: float = LABEL_GAP,
    step: float = 3.0,
    rings: int = 40,
) -> list[tuple[float, float]]:
    """Offsets (lower-left corner from the anchor) putting each label where it overlaps no label
    placed before it and no box of ``avoid`` (the points' markers): the nearest free candidate,
    else above everything placed."""
    placed: list[Box] = list(avoid)
    out = []
    for (x, y), (w, h) in zip(anchors, sizes, strict=True):
        for dx, dy in _candidates(w, h, gap, step, rings):
            box = (x + dx, y + dy, x + dx + w, y + dy + h)
            if not any(overlaps(box, b) for b in placed):
                break
        else:  # crowded beyond every ring: above the highest box, where nothing is
            dx, dy = gap, max(b[3] for b in placed) - y + gap
            box = (x + dx, y + dy, x + dx + w, y + dy + h)
        placed.append(box)
        out.append((dx, dy))
    return out


def _axes(title: str, xlabel: str, ylabel: str, legend_outside: bool = False) -> tuple[Figure, Axes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5 if legend_outside else 7.5, 4.8), dpi=110)
    if legend_outside:  # the legend beside the axes never covers a point or a label
        fig.subplots_adjust(left=0.09, right=0.66, bottom=0.12, top=0.9)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _close(fig: Figure) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def load_label(r: ResultRow) -> str:
    """A point's load in a few characters: ``c16`` (concurrency), ``r4`` (requests/s)."""
    if r.load.max_concurrency is None and math.isfinite(r.load.request_rate):
        return f"r{r.load.request_rate:g}"
    return f"c{concurrency(r.load)}"


def _label_points(fig: Figure, ax: Axes, points: Sequence[tuple[float, float, str, str]]) -> None:
    """Annotate each (x, y, text, colour) in data coordinates where no two labels overlap."""
    fig.canvas.draw()  # settles the limits and gives a renderer to measure the texts with
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    k = 72.0 / fig.dpi  # display pixels -> points, so the offsets hold at any dpi (PNG, SVG)
    anchors, sizes = [], []
    for x, y, text, _ in points:
        px, py = ax.transData.transform((x, y))
        anchors.append((px * k, py * k))
        t = ax.text(0, 0, text, fontsize=FONT_SIZE)
        bb = t.get_window_extent(renderer)
        sizes.append((bb.width * k, bb.height * k))
        t.remove()
    markers = [(ax_ - MARKER_HALF, ay - MARKER_HALF, ax_ + MARKER_HALF, ay + MARKER_HALF) for ax_, ay in anchors]
    for (x, y, text, colour), (dx, dy) in zip(points, place_labels(anchors, sizes, markers), strict=True):
        ax.annotate(
            text,
            (x, y),
            textcoords="offset points",
            xytext=(dx, dy),
            fontsize=FONT_SIZE,
            ha="left",
            va="bottom",
            color=colour,
            annotation_clip=False,
        )


def _log_x(ax: Axes, lo: float, hi: float) -> None:
    """A log x axis ticked 1-2-5 in plain numbers (matplotlib's 2x10^1 labels run into each other)."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ticks = [m * 10.0**k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1) for m in (1, 2, 5)]
    ticks = [t for t in ticks if lo / 1.5 <= t <= hi * 1.5]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())


def throughput_vs_latency(ss: Sequence[Series], metric: str, title: str, ctx: Context | None = None) -> Figure:
    """Throughput (per GPU where known) against the p99 of ``metric``: per-deployment fronts."""
    ctx = ctx or Context()
    rows = [r for s in ss for r in s.rows]
    by_gpu = bool(rows) and all(per_gpu(r, ctx) is not None for r in rows)
    y: Callable[[ResultRow], float | None] = (
        (lambda r: per_gpu(r, ctx)) if by_gpu else (lambda r: r.metrics.output_throughput if r.metrics else None)
    )
    ylabel = "output throughput per GPU (tok/s/GPU)" if by_gpu else "output throughput (tok/s)"
    from matplotlib.colors import to_hex

    fig, ax = _axes(title, f"{metric.upper()} p99 (ms)", ylabel, legend_outside=True)

    def x(r: ResultRow) -> float | None:
        return latency(r, metric)

    labels: list[tuple[float, float, str, str]] = []  # in the colour of their deployment
    for s in ss:
        pts = xy(s.rows, x, y)
        best = front(s.rows, x, y)
        on_front = {id(p[2]) for p in best}
        (line,) = ax.plot([p[0] for p in best], [p[1] for p in best], marker="o", label=textwrap.fill(s.name, 34))
        rest = [p for p in pts if id(p[2]) not in on_front]
        if rest:
            ax.scatter([p[0] for p in rest], [p[1] for p in rest], facecolors="none", edgecolors=line.get_color(), zorder=3)
        colour = to_hex(line.get_color())  # a name or an RGB tuple, whatever the style gave
        labels += [(px, py, load_label(r), colour) for px, py, r in pts]
    overall = front(rows, x, y)
    if len(ss) > 1 and overall:
        ax.step(
            [p[0] for p in overall],
            [p[1] for p in overall],
            where="post",
            linestyle="--",
            color="grey",
            linewidth=1,
            label="front over all deployments",
        )
    refs = [ref for ref in ctx.references if ref.metric == f"p99_{metric}_ms"] if by_gpu else []
    if refs:
        ax.scatter([r.x for r in refs], [r.y for r in refs], marker="*", s=120, color="black", zorder=4, label="published")
        labels += [(r.x, r.y, r.label, "black") for r in refs]
    xs = [p[0] for p in labels]
    if xs and min(xs) > 0 and max(xs) / min(xs) > 30:  # TTFT from tens of ms to seconds: log, or the fast points merge
        _log_x(ax, min(xs), max(xs))
    if labels:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
        _label_points(fig, ax, labels)
    return fig


def ttft_vs_concurrency(ss: Sequence[Series], title: str) -> Figure:
    fig, ax = _axes(title, "max concurrency", "TTFT (ms)")
    for s in ss:
        pts = [
            (concurrency(r.load), r.metrics.p99_ttft_ms, r.metrics.mean_ttft_ms)
            for r in s.rows
            if r.metrics is not None and r.metrics.p99_ttft_ms is not None and r.metrics.mean_ttft_ms is not None
        ]
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{s.name} (p99)")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle=":", color=line.get_color(), label=f"{s.name} (mean)")
    xs = sorted({concurrency(r.load) for s in ss for r in s.rows})
    if len(xs) > 2:
        from matplotlib.ticker import NullFormatter

        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(xs, [str(x) for x in xs])  # the concurrencies measured, written as numbers
    if ss:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figures(rows: Sequence[ResultRow], campaign: str, ctx: Context | None = None) -> list[tuple[str, Figure]]:
    """Every plot of a report: (file stem, figure); the caller closes them (:func:`close`)."""
    ss = series(rows)
    out = [(f"throughput_vs_{m}_p99", throughput_vs_latency(ss, m, f"{campaign}: throughput vs {m.upper()} p99", ctx)) for m in LATENCIES]
    return [*out, ("ttft_vs_concurrency", ttft_vs_concurrency(ss, f"{campaign}: TTFT vs concurrency"))]


def close(figs: Sequence[tuple[str, Figure]]) -> None:
    for _, fig in figs:
        _close(fig)


def svg(fig: Figure) -> str:
    """The figure as an inline ``<svg>`` element (no XML prolog: it goes inside HTML)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg") :]


def plot_all(rows: Sequence[ResultRow], out: Path, campaign: str, ctx: Context | None = None) -> list[Path]:
    """Write every plot under ``out`` (created) as PNG; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    figs = figures(rows, campaign, ctx)
    paths = []
    try:
        for stem, fig in figs:
            path = out / f"{stem}.png"
            fig.savefig(path)
            paths.append(path)
    finally:
        close(figs)
    return paths
