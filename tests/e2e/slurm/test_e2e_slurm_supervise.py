"""A Slurm job that supervises itself, end to end on the local Slurm cluster (``tests/support/slurmcluster.py``).

``k3launch up --supervise`` on a slurm inventory: the job's own controller (``python -m
k3launch.deploy.slurm.injob`` on its batch host) starts the simulated engine's steps; a process
killed on its node (kill -9) is restarted inside the same allocation (its recovery unit: both ranks
of a DEP engine, out of the router and back; the router's step left alone) and serves again; a crash loop
(``K3LAUNCH_SIM_FAIL=crash-after-ready``) ends the job after ``max_restarts``, and ``status`` says
failed with the reason; ``down`` during a restart leaves nothing. The events are read from the
login node with ``k3launch events``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from e2e_helpers import processes
from slurmdeploy import assert_nothing_left, chat, events, jobs_named, k3, step_ids, supervised_inventory, wait_for

if TYPE_CHECKING:
    from slurmcluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]


def _served(endpoint: str) -> bool:
    import urllib.error

    try:
        return bool(chat(endpoint)["usage"]["completion_tokens"] > 0)
    except (urllib.error.URLError, OSError):
        return False


def pids_of(name: str, process: str) -> set[int]:
    return {pid for pid, p in processes(name).items() if p == process}


def test_a_rank_killed_on_its_node_restarts_its_group_inside_the_same_job_and_serves_again(cluster: Cluster, state: Path,
                                                                                           tmp_path: Path) -> None:
    inv = supervised_inventory(tmp_path, cluster, {"max_restarts": 3, "window": 600, "backoff": 1, "poll": 0.5})
    name = f"k3sv-dep-{uuid.uuid4().hex[:4]}"
    up = k3(cluster, state, "up", "-i", str(inv), "--strategy", "multi_node_dep", "--nodes", "2", "--name", name, "--supervise",
            "--ready-timeout", "60")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        rec = json.loads((state / "deployments" / f"{name}.json").read_text())
        job, endpoint = rec["slurm"]["job_id"], rec["endpoint"]
        assert rec["slurm"]["supervised"]["max_restarts"] == 3
        assert f"supervised by job {job} itself" in up.stdout
        assert wait_for(lambda: [e for e in events(cluster, state, name) if e["kind"] == "watching"], 15, "the job's watching event")
        before = {p: pids_of(name, p) for p in ("serve-0", "serve-1")}
        steps_before = step_ids(cluster, job)
        assert all(before.values()) and sorted(steps_before) == ["router", "serve-0", "serve-1"], (before, steps_before)
        assert chat(endpoint)["usage"]["completion_tokens"] > 0

        t_kill = time.time()
        for pid in before["serve-1"]:
            os.kill(pid, signal.SIGKILL)  # the headless DP rank, on its node
        back = wait_for(lambda: next((e for e in events(cluster, state, name) if e["kind"] == "restarted"), None), 90,
                        "the unit serving again")
        got = events(cluster, state, name)
        detected = next(e for e in got if e["kind"] == "detected")
        # serve-0 notices its lost peer and exits within the same poll: the first of the unit in start order is named (as a
        # supervisor on a login node does); either way, with its own node and exit code
        rank = detected["process"]
        assert detected["unit"] == "serve" and rank in ("serve-0", "serve-1"), detected
        assert detected["node"] == rec["slurm"]["hosts"][f"slurm-node-{rank[-1]}"] and detected["reason"].startswith(f"{rank} exited with code ")
        assert [e["kind"] for e in got if e["kind"] not in ("watching", "rerouted")] == ["detected", "restarting", "restarted"], got
        # the controller keeps the router's worker list: the group's engines left it before the restart, and came back once serving
        routed = [e["reason"] for e in got if e["kind"] == "rerouted"]
        assert routed and routed[0].startswith("removed ") and routed[-1].startswith("added "), routed
        assert back["unit"] == "serve" and back["attempt"] == 1 and back["seconds"] > 0
        print(f"\n[self-supervised DEP-2 on Slurm: kill -9 of serve-1 -> detected {detected['time'] - t_kill:.1f}s, "
              f"serving again {back['time'] - t_kill:.1f}s after the kill ({back['seconds']:.1f}s from detection)]")
        assert detected["time"] - t_kill < 5  # poll 0.5 s

        # the same job, both ranks new steps and processes, the router's step untouched; serving through the router again
        assert jobs_named(cluster, name) == {job: "RUNNING"}
        after = {p: pids_of(name, p) for p in ("serve-0", "serve-1")}
        assert after["serve-0"] and after["serve-1"] and not after["serve-0"] & before["serve-0"] and not after["serve-1"] & before["serve-1"]
        steps_after = step_ids(cluster, job)
        assert steps_after["router"] == steps_before["router"], (steps_before, steps_after)
        assert all(steps_after[p] != steps_before[p] for p in ("serve-0", "serve-1")), (steps_before, steps_after)
        # the whole group restarted: the router answers 503 until its health check (every 1 s) re-admits the ranks
        assert wait_for(lambda: _served(endpoint), 30, "a completion through the router")
        snap = json.loads(k3(cluster, state, "status", name, "--json").stdout)
        assert snap["state"] == "ready" and snap["job"]["id"] == job and all(p["alive"] for p in snap["processes"]), snap
        assert snap["supervisor"]["job"] == job and snap["supervisor"]["restarts"] == 1 and snap["supervisor"]["pid"] is None
        assert snap["supervisor"]["host"] == rec["slurm"]["hosts"]["slurm-node-0"]
        assert (Path(rec["slurm"]["log_dir"]) / "serve-1.log.1").is_file()  # the killed run's log, kept beside the new one
        sup = k3(cluster, state, "supervise", name)
        assert sup.returncode == 2 and sup.stderr.startswith(f"error: {name} supervises itself: job {job} restarts failed steps"), sup.stderr
    finally:
        down = k3(cluster, state, "down", name, "--json")
    assert down.returncode == 0 and json.loads(down.stdout)["clean"] is True, down.stdout + down.stderr
    assert_nothing_left(cluster, name)
    kept = [e["kind"] for e in events(cluster, state, name) if e["kind"] not in ("rerouted", "stopped-watching")]
    assert kept[-3:] == ["detected", "restarting", "restarted"]  # kept after down


def test_a_crash_loop_ends_the_job_after_max_restarts_and_status_says_failed_with_the_reason(cluster: Cluster, state: Path,
                                                                                             tmp_path: Path) -> None:
    inv = supervised_inventory(tmp_path, cluster, {"max_restarts": 2, "window": 600, "backoff": 0.5, "backoff_max": 1, "poll": 0.5},
                               {"K3LAUNCH_SIM_FAIL": "crash-after-ready", "K3LAUNCH_SIM_FAIL_AFTER_S": "4"})
    name = f"k3sv-loop-{uuid.uuid4().hex[:4]}"
    up = k3(cluster, state, "up", "-i", str(inv), "--strategy", "single_node_tp", "--name", name, "--supervise", "--ready-timeout", "60")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        job = json.loads((state / "deployments" / f"{name}.json").read_text())["slurm"]["job_id"]
        t0 = time.monotonic()
        # three crashes, two restarts, then the job ends: ~4.3 s a life
        wait_for(lambda: set(jobs_named(cluster, name).values()) <= {"FAILED"}, 90, f"job {job} ending")
        print(f"\n[self-supervised crash loop on Slurm: job ended {time.monotonic() - t0:.1f}s after up returned]")
        got = events(cluster, state, name)
        assert [e["kind"] for e in got] == ["watching", "detected", "restarting", "restarted", "detected", "backoff", "restarting",
                                            "restarted", "detected", "gave-up", "failed", "stopped-watching"], got
        snap = json.loads(k3(cluster, state, "status", name, "--json").stdout)
        log_dir = snap["job"]["log_dir"]
        # the engine's own last words follow the exit code; its last lines are kept beside the job's logs
        why = got[-2]["reason"]
        assert why.startswith("serve-0 given up: 2 restarts within 600s; last failure: serve-0 exited with code 1"), why
        assert why.endswith(f"; last log lines kept in {log_dir}/control/logs/{name}/"), why
        assert (Path(log_dir) / "control" / "logs" / name / "serve-0.log").is_file()
        assert got[-1]["reason"] == "failed"
        assert snap["state"] == "failed" and snap["error"] == f"the job gave up: {why}; logs in {log_dir}", snap
        assert snap["supervisor"]["restarts"] == 2 and not any(p["alive"] for p in snap["processes"])
        assert [(d["name"], d["state"]) for d in json.loads(k3(cluster, state, "list", "--json").stdout)] == [(name, "failed")]
        out = (Path(log_dir) / f"slurm-{job}.out").read_text()
        assert "exited with code 1; supervision gave up" in out and f"k3launch: supervision gave up: {why}" in out
        assert_nothing_left(cluster, name)
    finally:
        down = k3(cluster, state, "down", name, "--json")
    assert down.returncode == 0 and json.loads(down.stdout)["clean"] is True, down.stdout + down.stderr
    assert not (state / "deployments" / f"{name}.json").exists()


def test_down_while_the_job_restarts_a_step_stops_everything(cluster: Cluster, state: Path, tmp_path: Path) -> None:
    """The restarted engine is still loading (5 s) when `down` comes: the job stops it with the rest."""
    inv = supervised_inventory(tmp_path, cluster, {"max_restarts": 3, "poll": 0.5}, {"K3LAUNCH_SIM_LOAD_S": "5"})
    name = f"k3sv-down-{uuid.uuid4().hex[:4]}"
    up = k3(cluster, state, "up", "-i", str(inv), "--strategy", "single_node_tp", "--name", name, "--supervise", "--ready-timeout", "60")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        job = json.loads((state / "deployments" / f"{name}.json").read_text())["slurm"]["job_id"]
        first = pids_of(name, "serve-0")
        for pid in first:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: pids_of(name, "serve-0") - first, 30, "the restarted engine")
        assert [e["kind"] for e in events(cluster, state, name)][-1] == "restarting"  # loading: not serving yet
    finally:
        t0 = time.monotonic()
        down = k3(cluster, state, "down", name, "--json")
    assert down.returncode == 0 and json.loads(down.stdout)["clean"] is True, down.stdout + down.stderr
    print(f"\n[down during a restart: {time.monotonic() - t0:.1f}s]")
    assert jobs_named(cluster, name) in ({job: "COMPLETED"}, {}), jobs_named(cluster, name)
    assert_nothing_left(cluster, name)


def test_a_units_steps_are_stopped_through_slurm_one_step_at_a_time(cluster: Cluster, tmp_path: Path, jobs: list[str]) -> None:
    """Steps.stop on a real job (the controller's way of stopping a unit): the step named gets SIGTERM
    through Slurm (scancel JOB.STEP), not srun's forced end (TERM and KILL at once): its handler, which
    takes 1 s, completes; the other step keeps running."""
    import sys

    from slurmcluster import TERMINAL

    from k3launch.render.sbatch import job_library

    out = tmp_path / "out"
    out.mkdir()
    # each step says when its handler is in place (a step signalled while Slurm still launches it is cancelled outright)
    slow_term = "trap 'sleep 1; echo graceful >\"$0\"; exit 0' TERM; touch \"$0.up\"; while :; do sleep 0.1; done"
    driver = tmp_path / "driver.py"
    driver.write_text(f"""
import os, subprocess, time
from pathlib import Path
from k3launch.deploy.slurm.steps import Step, Steps
from k3launch.planning.inventory import SlurmSection
out = Path({str(out)!r})
steps = Steps(out, os.environ["SLURM_JOB_ID"], SlurmSection(), "", [os.environ["K3_HOST_0"]])
for name in ("a", "b"):
    argv = ["srun", "--nodes=1", "--ntasks=1", "--overlap", f"--job-name={{name}}", "bash", "-c", {slow_term!r}, str(out / f"{{name}}.term")]
    steps.running[name] = Step(subprocess.Popen(argv), 0, os.environ["K3_HOST_0"])
for _ in range(100):
    if (out / "a.term.up").exists() and (out / "b.term.up").exists():
        break
    time.sleep(0.1)
print("stopped:", steps.stop(["a"], 5.0))
print("b:", "runs" if steps.running["b"].proc.poll() is None else "gone")
print(subprocess.run(["squeue", "-h", "-s", "-j", os.environ["SLURM_JOB_ID"], "-o", "%j"], capture_output=True, text=True).stdout,
      file=open(out / "steps", "w"))
steps.stop(["b"], 5.0)
""")
    script = "\n".join([
        "#!/bin/bash", f"#SBATCH --nodes=1 --ntasks-per-node=1 --time=00:02:00 --output={out}/job.out --partition={cluster.partition}",
        job_library(), f"K3_LOGDIR={out} K3_NODES=1", "k3_bind", f"{shlex.quote(sys.executable)} {shlex.quote(str(driver))}", ""])
    (tmp_path / "job.sbatch").write_text(script)
    job = cluster.sbatch(str(tmp_path / "job.sbatch"))
    jobs.append(job)
    state = cluster.wait(job, timeout=60)
    assert state == "COMPLETED" and state in TERMINAL, (out / "job.out").read_text()
    said = (out / "job.out").read_text()
    assert "stopped: ['a']" in said and "b: runs" in said, said
    assert (out / "a.term").read_text() == "graceful\n"  # the 1 s handler ran: a TERM, not a TERM and a KILL
    assert [s for s in (out / "steps").read_text().split() if s in ("a", "b")] == ["b"]  # only a's step ended
