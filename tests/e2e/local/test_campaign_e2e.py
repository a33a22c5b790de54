"""Campaigns end to end on the simulated engine (no root needed), on the bundled local inventory
moved to the test suite's own loopback range (``local_inventory``, conftest.py), so a user's
deployment on the shipped addresses never meets these.

Each test writes its own campaign (unique name, its own --port-base block, 512 apart from the
others) and uses its own state dir, and runs `k3launch campaign` as a subprocess, as a user or a
Slurm array task would. Engine starts are counted from the launch stages in campaign.log
(one `start: started N engine process(es)` line per api.up of these single-node deployments),
independently of the run's own summary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import yaml

from k3launch import api
from k3launch.campaign.results import read_rows

pytestmark = pytest.mark.e2e  # local deployments of the simulated engine
TTFT_MS, ITL_MS = 30.0, 2.0
FAST = {"K3LAUNCH_SIM_LOAD_S": "0.3", "K3LAUNCH_SIM_TTFT_MS": str(TTFT_MS), "K3LAUNCH_SIM_ITL_MS": str(ITL_MS)}
LOAD = {"max_concurrency": [1, 2, 4], "input_len": 32, "output_len": 8, "num_prompts": 8}


def write(tmp: Path, port_base: int, inventory: Path, env: dict[str, str] | None = None, seqs: tuple[int, ...] = (2, 8),
          **extra: object) -> tuple[Path, str]:
    name = f"ce-{uuid.uuid4().hex[:6]}"
    body: dict[str, object] = {"name": name, "inventory": str(inventory), "port_base": port_base, "engine_env": {**FAST, **(env or {})}, "ready_timeout": 60,
                               "base": {"strategy": "single_node_tp"}, "deployments": {"set": {"max-num-seqs": list(seqs)}},
                               "load": LOAD, "validity": {"max_error_rate": 0.0}, **extra}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path, name


class Campaign:
    def __init__(self, tmp: Path, path: Path) -> None:
        self.tmp, self.path = tmp, path
        self.out = tmp / "out"
        self.state = tmp / "state"
        self.env = {**os.environ, "K3LAUNCH_STATE_DIR": str(self.state)}

    def argv(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "k3launch", "campaign", "run", str(self.path), "--out", str(self.out), *extra]

    def run(self, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*extra), capture_output=True, text=True, timeout=timeout, env=self.env, cwd=self.tmp,
                              stdin=subprocess.DEVNULL)

    def summary(self, *extra: str) -> tuple[int, dict[str, object]]:
        r = self.run("--json", *extra)
        try:
            return r.returncode, json.loads(r.stdout)
        except json.JSONDecodeError:
            raise AssertionError(f"exit {r.returncode}\n{r.stdout}\n{r.stderr}") from None

    def engine_starts(self) -> int:
        log = self.out / "campaign.log"
        lines = log.read_text().splitlines() if log.is_file() else []
        return sum(": start: started" in line and "engine process" in line for line in lines)

    def deployments(self) -> list[str]:
        return [r.name for r in api.deployments(self.state)]

    def cleanup(self) -> None:
        for name in self.deployments():
            api.down(name, state_dir=self.state, grace=2)


@pytest.fixture
def make(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[Campaign] = []

    def _make(path: Path) -> Campaign:
        c = Campaign(tmp_path, path)
        made.append(c)
        return c

    yield _make
    for c in made:
        c.cleanup()


def test_campaign_end_to_end_one_start_per_deployment(tmp_path: Path, make, local_inventory: Path) -> None:  # type: ignore[no-untyped-def]
    path, name = write(tmp_path, 30208, local_inventory)
    c = make(path)
    code, s = c.summary()
    assert code == 0, s
    assert (s["engine_starts"], s["ran"], s["valid"], s["invalid"]) == (2, 6, 6, 0)
    assert c.engine_starts() == 2  # two distinct deployments, two engine starts, whatever the load points
    rows = read_rows(c.out)
    assert len(rows) == 6 and all(r.valid and r.campaign == name for r in rows)
    for r in rows:
        m, p = r.metrics, r.provenance
        assert m is not None and p is not None
        assert (m.completed, m.failed) == (8, 0) and m.total_output_tokens == 8 * 8 and m.total_input_tokens == 8 * 32
        assert m.mean_ttft_ms is not None and m.mean_ttft_ms >= TTFT_MS
        assert m.p99_tpot_ms is not None and m.p99_tpot_ms >= ITL_MS and m.p99_e2el_ms is not None
        assert p.vllm_version == "0.33.0" and p.nodes == ["local-1"] and p.client == "local" and p.recipe_sha256
        assert p.deployment == f"{name}-{p.plan_hash[:8]}" and p.started <= p.ended
        assert r.result_file and json.loads((c.out / r.result_file).read_text())["completed"] == 8
    # a lower bound only: no load undercuts the engine's configured prefill wait; how much the 2-slot
    # batch limit adds at concurrency 4 is a figure for the report, not a test assertion (DESIGN §5)
    ttft = {(r.deployment, r.load.max_concurrency): r.metrics.mean_ttft_ms for r in rows if r.metrics}
    assert ttft[("max-num-seqs=2", 4)] is not None and ttft[("max-num-seqs=2", 4)] >= TTFT_MS
    assert c.deployments() == []

    rep = subprocess.run([sys.executable, "-m", "k3launch", "campaign", "report", str(path), "--out", str(c.out), "--json"],
                         capture_output=True, text=True, timeout=120, env=c.env)
    assert rep.returncode == 0, rep.stderr
    report = json.loads(rep.stdout)
    assert report["cells"] == 6 and report["valid"] == 6 and report["pareto"]["tpot"]
    for png in report["plots"]:
        data = Path(png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert len((c.out / "results.csv").read_text().splitlines()) == 7
    table = subprocess.run([sys.executable, "-m", "k3launch", "campaign", "report", str(path), "--out", str(c.out)],
                           capture_output=True, text=True, timeout=120, env=c.env)
    assert "by max_concurrency" in table.stdout and "max-num-seqs=2" in table.stdout

    code, again = c.summary()  # resume of a finished campaign: nothing to do, no engine start
    assert code == 0 and (again["engine_starts"], again["skipped"], again["ran"]) == (0, 6, 0)
    assert len(read_rows(c.out)) == 6 and c.engine_starts() == 2

    body = yaml.safe_load(path.read_text())  # a narrower matrix: its cells are done, the others stay out of the report
    body["load"]["max_concurrency"] = [1, 2]
    path.write_text(yaml.safe_dump(body))
    dry = json.loads(c.run("--dry-run", "--json").stdout)
    assert dry["cells"] == 4 and dry["engine_starts"] == 0
    rep = subprocess.run([sys.executable, "-m", "k3launch", "campaign", "report", str(path), "--out", str(c.out), "--json"],
                         capture_output=True, text=True, timeout=120, env=c.env)
    assert (json.loads(rep.stdout)["cells"], json.loads(rep.stdout)["stale"]) == (4, 2)


def _wait_rows(out: Path, n: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(read_rows(out)) < n:
        assert proc.poll() is None, f"campaign ended early ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}"
        assert time.monotonic() < deadline, f"fewer than {n} rows after {timeout}s"
        time.sleep(0.05)


def _check_complete(c: Campaign) -> None:
    valid = Counter(r.cell for r in read_rows(c.out) if r.valid)
    assert len(valid) == 6 and set(valid.values()) == {1}  # every cell once: none lost, none run twice
    assert c.deployments() == []


@pytest.mark.parametrize(("sig", "port_base"), [(signal.SIGKILL, 30720), (signal.SIGINT, 31232)])
def test_interrupted_campaign_resumes_with_only_the_missing_cells(tmp_path: Path, make, local_inventory: Path, sig: int, port_base: int) -> None:  # type: ignore[no-untyped-def]
    # slow tokens: the two load points after the 4th row take seconds, so a loaded machine still
    # delivers the signal while the second group is serving
    path, _ = write(tmp_path, port_base, local_inventory, env={"K3LAUNCH_SIM_ITL_MS": "60"})
    c = make(path)
    proc = subprocess.Popen(c.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=c.env, cwd=tmp_path,
                            stdin=subprocess.DEVNULL)
    try:
        _wait_rows(c.out, 4, proc)  # the first group is done and the second one is serving
        proc.send_signal(sig)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = read_rows(c.out)
    assert 4 <= len(before) < 6
    if sig == signal.SIGINT:
        assert code == 130
        assert c.deployments() == []  # Ctrl-C takes the deployment in use down before exiting
    else:
        assert code == -signal.SIGKILL
    starts_before = c.engine_starts()
    code, s = c.summary()
    assert code == 0, s
    assert s["ran"] == 6 - len(before) and s["skipped"] == len(before)
    # the second group's engine is started again only if the interrupted run could not leave it serving
    assert s["engine_starts"] + s["reused"] == 1 and c.engine_starts() - starts_before == s["engine_starts"]
    if sig == signal.SIGINT:
        assert s["reused"] == 0
    _check_complete(c)


def test_zero_token_engine_gives_invalid_cells_not_numbers(tmp_path: Path, make, local_inventory: Path) -> None:  # type: ignore[no-untyped-def]
    # the engine passes up's readiness probe, then answers every request 200 with no tokens: the
    # deployment serves, every load point runs and vLLM's client counts the empty streams as
    # completed — only the campaign's output-token gate stands between them and the results
    path, _ = write(tmp_path, 34816, local_inventory, env={"K3LAUNCH_SIM_FAIL": "empty-after-ready"}, seqs=(4,))
    c = make(path)
    code, s = c.summary()
    assert code == 1 and (s["ran"], s["valid"], s["invalid"], s["engine_starts"]) == (3, 0, 3, 1), s
    assert c.engine_starts() == 1
    rows = read_rows(c.out)
    assert len(rows) == 3 and all(not r.valid and r.metrics is None for r in rows)
    assert all(r.reason and "0 output tokens from 8 completed requests (need at least 1)" in r.reason for r in rows)
    for r in rows:  # the load point was measured: its raw result is kept, its numbers are not
        assert r.result_file
        raw = json.loads((c.out / r.result_file).read_text())
        assert (raw["completed"], raw["failed"], raw["total_output_tokens"]) == (8, 0, 0)
    assert c.deployments() == []
    rep = subprocess.run([sys.executable, "-m", "k3launch", "campaign", "report", str(path), "--out", str(c.out)],
                         capture_output=True, text=True, timeout=120, env=c.env)
    assert rep.returncode == 0 and "invalid cells" in rep.stdout and "0 output tokens" in rep.stdout


def test_engine_without_tokens_at_readiness_is_never_measured(tmp_path: Path, make, local_inventory: Path) -> None:  # type: ignore[no-untyped-def]
    # generating nothing from the start: up's completion stage refuses the deployment, so its cells
    # are invalid with the launch's reason and no load point runs against it
    path, _ = write(tmp_path, 31744, local_inventory, env={"K3LAUNCH_SIM_FAIL": "zero-tokens"}, seqs=(4,))
    c = make(path)
    code, s = c.summary()
    assert code == 1 and (s["valid"], s["invalid"], s["engine_starts"]) == (0, 3, 1)
    rows = read_rows(c.out)
    assert len(rows) == 3 and all(not r.valid and r.metrics is None and not r.result_file for r in rows)
    assert all(r.reason and "no-tokens" in r.reason and "generated no tokens" in r.reason for r in rows)
    assert c.deployments() == []
    rep = subprocess.run([sys.executable, "-m", "k3launch", "campaign", "report", str(path), "--out", str(c.out)],
                         capture_output=True, text=True, timeout=120, env=c.env)
    assert rep.returncode == 0 and "invalid cells" in rep.stdout and "no-tokens" in rep.stdout


def test_validity_gate_on_measured_figures(tmp_path: Path, make, local_inventory: Path) -> None:  # type: ignore[no-untyped-def]
    # an engine that serves, measured against a bar it cannot reach: the figures are dropped, the reason kept
    path, _ = write(tmp_path, 32256, local_inventory, seqs=(4,), validity={"min_output_tokens": 10_000})
    c = make(path)
    code, s = c.summary("--group", "0")
    assert code == 1 and (s["ran"], s["invalid"], s["engine_starts"]) == (3, 3, 1)
    rows = read_rows(c.out)
    assert all(r.metrics is None and r.result_file and "64 output tokens" in (r.reason or "") for r in rows)
    assert all(r.provenance is not None and r.provenance.client == "local" for r in rows)
    code, s = c.summary("--group", "0")  # invalid cells are run again on resume (only valid ones count as done)
    assert s["ran"] == 3 and c.engine_starts() == 2


def test_bench_command_on_a_live_deployment(tmp_path: Path, local_inventory: Path) -> None:
    inv = yaml.safe_load(local_inventory.read_text())
    inv["defaults"]["env"] = FAST
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(inv))
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(tmp_path / "state")}
    name = f"cb-{uuid.uuid4().hex[:6]}"

    def k3(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "k3launch", *args], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
                              stdin=subprocess.DEVNULL)

    up = k3("up", "-i", str(tmp_path / "inv.yaml"), "--name", name, "--port-base", "33792", "--strategy", "single_node_tp", "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        b = k3("bench", name, "--num-prompts", "6", "--random-input-len", "20", "--random-output-len", "5", "--request-rate", "50",
               "--result-dir", "res", "--json")
        assert b.returncode == 0, b.stdout + b.stderr
        res = json.loads(b.stdout)
        assert res["client"] == "local" and res["valid"] and res["reason"] is None
        data = res["result"]
        assert (data["completed"], data["total_input_tokens"], data["total_output_tokens"]) == (6, 120, 30)
        assert data["request_rate"] == 50.0 and data["mean_ttft_ms"] >= TTFT_MS
        assert (tmp_path / res["result_file"]) == tmp_path / "res" / f"bench-{name}-cx-in20-out5-r50-n6.json"
        human = k3("bench", name, "--num-prompts", "2", "--random-output-len", "3", "--result-dir", "res")
        assert human.returncode == 0 and "TTFT (ms)" in human.stdout and "result JSON:" in human.stdout
        engine = k3("bench", name, "--client", "engine", "--num-prompts", "2")
        assert engine.returncode == 2 and "not in a container" in engine.stderr
        missing = k3("bench", "no-such-deployment")
        assert missing.returncode == 2 and missing.stderr.startswith("error: no deployment named")
    finally:
        assert k3("down", name).returncode == 0
