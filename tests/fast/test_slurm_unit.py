"""The Slurm backend without a cluster: parsers of Slurm's output and of the job's, plan binding,
and ``SlurmLaunch`` against :class:`k3launch.testing.FakeSlurm` (the real client, Slurm's commands faked)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from k3launch.deploy.slurm.client import JobInfo, expand, parse_sacct, parse_squeue, parse_steps, submit_env
from k3launch.deploy.slurm.job import bind_plan, parse_output
from k3launch.deploy.slurm.launch import SlurmLaunch
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.reports import LaunchFailed
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import Inventory
from k3launch.planning.recipes import RecipeTree
from k3launch.render.sbatch import make_sbatch_string
from k3launch.testing import BUSY, FakeSlurm

TREE = RecipeTree()


def inventory(**slurm: object) -> Inventory:
    return Inventory.model_validate({"name": "u", "backend": "slurm", "hardware": "b300", "engine": "sim",
                                     "defaults": {"runtime": "bare"}, "slurm": {"container": "bare", **slurm}})


def test_parsers_read_slurms_own_formats() -> None:
    assert expand("gpu-[01-03],login7") == ["gpu-01", "gpu-02", "gpu-03", "login7"] and expand("(null)") == [] and expand("x[") == []
    info = parse_squeue("7", "RUNNING|k3n[1-2]|None\n")
    assert info == JobInfo("7", "RUNNING", ["k3n1", "k3n2"], "") and info.active
    pend = parse_squeue("7", "PENDING|(null)|PartitionNodeLimit\n")
    assert pend is not None and pend.nodes == [] and pend.reason == "PartitionNodeLimit" and pend.active
    done = parse_sacct("7", "CANCELLED by 0|0:15|k3n3\n")
    assert done is not None and done.state == "CANCELLED" and not done.active and done.exit_code == "0:15"
    assert parse_squeue("7", "") is None and parse_sacct("7", "") is None
    assert parse_steps("7.0|serve-0|k3n1\n7.1|router|k3n1\n7.batch|batch|k3n1\n7.extern|extern|k3n1\n") == {"serve-0": "k3n1", "router": "k3n1"}
    assert "HF_TOKEN" not in submit_env({"HF_TOKEN": "s", "PATH": "/bin"}) and submit_env({"PATH": "/bin"}) == {"PATH": "/bin"}


def test_the_jobs_output_names_hosts_doctor_verdicts_and_which_step_ended() -> None:
    out = parse_output("k3launch: node 0 = k3n2 10.0.0.2\nk3launch: node 1 = k3n4 10.0.0.4\nk3launch: doctor: 2 node(s) ok\n"
                       "k3launch: started serve-0 on node 0 (k3n2)\n"
                       "k3launch: serve-0 on node 0 (k3n2) exited with code 1; stopping the deployment\n"
                       "k3launch: then serve-1 on node 1 (k3n4) exited with code 7\n")
    assert out.hosts == {0: ("k3n2", "10.0.0.2"), 1: ("k3n4", "10.0.0.4")} and out.doctor_ok and not out.doctor_failed
    assert out.step_exits == [("serve-0", "k3n2", 1), ("serve-1", "k3n4", 7)] and out.step_exit == ("serve-0", "k3n2", 1)
    bad = parse_output("k3launch: doctor failed on k3n1: port 8000 already in use; 6 of 8 GPUs visible\n")
    assert bad.doctor_failed == {"k3n1": "port 8000 already in use; 6 of 8 GPUs visible"} and not bad.doctor_ok


def test_binding_replaces_every_plan_address_and_never_a_prefix_of_another() -> None:
    inv = inventory(nodelist="g[1-12]")
    plan = build_plan(TREE, Selection(strategy="multi_node_dep", nodes=12), inventory=inv, name="u-bind")
    addrs = {h.name: f"10.1.0.{i + 1}" for i, h in enumerate(h for h in plan.hosts if h.gpus)}
    bound = bind_plan(plan, addrs)
    # what processes run with (provenance keeps the planned values: it explains the plan)
    text = json.dumps([[p.address, p.argv, p.env] for p in bound.processes] + [h.address for h in bound.hosts]
                      + [u.address for u in bound.ports] + [bound.endpoint])
    assert not re.search(r"\bg\d+\b", text), text[:300]
    g11 = next(p for p in bound.processes if p.node == "g11")
    assert g11.address == "10.1.0.11" and g11.env["VLLM_HOST_IP"] == "10.1.0.11"  # not "10.1.0.1" + "1"
    assert bound.endpoint.startswith("http://10.1.0.1:") and [p.node for p in bound.processes] == [p.node for p in plan.processes]


def launch(tmp: Path, fake: FakeSlurm, plan: Plan | None = None) -> tuple[SlurmLaunch, StateStore]:
    inv = inventory(log_dir=str(tmp / "logs"))
    plan = plan or build_plan(TREE, Selection(strategy="multi_node_tp", nodes=2), inventory=inv, name="u-launch")
    store = StateStore(tmp / "state")
    return SlurmLaunch(plan, inv, store, client=fake, max_attempts=2), store


def test_the_rank_that_did_not_blame_a_peer_is_the_cause_and_its_node_is_recorded(tmp_path: Path) -> None:
    fake = FakeSlurm([JobInfo("42", "RUNNING"), JobInfo("42", "FAILED", ["k3n1", "k3n2"], "NonZeroExitCode")],
                     output="k3launch: serve-0 on node 0 (k3n1) exited with code 1; stopping the deployment\n"
                     "k3launch: then serve-1 on node 1 (k3n2) exited with code 1\n")
    sl, store = launch(tmp_path, fake)
    (tmp_path / "logs" / "u-launch").mkdir(parents=True)
    (tmp_path / "logs" / "u-launch" / "serve-0.log").write_text("RuntimeError: Connection reset by peer\n")
    (tmp_path / "logs" / "u-launch" / "serve-1.log").write_text("CUDA error: uncorrectable ECC error encountered\n")
    with pytest.raises(LaunchFailed) as ei:
        sl.up(timeout=5)
    e = ei.value
    assert e.code == "process-exited" and e.failing == "serve-1" and e.node == "k3n2" and "ECC" in e.log_tail
    assert e.message.startswith("serve-1 (serve, node rank 1) on k3n2 exited with code 1 during running; serve-0 exited too")
    assert json.loads((tmp_path / "state" / "slurm-bad-nodes.json").read_text())["k3n2"]["kind"] == "rank-died"
    assert not store.exists("u-launch")  # the job is gone: nothing to keep


def test_a_directory_the_job_could_not_make_is_named_with_the_setting_that_fixes_it(tmp_path: Path) -> None:
    out = parse_output("k3launch: doctor: 2 node(s) ok\nk3launch: prepare failed on k3n2: cannot make /ro/cc $(x)/Kimi-K3-0.33.0-abc\n"
                       "k3launch: prepare failed on k3n2: cannot make /ro/hf\n")
    assert out.prepare_failed == {"k3n2": "/ro/cc $(x)/Kimi-K3-0.33.0-abc"} and not out.doctor_failed
    fake = FakeSlurm([JobInfo("42", "RUNNING"), JobInfo("42", "FAILED", ["k3n1", "k3n2"], "NonZeroExitCode")],
                     output="k3launch: prepare failed on k3n2: cannot make /ro/cc/Kimi-K3-0.33.0-abc\n")
    sl, store = launch(tmp_path, fake)
    with pytest.raises(LaunchFailed) as ei:
        sl.up(timeout=5)
    e = ei.value
    assert e.code == "prepare-failed" and e.node == "k3n2" and e.message.startswith("job 42 could not make /ro/cc/Kimi-K3-0.33.0-abc on k3n2")
    assert "`compile_cache:`" in e.hint and "prepare.log" in e.hint
    assert not (tmp_path / "state" / "slurm-bad-nodes.json").exists()  # a setting to fix, not a node to leave out
    assert not store.exists("u-launch")


def test_a_refused_submission_leaves_no_record_and_a_never_running_job_is_cancelled(tmp_path: Path) -> None:
    sl, store = launch(tmp_path, FakeSlurm([JobInfo("42", "PENDING")], refuse="Requested node configuration is not available"))
    with pytest.raises(K3Error, match="Slurm refused the job") as refused:
        sl.up(timeout=5)
    assert refused.value.code == "sbatch-refused"
    assert not store.exists("u-launch") and not store.list()
    assert not list(store.dir.glob("u-launch*")), list(store.dir.iterdir())  # no lock file left either
    fake = FakeSlurm([JobInfo("42", "PENDING", [], "Priority"), JobInfo("42", "PENDING", [], "PartitionTimeLimit")])
    sl, store = launch(tmp_path / "b", fake)
    with pytest.raises(LaunchFailed, match=r"can never start.*PartitionTimeLimit") as ei:
        sl.up(timeout=5)
    assert ei.value.code == "job-never-runs" and ["scancel", "42"] in fake.calls and not store.exists("u-launch")


def test_render_writes_the_sbatch_script_up_would_submit(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("name: r\nbackend: slurm\nhardware: b300\nslurm: {partition: gpu, container: pyxis}\n")
    res = subprocess.run([sys.executable, "-m", "k3launch", "render", "-i", str(path), "--name", "u-render", "-o", str(tmp_path / "out")],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "K3LAUNCH_STATE_DIR": str(tmp_path / "st")},
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["plan.json", "u-render.sbatch"]
    plan = Plan.model_validate_json((tmp_path / "out" / "plan.json").read_text())
    inv = Inventory.model_validate({"name": "r", "backend": "slurm", "hardware": "b300", "slurm": {"partition": "gpu", "container": "pyxis"}})
    assert inv.slurm is not None
    got = (tmp_path / "out" / "u-render.sbatch").read_text()
    # its jobs' id is a new one of the state directory's (`up` makes its own): models.identity
    ident = next(ln.split("=", 2)[2] for ln in got.splitlines() if ln.startswith("#SBATCH --comment=k3launch-id="))
    assert ident.startswith((tmp_path / "st" / "id").read_text().strip() + "-"), ident
    want = make_sbatch_string(plan, inv.slurm, str((tmp_path / "st").resolve() / "slurm" / "u-render"), ident=ident)
    assert got == want


def test_a_running_job_whose_output_never_appears_means_an_unshared_log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import k3launch.deploy.slurm.launch as sb

    monkeypatch.setattr(sb, "OUTPUT_VISIBLE_S", 0.2)
    fake = FakeSlurm([JobInfo("42", "RUNNING", ["k3n1", "k3n2"])])  # no output: it never shows up here
    sl, store = launch(tmp_path, fake)
    with pytest.raises(LaunchFailed, match="does not appear on this machine") as ei:
        sl.up(timeout=30)
    assert ei.value.code == "log-dir-not-shared" and "shares with the compute nodes" in ei.value.hint
    assert any(c[0] == "scancel" for c in fake.calls) and not store.exists("u-launch")  # the job is cancelled, nothing kept


def test_partition_node_limit_waits_when_the_partition_is_big_enough_and_squeue_hiccups_are_ridden_out(tmp_path: Path) -> None:
    # PartitionNodeLimit with a 4-node partition and a 2-node plan: nodes are down or drained, not too few: wait
    fake = FakeSlurm([JobInfo("42", "PENDING", [], "PartitionNodeLimit"), BUSY,  # that poll of squeue fails
                      JobInfo("42", "FAILED", [], "NonZeroExitCode")], partition_size=4)
    sl, _ = launch(tmp_path, fake)
    with pytest.raises(LaunchFailed) as ei:
        sl.up(timeout=5)
    assert ei.value.code == "job-ended" and "FAILED" in ei.value.message  # the job's own end, not never-runs or unavailable
    fake = FakeSlurm([JobInfo("42", "PENDING", [], "PartitionNodeLimit")], partition_size=1)
    sl, _ = launch(tmp_path / "small", fake)
    with pytest.raises(LaunchFailed) as ei:
        sl.up(timeout=5)
    assert ei.value.code == "job-never-runs"


def test_down_sends_the_grace_signal_to_the_job_script_with_the_grace_then_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import k3launch.deploy.slurm.ops as ops
    from k3launch.models.record import SlurmJob, SlurmRecord

    plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inventory(), name="u-down")
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    rec = SlurmRecord(name="u-down", state="ready", created=0.0, updated=0.0, endpoint=plan.endpoint, plan=plan,
                      slurm=SlurmJob(job_id="42", log_dir=str(log_dir), script=""))
    fake = FakeSlurm([JobInfo("42", "RUNNING", ["k3n1"])])
    report = ops.cancel_job(rec, StateStore(tmp_path / "state"), grace_s=25, client=fake)
    assert fake.calls_to("sbatch", "scancel") == [["scancel", "--batch", "--signal=TERM", "42"]]  # the job script stops its own steps
    assert (log_dir / ".k3launch-grace").read_text() == "25\n"  # ... within down's grace
    assert report.clean and report.verified == "job 42 ended, no step left"
    monkeypatch.setattr(ops, "CANCEL_WAIT_S", 0.2)
    monkeypatch.setattr(ops, "STOP_MARGIN_S", 0.0)
    stuck = FakeSlurm([JobInfo("42", "RUNNING", ["k3n1"])], steps={"serve-0": "k3n1"}, stuck=True)  # ignores every cancel
    left = ops.cancel_job(rec, StateStore(tmp_path / "state"), grace_s=0, client=stuck)
    assert not left.clean and left.leftovers["slurm"] == ["job 42 still RUNNING", "step serve-0 on k3n1"]
    assert stuck.calls_to("sbatch", "scancel") == [["scancel", "--batch", "--signal=TERM", "42"], ["scancel", "42"]]  # then Slurm's own cancel


def test_skip_doctor_leaves_the_doctor_step_out_of_the_job(tmp_path: Path) -> None:
    sl, _ = launch(tmp_path, FakeSlurm([JobInfo("42", "PENDING")]))
    def calls(text: str) -> list[str]:  # the deployment's calls of the job library, after the library itself
        body = text.split("# ---- end of the k3launch job library ----", 1)[1]
        return [ln.split()[0] for ln in body.splitlines() if ln.startswith("k3_")]

    assert calls(sl.script("/logs", []))[:2] == ["k3_bind", "k3_doctor"]
    sl.doctor = False
    assert calls(sl.script("/logs", []))[:2] == ["k3_bind", "k3_step"]


def test_status_of_an_ended_or_queued_job_and_following_logs(tmp_path: Path) -> None:
    from k3launch.deploy.slurm.ops import follow_files, observe_job
    from k3launch.models.record import SlurmJob, SlurmRecord

    plan = build_plan(TREE, Selection(strategy="multi_node_tp", nodes=2), inventory=inventory(), name="u-status")
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    rec = SlurmRecord(name="u-status", state="ready", created=0.0, updated=0.0, endpoint="http://10.9.9.1:8000", plan=plan,
                      slurm=SlurmJob(job_id="42", log_dir=str(log_dir), script="",
                                     hosts={"slurm-node-0": "k3n1", "slurm-node-1": "k3n2"},
                                     addresses={"slurm-node-0": "127.0.0.201", "slurm-node-1": "127.0.0.202"}))
    ended = observe_job(rec, FakeSlurm([JobInfo("42", "FAILED", ["k3n1", "k3n2"])])).as_dict()
    assert ended["state"] == "ended (FAILED)" and not any(p["alive"] for p in ended["processes"])
    assert [p["node"] for p in ended["processes"]] == ["k3n1", "k3n2"]
    queued = observe_job(rec, FakeSlurm([JobInfo("42", "PENDING", [], "Resources")])).as_dict()
    assert queued["state"] == "queued"
    assert queued["job"] == {"id": "42", "state": "PENDING", "nodes": [], "reason": "Resources", "log_dir": str(log_dir)}
    (log_dir / "serve-0.log").write_text("old line\n")
    got: list[str] = []

    def later() -> None:
        time.sleep(0.3)
        with (log_dir / "serve-0.log").open("a") as f:
            f.write("new line 1\nnew line 2\n")

    t = threading.Thread(target=later)
    t.start()
    follow_files(rec, ["serve-0", "serve-1"], got.append, poll_s=0.1, max_s=1.0)  # serve-1 has no log yet: skipped
    t.join()
    assert got == ["serve-0| new line 1", "serve-0| new line 2"]  # only what was appended, each line once
