"""Energy of a load point from GPU power samples, and what it costs per token. Pure.

A sample is one reading of a node's GPUs: the wall-clock time it was taken (seconds since the
epoch) and the draw of each GPU in watts. A node's power is the sum over its GPUs; its energy
over the run's window is the trapezoid over its samples, the power at the window's ends
interpolated between the samples either side. The deployment's energy is the sum over its nodes.

The figures count only when the samples cover the run (:func:`coverage`): on every node, a
sample at or before the window's start, one at or after its end, and no gap between two samples
longer than :data:`MAX_GAP_S` — otherwise a stalled sampler would pass for an idle GPU.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from k3launch.models.bench import Sample

MAX_GAP_S = 2.0  # at least 1 Hz is asked of every source; twice that period is a stall
TOKENS_PER_MILLION = 1_000_000
SECONDS_PER_HOUR = 3600.0


class Energy(BaseModel):
    """What a row says about the energy of its load point (``valid``: the samples cover the run)."""

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="strings")

    source: str  # the tool that was read: nvidia-smi, amd-smi, rocm-smi (several: joined by "+")
    nodes: int
    gpus: int  # GPUs read, summed over nodes (their last reading)
    samples: int
    window_s: float  # the run's window the energy is integrated over
    joules: float | None
    mean_watts: float | None
    j_per_output_token: float | None
    j_per_total_token: float | None
    valid: bool
    reason: str | None = None  # why not valid
    samples_file: str | None = None  # every reading, relative to the campaign directory


def node_joules(samples: Sequence[Sample], start: float, end: float) -> float:
    """Trapezoid of one node's power over ``[start, end]`` (samples sorted by time, clipped to it)."""
    pts = sorted((s.t, s.total) for s in samples)
    if not pts or end <= start:
        return 0.0
    inside = [(t, w) for t, w in pts if start < t < end]
    edges = [(start, _power_at(pts, start)), *inside, (end, _power_at(pts, end))]
    return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in itertools.pairwise(edges))


def _power_at(pts: Sequence[tuple[float, float]], t: float) -> float:
    """Linear between the samples around ``t``; the nearest sample's value beyond them."""
    if t <= pts[0][0]:
        return pts[0][1]
    if t >= pts[-1][0]:
        return pts[-1][1]
    for (t0, w0), (t1, w1) in itertools.pairwise(pts):
        if t0 <= t <= t1:
            return w0 if t1 == t0 else w0 + (w1 - w0) * (t - t0) / (t1 - t0)
    return pts[-1][1]  # not reached: pts is sorted and t lies within it


def coverage(
    by_node: Mapping[str, Sequence[Sample]], nodes: Sequence[str], start: float, end: float, max_gap_s: float = MAX_GAP_S
) -> str | None:
    """Why the samples do not cover ``[start, end]`` on every node, or None when they do."""
    for node in nodes:
        ts = sorted(s.t for s in by_node.get(node, ()))
        if not ts:
            return f"no power sample from {node}"
        if ts[0] > start:
            return f"{node}: first power sample {ts[0] - start:.2f} s after the run started"
        if ts[-1] < end:
            return f"{node}: last power sample {end - ts[-1]:.2f} s before the run ended"
        span = [t for t in ts if start <= t <= end]
        before = max(t for t in ts if t <= start)
        after = min(t for t in ts if t >= end)
        chain = [before, *span, after]
        gap = max((b - a for a, b in itertools.pairwise(chain)), default=0.0)
        if gap > max_gap_s:
            return f"{node}: {gap:.1f} s without a power sample (at most {max_gap_s:g} s)"
    return None


def energy(
    by_node: Mapping[str, Sequence[Sample]],
    nodes: Sequence[str],
    start: float,
    end: float,
    *,
    output_tokens: int,
    total_tokens: int,
    source: str,
    problem: str | None = None,
    samples_file: str | None = None,
) -> Energy:
    """The energy of the window ``[start, end]`` over ``nodes``; ``problem``: a sampler failure to report."""
    window = max(0.0, end - start)
    n = sum(len(by_node.get(node, ())) for node in nodes)
    gpus = sum(len(by_node[node][-1].watts) for node in nodes if by_node.get(node))
    reason = problem or coverage(by_node, nodes, start, end)
    if reason is None and window <= 0:
        reason = "the run has no duration"
    joules = sum(node_joules(by_node[node], start, end) for node in nodes) if reason is None else None
    return Energy(
        source=source,
        nodes=len(nodes),
        gpus=gpus,
        samples=n,
        window_s=window,
        joules=joules,
        mean_watts=joules / window if joules is not None else None,
        j_per_output_token=joules / output_tokens if joules is not None and output_tokens > 0 else None,
        j_per_total_token=joules / total_tokens if joules is not None and total_tokens > 0 else None,
        valid=reason is None,
        reason=reason,
        samples_file=samples_file,
    )


def cost_per_million(gpus: int, price_per_gpu_hour: float, tokens: int, duration_s: float) -> float | None:
    """What ``tokens`` cost per million when ``gpus`` are rented for ``duration_s`` at the price."""
    if tokens <= 0 or gpus <= 0 or not math.isfinite(duration_s) or duration_s <= 0:
        return None
    return gpus * price_per_gpu_hour * duration_s / SECONDS_PER_HOUR / tokens * TOKENS_PER_MILLION
