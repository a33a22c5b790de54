"""One scrape of an engine's or router's ``/metrics``, and what a window of scrapes says (pure).

What ``k3launch top`` shows per process: requests running and waiting, KV cache use, prompt and
generated tokens per second, time to first token and inter-token latency percentiles (from the
histograms' growth over the window, as Prometheus's ``histogram_quantile`` computes them), and
for the router its requests, errors and retries per second.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Buckets = dict[float, float]  # upper bound (inf last) -> cumulative count


@dataclass(frozen=True)
class Scrape:
    time: float
    values: Mapping[str, float] = field(default_factory=dict)  # summed over label sets (DP ranks, finished reasons)
    peaks: Mapping[str, float] = field(default_factory=dict)  # the largest of one gauge's label sets (KV use of the fullest rank)
    hists: Mapping[str, Buckets] = field(default_factory=dict)  # histogram name -> cumulative buckets summed over label sets


SUMMED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
          "vllm_router_requests_total", "vllm_router_request_errors_total", "vllm_router_retries_total", "vllm_router_running_requests")
PEAK = ("vllm:kv_cache_usage_perc",)
HISTS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds")


def parse(text: str, at: float) -> Scrape:
    """The values ``top`` reads from one exposition (Prometheus text format; other lines ignored)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    peaks: dict[str, float] = {}
    hists: dict[str, Buckets] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in SUMMED:
                values[s.name] = values.get(s.name, 0.0) + s.value
            elif s.name in PEAK:
                peaks[s.name] = max(peaks.get(s.name, 0.0), s.value)
            elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in HISTS:
                b = hists.setdefault(s.name[: -len("_bucket")], {})
                le = float(s.labels["le"])
                b[le] = b.get(le, 0.0) + s.value
    return Scrape(at, values, peaks, hists)


def quantile(q: float, buckets: Buckets) -> float | None:
    """``histogram_quantile(q, ...)`` of cumulative buckets (None: no observation)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if math.isinf(b):
                return prev_bound  # in the +Inf bucket: the highest finite bound, as Prometheus answers
            if c == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (c - prev_count)
        prev_bound, prev_count = b, c
    return prev_bound


@dataclass(frozen=True)
class Window:
    """What the scrapes of one process within the window say."""

    seconds: float
    running: float | None
    waiting: float | None
    kv_usage: float | None
    prompt_tps: float | None
    generation_tps: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    requests_ps: float | None  # a router's
    errors_ps: float | None
    retries_ps: float | None

    def as_dict(self) -> dict[str, float | None]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def window(scrapes: Sequence[Scrape]) -> Window:
    """From the first to the last scrape (rates need two; the gauges are the last scrape's)."""
    last = scrapes[-1] if scrapes else Scrape(0.0)
    first = scrapes[0] if len(scrapes) > 1 else None
    span = last.time - first.time if first is not None else 0.0

    def rate(name: str) -> float | None:
        if first is None or span <= 0 or name not in last.values or name not in first.values:
            return None
        return max(0.0, last.values[name] - first.values[name]) / span  # a counter reset (a restart) is no negative rate

    def grown(name: str) -> Buckets:
        new, old = last.hists.get(name, {}), first.hists.get(name, {}) if first is not None else {}
        return {b: max(0.0, c - old.get(b, 0.0)) for b, c in new.items()}

    ttft, itl = grown("vllm:time_to_first_token_seconds"), grown("vllm:inter_token_latency_seconds")
    return Window(
        seconds=span,
        running=last.values.get("vllm:num_requests_running"),
        waiting=last.values.get("vllm:num_requests_waiting"),
        kv_usage=last.peaks.get("vllm:kv_cache_usage_perc"),
        prompt_tps=rate("vllm:prompt_tokens_total"),
        generation_tps=rate("vllm:generation_tokens_total"),
        ttft_p50=quantile(0.5, ttft),
        ttft_p99=quantile(0.99, ttft),
        itl_p50=quantile(0.5, itl),
        itl_p99=quantile(0.99, itl),
        requests_ps=rate("vllm_router_requests_total"),
        errors_ps=rate("vllm_router_request_errors_total"),
        retries_ps=rate("vllm_router_retries_total"),
    )
