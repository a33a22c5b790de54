"""The simulated engine on one node: the OpenAI API, metrics, faults, shutdown (its command line
without a server: test_sim_unit.py).

Every sim runs as a real subprocess on a loopback "node" address with a free port and a short
load time; the ``procs`` fixture kills whatever a test started.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import pytest
from simproc import Proc, Procs, free_port, get, port_open, post, stream, wait_healthy

HOST = "127.0.0.11"


def serve(procs: Procs, *args: str, env: dict[str, str] | None = None, name: str = "sim") -> tuple[int, Proc]:
    port = free_port()
    proc = procs.sim(["--port", str(port), *args], {"VLLM_HOST_IP": HOST, **(env or {})}, name)
    return port, proc


# -- serving ------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_single_node_serves_the_openai_api(procs: Procs) -> None:
    port, proc = serve(procs, "--served-model-name", "k3", "--max-model-len", "4096", env={"K3LAUNCH_SIM_LOAD_S": "1.0"})
    proc.wait_log("Loading weights of")
    assert not port_open(HOST, port), "the API port must stay closed while the engine loads"
    wait_healthy(HOST, port, proc)
    proc.wait_log(rf"Starting vLLM server on http://{HOST}:{port}")
    base = f"http://{HOST}:{port}"

    models = json.loads(get(f"{base}/v1/models")[1])
    assert [m["id"] for m in models["data"]] == ["k3"] and models["data"][0]["max_model_len"] == 4096
    assert json.loads(get(f"{base}/version")[1]) == {"version": "0.33.0"}

    status, body = post(f"{base}/v1/completions", {"model": "k3", "prompt": "one two three", "max_tokens": 7})
    assert status == 200
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 7,
        "total_tokens": 10,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }  # vLLM's usage keys
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["text"].split()) == 7

    status, body = post(f"{base}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 16  # default max_tokens
    assert body["choices"][0]["message"]["role"] == "assistant"

    # SGLang-style extras that vllm-router injects are ignored, not refused
    status, _ = post(f"{base}/v1/completions", {"prompt": "x", "max_tokens": 1, "no_stop_trim": True, "separate_reasoning": True})
    assert status == 200
    assert post(f"{base}/v1/completions", {"model": "other", "prompt": "x"})[0] == 404
    assert post(f"{base}/v1/completions", {"prompt": "x " * 5000, "max_tokens": 2})[0] == 400  # a prompt over --max-model-len
    status, body = post(f"{base}/v1/completions", {"prompt": "x " * 4000, "max_tokens": 200})
    assert status == 200 and body["usage"]["completion_tokens"] == 96  # as vLLM 0.32: clamped to what the context holds
    assert get(f"{base}/nope")[0] == 404


@pytest.mark.e2e
def test_streaming_and_usage(procs: Procs) -> None:
    port, proc = serve(procs)
    wait_healthy(HOST, port, proc)
    events = stream(
        HOST, port, "/v1/completions", {"prompt": "a b", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).split() == ["Kimi", "is", "a", "simulated", "mixture"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # the usage chunk is dumped with exclude_none (vllm/entrypoints/openai/completion/serving.py): no *_details keys
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}

    events = stream(HOST, port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    chat = [json.loads(e) for e in events[:-1]]
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for c in chat if c["choices"][0]["delta"].get("content")) == 3
    assert all("usage" not in c for c in chat)  # no include_usage: no usage chunk


@pytest.mark.e2e
def test_finish_reason_rides_on_the_last_token_chunk(procs: Procs) -> None:
    # as vLLM's stream generators do: no empty chunk with choices after the last token, which a
    # benchmark client would count as one more token arrival; the usage chunk has no choices
    port, proc = serve(procs)
    wait_healthy(HOST, port, proc)
    usage = {"stream_options": {"include_usage": True}}
    for path, body, text in (
        ("/v1/completions", {"prompt": "a b", "max_tokens": 4}, lambda c: c["text"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, lambda c: c["delta"].get("content")),
    ):
        for extra in ({}, usage):
            chunks = [json.loads(e) for e in stream(HOST, port, path, {**body, **extra, "stream": True})[:-1]]
            with_choices = [c["choices"][0] for c in chunks if c["choices"]]
            tokens = [c for c in with_choices if text(c)]
            assert len(tokens) == 4 and with_choices[-1] is tokens[-1], (path, chunks)
            assert tokens[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in with_choices[:-1])
            if extra:
                assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
            else:
                assert all("usage" not in c for c in chunks)


@pytest.mark.e2e
def test_keep_alive_connection_serves_several_requests(procs: Procs) -> None:
    port, proc = serve(procs)
    wait_healthy(HOST, port, proc)
    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        for n in (1, 2, 3):
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": n}), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == n
    finally:
        conn.close()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.e2e
def test_metrics_and_max_num_seqs(procs: Procs) -> None:
    port, proc = serve(procs, "--max-num-seqs", "2", env={"K3LAUNCH_SIM_ITL_MS": "80"})
    wait_healthy(HOST, port, proc)
    base = f"http://{HOST}:{port}"
    results: list[int] = []
    workers = [
        threading.Thread(target=lambda: results.append(post(f"{base}/v1/completions", {"prompt": "p q", "max_tokens": 10})[0]))
        for _ in range(4)
    ]
    for w in workers:
        w.start()
    seen = (0.0, 0.0)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and seen != (2.0, 2.0):
        text = get(f"{base}/metrics")[1].decode()
        seen = (_metric(text, "vllm:num_requests_running"), _metric(text, "vllm:num_requests_waiting"))
    for w in workers:
        w.join(10)
    assert seen == (2.0, 2.0), "4 requests with --max-num-seqs 2: two run, two wait"
    assert results == [200] * 4
    text = get(f"{base}/metrics")[1].decode()
    assert _metric(text, "vllm:prompt_tokens_total") == 8
    assert _metric(text, "vllm:generation_tokens_total") == 40
    assert _metric(text, "vllm:request_success_total") == 4
    assert _metric(text, "vllm:time_to_first_token_seconds_count") == 4
    assert _metric(text, "vllm:e2e_request_latency_seconds_count") == 4
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert _metric(text, "vllm:num_requests_running") == 0


# -- faults -------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_fault_exit_during_load(procs: Procs) -> None:
    _, proc = serve(procs, env={"K3LAUNCH_SIM_FAIL": "exit-during-load", "K3LAUNCH_SIM_LOAD_S": "0.6"})
    assert proc.wait_exit(30) == 1
    log = proc.log()
    assert "EngineCore failed to start" in log and "Starting vLLM server" not in log


@pytest.mark.e2e
def test_fault_hang_never_ready_until_sigterm(procs: Procs) -> None:
    port, proc = serve(procs, env={"K3LAUNCH_SIM_FAIL": "hang"})
    proc.wait_log("simulated hang")
    time.sleep(0.3)
    assert proc.alive() and not port_open(HOST, port)
    proc.signal(signal.SIGTERM)
    assert proc.wait_exit(3) == 0


@pytest.mark.e2e
def test_fault_zero_tokens(procs: Procs) -> None:
    port, proc = serve(procs, env={"K3LAUNCH_SIM_FAIL": "zero-tokens"})
    wait_healthy(HOST, port, proc)
    status, body = post(f"http://{HOST}:{port}/v1/completions", {"prompt": "x", "max_tokens": 8})
    assert status == 200
    assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 0


@pytest.mark.e2e
def test_fault_empty_after_ready(procs: Procs) -> None:
    port, proc = serve(procs, env={"K3LAUNCH_SIM_FAIL": "empty-after-ready"})
    wait_healthy(HOST, port, proc)
    url = f"http://{HOST}:{port}/v1/completions"
    status, body = post(url, {"prompt": "x", "max_tokens": 8})  # the first one: a readiness probe passes
    assert status == 200 and body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"]
    for _ in range(2):
        status, body = post(url, {"prompt": "x", "max_tokens": 8})
        assert status == 200
        assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 0
    chunks = [
        json.loads(e)
        for e in stream(
            HOST, port, "/v1/completions", {"prompt": "x", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
        )[:-1]
    ]
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == [""]  # only the finish chunk, no tokens
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    assert "K3LAUNCH_SIM_FAIL=empty-after-ready" in proc.log()


@pytest.mark.e2e
def test_fault_crash_after_ready(procs: Procs) -> None:
    port, proc = serve(procs, env={"K3LAUNCH_SIM_FAIL": "crash-after-ready", "K3LAUNCH_SIM_FAIL_AFTER_S": "1.0"})
    wait_healthy(HOST, port, proc)
    assert proc.wait_exit(30) == 1
    assert "EngineDeadError" in proc.log()
    assert not port_open(HOST, port)


@pytest.mark.e2e
def test_fault_targets_one_process(procs: Procs) -> None:
    env = {"K3LAUNCH_SIM_FAIL": "exit-during-load", "K3LAUNCH_SIM_FAIL_PROCESS": "serve-1"}
    p0, a = serve(procs, env={**env, "K3LAUNCH_PROCESS": "serve-0"}, name="serve-0")
    _, b = serve(procs, env={**env, "K3LAUNCH_PROCESS": "serve-1"}, name="serve-1")
    assert b.wait_exit(30) == 1
    wait_healthy(HOST, p0, a)


@pytest.mark.e2e
def test_side_channel_on_an_address_not_of_this_node_fails_startup(procs: Procs) -> None:
    kv = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_load_failure_policy":"fail"}'
    _, proc = serve(
        procs,
        "--kv-transfer-config",
        kv,
        env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.255.255.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    )
    assert proc.wait_exit(30) == 1
    assert "NIXL side channel cannot bind tcp://10.255.255.1:" in proc.log()


# -- shutdown -----------------------------------------------------------------------------------


@pytest.mark.e2e
def test_sigterm_exits_0_and_frees_the_port(procs: Procs) -> None:
    port, proc = serve(procs)
    wait_healthy(HOST, port, proc)
    proc.signal(signal.SIGTERM)
    assert proc.wait_exit(1.5) == 0
    assert "Shutting down: received SIGTERM" in proc.log()
    with socket.socket() as s:  # the port is free for the next deployment right away
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, port))


@pytest.mark.e2e
def test_batch_cost_stretches_decode_steps_with_the_batch(procs: Procs) -> None:
    """K3LAUNCH_SIM_BATCH_COST: 8 requests decoding together take longer per token than one alone."""
    port, proc = serve(
        procs, "--max-num-seqs", "8", env={"K3LAUNCH_SIM_ITL_MS": "20", "K3LAUNCH_SIM_TTFT_MS": "1", "K3LAUNCH_SIM_BATCH_COST": "0.5"}
    )
    wait_healthy(HOST, port, proc)
    url = f"http://{HOST}:{port}/v1/completions"

    def timed() -> float:
        t0 = time.monotonic()
        assert post(url, {"prompt": "p", "max_tokens": 11, "ignore_eos": True})[0] == 200
        return time.monotonic() - t0

    alone = timed()  # 10 steps of 20 ms
    took: list[float] = []
    workers = [threading.Thread(target=lambda: took.append(timed())) for _ in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    # with 8 running, a step is 20 ms x (1 + 0.5 x 7) = 90 ms: well over twice the lone request
    assert len(took) == 8 and min(took) > 2 * alone, (alone, took)
