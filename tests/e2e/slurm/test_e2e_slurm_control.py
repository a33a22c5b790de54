"""The one controller inside a Slurm job, end to end on the local Slurm cluster (``tests/support/slurmcluster.py``).

``k3launch up --replicas 2 --supervise``: the job's controller (``python -m k3launch.deploy.slurm.injob``
on its batch host) runs the Python decision step. ``rollout --set ...`` rolls both copies onto the
new flag, one copy's steps at a time behind the real vllm-router, in the same job, under a steady
client load with no failed request; an engine step SIGSTOPped on its node is detected as hung
(``/health`` silent for ``unhealthy_after``) and restarted in the same job.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from e2e_helpers import Load, processes
from slurmdeploy import (
    ENGINES,
    argv_of,
    assert_nothing_left,
    chat,
    events,
    jobs_named,
    k3,
    record,
    step_ids,
    supervised_inventory,
    wait_for,
    workers,
)

if TYPE_CHECKING:
    from slurmcluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]


def _up_copies(cluster: Cluster, state: Path, tmp: Path, name: str, restart: dict[str, Any], *args: str) -> dict[str, Any]:
    inv = supervised_inventory(tmp, cluster, restart)
    up = k3(cluster, state, "up", "-i", str(inv), *args, "--replicas", "2", "--name", name, "--supervise", "--ready-timeout", "60")
    assert up.returncode == 0, up.stdout + up.stderr
    rec = record(state, name)
    assert wait_for(lambda: [e for e in events(cluster, state, name) if e["kind"] == "watching"], 15, "the controller's watching event")
    return rec


def test_a_rollout_rolls_both_copies_inside_the_same_job_behind_the_router_without_a_failed_request(
        cluster: Cluster, state: Path, tmp_path: Path) -> None:
    name = f"k3ct-roll-{uuid.uuid4().hex[:4]}"
    rec = _up_copies(cluster, state, tmp_path, name, {"max_restarts": 3, "poll": 0.5}, "--strategy", "multi_node_dep", "--nodes", "2")
    try:
        job, endpoint, model = rec["slurm"]["job_id"], rec["endpoint"], rec["plan"]["model"]
        before = argv_of(name)
        assert sorted(before) == ENGINES and not any("--max-num-seqs" in a for a in before.values()), before
        steps_before = step_ids(cluster, job)
        listed = sorted(workers(endpoint))
        with Load(endpoint, model, workers=2, limit=5000, pause=0.02) as load:
            time.sleep(1.0)
            t0 = time.monotonic()
            ro = k3(cluster, state, "rollout", name, "--set", "max-num-seqs=8", "--json", "--no-canary", timeout=300)
            roll_s = time.monotonic() - t0
            time.sleep(1.0)
        assert ro.returncode == 0, ro.stdout + ro.stderr
        result = json.loads(ro.stdout)
        assert result["ok"] is True and [u["unit"] for u in result["rolled"]] == ["r0-serve", "r1-serve"], result
        # the same job; every engine a new step on the new flag, the router's step untouched, listing all four again
        assert jobs_named(cluster, name) == {job: "RUNNING"}
        after = argv_of(name)
        assert sorted(after) == ENGINES and all(a[a.index("--max-num-seqs") + 1] == "8" for a in after.values()), after
        steps_after = step_ids(cluster, job)
        assert steps_after["router"] == steps_before["router"] and all(steps_after[e] != steps_before[e] for e in ENGINES)
        assert wait_for(lambda: sorted(workers(endpoint)) == listed, 15, "the router listing every engine again")
        got = [e for e in events(cluster, state, name) if e["kind"] in ("rolling", "rolled", "rollout-done")]
        assert [(e["kind"], e.get("unit")) for e in got] == [("rolling", "r0-serve"), ("rolled", "r0-serve"), ("rolling", "r1-serve"),
                                                              ("rolled", "r1-serve"), ("rollout-done", None)], got
        per_copy = ", ".join(f"{u['unit']} {u['seconds']:.1f}s" for u in result["rolled"])
        print(f"\n[rollout of two DEP copies inside one Slurm job: {roll_s:.1f}s; client {load.ok} ok, {load.failed} failed; "
              f"per copy {per_copy}]")
        assert load.failed == 0 and load.ok > 20, (load.ok, load.failures[:5])
        # the login node's record runs the new plan: status, and the next rollout's plan, start from it
        plan = record(state, name)["plan"]
        assert all("8" in p["argv"][p["argv"].index("--max-num-seqs") + 1:][:1] for p in plan["processes"] if p["id"] in ENGINES), plan
        snap = json.loads(k3(cluster, state, "status", name, "--json").stdout)
        assert snap["state"] == "ready" and all(p["alive"] for p in snap["processes"]), snap
        assert chat(endpoint)["usage"]["completion_tokens"] > 0
    finally:
        down = k3(cluster, state, "down", name, "--json")
    assert down.returncode == 0 and json.loads(down.stdout)["clean"] is True, down.stdout + down.stderr
    assert_nothing_left(cluster, name)


def test_a_sigstopped_engine_step_is_detected_as_hung_and_restarted_in_the_same_job(cluster: Cluster, state: Path,
                                                                                    tmp_path: Path) -> None:
    name = f"k3ct-hung-{uuid.uuid4().hex[:4]}"
    rec = _up_copies(cluster, state, tmp_path, name, {"max_restarts": 3, "poll": 0.5, "unhealthy_after": 3},
                     "--strategy", "single_node_tp")
    try:
        job, endpoint = rec["slurm"]["job_id"], rec["endpoint"]
        stopped = {pid for pid, p in processes(name).items() if p == "r0-serve-0"}
        assert stopped
        steps_before = step_ids(cluster, job)
        t_stop = time.time()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        back = wait_for(lambda: next((e for e in events(cluster, state, name) if e["kind"] == "restarted"), None), 90,
                        "the hung engine serving again")
        got = events(cluster, state, name)
        detected = next(e for e in got if e["kind"] == "detected")
        assert detected["unit"] == "r0-serve-0" and " hung: /health failing or silent for " in detected["reason"], detected
        assert detected["node"] == rec["slurm"]["hosts"][rec["plan"]["processes"][0]["node"]], detected
        print(f"\n[SIGSTOP of an engine step in a supervised Slurm job: detected as hung {detected['time'] - t_stop:.1f}s, "
              f"serving again {back['time'] - t_stop:.1f}s after the SIGSTOP]")
        assert jobs_named(cluster, name) == {job: "RUNNING"}
        assert not any(pid in stopped for pid, p in processes(name).items()), "the stopped engine was left behind"
        steps_after = step_ids(cluster, job)
        assert steps_after["r0-serve-0"] != steps_before["r0-serve-0"] and steps_after["r1-serve-0"] == steps_before["r1-serve-0"]
        assert steps_after["router"] == steps_before["router"]
        assert chat(endpoint)["usage"]["completion_tokens"] > 0
    finally:
        for pid in stopped if "stopped" in dir() else ():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        down = k3(cluster, state, "down", name, "--json")
    assert down.returncode == 0 and json.loads(down.stdout)["clean"] is True, down.stdout + down.stderr
    assert_nothing_left(cluster, name)


def test_a_copy_that_fails_to_start_is_rolled_back_then_rollback_and_a_good_flag_roll_on(cluster: Cluster, state: Path,
                                                                                                 tmp_path: Path) -> None:
    name = f"k3ct-back-{uuid.uuid4().hex[:4]}"
    rec = _up_copies(cluster, state, tmp_path, name, {"max_restarts": 3, "poll": 0.5}, "--strategy", "single_node_tp")
    engines = ["r0-serve-0", "r1-serve-0"]
    try:
        endpoint, model, job = rec["endpoint"], rec["plan"]["model"], rec["slurm"]["job_id"]
        with Load(endpoint, model, workers=2, limit=5000, pause=0.02) as load:
            # an engine that dies while it loads (a value vLLM refuses, --set max-num-seqs=0, is refused at planning, exit 2)
            bad = k3(cluster, state, "rollout", name, "--env", "K3LAUNCH_SIM_FAIL=exit-during-load", "--json", "--no-canary",
                     "--start-timeout", "20", timeout=300)
            stopped = record(state, name)
            back = k3(cluster, state, "rollout", name, "--rollback", "--json", "--no-canary", timeout=300)
            good = k3(cluster, state, "rollout", name, "--set", "max-num-seqs=8", "--json", "--no-canary", timeout=300)
            time.sleep(1.0)
        said = json.loads(bad.stdout)
        assert bad.returncode == 1 and said["failed"] == "r0-serve-0" and "Engine core initialization failed" in said["reason"], \
            bad.stdout + bad.stderr
        # the login node's record keeps the stopped rollout (for --continue / --rollback) and the plan each process runs
        assert stopped["rollout"]["stopped"] and [u["on"] for u in stopped["rollout"]["units"]] == ["old", "old"], stopped["rollout"]
        assert not any("K3LAUNCH_SIM_FAIL" in p["env"] for p in stopped["plan"]["processes"])
        assert back.returncode == 0 and json.loads(back.stdout)["ok"] is True, back.stdout + back.stderr
        assert good.returncode == 0 and json.loads(good.stdout)["ok"] is True, good.stdout + good.stderr
        after = argv_of(name)
        assert sorted(after) == engines and all(a[a.index("--max-num-seqs") + 1] == "8" for a in after.values()), after
        assert jobs_named(cluster, name) == {job: "RUNNING"} and record(state, name).get("rollout") is None
        print(f"\n[a copy that failed to start rolled back inside the Slurm job, then --rollback and a good flag: client {load.ok} ok, {load.failed} failed]")
        assert load.failed == 0 and load.ok > 20, (load.ok, load.failures[:5])
    finally:
        down = k3(cluster, state, "down", name, "--json")
    assert down.returncode == 0 and json.loads(down.stdout)["clean"] is True, down.stdout + down.stderr
    assert_nothing_left(cluster, name)
