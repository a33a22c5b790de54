"""The Slurm backend end to end, on the local Slurm cluster (``tests/support/slurmcluster.py``).

The simulated engine runs bare in the jobs' steps (``container: bare``); every other part is
real: sbatch/squeue/scancel, the job script and its doctor step, srun steps in the nodes'
network namespaces, vllm-router, and ``k3launch up/status/logs/down`` from this (login) node.
Each test checks what a user would: the deployment answers a completion at the endpoint ``up``
printed, and after ``down`` (or a failed ``up``) no job, step or engine process is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from slurmdeploy import assert_nothing_left, chat, jobs_named, k3, procs_of, refuses, write_inventory

from k3launch.models.record import Status

if TYPE_CHECKING:
    from slurmcluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

# ------------------------------------------------------------------ serving
SHAPES = {
    "single_node_tp": ["--strategy", "single_node_tp"],
    "multi_node_tp_2": ["--strategy", "multi_node_tp", "--nodes", "2"],
    "multi_node_dep_4": ["--strategy", "multi_node_dep", "--nodes", "4"],
    "pd_cluster": ["--strategy", "pd_cluster"],
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_up_serves_a_completion_and_down_leaves_no_job_and_no_process(shape: str, cluster: Cluster, state: Path, tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, cluster)
    name = f"k3e-{shape.replace('_', '-')}-{uuid.uuid4().hex[:4]}"
    up = k3(cluster, state, "up", "-i", str(inv), *SHAPES[shape], "--name", name, "--ready-timeout", "60")
    assert up.returncode == 0, up.stdout + up.stderr
    for stage in ("submit", "running", "doctor", "alive", "health", "completion", "ready"):
        assert f" {stage} " in up.stdout, (stage, up.stdout)
    rec = json.loads((state / "deployments" / f"{name}.json").read_text())
    job = rec["slurm"]["job_id"]
    hosts = rec["slurm"]["hosts"]  # plan node -> allocated host
    plan_nodes = {p["node"] for p in rec["plan"]["processes"]}
    assert set(hosts) == plan_nodes and len(set(hosts.values())) == len(hosts) and set(hosts.values()) <= set(cluster.nodes)
    # the endpoint is the bound router/head address, reachable from this login node
    first = rec["slurm"]["addresses"][rec["plan"]["processes"][0]["node"]]
    assert rec["endpoint"].startswith(f"http://{first}:") and first in cluster.addresses.values()
    reply = chat(rec["endpoint"])
    assert reply["usage"]["completion_tokens"] > 0 and reply["choices"][0]["message"]["content"]

    st = k3(cluster, state, "status", name, "--json")
    assert st.returncode == 0, st.stderr
    snap = json.loads(st.stdout)
    assert Status.model_validate(snap).as_dict() == snap  # exactly the published Status shape
    assert snap["state"] == "ready" and snap["job"]["id"] == job and snap["job"]["state"] == "RUNNING"
    assert all(p["alive"] for p in snap["processes"]) and all(p["healthy"] in (True, None) for p in snap["processes"])
    assert {p["node"] for p in snap["processes"]} == set(hosts.values())
    # a load point from the login node against the job's endpoint (the router for P/D and DEP)
    b = k3(cluster, state, "bench", name, "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "4",
           "--max-concurrency", "2", "--result-dir", str(tmp_path / "bench"), "--json")
    assert b.returncode == 0, b.stdout + b.stderr
    result = json.loads(next((tmp_path / "bench").glob("*.json")).read_text())
    assert result["completed"] == 6 and result["total_output_tokens"] == 24 and result["max_concurrency"] == 2
    lst = json.loads(k3(cluster, state, "list", "--json").stdout)
    assert [(d["name"], d["slurm_job"]) for d in lst] == [(name, job)]
    human = k3(cluster, state, "status", name)
    assert f"Slurm job {job}: RUNNING on " in human.stdout
    logs = k3(cluster, state, "logs", name, "-n", "5")
    assert logs.returncode == 0 and f"==> job {job} output <==" in logs.stdout
    assert all(f"==> {p['id']} on {hosts[p['node']]} <==" in logs.stdout for p in rec["plan"]["processes"])

    t0 = time.monotonic()
    down = k3(cluster, state, "down", name, "--json")
    assert down.returncode == 0, down.stdout + down.stderr
    assert json.loads(down.stdout)["clean"] is True
    print(f"{shape}: down {time.monotonic() - t0:.1f}s")
    # the job script stopped its steps on the grace signal and ended the job cleanly
    assert jobs_named(cluster, name) in ({job: "COMPLETED"}, {}), jobs_named(cluster, name)
    assert "k3launch: stop requested (SIGTERM); stopping the deployment" in (Path(rec["slurm"]["log_dir"]) / f"slurm-{job}.out").read_text()
    assert not (state / "deployments" / f"{name}.json").exists()
    assert_nothing_left(cluster, name)
    assert refuses(rec["endpoint"])


def test_a_job_array_of_three_deployments_completes_with_per_task_results(cluster: Cluster, state: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmcluster import TERMINAL

    from k3launch import api

    inv = write_inventory(tmp_path, cluster)
    plans = [api.plan(inv, strategy="single_node_tp", name=f"k3a-{i}-{uuid.uuid4().hex[:4]}", sets=(f"--max-num-seqs={8 << i}",))
             for i in range(3)]
    # each task's work: one chat completion through its deployment's endpoint, its reply saved
    work = [sys.executable, "-c", "import json, os, sys, urllib.request as u; e = os.environ['K3LAUNCH_ENDPOINT']; "
            "b = json.dumps({'model': os.environ['K3LAUNCH_MODEL'], 'prompt': 'hi', 'max_tokens': 5}).encode(); "
            "r = json.loads(u.urlopen(u.Request(e + '/v1/completions', data=b, headers={'Content-Type': 'application/json'})).read()); "
            "open(sys.argv[1], 'w').write(json.dumps([e, os.environ['K3LAUNCH_DEPLOYMENT'], r['usage']['completion_tokens']]))"]
    monkeypatch.setenv("SLURM_CONF", cluster.conf)  # api.* call Slurm's commands from this process
    t0 = time.monotonic()
    jobs = api.submit_array(plans, inv, work=lambda i, p: [*work, str(tmp_path / f"work-{i}.json")], concurrency=2,
                            log_dir=tmp_path / "arrays", ready_timeout=60)
    assert len(jobs) == 1  # one shape (1 node x 8 GPUs): one array
    res = api.wait_array(jobs[0], timeout=120)
    print(f"3-task array: {time.monotonic() - t0:.1f}s")
    assert set(res.states.values()) <= TERMINAL and sorted(res.states) == [0, 1, 2]
    assert set(res.states.values()) == {"COMPLETED"}, res.results
    for i, plan in enumerate(plans):
        r = res.results[i]
        assert r["ok"] is True and r["ready"] is True and r["work_rc"] == 0 and r["deployment"] == plan.name, r
        assert r["task"] == str(i) and r["array_job"] == jobs[0].job_id
        hosts = r["hosts"]
        assert isinstance(hosts, dict) and set(hosts.values()) <= set(cluster.nodes)
        endpoint, deployment, tokens = json.loads((tmp_path / f"work-{i}.json").read_text())
        assert endpoint == r["endpoint"] and deployment == plan.name and tokens > 0
        assert not procs_of(plan.name)
        # the task's own logs: its engine answered the work's completion
        assert "POST /v1/completions" in (Path(jobs[0].log_dir) / f"task-{i}" / "serve-0.log").read_text()


# ------------------------------------------------------------------ faults
def test_a_rank_that_exits_during_load_fails_up_fast_naming_its_node(cluster: Cluster, state: Path, tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, cluster, {"K3LAUNCH_SIM_FAIL": "exit-during-load", "K3LAUNCH_SIM_FAIL_PROCESS": "serve-1",
                                              "K3LAUNCH_SIM_FAIL_AFTER_S": "0.2", "K3LAUNCH_SIM_LOAD_S": "30"})
    name = f"k3f-rank-{uuid.uuid4().hex[:4]}"
    t0 = time.monotonic()
    up = k3(cluster, state, "up", "-i", str(inv), "--strategy", "multi_node_tp", "--nodes", "2", "--name", name, "--ready-timeout", "60")
    took = time.monotonic() - t0
    assert up.returncode == 2, up.stdout + up.stderr
    # a bound, not a timing: without fail-fast, up would wait out the 30 s load and then some
    assert took < 30, f"up took {took:.1f}s to notice a rank dying 0.2 s into a 30 s load"
    err = up.stderr.splitlines()[0]
    # the cause (serve-1, node rank 1), not the rank that only lost its peer, with its node and its log
    assert err.startswith("error: serve-1 (serve, node rank 1) on k3n") and "exited with code 1" in err, up.stderr
    node = err.split(" on ", 1)[1].split()[0]
    assert node in cluster.nodes
    assert "CUDA error: uncorrectable ECC error" in up.stdout  # the failing rank's last log lines
    assert not (state / "deployments" / f"{name}.json").exists()
    bad = json.loads((state / "slurm-bad-nodes.json").read_text())
    assert bad[node]["kind"] == "rank-died" and bad[node]["deployment"] == name
    assert_nothing_left(cluster, name)


def test_scancel_while_loading_ends_up_with_a_clear_error_and_nothing_left(cluster: Cluster, state: Path, tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, cluster, {"K3LAUNCH_SIM_LOAD_S": "60"})
    name = f"k3f-scancel-{uuid.uuid4().hex[:4]}"
    p = subprocess.Popen([sys.executable, "-m", "k3launch", "up", "-i", str(inv), "--name", name, "--ready-timeout", "120"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                         env=cluster.env({"K3LAUNCH_STATE_DIR": str(state), "COLUMNS": "200"}))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not procs_of(name):  # the engine is loading
            time.sleep(0.1)
        assert procs_of(name), "the engine never started"
        (job,) = jobs_named(cluster, name)
        cluster.cancel(job)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            p.communicate(timeout=30)
    assert p.returncode == 2, out + err
    assert err.startswith(f"error: job {job} ended (CANCELLED") and "during" in err, err
    assert not (state / "deployments" / f"{name}.json").exists()
    assert_nothing_left(cluster, name)


@pytest.mark.parametrize("ask", ["gpus", "nodes"])
def test_a_request_slurm_cannot_satisfy_is_refused_with_slurms_reason_and_nothing_left(ask: str, cluster: Cluster, state: Path,
                                                                                       tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, cluster)
    name = f"k3f-refused-{ask}-{uuid.uuid4().hex[:4]}"
    args = ["--extra-sbatch=--gres=gpu:16"] if ask == "gpus" else ["--strategy", "multi_node_tp", "--nodes", str(len(cluster.nodes) + 2)]
    up = k3(cluster, state, "up", "-i", str(inv), "--name", name, *args)
    assert up.returncode == 2, up.stdout + up.stderr
    first = up.stderr.splitlines()[0]
    if ask == "gpus":  # refused at submission
        assert first == "error: Slurm refused the job: sbatch: error: Batch job submission failed: Requested node configuration is not available [sbatch-refused]"
        assert set(jobs_named(cluster, name).values()) <= {"FAILED"}  # Slurm may keep a record of what it refused
    else:  # accepted, but pending for a reason that never clears: cancelled at once
        assert "can never start: Slurm keeps it pending with reason PartitionNodeLimit" in first, up.stderr
    assert up.stderr.splitlines()[1].startswith("hint: ")
    assert "Traceback" not in up.stderr
    assert not (state / "deployments" / f"{name}.json").exists()
    assert_nothing_left(cluster, name)


def test_a_node_refused_by_the_doctor_step_is_excluded_and_the_job_submitted_again(cluster: Cluster, state: Path, tmp_path: Path) -> None:
    """k3n1's planned HTTP port is taken: the job's doctor refuses it, up resubmits without it, and
    the next up (another deployment) excludes it from the start."""
    inv = write_inventory(tmp_path, cluster, nodelist=",".join(cluster.nodes[:2]))
    base = 24576
    bad = cluster.nodes[0]
    squatter = subprocess.Popen(["ip", "netns", "exec", bad, sys.executable, "-m", "http.server", str(base), "--bind", "0.0.0.0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        name = f"k3f-doctor-{uuid.uuid4().hex[:4]}"
        up = k3(cluster, state, "up", "-i", str(inv), "--name", name, "--port-base", str(base))
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"doctor refused {bad} (port {base} already in use); submitting again without them" in up.stdout, up.stdout
        rec = json.loads((state / "deployments" / f"{name}.json").read_text())
        assert rec["slurm"]["attempts"] == 2 and bad in rec["slurm"]["excluded"] and bad not in rec["slurm"]["hosts"].values()
        assert json.loads((state / "slurm-bad-nodes.json").read_text())[bad]["kind"] == "doctor"
        assert k3(cluster, state, "down", name).returncode == 0
        again = f"k3f-doctor2-{uuid.uuid4().hex[:4]}"
        up2 = k3(cluster, state, "up", "-i", str(inv), "--name", again, "--port-base", str(base))
        assert up2.returncode == 0, up2.stdout + up2.stderr
        assert f"excluding node(s) that failed the doctor step in the last day: {bad}" in up2.stdout
        rec2 = json.loads((state / "deployments" / f"{again}.json").read_text())
        excl = [ln.split("=", 1)[1] for ln in Path(rec2["slurm"]["script"]).read_text().splitlines() if ln.startswith("#SBATCH --exclude=")]
        # the nodes outside the nodelist (candidates only) and the node the doctor refused
        assert rec2["slurm"]["attempts"] == 1 and [set(x.split(",")) for x in excl] == [{*cluster.nodes[2:], bad}]
        assert k3(cluster, state, "down", again).returncode == 0
        assert_nothing_left(cluster, name)
        assert_nothing_left(cluster, again)
    finally:
        squatter.terminate()
        squatter.wait(timeout=10)


# ------------------------------------------------------------------ the Python API from a submitit job
def test_a_submitit_job_drives_a_deployment_through_the_api(cluster: Cluster, state: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    submitit = pytest.importorskip("submitit")
    inv = write_inventory(tmp_path, cluster)
    name = f"k3s-{uuid.uuid4().hex[:4]}"

    def drive(inventory: str, state_dir: str, name: str) -> dict[str, object]:
        from k3launch import api  # in the submitit job, on a compute node

        rec = api.up(api.plan(inventory, strategy="single_node_tp", name=name), inventory, state_dir=state_dir, ready_timeout=60)
        snap = api.status(name, state_dir=state_dir)
        report = api.down(name, state_dir=state_dir)
        return {"endpoint": rec.endpoint, "state": snap.state, "clean": report.clean, "host": os.uname().nodename}

    monkeypatch.setenv("SLURM_CONF", cluster.conf)  # submitit's sbatch, and (exported) the job's own
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    ex.update_parameters(slurm_partition=cluster.partition, timeout_min=5, nodes=1, tasks_per_node=1, cpus_per_task=1)
    out = ex.submit(drive, str(inv), str(state), name).result()
    assert out["state"] == "ready" and out["clean"] is True and out["host"] in cluster.nodes, out
    assert str(out["endpoint"]).startswith("http://10.")
    assert_nothing_left(cluster, name)


def test_a_slurm_bring_up_shows_its_phases_keeps_a_timeline_and_its_power_is_read_by_an_srun_step(
        cluster: Cluster, state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off a terminal, `up` on Slurm prints each rank's phase from the job's own log files, at
    least every 10 s of a 12 s load; the record keeps the timeline; and a power sampler reads the
    job's nodes through one `srun --overlap` step (a stand-in nvidia-smi reading the simulated
    engines' draw), integrating to valid joules."""
    from k3launch import api
    from k3launch.campaign import power
    from k3launch.sim import power as simpower

    power_dir = tmp_path / "power"
    inv = write_inventory(tmp_path, cluster, env={"K3LAUNCH_SIM_LOAD_S": "12", "K3LAUNCH_SIM_POWER_DIR": str(power_dir)})
    name = f"k3e-phases-{uuid.uuid4().hex[:4]}"
    t0 = time.monotonic()
    up = k3(cluster, state, "up", "-i", str(inv), "--strategy", "multi_node_tp", "--nodes", "2", "--name", name, "--ready-timeout", "120",
            timeout=240)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        print(f"up {time.monotonic() - t0:.1f}s")
        lines = up.stdout.splitlines()
        assert any("loading weights" in ln for ln in lines), up.stdout  # the phase the 12 s load sits in, from the job's logs
        rec = api.record(name, state)
        assert rec is not None and rec.timeline is not None and rec.timeline.ready
        for p in rec.timeline.processes:
            phases = [s.phase.value for s in p.phases]
            assert "loading_weights" in phases and all(s.start <= s.end for s in p.phases), (p.id, phases)
        assert rec.timeline.slowest() is not None

        bindir = simpower.install(tmp_path / "bin").parent
        for k, v in cluster.env({"PATH": f"{bindir}:{os.environ['PATH']}", "K3LAUNCH_SIM_POWER_DIR": str(power_dir)}).items():
            monkeypatch.setenv(k, v)
        sampler = api.power_sampler(rec)
        assert type(sampler).__name__ == "SrunSampler"  # the job step, through the backend
        sampler.start()
        start = time.time()
        time.sleep(3)
        end = time.time()
        trace = sampler.stop()
        energy = power.summarize(trace, start, end, output_tokens=100, total_tokens=200, samples_file=None)
        print(f"srun power step: {energy.samples} readings of {energy.nodes} node(s), {energy.mean_watts} W")
        assert energy.valid and energy.nodes == 2 and energy.joules and energy.joules > 0, energy
        assert not [line for line in cluster.run("squeue", "-h", "-s", "-j", rec.slurm.job_id, "-o", "%j").stdout.split() if "bash" in line]
    finally:
        down = k3(cluster, state, "down", name, "--json")
        assert down.returncode == 0, down.stdout + down.stderr
    assert_nothing_left(cluster, name)
