"""Probe noise: the access-log lines of /health and /metrics polls stay out of engines' logs
(planned flag, where the plan's vLLM has it; the simulated engine obeys it as vLLM does), out of
``up``'s progress and out of ``logs``; a heartbeat does not repeat a log line already shown."""

from __future__ import annotations

import http.client
import io
import threading

import pytest
from rich.console import Console
from typer.testing import CliRunner

from k3launch.api.lifecycle import _without_probes
from k3launch.cli import app, show_progress
from k3launch.deploy.progress import Tracker
from k3launch.models.phases import BringUp, LogDelta, Phase, ProcessProgress, probe_access
from k3launch.models.plan import Plan
from k3launch.planning.layers import QUIET_FLAG, quiet_probes
from k3launch.planning.schema import FlagSchema, load_schema
from k3launch.sim.cli import parse_serve
from k3launch.sim.engine import Engine
from k3launch.sim.logs import Logger
from k3launch.sim.options import Knobs
from k3launch.sim.server import App, start

HOST = "127.0.79.7"  # this module's own loopback address
HEALTH = '(APIServer pid=7) INFO 12-07 10:00:00 [h11_impl.py:478] 127.0.0.1:50632 - "GET /health HTTP/1.1" 200 OK'
METRICS = 'INFO:     10.0.0.5:40022 - "GET /metrics?name=x HTTP/1.1" 200 OK'
CHAT = '(APIServer pid=7) INFO 12-07 10:00:01 [h11_impl.py:478] 127.0.0.1:50640 - "POST /v1/chat/completions HTTP/1.1" 200 OK'


def _plan(*args: str) -> Plan:
    res = CliRunner().invoke(app, ["plan", "--json", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return Plan.model_validate_json(res.stdout)


def test_serving_engines_are_planned_not_to_log_probes_with_provenance() -> None:
    for args in (["--strategy", "multi_node_tep", "--nodes", "2"], ["--strategy", "pd_cluster"], ["--vllm-version", "0.32.0"]):
        p = _plan(*args)
        for proc in p.processes:
            has = QUIET_FLAG in proc.argv
            if proc.role == "router" or proc.http_port is None:  # a router, or a headless rank: no API server
                assert not has, (args, proc.id)
                continue
            assert proc.argv[proc.argv.index(QUIET_FLAG) + 1] == "/health,/metrics", (args, proc.id)
            assert [e.origin for e in proc.provenance[QUIET_FLAG]] == ["k3launch probes (health and metrics polls)"]


def test_a_vllm_without_the_flag_is_not_given_it() -> None:
    full = load_schema("0.33.0")
    older = FlagSchema("0.0.1", [s for s in full.specs if QUIET_FLAG not in s.options], full.env_vars)
    assert quiet_probes(full) and not quiet_probes(older)


def _sim_log(extra: list[str]) -> str:
    env = {"K3LAUNCH_SIM_TTFT_MS": "0", "K3LAUNCH_SIM_ITL_MS": "0"}
    knobs = Knobs.from_env(env)
    opts = parse_serve(load_schema(knobs.version), ["moonshotai/Kimi-K3", *extra], env)
    out = io.StringIO()
    log = Logger(stream=out)
    httpd = start(HOST, 0, App(opts, Engine(opts, knobs, log, None), log, knobs.version))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        for path in ("/health", "/metrics?x=1", "/v1/models", "/healthz"):
            conn = http.client.HTTPConnection(HOST, httpd.server_address[1], timeout=10)
            conn.request("GET", path)
            conn.getresponse().read()
            conn.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    return out.getvalue()


def test_the_simulated_engine_leaves_out_the_paths_it_is_told_as_vllm_does() -> None:
    told = _sim_log([QUIET_FLAG, "/health,/metrics"])
    assert '"GET /v1/models HTTP/1.1" 200' in told and '"GET /healthz HTTP/1.1" 404' in told  # exact paths only
    assert "GET /health " not in told and "GET /metrics" not in told, told
    plain = _sim_log([])
    assert '"GET /health HTTP/1.1" 200' in plain and '"GET /metrics?x=1 HTTP/1.1" 200' in plain
    assert "GET" not in _sim_log(["--disable-uvicorn-access-log"])


def test_probe_lines_are_recognised() -> None:
    assert probe_access(HEALTH) and probe_access(METRICS)
    assert not probe_access(CHAT) and not probe_access('127.0.0.1:1 - "GET /healthz HTTP/1.1" 200')


def test_progress_never_shows_a_probe_line_as_the_last_line() -> None:
    plan = _plan()
    pid = plan.processes[0].id
    t = Tracker(plan, started=0.0)
    t.update({pid: LogDelta("Application startup complete.\n" + HEALTH + "\n" + METRICS + "\n")}, (), "health", 1.0)
    snap = t.update({pid: LogDelta(HEALTH + "\n")}, (), "health", 2.0)
    assert next(p for p in snap.processes if p.id == pid).last_line == "Application startup complete."


def test_logs_leaves_out_probe_lines() -> None:
    got: list[str] = []
    emit = _without_probes(got.append)
    emit("\n".join([HEALTH, CHAT, METRICS, "Engine 000: Avg prompt throughput: 1.0 tokens/s"]))
    emit(f"serve-0| {HEALTH}")  # `logs -f`: a line at a time
    emit("==> serve-0 on node-1 <==")
    assert got == [CHAT + "\nEngine 000: Avg prompt throughput: 1.0 tokens/s", "==> serve-0 on node-1 <=="]


def test_a_heartbeat_does_not_repeat_a_line_already_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(show_progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    view = show_progress.UpView(Console(file=out, width=80, soft_wrap=False))
    snap = BringUp(0.0, 1.0, "health", (ProcessProgress("serve-0", "node-1", "serve", Phase.API_SERVER, 0.0, None, "Waiting for engine"),))
    view.progress(snap)
    for _ in range(3):
        clock[0] += 10
        view.progress(snap)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and sum("Waiting for engine" in line for line in lines) == 1, lines


def test_sim_quiet_paths_come_from_the_flag() -> None:
    opts = parse_serve(load_schema("0.33.0"), ["m", QUIET_FLAG, " /health , /metrics "], {})
    assert opts.quiet_paths == frozenset({"/health", "/metrics"}) and opts.access_log
