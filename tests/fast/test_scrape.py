"""What ``k3launch top`` reads from ``/metrics`` (k3launch.models.scrape): the simulated engine's
exposition and a router's, rates over a window, and latency percentiles computed as Prometheus's
``histogram_quantile`` does."""

from __future__ import annotations

import math

import pytest

from k3launch.models.scrape import Scrape, parse, quantile, window
from k3launch.sim.metrics import Metrics, render


def _sim(running: int, tokens: int, ttft: list[float]) -> str:
    m0, m1 = Metrics(capacity=4), Metrics(capacity=4)
    m0.running, m1.running, m1.waiting = running, 1, 2
    m0.generation_tokens, m1.generation_tokens = tokens, 10
    m0.prompt_tokens = 3 * tokens
    for v in ttft:
        m0.ttft.observe(v)
    return render("tiny", {0: m0, 1: m1})


def test_an_engines_exposition_sums_its_dp_ranks_and_keeps_the_fullest_kv_cache() -> None:
    s = parse(_sim(running=2, tokens=100, ttft=[0.03]), at=5.0)
    assert s.values["vllm:num_requests_running"] == 3 and s.values["vllm:num_requests_waiting"] == 2
    assert s.values["vllm:generation_tokens_total"] == 110
    assert s.peaks["vllm:kv_cache_usage_perc"] == 0.5  # rank 0: 2 of 4
    assert s.hists["vllm:time_to_first_token_seconds"][math.inf] == 1


def test_rates_and_percentiles_come_from_the_growth_over_the_window() -> None:
    first = parse(_sim(running=1, tokens=100, ttft=[0.03] * 10), at=10.0)
    last = parse(_sim(running=1, tokens=300, ttft=[0.03] * 10 + [0.07] * 90 + [15.0] * 10), at=20.0)
    w = window([first, last])
    assert w.seconds == 10 and w.generation_tps == 20.0 and w.prompt_tps == 60.0
    # 100 new observations: 90 in (0.06, 0.08], 10 in (10, 20]; the 10 older ones (0.03) are not in the window
    assert w.ttft_p50 == pytest.approx(0.06 + 0.02 * (50 / 90))
    assert w.ttft_p99 == pytest.approx(10 + 10 * (99 - 90) / 10)
    assert w.itl_p50 is None  # nothing observed


def test_a_counter_that_restarted_gives_no_negative_rate_and_one_scrape_gives_no_rate() -> None:
    before, after = Scrape(0.0, {"vllm:generation_tokens_total": 500.0}), Scrape(2.0, {"vllm:generation_tokens_total": 20.0})
    assert window([before, after]).generation_tps == 0.0
    assert window([after]).generation_tps is None and window([]).running is None


def test_quantile_agrees_with_prometheus_at_the_edges() -> None:
    # all in +Inf: the highest finite bound (what promtool gave the K3TTFTAboveSLO case)
    assert quantile(0.99, {1.0: 0.0, 20.0: 0.0, math.inf: 10.0}) == 20.0
    assert quantile(0.99, {20.0: 10.0, math.inf: 10.0}) == pytest.approx(19.8)
    assert quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None


def test_a_routers_requests_errors_and_retries_per_second() -> None:
    text0 = ("# TYPE vllm_router_requests_total counter\n"
             'vllm_router_requests_total{route="/v1/completions"} 100\nvllm_router_requests_total{route="/v1/chat/completions"} 50\n'
             "# TYPE vllm_router_request_errors_total counter\n"
             'vllm_router_request_errors_total{route="/v1/completions",error_type="x"} 1\n'
             "# TYPE vllm_router_retries_total counter\nvllm_router_retries_total 4\n")
    text1 = text0.replace("} 100\n", "} 160\n").replace("} 1\n", "} 3\n").replace("retries_total 4", "retries_total 8")
    w = window([parse(text0, 0.0), parse(text1, 4.0)])
    assert (w.requests_ps, w.errors_ps, w.retries_ps) == (15.0, 0.5, 1.0)
