"""Adding a backend touches no k3launch module (docs/design.md, "How to add a backend").

A toy backend lives in this file only: a registry entry (:func:`k3launch.models.backends.register`)
with its features and traits, and a class with the lifecycle, driven by the shared ``up``
skeleton (:func:`k3launch.deploy.base.run_up`). Its "control plane" is a shipped
:class:`~k3launch.testing.FakeRunner` (every start and stop is a recorded command), and what
serves is a small HTTP server of this test answering ``/health`` and ``/v1/completions``, so the
readiness stages are the real ones. ``plan``, ``up``, ``status``, ``logs`` and ``down`` run
through :mod:`k3launch.api` as they do for ssh and slurm.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from k3launch import api
from k3launch.deploy.base import Emit, Events, Progress, run_up
from k3launch.deploy.options import UpOptions
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.backends import BackendSpec, register, unregister
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord, OtherRecord, ProcessStatus, Stage, StageFn, Status
from k3launch.models.reports import DryRun, LaunchFailed, TeardownReport
from k3launch.testing import FakeRunner
from k3launch.transport.runners import Target

CONTROL = FakeRunner(respond={r"^toyctl status": (0, "running", "")})
CONSOLE = Target("toy-control", "toy-control", local=True)


class _Engine(BaseHTTPRequestHandler):
    """What the toy's deployment serves: vLLM's health and completion shapes, nothing more."""

    def do_GET(self) -> None:
        self._send(200, {} if self.path == "/health" else {"data": []})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(200, {"choices": [{"index": 0, "text": " toy"}], "usage": {"completion_tokens": 1}})

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        return None


@dataclass
class ToyLaunch:
    """The toy's hooks for :func:`run_up`: start asks the control plane, poll reads it."""

    plan: Plan
    record: OtherRecord
    on_stage: StageFn
    endpoint: str
    store: StateStore
    _started: bool = field(default=False)

    def start(self) -> None:
        CONTROL.run(CONSOLE, f"toyctl start {self.plan.name}")
        self._started = True
        self.record.state = "starting"
        self.store.save(self.record)

    def poll(self, stage: Stage | None) -> Progress:
        alive = CONTROL.run(CONSOLE, f"toyctl status {self.plan.name}").stdout == "running"
        if not alive:
            raise LaunchFailed(f"{self.plan.name} stopped", "read the toy's logs")
        return Progress(running=True, serving=(), endpoint=self.endpoint)

    def poll_interval(self, elapsed_s: float) -> float:
        return 0.05

    def not_ready(self, deadline_s: float, stage: Stage, missing: list[str]) -> LaunchFailed:
        return LaunchFailed(f"not ready in {deadline_s:g}s", "wait longer")

    def started(self) -> bool:
        return self._started

    def failed(self, exc: LaunchFailed) -> None:
        return None

    def teardown(self, exc: BaseException) -> TeardownReport:
        CONTROL.run(CONSOLE, f"toyctl stop {self.plan.name}")
        return TeardownReport(stopped=[self.plan.name])


class ToyBackend:
    """The lifecycle, and nothing else: no doctor, no weights, no fleet, no power, no arrays."""

    OPTIONS: ClassVar[tuple[type, ...]] = ()
    endpoint = ""  # the test's HTTP server

    def up(self, plan: Plan, inv: Any, inv_path: str, store: StateStore, opts: UpOptions, events: Events) -> DeploymentRecord:
        now = time.time()
        rec = OtherRecord(backend="toy", name=plan.name, state="starting", created=now, updated=now, inventory=inv_path,
                          endpoint=self.endpoint, plan=plan, data={"console": "toy-control"})
        launch = ToyLaunch(plan, rec, events.on_stage, self.endpoint, store)
        run_up(launch, store, opts.ready_timeout or 10.0, opts.keep_on_failure, events.on_failure, events.on_progress)
        return rec

    def status(self, rec: DeploymentRecord) -> Status:
        alive = CONTROL.run(CONSOLE, f"toyctl status {rec.name}").stdout == "running"
        procs = [ProcessStatus(id=p.id, node=p.node, role=p.role, alive=alive, healthy=alive) for p in rec.plan.processes]
        return Status(name=rec.name, state=rec.state, endpoint=rec.endpoint, processes=procs)

    def logs(self, rec: DeploymentRecord, ids: Sequence[str], lines: int, follow: bool, emit: Emit, everything: bool = False) -> None:
        for pid in ids:
            emit(f"==> {pid} <==")

    def down(self, rec: DeploymentRecord, store: StateStore, grace_s: float) -> TeardownReport:
        CONTROL.run(CONSOLE, f"toyctl stop {rec.name}")
        return TeardownReport(stopped=[p.id for p in rec.plan.processes], verified="the toy's control plane says stopped")

    def sweep(self, name: str, inv: Any, grace_s: float) -> TeardownReport:
        CONTROL.run(CONSOLE, f"toyctl stop {name}")
        return TeardownReport(verified="nothing of it left in the toy")

    def dry_run(self, plan: Plan, inv: Any, store: StateStore, opts: UpOptions) -> DryRun:
        return DryRun(plan.name, files=((f"{plan.name}.toy", f"toyctl start {plan.name}\n"),))


@pytest.fixture
def toy(tmp_path: Path) -> Iterator[Path]:
    """The toy registered, its engine serving on a free loopback port; the inventory file that uses it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ToyBackend.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    register(BackendSpec("toy", f"{__name__}:ToyBackend", frozenset(), "a backend of this test", default_runtime="bare"))
    CONTROL.calls.clear()
    inv = tmp_path / "toy.yaml"
    inv.write_text(
        "name: toy\nbackend: toy\nhardware: cpu-x86\nengine: vllm\nvllm_version: '0.32.0'\n"
        "defaults: {cpu_memory_gb: 8, iface: lo}\nnodes:\n  - {name: toy-1, address: 127.0.0.91}\n"
    )
    try:
        yield inv
    finally:
        unregister("toy")
        server.shutdown()


def test_a_toy_backend_runs_plan_up_status_logs_down_through_the_api(toy: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    plan = api.plan(toy, recipe="k3launch/tiny-llama", name="toy-dep")
    assert plan.backend == "toy" and [h.runtime for h in plan.hosts] == ["bare"]  # the toy's trait, read by placement
    stages: list[Stage] = []
    rec = api.up(plan, toy, state_dir=state, on_stage=lambda s, _m: stages.append(s))
    assert isinstance(rec, OtherRecord) and rec.state == "ready" and rec.data == {"console": "toy-control"}
    assert Stage.COMPLETION in stages and stages[-1] == Stage.READY  # the real readiness stages, against the toy's engine
    back = api.record("toy-dep", state)
    assert isinstance(back, OtherRecord) and back.backend == "toy"  # the record reads back as the toy's
    st = api.status("toy-dep", state_dir=state)
    assert st.state == "ready" and st.healthy
    lines: list[str] = []
    api.logs("toy-dep", lines.append, state_dir=state)
    assert lines == [f"==> {p.id} <==" for p in plan.processes]
    assert api.dry_run(plan, toy).files == (("toy-dep.toy", "toyctl start toy-dep\n"),)
    report = api.down("toy-dep", state_dir=state)
    assert report.clean and api.record("toy-dep", state) is None
    CONTROL.assert_ran(r"^toyctl start toy-dep$")
    CONTROL.assert_ran(r"^toyctl stop toy-dep$")


def test_what_the_toy_does_not_declare_is_refused_in_one_place(toy: Path, tmp_path: Path) -> None:
    plan = api.plan(toy, recipe="k3launch/tiny-llama", name="toy-dep")
    for call in (lambda: api.doctor(plan, toy), lambda: api.weights_check(plan, toy),
                 lambda: api.submit_array([plan], toy, log_dir=tmp_path)):
        with pytest.raises(K3Error) as info:
            call()
        assert info.value.code == "not-supported" and "toy backend" in info.value.message, info.value.message
    with pytest.raises(K3Error) as info:  # another backend's option that changes the deployment
        api.up(plan, toy, state_dir=tmp_path / "state", extra_sbatch=["--qos=high"])
    assert info.value.code == "not-supported" and "--extra-sbatch" in info.value.message
    assert not CONTROL.calls  # nothing was started by any refusal
