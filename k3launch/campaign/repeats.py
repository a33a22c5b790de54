"""The pure part of ``repeats:``: a point's runs summed up as its median and a confidence interval.

No I/O. ``results.jsonl`` keeps one row per run (``run`` = 0..N-1); readers that want one row per
point (tables, plots, fronts, SLA verdicts) take :func:`points`: each point's figures are the
medians of its valid runs, with the interval of their mean at the campaign's confidence
(Student's t, as the runs of one point are few), and the validity gate ``max_spread`` flags a
point whose interval of output throughput is wider than that share of its median on either
side — too noisy to compare with its neighbours; in an SLA search, also a point whose interval
of an SLO statistic is that wide *and* holds the SLO's bound — whether it meets the SLO is then
not known (a wide p99 of 12 requests far from its bound decides nothing). A point with one run
is its run, unchanged.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from k3launch.campaign.energy import Energy
from k3launch.campaign.results import PointStats, ResultRow
from k3launch.models.bench import BenchMetrics

SPREAD_METRIC = "output_throughput"  # always gated; SLO metrics too in an SLA search, near their bounds


def _t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` degrees of freedom (the closed forms of integer df)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: 2/pi * (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, acc = math.cos(theta), 0.0
        for k in range(1, (df - 1) // 2 + 1):
            acc += term
            term *= c2 * (2 * k) / (2 * k + 1)
        return 2 / math.pi * (theta + s * acc)
    term, acc = 1.0, 0.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(df // 2):
        acc += term
        term *= c2 * (2 * k + 1) / (2 * k + 2)
    return s * acc


def t_quantile(confidence: float, df: int) -> float:
    """The t with ``P(|T| <= t) = confidence`` (two-sided), by bisection: 12.71 for 95 % and 1 df."""
    lo, hi = 0.0, 1.0
    while _t_within(hi, df) < confidence:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_within(mid, df) < confidence else (lo, mid)
        if hi - lo < 1e-9 * hi:
            break
    return (lo + hi) / 2


@dataclass(frozen=True)
class Estimate:
    median: float
    low: float  # the confidence interval of the mean
    high: float
    runs: int

    def spread(self) -> float:
        """The interval's larger distance from the median, as a share of the median."""
        if self.median == 0:
            return 0.0 if self.low == self.high == 0 else math.inf
        return max(self.median - self.low, self.high - self.median) / abs(self.median)


def estimate(values: Sequence[float], confidence: float) -> Estimate:
    n = len(values)
    med = statistics.median(values)
    if n < 2:
        return Estimate(med, med, med, n)
    mean = statistics.fmean(values)
    half = t_quantile(confidence, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Estimate(med, mean - half, mean + half, n)


def _median_metrics(ms: Sequence[BenchMetrics]) -> BenchMetrics:
    out: dict[str, object] = {}
    for name, info in BenchMetrics.model_fields.items():
        vals = [v for m in ms if isinstance(v := getattr(m, name), (int, float))]
        if not vals:
            out[name] = None
        elif info.annotation in (int, int | None):
            out[name] = round(statistics.median(vals))
        else:
            out[name] = float(statistics.median(vals))
    return BenchMetrics.model_validate(out)


def figure(row: ResultRow, key: str) -> float | None:
    """One run's figure by vLLM's result key: from its SLO figures, else its metrics."""
    if key in row.slo:
        return row.slo[key]
    v = getattr(row.metrics, key, None) if row.metrics is not None else None
    return float(v) if isinstance(v, (int, float)) else None


def _median_energy(runs: Sequence[ResultRow]) -> Energy | None:
    """The point's energy: the median of each figure over its runs (the last run's samples file);
    valid only when every run's samples covered it."""
    es = [r.energy for r in runs if r.energy is not None]
    if not es:
        return None
    if len(es) < len(runs) or not all(e.valid for e in es):
        bad = next((e for e in es if not e.valid), es[-1])
        return bad if not bad.valid else bad.model_copy(update={"valid": False, "reason": "a run of this point has no energy figures"})

    def med(name: str) -> float | None:
        vs = [v for e in es if (v := getattr(e, name)) is not None]
        return statistics.median(vs) if len(vs) == len(es) else None

    return es[-1].model_copy(update={k: med(k) for k in ("joules", "mean_watts", "j_per_output_token", "j_per_total_token", "window_s")})


def point(runs: Sequence[ResultRow], confidence: float, max_spread: float, slo: Mapping[str, float] | None = None) -> ResultRow:
    """One row standing for a point's runs (all of one cell): medians, intervals, the spread gate
    (``slo``: an SLA search's bounds by vLLM's key).

    Invalid runs are left out (their reasons stay in results.jsonl); a point without a valid run
    is its last attempt."""
    valid = [r for r in runs if r.valid and r.metrics is not None]
    if (len(runs) == 1 and runs[0].run == 0) or not valid:
        return runs[-1]
    bounds = slo or {}
    keys = dict.fromkeys([SPREAD_METRIC, *bounds, *(k for r in valid for k in r.slo)])
    est = {k: estimate(vs, confidence) for k in keys if len(vs := [v for r in valid if (v := figure(r, k)) is not None]) == len(valid)}

    def too_wide(k: str, e: Estimate) -> bool:
        return e.spread() > max_spread and (k not in bounds or e.low <= bounds[k] <= e.high)

    wide = [
        f"{k} ±{e.spread():.0%}" + (f" around its bound {bounds[k]:g}" if k in bounds else "")
        for k in (SPREAD_METRIC, *bounds)
        if (e := est.get(k)) is not None and too_wide(k, e)
    ]
    stats = PointStats(runs=len(valid), confidence=confidence, ci={k: (e.low, e.high) for k, e in est.items()})
    metrics = _median_metrics([r.metrics for r in valid if r.metrics is not None])
    base = valid[-1]
    slo = {k: est[k].median for k in base.slo if k in est}
    if wide:
        why = f"spread too wide over {len(valid)} runs at {confidence:.0%} confidence: {', '.join(wide)} (max ±{max_spread:.0%})"
        return base.model_copy(update={"valid": False, "reason": why, "metrics": None, "slo": {}, "stats": stats})
    return base.model_copy(update={"metrics": metrics, "slo": slo, "stats": stats, "energy": _median_energy(valid)})


def points(rows: Iterable[ResultRow], confidence: float, max_spread: float, slo: Mapping[str, float] | None = None) -> list[ResultRow]:
    """One row per cell from one row per run (:func:`results.latest`), in first-seen order."""
    by_cell: dict[str, list[ResultRow]] = {}
    for r in rows:
        by_cell.setdefault(r.cell, []).append(r)
    return [point(sorted(rs, key=lambda r: r.run), confidence, max_spread, slo) for rs in by_cell.values()]
