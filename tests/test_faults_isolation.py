"""Isolation: the test suite's local deployments never meet a user's, the doctor judges the local
backend's one shared machine right, and a campaign whose nodes are held says so before it runs
and counts what really happened when it does.

The end-to-end case starts a deployment as a user would (the bundled local inventory, its
default addresses, its own state dir), then runs the suite's own tests and campaigns beside it;
the user's deployment must stay up and untouched (same processes, same record, still answering).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from isolation import campaign_file, k3
from paths import ROOT

from k3launch import api
from k3launch.campaign.results import read_rows
from k3launch.deploy.ssh.doctor import doctor
from k3launch.deploy.state import StateStore, default_state_dir
from k3launch.models.plan import Plan
from k3launch.models.record import SshRecord
from k3launch.testing import FakeRunner
from k3launch.transport.fleet import Fleet
from k3launch.transport.runners import Target

TEST_NET = "127.0.77."  # the suite's own loopback range (conftest.py)
# ------------------------------------------------------------------ the suite's own range and state
def test_the_suite_runs_on_its_own_state_dir_and_loopback_range(
    tmp_path_factory: pytest.TempPathFactory, local_inventory: Path, local_cpu_inventory: Path
) -> None:
    # a test (or a subprocess it starts) that names no state dir never reaches the user's
    assert default_state_dir().resolve().is_relative_to(tmp_path_factory.getbasetemp().resolve())
    assert os.environ["K3LAUNCH_STATE_DIR"] == str(default_state_dir())
    users: set[str | None] = set()
    for name in ("local", "local-cpu"):
        inv = api.load(api.bundled_inventory(name))[0]
        users |= {n.address for n in inv.nodes} | {inv.router.address or "127.0.0.1"}
    for path, shipped in ((local_inventory, "local"), (local_cpu_inventory, "local-cpu")):
        inv = api.load(path)[0]
        ours = {n.address for n in inv.nodes} | {inv.router.address}
        assert all(a and a.startswith(TEST_NET) for a in ours) and not ours & users, ours
        # the same machine as shipped otherwise: names, engine, runtime, router node
        orig = api.load(api.bundled_inventory(shipped))[0]
        assert [n.name for n in inv.nodes] == [n.name for n in orig.nodes] and inv.engine == orig.engine
        assert inv.router.node == orig.router.node and inv.defaults.runtime == orig.defaults.runtime
        plan = api.plan(path, name="iso", **({"recipe": "k3launch/tiny-llama"} if shipped == "local-cpu" else {}))
        assert plan.endpoint.startswith(f"http://{TEST_NET}")


# ------------------------------------------------------------------ the doctor's leftovers judgement
def _leftovers(plan: Plan, procs: Sequence[str], containers: Sequence[str] = (), live: frozenset[str] = frozenset()) -> tuple[str, str]:
    """The doctor's leftovers check of the plan's first node, the node answering with ``procs``
    (``PID DEPLOYMENT PROCESS`` lines) and ``containers`` (labels) of k3launch's scans."""

    def node(t: Target, cmd: str) -> tuple[int, str, str]:
        return (
            0,
            "@@listening\n@@procs\n"
            + "".join(f"{p}\n" for p in procs)
            + "@@containers\n"
            + "".join(f"{c}\n" for c in containers)
            + "@@runtime\nok\n",
            "",
        )

    report = doctor(plan, Fleet.for_plan(plan, FakeRunner(node), FakeRunner(node)), live_deployments=live)
    (check,) = [c for c in report.checks if c.name == "leftovers" and c.node == plan.processes[0].node]
    return check.status, check.detail


def test_doctor_leftovers_on_the_local_backend_are_this_deployments_own_and_on_ssh_nodes_anyones() -> None:
    plan = api.plan(None, name="mine", strategy="single_node_tp")
    assert plan.backend == "local"
    # every "node" of the local backend is this machine: another deployment's engine (a user's,
    # not in this state dir) runs here but holds none of this plan's ports (the ports check says so)
    status, detail = _leftovers(plan, ["4242 users-demo serve-0", "4243 users-demo serve-0"])
    assert status == "warn" and "users-demo" in detail and "this machine" in detail, detail
    status, detail = _leftovers(plan, [], ["users-demo"])
    assert status == "warn" and "users-demo" in detail
    # this deployment's own name still running is a leftover of it, wherever it is
    status, detail = _leftovers(plan, ["4242 users-demo serve-0", "4244 mine serve-0"])
    assert status == "fail" and "mine" in detail and "users-demo" not in detail, detail
    status, _ = _leftovers(plan, [], ["mine"])
    assert status == "fail"
    status, detail = _leftovers(plan, ["4242 users-demo serve-0"], live=frozenset({"users-demo"}))
    assert status == "pass", detail  # a live deployment of this state dir: as before

    # a plan that needs this machine's GPUs: any engine here may hold them
    status, detail = _leftovers(plan.model_copy(update={"engine": "vllm"}), ["4242 users-demo serve-0"])
    assert plan.platform == "cuda" and status == "fail" and "users-demo" in detail, detail

    # a real node (ssh) is a machine of its own: another deployment's engine there holds its GPUs
    plan = plan.model_copy(update={"backend": "ssh"})
    status, detail = _leftovers(plan, ["4242 orphan serve-0"])
    assert status == "fail" and "orphan" in detail
    status, _ = _leftovers(plan, [], ["orphan"])
    assert status == "fail"
    status, _ = _leftovers(plan, ["4242 orphan serve-0"], live=frozenset({"orphan"}))
    assert status == "pass"


# ------------------------------------------------------------------ campaigns on held nodes
def _hold(state: Path, name: str) -> None:
    """A live deployment on the bundled local inventory's local-1, as `k3launch up` records one."""
    plan = api.plan(None, name=name, strategy="single_node_tp")
    rec = SshRecord(
        name=name,
        state="ready",
        created=0,
        updated=0,
        endpoint=plan.endpoint,
        plan=plan,
        backend="local",
        inventory=str(api.bundled_inventory("local")),
    )
    StateStore(state).save(rec)


def test_a_campaign_on_nodes_a_live_deployment_holds_says_so_and_starts_nothing(tmp_path: Path) -> None:
    state, out = tmp_path / "state", tmp_path / "out"
    _hold(state, "users-demo")
    f = campaign_file(tmp_path, "heldc", 30208)  # the bundled inventory, as local-demo: the same nodes
    opts = ("--out", str(out), "--state-dir", str(state))

    dry = k3("campaign", "run", str(f), *opts, "--dry-run", "--json", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    d = json.loads(dry.stdout)
    held = [h for h in d["held"] if h["blocking"]]
    assert held and {g for h in held for g in h["groups"]} == {0, 1}, d["held"]
    assert all("users-demo" in h["detail"] and h["node"] == "local-1" for h in held), held
    assert d["engine_starts"] == 2 and d["would_refuse"] == [0, 1]
    text = k3("campaign", "run", str(f), *opts, "--dry-run", cwd=tmp_path, env={"COLUMNS": "200"})
    assert text.returncode == 0 and "users-demo" in text.stdout and "held" in text.stdout, text.stdout

    r = k3("campaign", "run", str(f), *opts, "--json", cwd=tmp_path)
    s = json.loads(r.stdout)
    assert r.returncode == 1, r.stderr
    # nothing was started and nothing measured: no engine start counted, no cell recorded invalid
    assert (s["engine_starts"], s["ran"], s["valid"], s["invalid"], s["not_run"]) == (0, 0, 0, 0, 2), s
    assert [g["group"] for g in s["refused"]] == [0, 1]
    assert all(g["code"] == "nodes-in-use" and "users-demo" in g["message"] for g in s["refused"]), s["refused"]
    assert read_rows(out) == [] and ": start: started" not in (out / "campaign.log").read_text()
    assert StateStore(state).load("users-demo").state == "ready"  # the holder is left as it was
    text = k3("campaign", "run", str(f), *opts, cwd=tmp_path, env={"COLUMNS": "200"})
    assert text.returncode == 1 and "refused" in text.stdout and "nodes-in-use" in text.stdout, text.stdout


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
        "tests/test_campaign_e2e.py::test_campaign_end_to_end_one_start_per_deployment",
        "tests/test_campaign_e2e.py::test_bench_command_on_a_live_deployment",
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


def test_a_dry_run_reports_what_the_pre_flight_checks_of_ssh_nodes_find_once_per_placement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k3launch.campaign import held as heldmod
    from k3launch.campaign.run import pending, prepare
    from k3launch.models.reports import Check, DoctorReport

    body = {
        "name": "sshc",
        "inventory": str(ROOT / "inventories" / "h200-pair.yaml"),
        "base": {"strategy": "multi_node_tp"},
        "deployments": {"set": {"max-num-seqs": [2, 8]}},
        "load": {"max_concurrency": [1]},
    }
    f = tmp_path / "sshc.yaml"
    f.write_text(yaml.safe_dump(body))
    prep = prepare(f)
    asked: list[str] = []

    def doctor(plan: Plan, inventory: object, **_: object) -> DoctorReport:  # the nodes, as the doctor finds them
        asked.append(plan.name)
        return DoctorReport(
            [
                Check("h200-a", "leftovers", "fail", "engines of orphan still run"),
                Check("h200-a", "ports", "pass", "free"),
                Check("h200-b", "shm", "warn", "1 stale file(s) in /dev/shm"),
            ]
        )

    monkeypatch.setattr(heldmod.api, "doctor", doctor)  # the campaign asks the API, as any caller does
    holds = heldmod.held(prep, pending(prep, tmp_path / "out"), tmp_path / "state")
    assert len(asked) == 1  # both groups run on the same nodes and ports: one look at them
    assert [(h.groups, h.node, h.check, h.blocking) for h in holds] == [([0, 1], "h200-a", "leftovers", True)]
    assert heldmod.refused_groups(holds) == [0, 1]
