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

    def __init__(self) -> None:
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

    def render(self, model: str, engine: str = "0") -> str:
        labels = f'engine="{engine}",model_name="{model}"'
        with self.lock:
            out: list[str] = []

            def metric(name: str, kind: str, help_: str, lines: list[str]) -> None:
                out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines])

            metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   [f"vllm:num_requests_running{{{labels}}} {float(self.running)}"])
            metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                   [f"vllm:num_requests_waiting{{{labels}}} {float(self.waiting)}"])
            metric("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
                   [f"vllm:prompt_tokens_total{{{labels}}} {float(self.prompt_tokens)}"])
            metric("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
                   [f"vllm:generation_tokens_total{{{labels}}} {float(self.generation_tokens)}"])
            metric("vllm:request_success", "counter", "Count of successfully processed requests.",
                   [f'vllm:request_success_total{{{labels},finished_reason="{r}"}} {float(n)}' for r, n in sorted(self.finished.items())])
            metric("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
                   self.ttft.lines("vllm:time_to_first_token_seconds", labels))
            metric("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
                   self.itl.lines("vllm:inter_token_latency_seconds", labels))
            metric("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.",
                   self.e2e.lines("vllm:e2e_request_latency_seconds", labels))
            metric("vllm:nixl_kv_pulls", "counter", "KV transfers pulled from a remote prefill (sim).",
                   [f"vllm:nixl_kv_pulls_total{{{labels}}} {float(self.kv_pulls)}"])
            metric("vllm:nixl_kv_pull_failures", "counter", "KV transfers that failed (sim).",
                   [f"vllm:nixl_kv_pull_failures_total{{{labels}}} {float(self.kv_failures)}"])
        return "\n".join(out) + "\n"
