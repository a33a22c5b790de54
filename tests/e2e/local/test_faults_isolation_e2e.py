"""Isolation end to end: a deployment started as a user would (the bundled local inventory, its
default addresses, its own state dir), then the suite's own tests and campaigns run beside it; the
user's deployment must stay up and untouched (same processes, same record, still answering).
The doctor's view of the shared machine and held nodes: test_faults_isolation.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from isolation import campaign_file, k3
from paths import ROOT

from k3launch.campaign.results import read_rows


# ------------------------------------------------------------------ beside a user's live deployment
@dataclass
class UsersDeployment:
    name: str
    state: Path
    endpoint: str
    pids: dict[str, str]
    record: bytes

    def env(self) -> dict[str, str]:
        return {"K3LAUNCH_STATE_DIR": str(self.state)}


def _free(address: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _complete(endpoint: str) -> int:
    body = json.dumps({"model": "moonshotai/Kimi-K3", "prompt": "still there?", "max_tokens": 4}).encode()
    req = urllib.request.Request(endpoint + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        out: dict[str, list[dict[str, object]]] = json.loads(r.read())
        assert out["choices"][0]["text"]
        return int(r.status)


def _alive(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def users_deployment(tmp_path: Path) -> Iterator[UsersDeployment]:
    """`k3launch up` as the quick start runs it: the bundled inventory's default addresses (and its
    default port, unless something else already holds it), the user's own state dir."""
    state = tmp_path / "users-state"
    name = f"user-{uuid.uuid4().hex[:6]}"
    env = {"K3LAUNCH_STATE_DIR": str(state)}
    port = [] if _free("127.0.0.11", 8000) else ["--port-base", "38400"]
    up = k3("up", "--name", name, *port, "--json", env=env, cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        path = state / "deployments" / f"{name}.json"
        rec = json.loads(path.read_text())
        assert rec["plan"]["processes"][0]["address"] == "127.0.0.11"
        yield UsersDeployment(name, state, rec["endpoint"], {k: v["handle"] for k, v in rec["processes"].items()}, path.read_bytes())
    finally:
        down = k3("down", name, "--json", env=env, cwd=tmp_path)
        assert down.returncode == 0 and json.loads(down.stdout)["clean"], down.stdout + down.stderr


@pytest.mark.e2e
def test_the_suites_deployments_and_campaigns_run_beside_a_users_deployment(tmp_path: Path, users_deployment: UsersDeployment) -> None:
    user = users_deployment
    assert _complete(user.endpoint) == 200

    # the suite's own tests, as CI runs them: a campaign end to end and a local lifecycle (up, bench, down)
    tests = [
        "tests/e2e/local/test_campaign_e2e.py::test_campaign_end_to_end_one_start_per_deployment",
        "tests/e2e/local/test_campaign_e2e.py::test_bench_command_on_a_live_deployment",
    ]
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "inner")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "K3LAUNCH_STATE_DIR"},
    )
    assert inner.returncode == 0 and "2 passed" in inner.stdout, inner.stdout[-4000:] + inner.stderr[-2000:]

    # a campaign on the user's very nodes (the bundled inventory, other ports), in its own state
    # dir: the user's engine is a note at --dry-run, and the run measures every cell
    f = campaign_file(tmp_path, f"beside-{uuid.uuid4().hex[:4]}", 38912, seqs=(4,))
    mine = ("--out", str(tmp_path / "out"), "--state-dir", str(tmp_path / "state"))
    d = json.loads(k3("campaign", "run", str(f), *mine, "--dry-run", "--json", cwd=tmp_path).stdout)
    notes = [h for h in d["held"] if user.name in h["detail"]]
    assert notes and not any(h["blocking"] for h in d["held"]) and d["would_refuse"] == [], d["held"]
    r = k3("campaign", "run", str(f), *mine, "--json", cwd=tmp_path)
    s = json.loads(r.stdout)
    assert r.returncode == 0 and (s["engine_starts"], s["valid"], s["invalid"], s["refused"]) == (1, 1, 0, []), s

    # in the user's state dir, the same campaign is refused by the user's live deployment: said at
    # --dry-run, and the run starts nothing and records nothing
    theirs = ("--out", str(tmp_path / "out2"), "--state-dir", str(user.state))
    d = json.loads(k3("campaign", "run", str(f), *theirs, "--dry-run", "--json", cwd=tmp_path).stdout)
    assert [h["node"] for h in d["held"] if h["blocking"] and user.name in h["detail"]] == ["local-1"], d["held"]
    r = k3("campaign", "run", str(f), *theirs, "--json", cwd=tmp_path)
    s = json.loads(r.stdout)
    assert r.returncode == 1 and (s["engine_starts"], s["invalid"], s["not_run"]) == (0, 0, 1), s
    assert s["refused"][0]["code"] == "nodes-in-use" and read_rows(tmp_path / "out2") == []

    # untouched: the same processes, the same record, still serving
    assert all(_alive(pid) for pid in user.pids.values()), user.pids
    assert (user.state / "deployments" / f"{user.name}.json").read_bytes() == user.record
    assert _complete(user.endpoint) == 200
    st = json.loads(k3("status", user.name, "--json", env=user.env(), cwd=tmp_path).stdout)
    assert st["state"] == "ready" and all(p["alive"] and p["healthy"] for p in st["processes"]), st
