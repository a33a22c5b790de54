"""`vllm bench serve` of the sim (k3launch's client): its statistics, the unreachable case,
keep-alive connections reused as vLLM's client reuses them; and the command line k3launch gives
`vllm bench serve`. Against a simulated engine process: test_bench_e2e.py; next to the real
`vllm bench serve`: test_bench_engine.py."""

from __future__ import annotations

import math
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
from simproc import free_port, sim_bench
from simserver import sim_server

from k3launch.models.bench import LoadPoint, bench_argv
from k3launch.sim import bench as simbench
from k3launch.sim.bench_stats import Outcome, percentile, std, summarize
from k3launch.sim.pool import Pool

if TYPE_CHECKING:
    pass



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
