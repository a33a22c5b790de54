"""The engine's counters and histograms, rendered in vLLM's Prometheus names.

Benchmarks and k3launch's health checks scrape ``/metrics`` of real vLLM; the sim exposes the
same metric names and types so those scrapers run unchanged against it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# vLLM's bucket boundaries for the latency histograms (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.n += 1
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f'{name}_bucket{{{labels},le="{edge}"}} {float(c)}' for edge, c in zip(self.buckets, self.counts, strict=True)]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.n)}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {float(self.n)}")
        return out


class Metrics:
    """Thread-safe engine statistics (request threads write, ``/metrics`` reads)."""

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = max(1, capacity)  # --max-num-seqs: the sim's KV cache holds this many requests
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.kv_pulls = 0
        self.kv_failures = 0



def _metric(out: list[str], name: str, kind: str, help_: str, lines: list[str]) -> None:
    out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines])


def render(model: str, engines: dict[int, Metrics]) -> str:
    """Prometheus text for every local engine, labelled ``engine="<global DP rank>"`` as vLLM does.

    vllm-router counts the distinct ``engine`` labels to learn how many DP ranks a server
    fronts, so each local rank gets its own series even when it served nothing.
    """
    out: list[str] = []
    snap: list[tuple[str, Metrics]] = [(f'engine="{rank}",model_name="{model}"', m) for rank, m in sorted(engines.items())]
    for _, m in snap:
        m.lock.acquire()
    try:
        _metric(out, "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                [f"vllm:num_requests_running{{{lb}}} {float(m.running)}" for lb, m in snap])
        _metric(out, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                [f"vllm:num_requests_waiting{{{lb}}} {float(m.waiting)}" for lb, m in snap])
        _metric(out, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                [f"vllm:kv_cache_usage_perc{{{lb}}} {min(1.0, m.running / m.capacity)}" for lb, m in snap])
        _metric(out, "vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.",
                [f"vllm:num_preemptions_total{{{lb}}} 0.0" for lb, m in snap])  # the sim never preempts
        _metric(out, "vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
                [f"vllm:prompt_tokens_total{{{lb}}} {float(m.prompt_tokens)}" for lb, m in snap])
        _metric(out, "vllm:generation_tokens", "counter", "Number of generation tokens processed.",
                [f"vllm:generation_tokens_total{{{lb}}} {float(m.generation_tokens)}" for lb, m in snap])
        _metric(out, "vllm:request_success", "counter", "Count of successfully processed requests.",
                [f'vllm:request_success_total{{{lb},finished_reason="{r}"}} {float(n)}'
                 for lb, m in snap for r, n in sorted(m.finished.items())])
        for name, attr, help_ in (("vllm:time_to_first_token_seconds", "ttft", "Histogram of time to first token in seconds."),
                                  ("vllm:inter_token_latency_seconds", "itl", "Histogram of inter-token latency in seconds."),
                                  ("vllm:e2e_request_latency_seconds", "e2e", "Histogram of e2e request latency in seconds.")):
            hist_lines: list[str] = []
            for lb, m in snap:
                hist: Histogram = getattr(m, attr)
                hist_lines += hist.lines(name, lb)
            _metric(out, name, "histogram", help_, hist_lines)
        _metric(out, "vllm:nixl_kv_pulls", "counter", "KV transfers pulled from a remote prefill (sim).",
                [f"vllm:nixl_kv_pulls_total{{{lb}}} {float(m.kv_pulls)}" for lb, m in snap])
        _metric(out, "vllm:nixl_kv_pull_failures", "counter", "KV transfers that failed (sim).",
                [f"vllm:nixl_kv_pull_failures_total{{{lb}}} {float(m.kv_failures)}" for lb, m in snap])
    finally:
        for _, m in snap:
            m.lock.release()
    return "\n".join(out) + "\n"
