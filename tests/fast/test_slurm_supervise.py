"""A Slurm job that supervises itself (``up --supervise``): the one controller inside the job.

* goldens: a supervised K3 DEP, a P/D and a two-copy DEP job script in ``tests/golden/slurm/supervised/``
  (``K3LAUNCH_UPDATE_GOLDEN=1`` rewrites them); the unsupervised goldens stay as they are
  (tests/fast/test_slurm_render.py). A supervised script starts no step itself: after the doctor and
  prepare steps it hands over to ``python -m k3launch.deploy.slurm.injob`` with its settings.
* the controller starts each step with exactly the words the unsupervised script gives ``k3_step``
  (hostile values included: nothing in them runs).
* the controller itself, with the simulated engine on this machine and fakes of srun/squeue/scancel:
  a crashing engine is restarted with its own arguments, then given up, and the job ends with the
  reason; SIGTERM (``down``) stops every step and ends it cleanly.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from paths import TESTS
from sbatchcases import FAKE_ADDRS, LOG_DIR, bash_n, case_plan, hostile_inventory

from k3launch import api
from k3launch.api.policy import self_policy
from k3launch.deploy import eventlog
from k3launch.deploy.slurm.client import JobInfo
from k3launch.deploy.slurm.launch import SlurmLaunch
from k3launch.deploy.slurm.steps import expand
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.record import SlurmJob, SlurmRecord
from k3launch.models.selection import Selection
from k3launch.models.supervise import Event, RestartPolicy
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import Inventory
from k3launch.planning.recipes import RecipeTree
from k3launch.render.sbatch import CONTROL_END, JobControl, job_library, lean, make_sbatch_string, step_words
from k3launch.testing import FakeSlurm

GOLDEN = TESTS / "golden" / "slurm" / "supervised"
UPDATE = os.environ.get("K3LAUNCH_UPDATE_GOLDEN") == "1"
POLICY = RestartPolicy(max_restarts=3, window=1800, backoff=5, backoff_max=60, poll=1, start_timeout=900)
SUPERVISED = ("multi_node_dep_4", "pd_cluster", "multi_node_dep_2_replicas_2")  # copies: one unit each, restarted inside the one job
PYTHON = "/opt/k3/venv/bin/python"  # the interpreter a supervised script records (sys.executable when `up` submits)
TREE = RecipeTree()


def supervised_script(case: str, log_dir: str = LOG_DIR, policy: RestartPolicy = POLICY) -> str:
    plan, slurm, c = case_plan(case)
    return make_sbatch_string(plan, slurm, log_dir, c.extra_sbatch, c.exclude, supervise=policy, python=PYTHON)


# ------------------------------------------------------------------ goldens and structure
@pytest.mark.parametrize("case", SUPERVISED)
def test_golden_supervised_sbatch(case: str) -> None:
    path = GOLDEN / f"{case}.sbatch"
    got = supervised_script(case)
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(got, encoding="utf-8")
        return
    want = path.read_text(encoding="utf-8")
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), f"golden/slurm/supervised/{case}.sbatch", "now"))
        pytest.fail(f"{case} differs from its golden (K3LAUNCH_UPDATE_GOLDEN=1 to accept):\n{diff}")


def test_no_stale_supervised_goldens() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.sbatch")) == sorted(SUPERVISED)


@pytest.mark.parametrize("case", SUPERVISED)
def test_a_supervised_script_hands_over_to_the_controller_with_its_settings(case: str, tmp_path: Path) -> None:
    plan, slurm, _ = case_plan(case)
    text = supervised_script(case)
    (tmp_path / "job.sbatch").write_text(text)
    bash_n(tmp_path / "job.sbatch")
    assert job_library() in text and "k3launch-watch" not in text
    body = text.split("# ---- end of the k3launch job library ----\n", 1)[1]
    calls = [ln.split()[0] for ln in body.splitlines() if ln.startswith("k3_")]
    dirs = calls.count("k3_dir")  # what the steps need on their nodes, made first (tests/fast/test_slurm_render.py checks them)
    assert calls == ["k3_bind", "k3_doctor", *["k3_dir"] * dirs, "k3_prepare", "k3_control"] and dirs > 0
    # the last lines: the interpreter recorded at submission, then one JSON line of settings in a quoted here-document
    lines = body.rstrip("\n").splitlines()
    assert lines[-3] == f"k3_control {PYTHON} <<'{CONTROL_END}'" and lines[-1] == CONTROL_END
    ctl = JobControl.model_validate_json(lines[-2])
    assert ctl.plan == lean(plan) and ctl.slurm == slurm and ctl.policy == POLICY


def test_unsupervised_scripts_do_not_hand_over() -> None:
    text = make_sbatch_string(*case_plan("pd_cluster")[:2], LOG_DIR)
    assert "k3_control " not in text.split("# ---- end of the k3launch job library ----")[1] and text.endswith("k3_supervise\n")


def test_a_node_without_the_recorded_interpreter_fails_the_job_early_with_one_line(tmp_path: Path) -> None:
    """k3_control checks that the recorded interpreter imports the controller before anything starts."""
    missing = tmp_path / "no-venv" / "bin" / "python"
    script = f"{job_library()}\nK3_LOGDIR={shlex.quote(str(tmp_path))}\nk3_control {shlex.quote(str(missing))} <<'{CONTROL_END}'\n{{}}\n{CONTROL_END}\n"
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env={**os.environ, "SLURMD_NODENAME": "gpu-01"})
    assert res.returncode == 2 and res.stdout == "", res
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"k3launch: the controller cannot run on gpu-01: {missing} cannot import "
                                                   "k3launch.deploy.slurm.injob ("), lines
    assert lines[0].endswith("the allocation's first node needs that interpreter, with k3launch installed, at the same path")
    assert (tmp_path / "control.json").read_text() == "{}\n"


def _k3_step_words(script: str, tmp: Path, env: dict[str, str]) -> dict[str, list[str]]:
    """Each ``k3_step`` call of an unsupervised script, as its bash hands the words on (the job library stubbed)."""
    body = script.split("# ---- end of the k3launch job library ----\n", 1)[1]
    stubs = "".join(f"{f}() {{ :; }}\n" for f in ("k3_say", "k3_bind", "k3_doctor", "k3_dir", "k3_prepare", "k3_supervise"))
    stubs += f"k3_step() {{ local n=$1; shift 2; printf '%s\\0' \"$@\" >{shlex.quote(str(tmp))}/\"$n\".argv; }}\n"
    res = subprocess.run(["bash", "-c", stubs + body], capture_output=True, text=True, timeout=30, cwd=tmp, env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    return {p.stem: [w.decode() for w in p.read_bytes().split(b"\0")[:-1]] for p in tmp.glob("*.argv")}


def test_the_controller_starts_each_step_with_the_words_the_job_script_gives_k3_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile values (command substitutions, quotes, white space in env values, paths and URLs):
    expanded by the controller exactly as the script's own bash expands them, and nothing in them runs."""
    inv = hostile_inventory(tmp_path, "bare")
    assert inv.slurm is not None
    plan = build_plan(TREE, Selection(strategy="multi_node_dep", nodes=2), inventory=inv, name="k3t-sv-hostile")
    env = {f"K3_ADDR_{i}": a for i, a in enumerate(FAKE_ADDRS[:2])}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "bash").mkdir()
    want = _k3_step_words(make_sbatch_string(plan, inv.slurm, str(tmp_path / "logs"), ident="id-1"), tmp_path / "bash", env)
    got = {p.id: expand(step_words(plan, p, inv.slurm, "id-1")[1]) for p in plan.processes}
    assert got == want and sorted(got) == sorted(p.id for p in plan.processes)
    assert any(f"K3_PEER=http://{FAKE_ADDRS[1]}:9000/?a=$(touch {tmp_path}/pwned-env6)" in w for w in got["serve-0"])
    assert not list(tmp_path.glob("pwned*")), "a hostile value ran as a command"


# ------------------------------------------------------------------ the controller, on this machine with fakes of Slurm
# fake srun: records its argv (NUL-separated), then runs the step's command here (its options dropped)
FAKE_SRUN = r"""#!/bin/bash
printf '%s\0' "$@" >"$K3_FAKE_OUT/srun.$$.argv"
while [ "$#" -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""


def controller(tmp: Path, restart: dict[str, object], env: dict[str, str]) -> tuple[subprocess.Popen[str], Path, Path]:
    """The controller of a one-engine deployment (the simulated engine on 127.0.0.x), as a supervised job script's
    ``k3_control`` starts it; its process, its log directory and the fakes' record."""
    inv = Inventory.model_validate({"name": "u", "backend": "slurm", "hardware": "b300", "engine": "sim",
                                    "defaults": {"runtime": "bare", "python": sys.executable,
                                                 "env": {"K3LAUNCH_SIM_LOAD_S": "0.2", **env}},
                                    "slurm": {"container": "bare", "log_dir": str(tmp / "logs")}})
    plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inv, name="u-ctl", port_base=18000 + os.getpid() % 1000)
    assert inv.slurm is not None
    logs, out, bindir = tmp / "logs", tmp / "rec", tmp / "bin"
    for d in (logs, out, bindir):
        d.mkdir()
    (bindir / "srun").write_text(FAKE_SRUN)
    for name, text in (("squeue", "#!/bin/sh\nexit 1\n"), ("scancel", "#!/bin/sh\nexit 1\n")):  # no step ids: srun is signalled
        (bindir / name).write_text(text)
    for f in bindir.iterdir():
        f.chmod(0o755)
    ctl = JobControl(plan=plan, slurm=inv.slurm, policy=RestartPolicy.model_validate({"start_timeout": 30, **restart}), ident="0123abcd-456789")
    (logs / "control.json").write_text(ctl.model_dump_json())
    addr = f"127.0.{os.getpid() % 200 + 10}.{(os.getpid() // 200) % 200 + 10}"
    penv = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "K3_FAKE_OUT": str(out), "K3_ADDR_0": addr, "K3_HOST_0": "fake-node",
            "SLURM_JOB_ID": "4242", "K3_STOP_GRACE_S": "3"}
    p = subprocess.Popen([sys.executable, "-m", "k3launch.deploy.slurm.injob", str(logs / "control.json")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=penv)
    return p, logs, out


def argvs(out: Path) -> list[list[str]]:
    return [[w.decode() for w in p.read_bytes().split(b"\0")[:-1]] for p in sorted(out.glob("srun.*.argv"), key=lambda p: p.stat().st_mtime_ns)]


def job_events(logs: Path) -> list[Event]:
    path = logs / "events.jsonl"
    return [Event.model_validate_json(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def finished(p: subprocess.Popen[str], timeout: float) -> str:
    try:
        return p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"the controller did not end within {timeout:g}s:\n{p.communicate()[0]}") from None


def test_the_controller_restarts_a_crashing_engine_with_its_own_words_then_gives_up_and_ends_the_job(tmp_path: Path) -> None:
    p, logs, out = controller(tmp_path, {"max_restarts": 1, "window": 600, "backoff": 0.2, "poll": 0.2},
                              {"K3LAUNCH_SIM_FAIL": "crash-after-ready", "K3LAUNCH_SIM_FAIL_AFTER_S": "1"})
    said = finished(p, 90)
    assert p.returncode == 1, said
    kinds = [e.kind for e in job_events(logs)]
    assert kinds == ["watching", "detected", "restarting", "restarted", "detected", "gave-up", "failed", "stopped-watching"], said
    got = job_events(logs)
    assert got[0].node == os.uname().nodename.split(".")[0] and got[1].node == "fake-node" and got[1].process == "serve-0"
    assert got[1].reason.startswith("serve-0 exited with code 1")
    calls = argvs(out)
    assert len(calls) == 2 and calls[0] == calls[1] and "--job-name=serve-0" in calls[0]  # started again with its own words
    assert "k3launch: serve-0 on node 0 (fake-node) exited with code 1; supervision gave up" in said
    assert f"k3launch: supervision gave up: {got[-2].reason}; stopping the deployment" in said
    assert (logs / "serve-0.log.1").is_file() and (logs / "control" / "logs" / "u-ctl" / "serve-0.log").is_file()
    rec = StateStore(logs / "control").load("u-ctl")
    assert rec.state == "failed" and rec.control is not None and rec.control.restarts == 1


def test_sigterm_stops_every_step_and_ends_the_job_cleanly(tmp_path: Path) -> None:
    p, logs, out = controller(tmp_path, {"poll": 0.2}, {})
    deadline = time.monotonic() + 60
    while "watching" not in [e.kind for e in job_events(logs)] and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.1)
    engine = int(next(out.glob("srun.*.argv")).name.split(".")[1])
    p.send_signal(signal.SIGTERM)
    said = finished(p, 30)
    assert p.returncode == 0 and "k3launch: stop requested (SIGTERM); stopping the deployment" in said, said
    assert not Path(f"/proc/{engine}").exists() or "zombie" in Path(f"/proc/{engine}/status").read_text().lower()
    assert [e.kind for e in job_events(logs)] == ["watching", "stopped-watching"]


def test_a_step_that_ends_before_the_deployment_serves_fails_the_job_naming_it(tmp_path: Path) -> None:
    p, logs, _ = controller(tmp_path, {"poll": 0.2}, {"K3LAUNCH_SIM_FAIL": "exit-during-load"})
    said = finished(p, 60)
    assert p.returncode == 1 and "k3launch: serve-0 on node 0 (fake-node) exited with code " in said, said
    assert job_events(logs) == []  # nothing was supervised: `up` reports the exit, as for a job that fails fast


# ------------------------------------------------------------------ the login side, with Slurm faked
def slurm_record(tmp: Path, store: StateStore, *, supervised: RestartPolicy | None = POLICY, state: str = "ready") -> SlurmRecord:
    inv = Inventory.model_validate({"name": "u", "backend": "slurm", "hardware": "b300", "engine": "sim", "defaults": {"runtime": "bare"},
                                    "slurm": {"container": "bare", "log_dir": str(tmp / "logs")}})
    plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inv, name="u-sv")
    log_dir = tmp / "logs" / "u-sv"
    log_dir.mkdir(parents=True, exist_ok=True)
    rec = SlurmRecord(name="u-sv", state=state, created=1.0, updated=1.0, endpoint="http://127.0.0.254:9", plan=plan,  # type: ignore[arg-type]
                      slurm=SlurmJob(job_id="42", log_dir=str(log_dir), script="", supervised=supervised, hosts={"slurm-node-0": "k3n1"},
                                     addresses={"slurm-node-0": "127.0.0.254"}))
    store.save(rec)
    return rec


def job_event(log_dir: str, t: float, kind: str, **kw: object) -> None:
    with (Path(log_dir) / "events.jsonl").open("a") as f:  # as the job writes them (bash: "time":1700000001.500)
        f.write(json.dumps({"time": t, "kind": kind, "deployment": "u-sv", **kw}) + "\n")


def test_status_shows_the_job_supervising_itself_its_restarts_and_then_failed_with_the_reason(tmp_path: Path,
                                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import k3launch.deploy.slurm.ops as ops

    store = StateStore(tmp_path / "state")
    rec = slurm_record(tmp_path, store)
    log_dir = rec.slurm.log_dir
    job_event(log_dir, 1700000000.25, "watching", node="k3n1", reason="job 42 supervises itself; units: serve-0")
    for t in (1700000010.0, 1700000020.0):
        job_event(log_dir, t, "detected", unit="serve-0", process="serve-0", node="k3n1", reason="serve-0 exited with code 137")
        job_event(log_dir, t, "restarting", unit="serve-0", reason="serve-0 exited with code 137", attempt=1)
    fakes = iter([FakeSlurm([JobInfo("42", "RUNNING", ["k3n1"])]), FakeSlurm([JobInfo("42", "FAILED", ["k3n1"])])])
    monkeypatch.setattr(ops, "SlurmClient", lambda: next(fakes))
    snap = api.status("u-sv", state_dir=store.root)
    assert snap.supervisor is not None and snap.supervisor.model_dump() == {"host": "k3n1", "pid": None, "since": 1700000000.25, "restarts": 2,
                                                                            "detached": True, "job": "42"}
    assert snap.state == "degraded" and snap.error is None  # the engine does not answer here (no engine runs)
    job_event(log_dir, 1700000030.0, "gave-up", unit="serve-0", reason="2 restarts within 1800s; last failure: serve-0 exited with code 1")
    job_event(log_dir, 1700000030.0, "failed", reason="serve-0 given up: 2 restarts within 1800s; last failure: serve-0 exited with code 1")
    snap = api.status("u-sv", state_dir=store.root)
    why = f"the job gave up: serve-0 given up: 2 restarts within 1800s; last failure: serve-0 exited with code 1; logs in {log_dir}"
    assert snap.state == "failed" and snap.error == why and snap.as_dict()["error"] == why
    cur = store.load("u-sv")
    assert cur.state == "failed" and cur.error == why  # the record says it too (`list`)
    from rich.console import Console

    from k3launch.cli import show_deploy

    con = Console(record=True, width=300)
    show_deploy.status(con, snap)
    text = con.export_text()
    assert f"failed: {why}" in text and "supervised by job 42 itself (on k3n1) since " in text and "2 restart(s)" in text


def test_events_merge_the_jobs_own_and_down_keeps_them_in_the_state_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import k3launch.deploy.slurm.ops as ops

    store = StateStore(tmp_path / "state")
    rec = slurm_record(tmp_path, store)
    job_event(rec.slurm.log_dir, 1700000000.5, "watching", node="k3n1")
    job_event(rec.slurm.log_dir, 1700000002.0, "detected", unit="serve-0", process="serve-0", reason="serve-0 exited with code 9")
    eventlog.append(store, Event(time=1700000001.0, kind="hook-failed", deployment="u-sv", reason="a state-dir event"))
    assert [e.kind for e in api.events("u-sv", state_dir=store.root)] == ["watching", "hook-failed", "detected"]  # merged, by time
    followed = list(api.follow_events("u-sv", lambda: True, state_dir=store.root))
    assert [e.kind for e in followed] == ["watching", "hook-failed", "detected"]
    monkeypatch.setattr(ops, "SlurmClient", lambda: FakeSlurm([JobInfo("42", "RUNNING", ["k3n1"])]))
    report = api.down("u-sv", state_dir=store.root)
    assert report.clean and store.try_load("u-sv") is None
    shutil.rmtree(rec.slurm.log_dir)  # the job's log directory may go too: its events were adopted
    assert [e.kind for e in api.events("u-sv", state_dir=store.root)] == ["watching", "hook-failed", "detected"]  # each once


def test_supervise_says_a_self_supervising_job_needs_no_supervisor_and_plain_jobs_get_the_hint(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    slurm_record(tmp_path, store)
    res = subprocess.run([sys.executable, "-m", "k3launch", "supervise", "u-sv", "--state-dir", str(store.root)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.splitlines() == ["error: u-sv supervises itself: job 42 restarts failed steps inside its allocation [self-supervised]",
                                       "hint: `k3launch events u-sv` shows what it did, `k3launch status u-sv` its restarts"]
    with pytest.raises(K3Error, match="supervises itself"):
        api.supervise_detached("u-sv", state_dir=store.root)
    slurm_record(tmp_path, store, supervised=None)
    with pytest.raises(K3Error) as plain:
        api.supervise("u-sv", state_dir=store.root)
    assert plain.value.code == "not-supported" and "`k3launch up --supervise`" in plain.value.hint


def test_up_supervise_is_refused_where_a_login_node_supervises_and_nothing_starts(tmp_path: Path) -> None:
    plan = api.plan(None, strategy="single_node_tp", name="u-local")
    with pytest.raises(K3Error) as ei:
        api.up(plan, None, state_dir=tmp_path, supervise=True)
    assert ei.value.code == "not-supported" and "supervise NAME --detach" in ei.value.hint
    assert not StateStore(tmp_path).list()


def test_a_supervised_launch_hands_over_to_the_controller_records_the_policy_and_sets_the_last_jobs_events_aside(tmp_path: Path) -> None:
    inv = Inventory.model_validate({"name": "u", "backend": "slurm", "hardware": "b300", "engine": "sim", "defaults": {"runtime": "bare"},
                                    "slurm": {"container": "bare", "log_dir": str(tmp_path / "logs")},
                                    "restart": {"max_restarts": 2, "backoff": 1}})
    plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inv, name="u-launch")
    old = tmp_path / "logs" / "u-launch" / "events.jsonl"
    old.parent.mkdir(parents=True)
    old.write_text('{"time": 1.0, "kind": "failed", "deployment": "u-launch", "reason": "an earlier job"}\n')
    fake = FakeSlurm([JobInfo("42", "PENDING", [], "Resources")])
    policy = self_policy(inv, {"window": 60})
    assert policy is not None and (policy.max_restarts, policy.backoff, policy.window, policy.start_timeout) == (2, 1, 60, None)
    sl = SlurmLaunch(plan, inv, StateStore(tmp_path / "state"), client=fake, supervise=policy)
    sl.start()
    want = policy.model_copy(update={"start_timeout": api.ready_timeout(plan)})  # the plan's ready timeout (VLLM_ENGINE_READY_TIMEOUT_S)
    assert want.start_timeout == 3600 and sl.record.slurm.supervised == want
    script = Path(sl.record.slurm.script).read_text()
    # the interpreter `up` runs under runs the controller; its settings carry the policy and the deployment id
    head, control, end = script.rstrip("\n").splitlines()[-3:]
    assert head == f"k3_control {shlex.quote(sys.executable)} <<'{CONTROL_END}'" and end == CONTROL_END
    ctl = JobControl.model_validate_json(control)
    assert ctl.policy == want and ctl.ident == sl.record.deployment_id and ctl.plan == lean(plan)
    assert not old.exists() and (old.parent / "events.jsonl.1").is_file()
    assert SlurmRecord.model_validate_json(sl.record.to_json()).slurm.supervised == sl.record.slurm.supervised


def test_a_stop_request_during_a_restart_stops_everything_and_starts_nothing_more(tmp_path: Path) -> None:
    """The engine crashes once it serves; its restart loads for 3 s; SIGTERM to the controller (`down`)
    comes meanwhile: every step is stopped, the job ends cleanly, and the restart never serves."""
    p, logs, out = controller(tmp_path, {"max_restarts": 3, "poll": 0.2},
                              {"K3LAUNCH_SIM_FAIL": "crash-after-ready", "K3LAUNCH_SIM_FAIL_AFTER_S": "1", "K3LAUNCH_SIM_LOAD_S": "3"})
    deadline = time.monotonic() + 60
    while "restarting" not in [e.kind for e in job_events(logs)] and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    said = finished(p, 30)
    assert p.returncode == 0 and "k3launch: stop requested (SIGTERM); stopping the deployment" in said, said
    assert [e.kind for e in job_events(logs)] == ["watching", "detected", "restarting", "stopped-watching"]
    pids = [int(a.name.split(".")[1]) for a in out.glob("srun.*.argv")]
    assert len(pids) == 2 and not [q for q in pids if Path(f"/proc/{q}").exists() and "zombie" not in Path(f"/proc/{q}/status").read_text()]


def test_following_logs_picks_up_a_restarted_steps_new_log(tmp_path: Path) -> None:
    from k3launch.deploy.slurm.ops import follow_files

    store = StateStore(tmp_path / "state")
    rec = slurm_record(tmp_path, store)
    log = Path(rec.slurm.log_dir) / "serve-0.log"
    log.write_text("a long first life of the engine\n" * 20)
    got: list[str] = []

    def restart() -> None:
        time.sleep(0.3)
        log.rename(log.with_name("serve-0.log.1"))  # as k3_restart_unit does
        log.write_text("second life\n")

    t = threading.Thread(target=restart)
    t.start()
    follow_files(rec, ["serve-0"], got.append, poll_s=0.1, max_s=1.0)
    t.join()
    assert got == ["serve-0| second life"]


def test_a_rollout_is_refused_on_a_job_without_its_controller_with_surge_and_before_the_controller_runs(tmp_path: Path) -> None:
    from k3launch.api._jobroll import converge_in_job
    from k3launch.models.rollout import RolloutState, RolloutUnit

    store = StateStore(tmp_path / "state")
    rec = slurm_record(tmp_path, store, supervised=None)
    state = RolloutState(old=rec.plan, new=rec.plan, changes=["--set max-num-seqs=8"], started=1.0, updated=1.0,
                         units=[RolloutUnit(name="serve-0", processes=["serve-0"])])
    with pytest.raises(K3Error) as plain:
        converge_in_job(store, "u-sv", state, lambda _: None)
    assert plain.value.code == "rollout-needs-controller" and "--supervise" in plain.value.hint
    slurm_record(tmp_path, store)
    with pytest.raises(K3Error) as surge:
        converge_in_job(store, "u-sv", state.model_copy(update={"surge": True}), lambda _: None)
    assert surge.value.code == "surge-slurm"
    with pytest.raises(K3Error) as early:  # the job's controller has written no record yet: nothing is written for it
        converge_in_job(store, "u-sv", state, lambda _: None)
    assert early.value.code == "job-not-serving" and not (Path(rec.slurm.log_dir) / "control" / "supervise").exists()


def test_a_supervised_job_is_not_called_serving_before_its_controller_watches(tmp_path: Path) -> None:
    """A rank that dies between "every step answers" and "the controller watches" ends the job (its
    bring-up fails fast), so `up` probes a supervised job only once its controller said it supervises:
    a deployment `up` called ready has every later failure restarted."""
    inv = Inventory.model_validate({"name": "u", "backend": "slurm", "hardware": "b300", "engine": "sim", "defaults": {"runtime": "bare"},
                                    "slurm": {"container": "bare", "log_dir": str(tmp_path / "logs")}})
    plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inv, name="u-watch")
    out = "k3launch: node 0 = k3n1 10.0.0.1\nk3launch: doctor: 1 node(s) ok\n"
    for policy in (None, RestartPolicy(max_restarts=2)):
        fake = FakeSlurm([JobInfo("42", "RUNNING", ["k3n1"])], steps={p.id: "k3n1" for p in plan.processes}, output=out)
        sl = SlurmLaunch(plan, inv, StateStore(tmp_path / f"state-{policy is None}"), client=fake, supervise=policy)
        sl.start()
        for _ in range(3):  # bound, doctor passed, every step running
            seen = sl.poll(None)
        assert seen.stage == "health"
        assert (seen.serving is not None) is (policy is None), policy
        if policy is not None:
            with (Path(sl.record.slurm.log_dir) / "slurm-42.out").open("a") as f:
                f.write("k3launch: supervising u-watch: every step serves\n")
            watched = sl.poll(None).serving
            assert watched is not None and [p.id for p in watched] == [p.id for p in plan.processes]
