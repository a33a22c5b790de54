"""PNG plots of a campaign (matplotlib, Agg: no display needed on a login node).

* ``throughput_vs_tpot_p99.png`` / ``throughput_vs_itl_p99.png``: output tokens/s against the
  p99 latency budget, one line per deployment (points in concurrency order, labelled with it),
  the Pareto front over all deployments drawn as a dashed step line with ringed points — the
  answer to "which deployment gives the most throughput at my p99 budget";
* ``ttft_vs_concurrency.png``: p99 (solid) and mean (dotted) TTFT against concurrency.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch.campaign.report import Series, concurrency, p99_latency, pareto, series, xy
from k3launch.campaign.results import ResultRow

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def _axes(title: str, xlabel: str, ylabel: str) -> tuple[object, Axes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path


def throughput_vs_latency(ss: Sequence[Series], metric: str, title: str, path: Path) -> Path:
    fig, ax = _axes(title, f"{metric.upper()} p99 (ms)", "output throughput (tok/s)")
    everything: list[tuple[float, float, ResultRow]] = []
    for s in ss:
        pts = xy(s.rows, lambda r: p99_latency(r, metric), lambda r: r.metrics.output_throughput if r.metrics else None)
        everything += pts
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s.name)
        for x, y, r in pts:
            ax.annotate(f"c{concurrency(r.load)}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = sorted((everything[i] for i in pareto([(x, y) for x, y, _ in everything])), key=lambda p: p[0])
    if front:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", linestyle="--", color="black", linewidth=1, label="Pareto front")
        ax.scatter([p[0] for p in front], [p[1] for p in front], s=140, facecolors="none", edgecolors="black", linewidths=1.2, zorder=3)
    if everything:
        ax.legend(fontsize=8)
    return _save(fig, path)


def ttft_vs_concurrency(ss: Sequence[Series], title: str, path: Path) -> Path:
    fig, ax = _axes(title, "max concurrency", "TTFT (ms)")
    for s in ss:
        pts = [(concurrency(r.load), r.metrics.p99_ttft_ms, r.metrics.mean_ttft_ms) for r in s.rows
               if r.metrics is not None and r.metrics.p99_ttft_ms is not None and r.metrics.mean_ttft_ms is not None]
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
    return _save(fig, path)


def plot_all(rows: Sequence[ResultRow], out: Path, campaign: str) -> list[Path]:
    """Write every plot under ``out`` (created); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    ss = series(rows)
    return [
        throughput_vs_latency(ss, "tpot", f"{campaign}: throughput vs TPOT p99", out / "throughput_vs_tpot_p99.png"),
        throughput_vs_latency(ss, "itl", f"{campaign}: throughput vs ITL p99", out / "throughput_vs_itl_p99.png"),
        ttft_vs_concurrency(ss, f"{campaign}: TTFT vs concurrency", out / "ttft_vs_concurrency.png"),
    ]
