"""`vllm bench serve` of the sim (k3launch's client) against a simulated engine running as a real
process: vLLM's JSON field names and file name, the percentiles, a zero-token engine (completed but
invalid), and the served model name requests ask for. The rest of the client is in test_bench.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from simproc import Procs, free_port, sim_bench, wait_healthy

from k3launch.campaign.file import Validity
from k3launch.campaign.matrix import invalid_reason
from k3launch.models.bench import BenchMetrics

if TYPE_CHECKING:
    pass


# The keys vLLM's `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py: main_async's
# result_json, benchmark()'s result dict, process_one_metric's mean/median/std/p<N> per metric).
VLLM_SETUP_KEYS = {
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
}


VLLM_BENCH_KEYS = {
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
}


VLLM_DETAILED_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"}


def vllm_metric_keys(metrics: str, percentiles: str) -> set[str]:
    out = set()
    for m in metrics.split(","):
        out |= {f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms"}
        out |= {f"p{int(float(p)) if float(p).is_integer() else p}_{m}_ms" for p in percentiles.split(",")}
    return out


@pytest.mark.e2e
def test_result_json_has_vllms_field_names(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    sim = procs.sim(["--host", "127.0.0.1", "--port", str(port)], {"K3LAUNCH_SIM_TTFT_MS": "25", "K3LAUNCH_SIM_ITL_MS": "2"})
    wait_healthy("127.0.0.1", port, sim)
    r = sim_bench(
        "--port",
        str(port),
        "--num-prompts",
        "12",
        "--random-input-len",
        "40",
        "--random-output-len",
        "6",
        "--max-concurrency",
        "3",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        "out",
        "--result-filename",
        "r.json",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "Serving Benchmark Result" in r.stdout
    data = json.loads((tmp_path / "out" / "r.json").read_text())
    expected = VLLM_SETUP_KEYS | VLLM_BENCH_KEYS | VLLM_DETAILED_KEYS | vllm_metric_keys("ttft,tpot,itl", "99")
    assert set(data) == expected  # nothing missing, nothing vLLM would not write
    assert set(BenchMetrics.model_fields) <= expected | vllm_metric_keys("e2el", "99")
    assert (data["completed"], data["failed"], data["total_input_tokens"], data["total_output_tokens"]) == (12, 0, 12 * 40, 12 * 6)
    assert data["request_rate"] == "inf" and data["max_concurrency"] == 3 and data["model_id"] == "moonshotai/Kimi-K3"
    assert 1 <= data["max_concurrent_requests"] <= 3  # the client never has more than --max-concurrency in flight
    assert data["mean_ttft_ms"] >= 25.0  # the engine waits 25 ms before the first token
    assert 2.0 <= data["median_itl_ms"] < 25.0
    # a gap per chunk with choices after the first: 5 between the 6 tokens (finish_reason rides on the 6th, as in vLLM)
    assert all(len(itl) == 5 for itl in data["itls"])


@pytest.mark.e2e
def test_default_file_name_and_percentiles(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    sim = procs.sim(["--host", "127.0.0.1", "--port", str(port)])
    wait_healthy("127.0.0.1", port, sim)
    r = sim_bench(
        "--port",
        str(port),
        "--num-prompts",
        "4",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--request-rate",
        "40",
        "--percentile-metrics",
        "ttft,e2el",
        "--metric-percentiles",
        "50,99.9",
        "--save-result",
        "--label",
        "lab",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    (path,) = tmp_path.glob("lab-40.0qps-Kimi-K3-*.json")  # vLLM's {label}-{rate}qps-{model}-{date}.json
    data = json.loads(path.read_text())
    assert vllm_metric_keys("ttft,e2el", "50,99.9") <= set(data) and "mean_tpot_ms" not in data
    assert data["request_rate"] == 40.0


@pytest.mark.e2e
def test_zero_token_engine_is_completed_but_invalid(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    sim = procs.sim(["--host", "127.0.0.1", "--port", str(port)], {"K3LAUNCH_SIM_FAIL": "zero-tokens"})
    wait_healthy("127.0.0.1", port, sim)
    r = sim_bench(
        "--port",
        str(port),
        "--num-prompts",
        "5",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--save-result",
        "--result-filename",
        "z.json",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr  # vLLM's client counts an empty stream as completed...
    m = BenchMetrics.model_validate(json.loads((tmp_path / "z.json").read_text()))
    assert m.completed == 5 and m.total_output_tokens == 0
    reason = invalid_reason(m, Validity())  # ...which is why campaigns gate on output tokens
    assert reason is not None and "0 output tokens" in reason


@pytest.mark.e2e
def test_served_model_name_is_what_requests_ask_for(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    sim = procs.sim(["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "k3"])
    wait_healthy("127.0.0.1", port, sim)
    common = (
        "--port",
        str(port),
        "--model",
        "moonshotai/Kimi-K3",
        "--num-prompts",
        "2",
        "--random-input-len",
        "4",
        "--random-output-len",
        "2",
        "--ready-check-timeout-sec",
        "1",
    )
    wrong = sim_bench(*common, cwd=tmp_path)
    assert wrong.returncode == 1 and "404" in wrong.stderr
    assert sim_bench(*common, "--served-model-name", "k3", cwd=tmp_path).returncode == 0
