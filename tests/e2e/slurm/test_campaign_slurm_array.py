"""A campaign as a Slurm job array on the project's real local Slurm cluster: one array task per
deployment group (`campaign run FILE --out DIR --group $SLURM_ARRAY_TASK_ID`), every task
appending to the same results file, each on its own node.

Each task runs the simulated engine on the bundled local inventory inside its Slurm node (a
network namespace of its own, so the tasks' loopback addresses and ports do not meet); each
task has its own state dir because all of them name the same local node addresses. Needs root
(the fixture skips otherwise, or fails under K3LAUNCH_TEST_SLURM_REQUIRED=1).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from k3launch.campaign.results import read_rows

if TYPE_CHECKING:
    from slurmcluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

FAST = {"K3LAUNCH_SIM_LOAD_S": "0.3", "K3LAUNCH_SIM_TTFT_MS": "20", "K3LAUNCH_SIM_ITL_MS": "2"}


def slurm_inventory(cluster: Cluster, tmp_path: Path) -> Path:
    """A slurm inventory of the test cluster (simulated engine, bare); skips in multi mode."""
    if cluster.mode != "netns":
        import pytest

        pytest.skip("multi mode: every node is this machine's 127.0.0.1")
    inv = tmp_path / "slurm.yaml"
    inv.write_text(yaml.safe_dump({"name": "cs", "backend": "slurm", "hardware": "b300", "engine": "sim",
                                   "defaults": {"runtime": "bare", "python": sys.executable},
                                   "slurm": {"partition": cluster.partition, "container": "bare", "time_limit": "00:10:00"}}))
    return inv


def test_job_array_runs_one_deployment_group_per_task(slurm_cluster: Cluster, tmp_path: Path) -> None:
    name = f"ca-{uuid.uuid4().hex[:6]}"
    camp = tmp_path / "c.yaml"
    camp.write_text(yaml.safe_dump({"name": name, "port_base": 34304, "engine_env": FAST, "ready_timeout": 60,
                                    "base": {"strategy": "single_node_tp"}, "deployments": {"set": {"max-num-seqs": [2, 8]}},
                                    "load": {"max_concurrency": [1, 4], "input_len": 16, "output_len": 4, "num_prompts": 6}}))
    out = tmp_path / "out"
    k3 = [sys.executable, "-m", "k3launch", "campaign", "run", str(camp), "--out", str(out)]
    dry = json.loads(subprocess.run([*k3, "--dry-run", "--json"], capture_output=True, text=True, timeout=60, check=True).stdout)
    groups = len(dry["groups"])
    assert groups == 2 and dry["cells"] == 4
    task = f"echo node=$SLURMD_NODENAME; {' '.join(k3)} --group $SLURM_ARRAY_TASK_ID --state-dir {tmp_path}/state-$SLURM_ARRAY_TASK_ID --json"
    # --exclusive: one task per node, as real array tasks each hold their deployment's nodes
    job = slurm_cluster.sbatch(f"--array=0-{groups - 1}", "--nodes=1", "--exclusive", "--job-name", name, f"--output={tmp_path}/task-%a.out",
                               "--wrap", task)
    state = slurm_cluster.wait(job, timeout=240)
    logs = {i: (tmp_path / f"task-{i}.out").read_text() for i in range(groups)}
    assert state == "COMPLETED", logs
    for i, text in logs.items():
        summary = json.loads(text.strip().splitlines()[-1])
        assert summary["groups"] == [i] and summary["engine_starts"] == 1 and summary["valid"] == 2, text
    nodes = {re.findall(r"^node=(\S+)", text, re.M)[0] for text in logs.values()}
    assert len(nodes) == groups  # each task on its own Slurm node
    rows = read_rows(out)
    assert len(rows) == 4 and all(r.valid for r in rows) and {r.group for r in rows} == {0, 1}
    assert len({r.cell for r in rows}) == 4
    log = (out / "campaign.log").read_text()
    assert len(re.findall(r": start: started", log)) == 2  # one engine start per group, across both tasks
    again = subprocess.run([*k3, "--json", "--state-dir", str(tmp_path / "state-login")], capture_output=True, text=True, timeout=120)
    s = json.loads(again.stdout)
    assert again.returncode == 0 and (s["engine_starts"], s["skipped"]) == (0, 4)


def test_slurm_array_runs_each_group_in_its_own_allocation_and_resumes(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """`campaign run --slurm-array` on a slurm inventory: one array task per deployment group, each
    task's job starts its deployment and runs its load points attached to it; a second run submits
    nothing; a campaign whose engines never serve gets invalid rows with the reason."""
    name = f"cs-{uuid.uuid4().hex[:6]}"
    inv = slurm_inventory(slurm_cluster, tmp_path)
    camp = tmp_path / "c.yaml"
    spec = {"name": name, "inventory": str(inv), "engine_env": FAST, "ready_timeout": 20,
            "base": {"strategy": "single_node_tp"}, "deployments": {"set": {"max-num-seqs": [2, 8, 16]}},
            "load": {"max_concurrency": [1, 4], "input_len": 16, "output_len": 4, "num_prompts": 6}}
    camp.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    k3 = [sys.executable, "-m", "k3launch", "campaign", "run", str(camp), "--out", str(out), "--json"]
    env = slurm_cluster.env({"K3LAUNCH_STATE_DIR": str(tmp_path / "state")})
    first = subprocess.run([*k3, "--slurm-array", "--array-limit", "2"], capture_output=True, text=True, timeout=300, env=env)
    s = json.loads(first.stdout)
    assert s["submitted"] == [0, 1, 2] and len(s["jobs"]) == 1, first.stderr
    assert first.returncode == 0, first.stderr
    assert s["valid"] == 6 and s["invalid"] == 0 and all(t["ok"] for t in s["tasks"].values()), s
    rows = read_rows(out)
    assert len(rows) == 6 and {r.group for r in rows} == {0, 1, 2}
    for r in rows:  # measured by the task, against the deployment its own job started, on a cluster node
        assert r.provenance is not None and r.metrics is not None and r.metrics.completed == 6
        assert r.provenance.nodes and set(r.provenance.nodes) <= set(slurm_cluster.nodes)  # the allocated hosts, not placeholders
    hosts = {gi: t["hosts"]["slurm-node-0"] for gi, t in s["tasks"].items()}  # type: ignore[index]
    assert set(hosts.values()) <= set(slurm_cluster.nodes)
    log = (out / "campaign.log").read_text()
    assert "start: started" not in log  # no task brought a deployment up itself: the job did
    again = subprocess.run([*k3, "--slurm-array"], capture_output=True, text=True, timeout=120, env=env)
    s2 = json.loads(again.stdout)
    assert again.returncode == 0 and s2["submitted"] == [] and s2["skipped"] == [0, 1, 2] and s2["jobs"] == []

    # engines that answer with zero tokens never pass the task's readiness check: invalid cells, with the reason
    spec_bad = {**spec, "name": name + "-bad", "engine_env": {**FAST, "K3LAUNCH_SIM_FAIL": "zero-tokens"},
                "deployments": {"set": {"max-num-seqs": [2]}}}
    camp.write_text(yaml.safe_dump(spec_bad))
    bad = subprocess.run([*k3, "--slurm-array"], capture_output=True, text=True, timeout=300, env=env)
    sb = json.loads(bad.stdout)
    assert bad.returncode == 1 and sb["submitted"] == [0] and sb["valid"] == 0 and sb["invalid"] == 2, bad.stderr
    assert "generated no tokens" in str(sb["tasks"]["0"]["error"])
    bad_rows = [r for r in read_rows(out) if r.campaign == name + "-bad"]
    assert len(bad_rows) == 2 and all(not r.valid and r.metrics is None and "generated no tokens" in (r.reason or "") for r in bad_rows)


def test_a_campaign_on_a_slurm_inventory_runs_from_the_login_node_too(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """Without --slurm-array: each group is one `up` (an sbatch job), its load points from here, then `down`."""
    inv = slurm_inventory(slurm_cluster, tmp_path)
    camp = tmp_path / "c.yaml"
    camp.write_text(yaml.safe_dump({"name": f"cl-{uuid.uuid4().hex[:6]}", "inventory": str(inv), "engine_env": FAST, "ready_timeout": 60,
                                    "base": {"strategy": "single_node_tp"}, "deployments": {"set": {"max-num-seqs": [2, 8]}},
                                    "load": {"max_concurrency": [1, 4], "input_len": 16, "output_len": 4, "num_prompts": 6}}))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "k3launch", "campaign", "run", str(camp), "--out", str(out), "--json"], capture_output=True,
                       text=True, timeout=300, env=slurm_cluster.env({"K3LAUNCH_STATE_DIR": str(tmp_path / "state")}))
    s = json.loads(r.stdout)
    assert r.returncode == 0 and (s["valid"], s["engine_starts"]) == (4, 2), r.stderr
    rows = read_rows(out)
    assert all(row.provenance is not None and set(row.provenance.nodes) <= set(slurm_cluster.nodes) for row in rows)
    log = (out / "campaign.log").read_text()
    assert len(re.findall(r": submit: job \d+ submitted", log)) == 2 and len(re.findall(r": down$", log, re.M)) == 2


def test_slurm_array_no_wait_then_again_does_not_resubmit_groups_in_flight(slurm_cluster: Cluster, tmp_path: Path) -> None:
    inv = slurm_inventory(slurm_cluster, tmp_path)
    camp = tmp_path / "c.yaml"
    camp.write_text(yaml.safe_dump({"name": f"cf-{uuid.uuid4().hex[:6]}", "inventory": str(inv), "ready_timeout": 60,
                                    "engine_env": {**FAST, "K3LAUNCH_SIM_LOAD_S": "3"}, "base": {"strategy": "single_node_tp"},
                                    "deployments": {"set": {"max-num-seqs": [2, 8]}},
                                    "load": {"max_concurrency": [1], "input_len": 16, "output_len": 4, "num_prompts": 4}}))
    out = tmp_path / "out"
    k3 = [sys.executable, "-m", "k3launch", "campaign", "run", str(camp), "--out", str(out), "--json", "--slurm-array"]
    env = slurm_cluster.env({"K3LAUNCH_STATE_DIR": str(tmp_path / "state")})
    first = json.loads(subprocess.run([*k3, "--no-wait"], capture_output=True, text=True, timeout=120, env=env, check=True).stdout)
    assert first["submitted"] == [0, 1] and len(first["jobs"]) == 1
    again = subprocess.run([*k3, "--no-wait"], capture_output=True, text=True, timeout=120, env=env)
    s = json.loads(again.stdout)
    assert s["submitted"] == [] and s["skipped"] == [0, 1] and s["jobs"] == [], again.stderr  # still running: not again
    slurm_cluster.wait(first["jobs"][0], timeout=120)
    done = json.loads(subprocess.run(k3, capture_output=True, text=True, timeout=120, env=env).stdout)
    assert done["submitted"] == [] and done["skipped"] == [0, 1]  # finished by the first submission's tasks
    assert len([r for r in read_rows(out) if r.valid]) == 2
