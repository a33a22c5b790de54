"""vLLM 0.33.0's fault tolerance in the simulated engine (``--enable-fault-tolerance``).

Checked against vLLM 0.33.0 as released (the wheel's ``vllm/_version.py``: commit g4ba787ec9):
``vllm/entrypoints/serve/fault_tolerance/api_router.py`` (the two routes, request validation,
the 202 answer), ``vllm/v1/fault_tolerance/engine_core_sentinel.py`` (statuses, ``retry``, the
recovery timeout), ``vllm/v1/engine/core_client.py`` (the status body, ``ft_error``) and
``vllm/engine/arg_utils.py`` / ``vllm/config/parallel.py`` /
``vllm/v1/worker/sentinel/gpu_worker_sentinel.py`` (the start-up checks).

These tests call the request parser, the flag checks and the engine state machine directly;
test_sim_ft_e2e.py starts external-LB DP ranks (one process per rank, as fault tolerance
requires) on loopback addresses of the test range.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from simproc import FT_FLAGS

from k3launch.planning.schema import load_schema
from k3launch.sim import cli, ft_api, options
from k3launch.sim.apierror import ApiError
from k3launch.sim.ft import FaultTolerance, FTSettings, RetryFailed
from k3launch.sim.logs import Logger

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
