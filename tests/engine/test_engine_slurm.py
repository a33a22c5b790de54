"""The real-engine tier on Slurm: k3launch runs a REAL vLLM as an sbatch job on the local cluster.

The local Slurm cluster (slurmcluster.py: one slurmd per network namespace, sharing this
machine's kernel and filesystem) runs vLLM's CPU build (enginecpu.py) in a bare srun step: the
inventory is a Slurm partition with the shipped ``inventories/local-cpu.yaml``'s engine settings
(cpu-x86, vllm_version, venv, engine env). One start (~25-50 s of two busy cores) checks what a
user would: the job runs, its doctor step accepts a CPU node, the endpoint answers a completion,
``status`` says ready, and after ``down`` the job has ended with no step left, nothing of vLLM
runs in any node's namespace and vLLM shut down on its own (its shutdown log, no shared memory
left in /dev/shm) rather than being killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from e2e_helpers import netns, no_engine_left
from paths import ROOT

from k3launch.models.record import Status

if TYPE_CHECKING:
    from enginecpu import VllmCpu
    from slurmcluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.slurm]

LOCAL_CPU = ROOT / "inventories" / "local-cpu.yaml"
RECIPE = "k3launch/tiny-llama"
UP_TIMEOUT_S = 480


def cpu_inventory(tmp: Path, cluster: Cluster, venv: Path) -> Path:
    shipped = yaml.safe_load(LOCAL_CPU.read_text())
    inv = {"name": "test-slurm-cpu", "backend": "slurm", "hardware": "cpu-x86", "engine": "vllm", "vllm_version": shipped["vllm_version"],
           "defaults": {"runtime": "bare", "venv": str(venv), "cpu_memory_gb": shipped["defaults"]["cpu_memory_gb"],
                        "env": shipped["defaults"]["env"]},
           "slurm": {"partition": cluster.partition, "container": "bare", "time_limit": "00:15:00"}}
    path = tmp / "inv-cpu.yaml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def k3(cluster: Cluster, state: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "k3launch", *args], capture_output=True, text=True, timeout=timeout,
                          env=cluster.env({"K3LAUNCH_STATE_DIR": str(state), "COLUMNS": "200"}), stdin=subprocess.DEVNULL)


def node_netns(cluster: Cluster, node: str) -> str:
    return netns((cluster.dir / "run" / f"slurmd-{node}.pid").read_text().split()[0])


def jobs_named(cluster: Cluster, name: str) -> dict[str, str]:
    r = cluster.run("squeue", "-h", "-t", "all", "--name", f"k3-{name}", "-o", "%i|%T")
    return dict(line.split("|", 1) for line in r.stdout.split())


def _shm() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(("psm_", "sem.mp-", "vllm"))} if os.path.isdir("/dev/shm") else set()


def _complete(endpoint: str, model: str) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": "Hello from a Slurm job", "max_tokens": 8}).encode()
    req = urllib.request.Request(endpoint + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        data: dict[str, Any] = json.loads(r.read())
    return data


def test_single_engine_job_serves_and_down_stops_vllm_gracefully(cluster: Cluster, state: Path, tmp_path: Path, vllm_cpu: VllmCpu) -> None:
    from slurmcluster import TERMINAL

    inv = cpu_inventory(tmp_path, cluster, vllm_cpu.bin.parent)
    name = f"k3eng-{uuid.uuid4().hex[:6]}"
    namespaces = [node_netns(cluster, n) for n in cluster.nodes]
    shm_before = _shm()
    t0 = time.monotonic()
    up = k3(cluster, state, "up", "-i", str(inv), "--recipe", RECIPE, "--strategy", "single_node_tp", "--name", name,
            "--ready-timeout", str(UP_TIMEOUT_S - 60), timeout=UP_TIMEOUT_S)
    took = time.monotonic() - t0
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    for stage in ("submit", "running", "doctor", "alive", "health", "completion", "ready"):
        assert f" {stage} " in up.stdout, (stage, up.stdout)
    assert "1 node(s) ok (a CPU plan: no GPUs to check, engine found, ports free)" in up.stdout, up.stdout
    rec = json.loads((state / "deployments" / f"{name}.json").read_text())
    job, log_dir = rec["slurm"]["job_id"], Path(rec["slurm"]["log_dir"])
    (host,) = rec["slurm"]["hosts"].values()
    script = (log_dir / "job.sbatch").read_text()
    assert "--gres" not in script and "--gpus-per-node" not in script  # a CPU job asks for no GPUs
    assert f"k3_doctor 0 {vllm_cpu.bin}/vllm " in script
    assert "k3launch-doctor " + host + " ok" in (log_dir / "doctor.log").read_text()  # the doctor step accepted the CPU node

    # the engine runs as a step in its node's namespace, with its whole vLLM tree
    node_ns = node_netns(cluster, host)
    running = " ".join(no_engine_left([node_ns], wait_s=0).values())
    assert f"{vllm_cpu.bin}/vllm serve {vllm_cpu.model} " in running and "VLLM::EngineCore" in running and "VLLM::Worker" in running, running
    steps = cluster.run("squeue", "-h", "-s", "-j", job, "-o", "%i|%j").stdout.split()
    assert any(s.startswith(f"{job}.") and s.endswith("|serve-0") for s in steps), steps

    reply = _complete(rec["endpoint"], vllm_cpu.model)
    assert reply["usage"]["completion_tokens"] > 0 and reply["model"] == vllm_cpu.model, reply
    st = k3(cluster, state, "status", name, "--json")
    snap = json.loads(st.stdout)
    assert Status.model_validate(snap).as_dict() == snap
    assert snap["state"] == "ready" and snap["job"]["id"] == job and snap["job"]["state"] == "RUNNING", snap
    assert [(p["id"], p["node"], p["alive"], p["healthy"]) for p in snap["processes"]] == [("serve-0", host, True, True)]

    t1 = time.monotonic()
    down = k3(cluster, state, "down", name, "--json", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert json.loads(down.stdout)["clean"] is True
    took_down = time.monotonic() - t1
    assert jobs_named(cluster, name) in ({job: "COMPLETED"}, {}), jobs_named(cluster, name)
    assert not set(jobs_named(cluster, name).values()) - TERMINAL
    assert not [s for s in cluster.run("squeue", "-h", "-s", "-o", "%i").stdout.split() if s.split(".")[0] == job]
    assert no_engine_left(namespaces) == {}
    # vLLM got the TERM itself (through Slurm, not srun's TERM-and-KILL) and shut down on its own
    log = (log_dir / "serve-0.log").read_text()
    assert "[shutdown] API server: shutdown triggered" in log, log[-3000:]
    assert _shm() - shm_before == set()
    assert not (state / "deployments" / f"{name}.json").exists()
    print(f"\n[slurm single engine: up {took:.1f}s, down {took_down:.1f}s]")
