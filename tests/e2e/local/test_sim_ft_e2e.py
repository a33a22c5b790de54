"""vLLM 0.33.0's fault tolerance in the simulated engine, with external-LB DP ranks (one process per
rank, as fault tolerance requires) on loopback addresses of the test range: the routes, a single
rank's endpoints, a stalled collective, a lost rank, a collective timeout without fault
tolerance. The sources they were checked against, and the direct tests: test_sim_ft.py.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from simproc import FT_FLAGS, Proc, Procs, free_port, get, post, wait_healthy

NODES = ["127.0.77.51", "127.0.77.52", "127.0.77.53"]


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
