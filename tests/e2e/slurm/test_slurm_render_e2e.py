"""One real job on the local Slurm cluster (``tests/support/slurmcluster.py``; skipped without it): the
simulated engine, bare, answers /health at its node's address and scancel ends job and process; a
node that exits fails the two-node job fast, naming it (the script itself: test_slurm_render.py).
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from e2e_helpers import processes
from paths import ROOT
from sbatchcases import (
    TREE,
    node_order,
    slurm_inventory,
)

from k3launch.models.plan import Plan
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.render.sbatch import make_sbatch_string
from k3launch.render.scripts import cache_dir, cache_meta_json

if TYPE_CHECKING:
    from slurmcluster import Cluster


# ------------------------------------------------------------------ a real job on the local cluster
def _procs_of(deployment: str) -> list[int]:
    """Live processes of this deployment on this machine (the nodes share its kernel)."""
    return list(processes(deployment))


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.status)
    except (urllib.error.URLError, OSError):
        return None


def _until(cond: Callable[[], Any], timeout: float, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got or time.monotonic() >= deadline:
            return got
        time.sleep(step)


@dataclass
class Submitted:
    job: str
    plan: Plan
    log_dir: Path

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(self.log_dir.glob("*")))


def submit_sim(c: Cluster, tmp: Path, jobs: list[str], sel: Selection, env: dict[str, str], **defaults: str) -> Submitted:
    """Render a plan of the simulated engine (container: bare) and sbatch it to the local cluster."""
    if c.mode != "netns":
        pytest.skip("multi mode: nodes share this machine's hostname and address; $K3_ADDR_i (the Slurm node name) would not resolve")
    inv = slurm_inventory("b300", "bare", engine="sim", partition=c.partition, time_limit="00:05:00",
                          defaults={"python": sys.executable, "runtime": "bare", "env": {"K3LAUNCH_SIM_LOAD_S": "0.3", **env}, **defaults})
    assert inv.slurm is not None
    plan = build_plan(TREE, sel, inventory=inv, name=f"k3t-{uuid.uuid4().hex[:8]}", port_base=random.randrange(20000, 28000, 100))
    assert plan.gpus_per_node <= c.gpus_per_node and len(node_order(plan)) <= len(c.nodes)
    log_dir = tmp / "logs"
    # The script's own `mkdir -p "$K3_LOGDIR"` is too late for `#SBATCH --output=<log_dir>/...`: slurmd opens that
    # before the script runs, and a missing directory fails the launch (FAILED, JobLaunchFailure, exit 0:53).
    log_dir.mkdir()
    script = tmp / "job.sbatch"
    script.write_text(make_sbatch_string(plan, inv.slurm, str(log_dir)))
    res = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30, cwd=ROOT,
                         env=c.env(), stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    jobs.append(job)
    return Submitted(job, plan, log_dir)


@pytest.mark.e2e
@pytest.mark.slurm
def test_real_slurm_job_serves_the_simulated_engine_and_scancel_ends_it(slurm_cluster: Cluster, tmp_path: Path, jobs: list[str]) -> None:
    from slurmcluster import TERMINAL

    c = slurm_cluster
    cc = tmp_path / "compile cache"  # named: the simulated engine keeps none by default
    sub = submit_sim(c, tmp_path, jobs, Selection(strategy="single_node_tp"), {}, compile_cache=str(cc))
    job, name, serve = sub.job, sub.plan.name, sub.plan.processes[0]
    assert [p.id for p in sub.plan.processes] == ["serve-0"]
    state = c.wait(job, timeout=30, until={"RUNNING", *TERMINAL})
    assert state == "RUNNING", f"job {job}: {state}: {sub.logs()}"
    node = c.run("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()
    assert node in c.nodes, node
    url = f"http://{c.addresses[node]}:{serve.http_port}/health"

    def up() -> bool:
        assert not set(c.states(job)) & TERMINAL, f"job {job} ended: {c.states(job)}: {sub.logs()}"
        return _health(url) == 200

    assert _until(up, 30), f"{url} never answered: {sub.logs()}"
    addr = c.addresses[node]
    assert f"k3launch: node 0 = {node} {addr}" in (sub.log_dir / f"slurm-{job}.out").read_text()
    pids = _procs_of(name)
    assert len(pids) == 1, pids
    environ = dict(e.split("=", 1) for e in Path(f"/proc/{pids[0]}/environ").read_text().split("\0") if "=" in e)
    assert environ.get("VLLM_HOST_IP") == addr and environ.get("K3LAUNCH_PROCESS") == "serve-0"  # the node's NodeAddr
    # the prepare step made the engine's compile-cache directory on its node, with what the key stands for
    kept = str(cache_dir(sub.plan, serve, sub.plan.hosts[0]))
    assert environ.get("VLLM_CACHE_ROOT") == f"{kept}/vllm" and kept.startswith(f"{cc}/")
    assert Path(kept, "k3launch.json").read_text() == cache_meta_json(sub.plan, serve, sub.plan.hosts[0]) + "\n"
    assert "k3launch: prepare: 1 directory(ies) made on 1 node(s)" in (sub.log_dir / f"slurm-{job}.out").read_text()
    # the step sees every GPU of the allocation (no --gres on the step needed)
    assert environ.get("CUDA_VISIBLE_DEVICES") == ",".join(map(str, range(sub.plan.gpus_per_node))), environ.get("CUDA_VISIBLE_DEVICES")
    cmdline = Path(f"/proc/{pids[0]}/cmdline").read_bytes().decode().split("\0")[:-1]
    assert cmdline == [sys.executable, "-m", "k3launch.sim", *[addr if w == serve.address else w for w in serve.argv[1:]]]

    c.cancel(job)
    assert c.wait(job, timeout=30) == "CANCELLED"
    assert _until(lambda: not _procs_of(name), 10), f"still running after scancel: {_procs_of(name)}"
    assert _health(url) is None


@pytest.mark.e2e
@pytest.mark.slurm
def test_real_slurm_job_fails_fast_when_one_node_exits(slurm_cluster: Cluster, tmp_path: Path, jobs: list[str]) -> None:
    """Two-node TP: serve-1 exits during load; the script stops the deployment and the job fails."""
    c = slurm_cluster
    sub = submit_sim(c, tmp_path, jobs, Selection(strategy="multi_node_tp", nodes=2),
                     {"K3LAUNCH_SIM_FAIL": "exit-during-load", "K3LAUNCH_SIM_FAIL_PROCESS": "serve-1", "K3LAUNCH_SIM_FAIL_AFTER_S": "0.2"})
    assert c.wait(sub.job, timeout=40) == "FAILED", sub.logs()
    out = (sub.log_dir / f"slurm-{sub.job}.out").read_text()
    # serve-1 dies first, but serve-0 notices its lost peer and may be reaped first: either is named, with its node
    assert re.search(r"k3launch: serve-(\d) on node \1 \(k3\w+\) exited with code [1-9]\d*; stopping the deployment", out), sub.logs()
    assert "CUDA error: uncorrectable ECC error" in (sub.log_dir / "serve-1.log").read_text()
    assert _until(lambda: not _procs_of(sub.plan.name), 10), f"still running: {_procs_of(sub.plan.name)}"
