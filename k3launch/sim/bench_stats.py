"""The figures of ``vllm bench serve``, computed the way vLLM computes them, under its JSON names.

Pure functions over per-request outcomes. Field names, units and conventions follow vLLM's
``vllm/benchmarks/serve.py`` so a result file from this client and one from the real
``vllm bench serve`` read the same:

* ``completed`` / ``failed`` count requests; only completed ones enter the statistics;
* TTFT is request start → first chunk carrying ``choices``; ITL is every gap between such
  chunks (vLLM's client counts each as a token arrival, which is why vLLM's server, and the sim,
  put ``finish_reason`` on the last token's chunk rather than on an empty one of its own);
  TPOT per request is ``(e2e - ttft) / (output_tokens - 1)`` for requests with > 1 token;
* ``max_output_tokens_per_s`` counts token arrivals in one-second buckets;
  ``max_concurrent_requests`` is exact: a sweep line over the requests' ``[start, end)`` intervals;
* ``mean/median/std`` use population statistics (numpy's defaults), percentiles numpy's
  linear interpolation; an empty sample gives 0, as ``np.mean(xs or 0)`` does;
* ``p<N>_<metric>_ms`` for each ``--metric-percentiles`` value (``p99``, ``p99.9``), for each
  ``--percentile-metrics`` name (default ``ttft,tpot,itl``; ``e2el`` on request).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from k3launch.sim.wire import Json

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"  # vLLM's default for generation backends


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds, ``start`` on the perf counter)."""

    prompt_len: int
    success: bool = False
    start: float = 0.0
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""


def percentile(xs: Sequence[float], p: float) -> float:
    """numpy.percentile's default (linear) interpolation."""
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = (len(s) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def std(xs: Sequence[float]) -> float:
    if not xs:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def p_word(p: float) -> str:
    """vLLM's key spelling of a percentile: 99 → ``99``, 99.9 → ``99.9``."""
    return str(int(p)) if int(p) == p else str(p)


def _peak_tokens(done: Sequence[Outcome]) -> float:
    """vLLM's ``max_output_tokens_per_s``: token arrivals counted in one-second buckets."""
    if not done:
        return 0.0
    t0 = min(o.start for o in done)
    span = math.ceil(max(o.start + o.latency for o in done) - t0) + 1
    tokens = [0] * span
    for o in done:
        t = o.start + o.ttft
        stamps = [t]
        for gap in o.itl:
            t += gap
            stamps.append(t)
        for ts in stamps:
            b = int(ts - t0)
            if 0 <= b < span:
                tokens[b] += 1
    return float(max(tokens))


def _peak_requests(done: Sequence[Outcome]) -> int:
    """vLLM's ``max_concurrent_requests``: a sweep line over the half-open intervals
    ``[start, start + latency)`` — a request ending at the instant another starts does not overlap it."""
    events = sorted([(o.start, 1) for o in done] + [(o.start + o.latency, -1) for o in done])  # at a tie, -1 first
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def summarize(outcomes: Sequence[Outcome], duration: float, percentile_metrics: Sequence[str],
              percentiles: Sequence[float]) -> Json:
    """The benchmark part of vLLM's result JSON (no setup keys, no per-request lists)."""
    done = [o for o in outcomes if o.success]
    samples: dict[str, list[float]] = {m: [] for m in METRICS}
    total_in = total_out = 0
    for o in done:
        total_in += o.prompt_len
        total_out += o.output_tokens
        if o.output_tokens > 1:
            samples["tpot"].append((o.latency - o.ttft) / (o.output_tokens - 1))
        samples["itl"] += o.itl
        samples["ttft"].append(o.ttft)
        samples["e2el"].append(o.latency)
    dur = duration if duration > 0 else float("nan")
    out: Json = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / dur,
        "request_goodput": None,  # k3launch's client takes no --goodput SLOs
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_output_tokens_per_s": _peak_tokens(done),
        "max_concurrent_requests": _peak_requests(done),
    }
    for m in METRICS:
        if m not in percentile_metrics:
            continue
        ms = [x * 1000.0 for x in samples[m]]
        out[f"mean_{m}_ms"] = mean(ms)
        out[f"median_{m}_ms"] = percentile(ms, 50)
        out[f"std_{m}_ms"] = std(ms)
        for p in percentiles:
            out[f"p{p_word(p)}_{m}_ms"] = percentile(ms, p)
    return out


def detailed(outcomes: Sequence[Outcome]) -> Json:
    """The per-request lists vLLM adds with ``--save-detailed``."""
    return {
        "input_lens": [o.prompt_len for o in outcomes],
        "output_lens": [o.output_tokens if o.success else 0 for o in outcomes],
        "ttfts": [o.ttft for o in outcomes],
        "itls": [o.itl for o in outcomes],
        "generated_texts": [o.generated_text for o in outcomes],
        "errors": [o.error for o in outcomes],
    }
