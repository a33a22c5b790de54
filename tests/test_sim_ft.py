"""vLLM 0.33.0's fault tolerance in the simulated engine (``--enable-fault-tolerance``).

Checked against vLLM 0.33.0 as released (the wheel's ``vllm/_version.py``: commit g4ba787ec9):
``vllm/entrypoints/serve/fault_tolerance/api_router.py`` (the two routes, request validation,
the 202 answer), ``vllm/v1/fault_tolerance/engine_core_sentinel.py`` (statuses, ``retry``, the
recovery timeout), ``vllm/v1/engine/core_client.py`` (the status body, ``ft_error``) and
``vllm/engine/arg_utils.py`` / ``vllm/config/parallel.py`` /
``vllm/v1/worker/sentinel/gpu_worker_sentinel.py`` (the start-up checks).

Fast tests call the request parser, the flag checks and the engine state machine directly; the
``e2e`` ones start external-LB DP ranks (one process per rank, as fault tolerance requires) on
loopback addresses of the test range.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

import pytest
from simproc import FT_FLAGS, Proc, Procs, free_port, get, post, wait_healthy

from k3launch.planning.schema import load_schema
from k3launch.sim import cli, ft_api, options
from k3launch.sim.apierror import ApiError
from k3launch.sim.ft import FaultTolerance, FTSettings, RetryFailed
from k3launch.sim.logs import Logger

NODES = ["127.0.77.51", "127.0.77.52", "127.0.77.53"]


# -- POST /fault_tolerance/apply: validation (api_router.py:23-34, 48-51) -------------------------

def _err(raw: bytes, ctype: str | None = "application/json") -> dict[str, object]:
    with pytest.raises(ApiError) as info:
        ft_api.parse_apply(raw, ctype)
    assert info.value.status == 400
    return info.value.body()["error"]  # type: ignore[return-value]


@pytest.mark.parametrize(("raw", "message"), [
    (b"", "Invalid JSON format"),
    (b"{not json", "Invalid JSON format"),
    (b"[]", "Request body must be a JSON object."),
    (b'"retry"', "Request body must be a JSON object."),
    (b"{}", "'instruction' is required."),
    (b'{"instruction": null}', "'instruction' is required."),
    (b'{"instruction": ""}', "'instruction' is required."),
    (b'{"instruction": 0}', "'instruction' is required."),
    (b'{"instruction": "pause"}', "Invalid instruction: 'pause'."),
    (b'{"instruction": "RETRY"}', "Invalid instruction: 'RETRY'."),
    (b'{"instruction": true}', "Invalid instruction: 'True'."),
    (b'{"instruction": "/tmp/x/y"}', "Invalid instruction: '<path>'."),  # sanitize_message hides paths
    (b'{"instruction": "retry", "params": null}', "'params' must be an object."),
    (b'{"instruction": "retry", "params": []}', "'params' must be an object."),
    (b'{"instruction": "retry", "params": "x"}', "'params' must be an object."),
])
def test_apply_refusals_are_http_exceptions(raw: bytes, message: str) -> None:
    assert _err(raw) == {"message": message, "type": "Bad Request", "param": None, "code": 400}


@pytest.mark.parametrize(("raw", "kind"), [(b'{"instruction": ["retry"]}', "list"), (b'{"instruction": {"a": 1}}', "dict")])
def test_apply_unhashable_instruction_is_a_type_error(raw: bytes, kind: str) -> None:
    # `instruction not in {"retry"}` raises TypeError, which vLLM's fallback handler answers 400
    assert _err(raw) == {"message": f"unhashable type: '{kind}'", "type": "BadRequestError", "param": None, "code": 400}


def test_apply_bad_utf8_is_a_value_error() -> None:
    err = _err(b'{"instruction": "\xff"}')
    assert err["type"] == "BadRequestError" and "can't decode byte 0xff" in str(err["message"])


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/json ; charset=utf-8"])
def test_apply_needs_the_json_media_type(ctype: str | None) -> None:
    err = _err(b'{"instruction": "retry"}', ctype)
    assert err["type"] == "Bad Request" and "Unsupported Media Type: Only 'application/json' is allowed" in str(err["message"])


@pytest.mark.parametrize("raw", [b'{"instruction": "retry"}', b'{"instruction": "retry", "params": {"a": 1}, "x": 2}'])
def test_apply_accepts_retry(raw: bytes) -> None:
    instruction, _ = ft_api.parse_apply(raw, "Application/JSON; charset=utf-8")
    assert instruction == "retry"
    request_id, body = ft_api.accepted()
    assert body == {"message": "Request accepted; poll /fault_tolerance/status for updates.", "request_id": request_id}
    assert len(request_id) == 36 and request_id != ft_api.accepted()[0]


# -- the flags and vLLM's start-up checks -------------------------------------------------------

def _opts(*flags: str) -> options.ServeOptions:
    return cli.parse_serve(load_schema("0.33.0"), ["m", *flags], {})


def _refusal(*flags: str) -> str:
    opts = _opts(*flags)
    with pytest.raises(options.SimConfigError) as info:
        options.check(opts, options.Knobs.from_env({}))
    return str(info.value)


def test_ft_flags_and_defaults() -> None:
    o = _opts(*FT_FLAGS, "--data-parallel-size", "4", "--data-parallel-rank", "2")
    assert (o.ft.enabled, o.ft.recovery_timeout_s, o.ft.cpu_timeout_s) == (True, 120, 1800.0)
    assert (o.dp_start, o.dp_local, o.external_lb) == (2, 1, True)
    options.check(o, options.Knobs.from_env({}))  # a valid FT rank starts
    o = _opts(*FT_FLAGS, "--fault-tolerance-config", '{"engine_recovery_timeout_sec": 7}', "--cpu-distributed-timeout-seconds", "3")
    assert (o.ft.recovery_timeout_s, o.ft.cpu_timeout_s) == (7, 3.0)
    assert _opts(*FT_FLAGS, "--fault-tolerance-config.engine_recovery_timeout_sec", "9").ft.recovery_timeout_s == 9
    # from the command line the config alone does not enable it (arg_utils.py:906 only sees dicts)
    assert not _opts("--fault-tolerance-config", '{"engine_recovery_timeout_sec": 7}').ft.enabled
    assert not _opts(*FT_FLAGS, "--disable-fault-tolerance").ft.enabled


@pytest.mark.parametrize(("value", "words"), [
    ("{", "invalid parse_dataclass value: '{'"),  # the flag schema's own JSON check comes first
    ("5", "Input should be a dictionary"),
    ('{"engine_recovery_timeout_sec": 1.5}', "fractional part"),
    ('{"timeout": 5}', "Unexpected keyword argument"),
])
def test_bad_ft_config_is_a_usage_error(value: str, words: str) -> None:
    with pytest.raises(cli.UsageError) as info:
        _opts(*FT_FLAGS, "--data-parallel-rank", "0", "--fault-tolerance-config", value)
    assert str(info.value).startswith("argument --fault-tolerance-config: ") and words in str(info.value)


@pytest.mark.parametrize(("flags", "words"), [
    (["--data-parallel-size", "2", "--data-parallel-size-local", "2"], "Fault tolerance requires external load balancer mode"),
    (["--data-parallel-size", "2", "--data-parallel-hybrid-lb", "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1"],
     "Fault tolerance requires external load balancer mode"),
    (["--data-parallel-rank", "0", "--api-server-count", "2"], "Fault tolerance requires a single API server process"),
])
def test_ft_startup_refusals(flags: list[str], words: str) -> None:
    assert words in _refusal(*FT_FLAGS, *flags)


def test_ft_needs_an_ft_capable_all2all_backend() -> None:
    msg = _refusal("--enable-fault-tolerance", "--data-parallel-rank", "0")
    assert msg == ("Fault tolerance requires an FT-capable all2all backend (one of ['deepep_low_latency', 'nixl_ep']), "
                   "but got 'allgather_reducescatter'.")


def test_external_lb_rank_rules() -> None:
    assert "requires a data-parallel rank" in _refusal("--data-parallel-external-lb", "--data-parallel-size", "2")
    assert "requires `--data-parallel-size-local 1`; got 2" in _refusal(
        "--data-parallel-size", "4", "--data-parallel-rank", "1", "--data-parallel-size-local", "2")


# -- the engine's state machine, without processes ----------------------------------------------

class _Group:
    """A DP group stand-in: reinit succeeds, or fails with the given reason."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.joined: list[int] = []

    def announce(self, reason: str) -> None:
        pass

    def reinit(self, epoch: int, deadline: float, stop: threading.Event) -> None:
        self.joined.append(epoch)
        if self.fail:
            raise RetryFailed(self.fail)


def _engine(timeout_s: float = 30.0, group: _Group | None = None) -> tuple[FaultTolerance, list[str]]:
    died: list[str] = []
    ft = FaultTolerance(FTSettings(3, timeout_s, 0.01, 0.01, 5.0), Logger("APIServer", _Sink()), died.append)
    ft.group = group
    return ft, died


class _Sink:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _until(cond: Callable[[], bool], timeout: float = 0.8) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _entry(ft: FaultTolerance) -> dict[str, object]:
    body = ft.status_body()
    assert (body["schema_version"], body["total_engines"]) == (1, 1)
    return body["engines"][0]  # type: ignore[index,no-any-return]


def test_retry_while_healthy_is_refused_in_the_status() -> None:
    ft, _ = _engine()
    assert _entry(ft) == {"id": 3, "status": "healthy"}
    ft.apply("retry", "r1")
    _until(lambda: "ft_error" in _entry(ft))
    assert _entry(ft) == {"id": 3, "status": "healthy", "last_ft_request_id": "r1",
                          "ft_error": "[FT] Rejecting retry on engine 3: status is HEALTHY"}


def test_stall_unhealthy_then_retry_recovers() -> None:
    group = _Group()
    ft, died = _engine(group=group)
    assert ft.admit() == 0
    ft.stall("peer lost")
    _until(lambda: _entry(ft)["status"] == "unhealthy")
    assert _entry(ft) == {"id": 3, "status": "unhealthy", "fault_info": "RuntimeError"}
    assert not ft.resumed.is_set() and ft.epoch == 1  # requests wait; the ones admitted before are aborted
    ft.apply("retry", "r1")
    _until(lambda: _entry(ft)["status"] == "healthy")
    assert _entry(ft) == {"id": 3, "status": "healthy"} and group.joined == [0] and ft.admit() == 1 and not died


def test_failed_retry_stays_unhealthy_with_ft_error() -> None:
    ft, _ = _engine(group=_Group(fail="missing DP ranks: 2"))
    ft.stall("peer lost")
    _until(lambda: ft.status == "unhealthy")
    ft.apply("retry", "r9")
    _until(lambda: "ft_error" in _entry(ft))
    assert _entry(ft) == {"id": 3, "status": "unhealthy", "fault_info": "RuntimeError",
                          "last_ft_request_id": "r9", "ft_error": "missing DP ranks: 2"}


def test_no_recovery_within_the_timeout_kills_the_engine() -> None:
    ft, died = _engine(timeout_s=0.05)
    ft.stall("peer lost")
    _until(lambda: bool(died))
    assert ft.dead.is_set() and "no recovery instruction within engine_recovery_timeout_sec" in died[0]
    with pytest.raises(ApiError) as info:
        ft.admit()  # a request that waited gets EngineDeadError's answer
    assert (info.value.status, info.value.kind) == (500, "InternalServerError")


# -- processes: external-LB DP ranks ------------------------------------------------------------


def ft_rank(procs: Procs, rank: int, dp: int, coord: tuple[str, int], http: int, env: dict[str, str] | None = None,
            timeout: int = 30, extra: tuple[str, ...] = (), name: str = "") -> Proc:
    args = [*FT_FLAGS, "--fault-tolerance-config", json.dumps({"engine_recovery_timeout_sec": timeout}),
            "--data-parallel-size", str(dp), "--data-parallel-rank", str(rank), "--data-parallel-address", coord[0],
            "--data-parallel-rpc-port", str(coord[1]), "--port", str(http), *extra]
    base = {"VLLM_HOST_IP": NODES[rank], "K3LAUNCH_PROCESS": f"serve-{rank}", "K3LAUNCH_SIM_FT_DETECT_S": "0.3",
            "K3LAUNCH_SIM_FT_RETRY_S": "0.2"}
    return procs.sim(args, {**base, **(env or {})}, name or f"rank-{rank}")


def status(rank: int, http: int) -> dict[str, object]:
    code, body = get(f"http://{NODES[rank]}:{http}/fault_tolerance/status")
    assert code == 200, body
    return json.loads(body)["engines"][0]  # type: ignore[no-any-return]


def wait_status(ranks: list[int], http: int, want: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(status(r, http)["status"] != want for r in ranks):
        assert time.monotonic() < deadline, f"not all {want}: {[status(r, http) for r in ranks]}"
        time.sleep(0.05)


def retry(rank: int, http: int) -> str:
    code, body = post(f"http://{NODES[rank]}:{http}/fault_tolerance/apply", {"instruction": "retry", "params": {}})
    assert code == 202 and set(body) == {"message", "request_id"}, body
    return str(body["request_id"])


class Background:
    """A completion request on its own thread: its answer once it has one."""

    def __init__(self, rank: int, http: int, max_tokens: int) -> None:
        self.result: tuple[int, dict[str, object]] | None = None
        url = f"http://{NODES[rank]}:{http}/v1/completions"
        self._t = threading.Thread(target=self._run, args=(url, max_tokens), daemon=True)
        self._t.start()

    def _run(self, url: str, max_tokens: int) -> None:
        self.result = post(url, {"prompt": "x", "max_tokens": max_tokens}, timeout=60)

    def wait(self, timeout: float = 15.0) -> tuple[int, dict[str, object]]:
        self._t.join(timeout)
        assert self.result is not None, "no answer in time"
        return self.result


@pytest.mark.e2e
def test_routes_exist_only_with_fault_tolerance(procs: Procs) -> None:
    http = free_port()
    plain = procs.sim(["--port", str(http)], {"VLLM_HOST_IP": NODES[0]}, "plain")
    wait_healthy(NODES[0], http, plain)
    assert get(f"http://{NODES[0]}:{http}/fault_tolerance/status")[0] == 404
    assert post(f"http://{NODES[0]}:{http}/fault_tolerance/apply", {"instruction": "retry"})[0] == 404


@pytest.mark.e2e
def test_single_rank_endpoints(procs: Procs) -> None:
    http = free_port()
    p = ft_rank(procs, 0, 1, (NODES[0], free_port()), http)
    wait_healthy(NODES[0], http, p)
    base = f"http://{NODES[0]}:{http}"
    assert json.loads(get(f"{base}/fault_tolerance/status")[1]) == {
        "schema_version": 1, "total_engines": 1, "engines": [{"id": 0, "status": "healthy"}]}
    assert post(f"{base}/fault_tolerance/apply", {"instruction": "pause"}) == (
        400, {"error": {"message": "Invalid instruction: 'pause'.", "type": "Bad Request", "param": None, "code": 400}})
    assert get(f"{base}/fault_tolerance/apply")[0] == 405  # a POST route
    rid = retry(0, http)  # accepted at once, refused by the healthy engine afterwards
    deadline = time.monotonic() + 5
    while "ft_error" not in status(0, http):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert status(0, http) == {"id": 0, "status": "healthy", "last_ft_request_id": rid,
                               "ft_error": "[FT] Rejecting retry on engine 0: status is HEALTHY"}


@pytest.mark.e2e
def test_stalled_collective_unhealthy_then_retry_on_every_rank(procs: Procs) -> None:
    coord, http = (NODES[0], free_port()), free_port()
    fault = {"K3LAUNCH_SIM_FAIL": "collective-timeout", "K3LAUNCH_SIM_FAIL_PROCESS": "serve-1", "K3LAUNCH_SIM_FAIL_AFTER_S": "1.5",
             "K3LAUNCH_SIM_ITL_MS": "2"}
    ranks = [ft_rank(procs, r, 3, coord, http, fault) for r in range(3)]
    for r, p in enumerate(ranks):
        wait_healthy(NODES[r], http, p)
    in_flight = Background(2, http, 5000)  # ~10 s of decoding: still running when the fault hits
    wait_status([0, 1, 2], http, "unhealthy")
    assert all(status(r, http) == {"id": r, "status": "unhealthy", "fault_info": "RuntimeError"} for r in range(3))
    code, body = in_flight.wait()
    choice = body["choices"][0]  # type: ignore[index]
    assert code == 200 and choice["finish_reason"] == "abort" and body["usage"]["completion_tokens"] < 5000  # type: ignore[index]
    assert all(get(f"http://{NODES[r]}:{http}/health")[0] == 200 for r in range(3))  # liveness only
    stalled = Background(0, http, 3)
    retry(0, http)
    retry(1, http)
    time.sleep(1.0)  # the new DP group waits for rank 2: nobody recovers, the request waits
    assert [status(r, http)["status"] for r in range(3)] == ["unhealthy"] * 3 and stalled.result is None
    retry(2, http)
    wait_status([0, 1, 2], http, "healthy")
    assert [status(r, http) for r in range(3)] == [{"id": r, "status": "healthy"} for r in range(3)]
    code, body = stalled.wait()
    assert code == 200 and body["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert all(p.alive() for p in ranks)
    assert "[FT] Engine 1 status -> HEALTHY" in ranks[1].log()


@pytest.mark.e2e
@pytest.mark.parametrize("lost", [0, 2])
def test_lost_rank_means_restarting_the_group(procs: Procs, lost: int) -> None:
    coord, http = (NODES[0], free_port()), free_port()
    ranks = [ft_rank(procs, r, 3, coord, http, timeout=4, extra=("--cpu-distributed-timeout-seconds", "1")) for r in range(3)]
    for r, p in enumerate(ranks):
        wait_healthy(NODES[r], http, p)
    ranks[lost].signal(signal.SIGKILL)
    survivors = [r for r in range(3) if r != lost]
    wait_status(survivors, http, "unhealthy")
    assert all(get(f"http://{NODES[r]}:{http}/health")[0] == 200 for r in survivors)
    # a restarted rank cannot rejoin the running group: it hangs in its start-up until its deadline
    again = ft_rank(procs, lost, 3, coord, http, {"K3LAUNCH_SIM_RENDEZVOUS_TIMEOUT_S": "1"}, name="restarted") if lost else None
    stalled = Background(survivors[-1], http, 3)
    ids = {r: retry(r, http) for r in survivors}
    deadline = time.monotonic() + 5
    while not all("ft_error" in status(r, http) for r in survivors):
        assert time.monotonic() < deadline, [status(r, http) for r in survivors]
        time.sleep(0.05)
    for r in survivors:
        entry = status(r, http)
        assert entry["status"] == "unhealthy" and entry["last_ft_request_id"] == ids[r]
        want = "DP store of DP rank 0" if lost == 0 else "Timed out waiting for the new DP group"
        assert want in str(entry["ft_error"]), entry
    code, body = stalled.wait()  # the recovery timeout passes: EngineDeadError for the waiting request
    assert (code, body["error"]["type"]) == (500, "InternalServerError")  # type: ignore[index]
    assert [ranks[r].wait_exit(10) for r in survivors] == [1, 1]
    assert "[FT] No recovery within 4s timeout." in ranks[survivors[0]].log()
    if again is not None:
        assert again.wait_exit(15) == 1 and "Starting vLLM server" not in again.log()
        assert "Timed out waiting for the DP group" in again.log()
        assert "DP rank 2 (127.0.77.53, process serve-2) tried to join the DP group after it formed" in ranks[0].log()


@pytest.mark.e2e
def test_collective_timeout_without_fault_tolerance_kills_the_engine(procs: Procs) -> None:
    http = free_port()
    p = procs.sim(["--port", str(http)], {"VLLM_HOST_IP": NODES[0], "K3LAUNCH_SIM_FAIL": "collective-timeout",
                                          "K3LAUNCH_SIM_FAIL_AFTER_S": "0.2"}, "no-ft")
    assert p.wait_exit(10) == 1
    assert "Fault detected in EP all2all communication" in p.log()
