"""``up`` stages the weights onto node-local disk first (the inventory's ``weights.stage``):
the copy runs on every engine node whose copy is not complete, before the doctor and before any
engine starts; a node it fails on stops ``up`` with its reason. Against a fake runner (what runs
where, in what order), and for real on this machine (the node-side check and ``cp``, hostile paths)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import standin
import yaml

from k3launch import api
from k3launch.deploy.ssh import backend as ssh_backend
from k3launch.deploy.ssh.stage import stage
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.record import Stage
from k3launch.testing import FakeRunner
from k3launch.transport.fleet import Fleet
from k3launch.transport.runners import Target


def staged_inventory(tmp: Path, source: str, stage_dir: str, backend: str = "ssh", nodes: int = 2) -> Path:
    inv: dict[str, Any] = {
        "name": "st", "backend": backend, "hardware": "b300", "engine": "sim",
        "defaults": {"runtime": "bare", "iface": "lo", "cpu_memory_gb": 4096},
        "nodes": [{"name": f"s-{i}", "address": f"127.0.0.{31 + i}"} for i in range(nodes)],
        "router": {"node": "login", "address": "127.0.0.1"},
        "weights": {"path": source, "stage": stage_dir},
    }
    path = tmp / "inv.yaml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def _state(complete: bool, where: str) -> str:
    out = {"dir": where if complete else "", "commit": standin.COMMIT, "files": 2 if complete else 0, "bytes": 10 if complete else 0,
           "missing": [], "bad": [], "free": 10**12, "error": "" if complete else f"no refs/main in {where}"}
    return "K3W " + json.dumps(out)


class Nodes:
    """A fake fleet's nodes: which hold a complete staged copy; ``cp`` completes one (unless it is broken)."""

    def __init__(self, complete: set[str], broken: frozenset[str] = frozenset()) -> None:
        self.complete, self.broken = set(complete), set(broken)

    def __call__(self, target: Target, command: str) -> tuple[int, str, str]:
        if "K3W" in command:  # the node-side check
            return 0, _state(target.name in self.complete, "/nvme/k3/hub"), ""
        if "cp -a" in command:
            if target.name in self.broken:
                return 1, "cp: /nvme/k3/hub: No space left on device", ""
            self.complete.add(target.name)
        return 0, "", ""


def test_up_copies_to_the_nodes_without_a_complete_copy_only(tmp_path: Path) -> None:
    inv = staged_inventory(tmp_path, "/lustre/it's hf", "/nvme/k3")
    plan = api.plan(inv, strategy="multi_node_tp", nodes=2, state_dir=tmp_path / "state")
    runner = FakeRunner(Nodes({"s-0"}))
    said: list[tuple[Stage, str]] = []
    stage(plan, Fleet.for_plan(plan, runner, runner), lambda s, m: said.append((s, m)), interval=0.05)
    copies = runner.assert_ran(r"cp -a", node="s-1", times=1)
    runner.assert_not_ran(r"cp -a", node="s-0")
    assert """'/lustre/it'"'"'s hf'/models--moonshotai--Kimi-K3""" in copies[0]  # the source is data, quoted
    assert "mkdir -p /nvme/k3/hub && cp -a" in copies[0]  # into the stage's hub cache (the engines' HF_HUB_CACHE)
    assert said[-1][0] == Stage.WEIGHTS and "on 2 node(s): copied to 1, 1 already complete" in said[-1][1]


def test_a_node_the_copy_fails_on_stops_up_with_its_reason(tmp_path: Path) -> None:
    plan = api.plan(staged_inventory(tmp_path, "/lustre/hf", "/nvme/k3"), strategy="multi_node_tp", nodes=2, state_dir=tmp_path / "state")
    runner = FakeRunner(Nodes(set(), broken=frozenset({"s-1"})))
    with pytest.raises(K3Error) as e:
        stage(plan, Fleet.for_plan(plan, runner, runner), lambda s, m: None, interval=0.05)
    assert e.value.code == "weights-stage-failed" and "on s-1: cp: /nvme/k3/hub: No space left on device" in e.value.message
    assert "complete copies are kept" in e.value.hint
    unreachable = FakeRunner(Nodes(set()), fail_on=["s-0"])
    with pytest.raises(K3Error) as e:
        stage(plan, Fleet.for_plan(plan, unreachable, unreachable), lambda s, m: None, interval=0.05)
    assert e.value.code == "weights-stage-failed" and "on s-0" in e.value.message


def test_up_stages_before_the_doctor_and_a_plan_without_stage_never_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []

    class Stop(Exception):
        pass

    def doctor(*a: object, **k: object) -> None:
        order.append("doctor")
        raise Stop

    monkeypatch.setattr(ssh_backend, "stage", lambda plan, fleet, on_stage: order.append(f"stage {plan.stage.dir}"))
    monkeypatch.setattr(ssh_backend, "doctor", doctor)
    store = StateStore(tmp_path / "state")
    inv_path = staged_inventory(tmp_path, "/lustre/hf", "/nvme/k3", backend="local", nodes=1)
    inv = api.load(inv_path).inventory
    for staged in (True, False):
        plan = api.plan(inv_path, state_dir=tmp_path / "state")
        if not staged:
            plan = plan.model_copy(update={"stage": None})
        with pytest.raises(Stop):
            ssh_backend.SshBackend().up(plan, inv, str(inv_path), store, ssh_backend.UpOptions(), ssh_backend.Events())
    assert order == ["stage /nvme/k3", "doctor", "doctor"]


def test_dry_run_shows_the_copy_each_engine_node_would_run(tmp_path: Path) -> None:
    inv_path = staged_inventory(tmp_path, "/lustre/hf", "/nvme/k3")
    plan = api.plan(inv_path, strategy="multi_node_tp", nodes=2, state_dir=tmp_path / "state")
    dry = ssh_backend.SshBackend().dry_run(plan, api.load(inv_path).inventory, StateStore(tmp_path / "state"), ssh_backend.UpOptions())
    steps = [(s.step, s.node) for s in dry.steps]
    assert steps[:2] == [("weights", "s-0"), ("weights", "s-1")] and steps[2][0] == "engines"
    assert all(re.search(r"cp -a \"\$s\" /nvme/k3/hub/", s.script) for s in dry.steps[:2])
    assert all("HF_HUB_CACHE=/nvme/k3/hub" in s.script for s in dry.steps if s.step == "engines")


def test_staging_for_real_on_this_machine_then_skipped_when_complete(tmp_path: Path) -> None:
    """The node-side check and cp run for real; the paths hold a quote, spaces and $(...)."""
    shared = tmp_path / "sh'ared $(touch pwned-src)"
    local = tmp_path / "nv me $(touch pwned-dst)"
    standin.hf_cache(shared / "hub", shards=3)  # an HF_HOME on a shared filesystem: hub/models--...
    plan = api.plan(staged_inventory(tmp_path, str(shared), str(local), backend="local", nodes=1), state_dir=tmp_path / "state")
    said: list[str] = []
    stage(plan, Fleet.for_plan(plan), lambda s, m: said.append(m), interval=0.05)
    snap = local / "hub" / "models--moonshotai--Kimi-K3" / "snapshots" / standin.COMMIT
    assert len(list(snap.glob("*.safetensors"))) == 3 and (snap / "config.json").is_symlink()  # cp -a kept the hub layout
    assert "copied to 1, 0 already complete" in said[-1]
    stage(plan, Fleet.for_plan(plan), lambda s, m: said.append(m), interval=0.05)
    assert "copied to 0, 1 already complete" in said[-1]  # the second `up` copies nothing
    rows = api.weights_check(plan, staged_inventory(tmp_path, str(shared), str(local), backend="local", nodes=1))
    assert rows[0].complete and rows[0].state is not None and rows[0].state.dir == str(snap)  # what the engines will read
    assert not list(Path.cwd().glob("pwned-*")) and not list(tmp_path.rglob("pwned-*"))
    empty = api.plan(staged_inventory(tmp_path, str(tmp_path / "it's empty"), str(local / "x"), backend="local", nodes=1),
                     state_dir=tmp_path / "state")
    with pytest.raises(K3Error) as e:  # a source without the model: the node's own words, the path kept whole
        stage(empty, Fleet.for_plan(empty), lambda s, m: None, interval=0.05)
    assert e.value.code == "weights-stage-failed" and f"no models--moonshotai--Kimi-K3 in {tmp_path}/it's empty" in e.value.message


def test_a_standalone_doctor_warns_that_up_will_stage_instead_of_failing(tmp_path: Path) -> None:
    from k3launch.deploy.ssh import weights

    plan = api.plan(staged_inventory(tmp_path, "/lustre/hf", "/nvme/k3"), strategy="multi_node_tp", nodes=2, state_dir=tmp_path / "state")
    missing = [_state(False, "/nvme/k3/hub")]
    (row, _) = weights.judge(plan, plan.hosts[0], missing)
    assert (row.status, row.code) == ("warn", "") and "not staged in" in row.detail and "`up` copies it from /lustre/hf first" in row.detail
    (row, _) = weights.judge(plan.model_copy(update={"stage": None}), plan.hosts[0], missing)
    assert (row.status, row.code) == ("fail", "weights-missing")
    (row, _) = weights.judge(plan, plan.hosts[0], [_state(True, "/nvme/k3/hub")])
    assert row.status == "pass"


def test_a_spare_taking_over_a_lost_nodes_units_gets_the_staged_copy_before_its_doctor(tmp_path: Path,
                                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor (and a rollout's surge) checks spares with the watcher's ``check``: a staged plan's copy comes first there too."""
    from k3launch.deploy.ssh import watch
    from k3launch.models.record import SshRecord

    plan = api.plan(staged_inventory(tmp_path, "/lustre/hf", "/nvme/k3", nodes=3), strategy="multi_node_tp", nodes=2,
                    state_dir=tmp_path / "state")
    spare = api.plan(staged_inventory(tmp_path, "/lustre/hf", "/nvme/k3", nodes=3), strategy="multi_node_tp", nodes=2,
                     exclude=["s-0"], state_dir=tmp_path / "state")  # s-0 lost: s-1 and s-2
    rec = SshRecord(name=plan.name, state="ready", created=0, updated=0, endpoint=plan.endpoint, plan=plan)
    nodes = Nodes(set(), broken=frozenset({"s-2"}))
    runner = FakeRunner(nodes)
    doctored: list[list[str]] = []
    monkeypatch.setattr(watch, "doctor", lambda sub, fleet, live: doctored.append([h.name for h in sub.hosts]))
    w = watch.SshWatcher(rec, lambda r: Fleet.for_plan(r.plan, runner, runner), StateStore(tmp_path / "state"))
    problems = w.check(spare, ["s-2"])
    assert len(problems) == 1 and "staging moonshotai/Kimi-K3 to /nvme/k3 from /lustre/hf failed on s-2" in problems[0]
    assert doctored == []  # the copy failed: no doctor, the spare is refused
    runner.assert_ran(r"cp -a", node="s-2", times=1)
    runner.assert_not_ran(r"cp -a", node="s-1")  # only the spare is copied to
