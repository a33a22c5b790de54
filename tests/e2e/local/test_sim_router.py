"""P/D disaggregation: a prefill sim and a 2-node DEP decode sim behind the real vllm-router.

The router (PyPI ``vllm-router``) probes the workers, sends the prefill ``max_tokens: 1`` with
``kv_transfer_params.do_remote_decode``, then gives the decode the prefill's answer; the decode
sim must reach the producer's NIXL side channel over TCP before it decodes. Skipped when the
``vllm-router`` executable is not installed.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from simproc import Proc, Procs, free_port, get, post, stream, wait_healthy

ROUTER = shutil.which("vllm-router")
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")]

PREFILL, DECODE = "127.0.0.11", ["127.0.0.12", "127.0.0.13"]
KV = '{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_load_failure_policy":"fail"}}'


@dataclass
class PD:
    prefill: Proc
    decodes: list[Proc]
    router: Proc
    prefill_port: int
    decode_port: int
    router_port: int
    prefill_nixl: int
    decode_nixl: int


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    procs = Procs(tmp_path_factory.mktemp("pd"))
    try:
        yield _start(procs)
    finally:
        procs.kill_all()


def _start(procs: Procs) -> PD:
    pp, dp, rp, pn, dn, coord = (free_port() for _ in range(6))
    prefill = procs.sim(
        ["--port", str(pp), "--tensor-parallel-size", "8", "--enable-expert-parallel", "--kv-transfer-config", KV.format(role="kv_producer")],
        {"VLLM_HOST_IP": PREFILL, "VLLM_NIXL_SIDE_CHANNEL_HOST": PREFILL, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(pn),
         "K3LAUNCH_PROCESS": "prefill-0"}, "prefill-0")
    decodes = []
    for i, host in enumerate(DECODE):
        args = ["--port", str(dp), "--kv-transfer-config", KV.format(role="kv_consumer"), "--enable-expert-parallel",
                "--data-parallel-hybrid-lb", "--tensor-parallel-size", "1", "--data-parallel-size", "4",
                "--data-parallel-size-local", "2", "--data-parallel-address", DECODE[0], "--data-parallel-rpc-port", str(coord)]
        if i:
            args += ["--data-parallel-start-rank", str(2 * i)]
        decodes.append(procs.sim(args, {"VLLM_HOST_IP": host, "VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(dn),
                                        "K3LAUNCH_PROCESS": f"decode-{i}"}, f"decode-{i}"))
    assert ROUTER is not None
    router = procs.start([ROUTER, "--vllm-pd-disaggregation", "--prefill", f"http://{PREFILL}:{pp}",
                          *[a for h in DECODE for a in ("--decode", f"http://{h}:{dp}")], "--policy", "round_robin",
                          "--host", "127.0.0.1", "--port", str(rp), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                          "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30"], name="router")
    wait_healthy(PREFILL, pp, prefill)
    for host, proc in zip(DECODE, decodes, strict=True):
        wait_healthy(host, dp, proc)
    wait_healthy("127.0.0.1", rp, router, timeout=30)
    return PD(prefill, decodes, router, pp, dp, rp, pn, dn)


def test_completion_through_router_pulls_kv_from_the_producer(pd: PD) -> None:
    for i in range(4):  # round robin over both decode nodes (two DP engines each)
        status, body = post(f"http://127.0.0.1:{pd.router_port}/v1/completions",
                            {"model": "moonshotai/Kimi-K3", "prompt": f"request {i} " + "word " * 40, "max_tokens": 6})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 6 and len(body["choices"][0]["text"].split()) == 6  # type: ignore[index]
    producer = f"{PREFILL}:{pd.prefill_nixl}"
    for host, proc in zip(DECODE, pd.decodes, strict=True):
        # the decode's own log proves it reached the producer's side channel and got its blocks
        m = proc.wait_log(rf"NIXL handshake with remote engine (\S+) at {re.escape(producer)} succeeded; pulled (\d+) KV blocks")
        assert int(m.group(2)) == 3  # 42 prompt words / 16-token blocks
        pd.prefill.wait_log(rf"sent 3 KV block ids of request \S+ to {re.escape(host)} \(decode-")
    # the prefill did its part with one token per request, as the router asked
    metrics = get(f"http://{PREFILL}:{pd.prefill_port}/metrics")[1].decode()
    m = re.search(r'vllm:generation_tokens_total\{engine="0",model_name="moonshotai/Kimi-K3"\} ([\d.]+)', metrics)
    served = pd.prefill.log().count('"POST /v1/completions HTTP/1.1" 200')
    assert m is not None and served >= 4 and float(m.group(1)) == served


def test_streaming_chat_through_router(pd: PD) -> None:
    events = stream("127.0.0.1", pd.router_port, "/v1/chat/completions",
                    {"model": "moonshotai/Kimi-K3", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                     "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Kimi is a simulated"
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def _prefill_params(pd: PD) -> dict[str, object]:
    """Ask the producer directly, as the router does, for a request's kv_transfer_params."""
    status, body = post(f"http://{PREFILL}:{pd.prefill_port}/v1/completions",
                        {"prompt": "a b c", "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                                "remote_block_ids": None, "remote_host": None, "remote_port": None}})
    assert status == 200
    params = body["kv_transfer_params"]
    assert isinstance(params, dict) and params["remote_host"] == PREFILL and params["remote_port"] == pd.prefill_nixl
    assert params["do_remote_prefill"] is True and params["tp_size"] == 8
    return params


def _decode(pd: PD, params: dict[str, object]) -> tuple[int, dict[str, object]]:
    return post(f"http://{DECODE[0]}:{pd.decode_port}/v1/completions", {"prompt": "a b c", "max_tokens": 2, "kv_transfer_params": params})


def test_decode_with_the_right_side_channel_succeeds(pd: PD) -> None:
    status, body = _decode(pd, _prefill_params(pd))
    assert status == 200 and body["usage"]["completion_tokens"] == 2  # type: ignore[index]


@pytest.mark.parametrize("wrong", ["closed-port", "wrong-host", "other-engine"])
def test_decode_with_a_wrong_side_channel_fails_the_request(pd: PD, wrong: str) -> None:
    params = _prefill_params(pd)
    if wrong == "closed-port":
        params["remote_port"] = free_port()
    elif wrong == "wrong-host":
        params["remote_host"] = "127.0.0.14"  # the producer's port, on a node that is not the producer
    else:
        params["remote_host"], params["remote_port"] = DECODE[1], pd.decode_nixl + 2  # a live side channel, another engine
    status, body = _decode(pd, params)
    assert status == 500
    error = body["error"]
    assert isinstance(error, dict) and error["type"] == "InternalServerError"
    assert "NIXL handshake with" in str(error["message"])
    if wrong == "other-engine":
        assert "remote engine id mismatch" in str(error["message"])
    pd.decodes[0].wait_log("kv_load_failure_policy=fail")
