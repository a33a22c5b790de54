"""Isolation: the test suite's local deployments never meet a user's, the doctor judges the local
backend's one shared machine right, and a campaign whose nodes are held says so before it runs
and counts what really happened when it does.

The end-to-end case (a user's deployment with the suite's tests and campaigns running beside it)
is test_faults_isolation_e2e.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
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
