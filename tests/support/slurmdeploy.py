"""What the Slurm end-to-end tests share: a deployment's inventory on the local cluster, the CLI
pointed at it, the cluster's jobs and steps, and that nothing is left after ``down``.

The tests that use it run on the cluster of ``slurmcluster`` (tests/e2e/slurm, tests/engine):
``cluster`` and ``state`` are its fixtures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from e2e_helpers import processes

if TYPE_CHECKING:
    from slurmcluster import Cluster

MODEL = "moonshotai/Kimi-K3"


def write_inventory(tmp: Path, cluster: Cluster, env: dict[str, str] | None = None, **slurm: Any) -> Path:
    inv = {"name": "test-slurm", "backend": "slurm", "hardware": "b300", "engine": "sim",
           "defaults": {"runtime": "bare", "python": sys.executable, "env": {"K3LAUNCH_SIM_LOAD_S": "0.3", **(env or {})}},
           "slurm": {"partition": cluster.partition, "container": "bare", "time_limit": "00:10:00", **slurm}}
    path = tmp / f"inv-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def k3(cluster: Cluster, state: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "k3launch", *args], capture_output=True, text=True, timeout=timeout,
                          env=cluster.env({"K3LAUNCH_STATE_DIR": str(state), "COLUMNS": "200"}), stdin=subprocess.DEVNULL)


def procs_of(deployment: str) -> list[int]:
    """Live processes of this deployment on this machine (the nodes share its kernel)."""
    return list(processes(deployment))


def jobs_named(cluster: Cluster, name: str) -> dict[str, str]:
    """job id -> state of this cluster's jobs called k3-NAME (finished ones too, while Slurm remembers them)."""
    r = cluster.run("squeue", "-h", "-t", "all", "--name", f"k3-{name}", "-o", "%i|%T")
    return dict(line.split("|", 1) for line in r.stdout.split())


def assert_nothing_left(cluster: Cluster, name: str) -> None:
    from slurmcluster import TERMINAL

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (procs_of(name) or set(jobs_named(cluster, name).values()) - TERMINAL):
        time.sleep(0.1)
    assert not procs_of(name), f"engine processes of {name} outlived their job"
    assert not set(jobs_named(cluster, name).values()) - TERMINAL, jobs_named(cluster, name)
    steps = cluster.run("squeue", "-h", "-s", "-o", "%i|%j").stdout
    assert not [s for s in steps.split() if any(j in s.split("|")[0] for j in jobs_named(cluster, name))], steps


def chat(endpoint: str) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello, Kimi"}], "max_tokens": 16}).encode()
    req = urllib.request.Request(endpoint + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        data: dict[str, Any] = json.loads(r.read())
        return data


def refuses(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint + "/health", timeout=2)
    except OSError:
        return True
    return False


# ---- two copies in one job ---------------------------------------------------------------------

ENGINES = ["r0-serve-0", "r0-serve-1", "r1-serve-0", "r1-serve-1"]


def argv_of(name: str) -> dict[str, list[str]]:
    """process id -> the command line its running process has (one process per step here)."""
    out: dict[str, list[str]] = {}
    for pid, proc in processes(name).items():
        out[proc] = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    return out


def workers(endpoint: str) -> list[str]:
    """The HTTP servers the running vllm-router sends requests to (its own list, GET /list_workers)."""
    with urllib.request.urlopen(endpoint + "/list_workers", timeout=5) as r:
        urls: list[str] = json.loads(r.read())["urls"]
    return urls


def step_ids(cluster: Cluster, job: str) -> dict[str, str]:
    """step name -> step id of the job's running steps (a restarted step gets a new id)."""
    out = cluster.run("squeue", "-h", "-s", "-j", job, "-o", "%j|%i").stdout.split()
    return dict(line.split("|", 1) for line in out if not line.endswith((".batch", ".extern")))


def record(state: Path, name: str) -> dict[str, Any]:
    """The deployment's record as k3launch keeps it (``STATE/deployments/NAME.json``)."""
    data: dict[str, Any] = json.loads((state / "deployments" / f"{name}.json").read_text())
    return data


# ---- a job that supervises itself ---------------------------------------------------------------


def supervised_inventory(tmp: Path, cluster: Cluster, restart: dict[str, Any], env: dict[str, str] | None = None) -> Path:
    path = write_inventory(tmp, cluster, env)
    inv = yaml.safe_load(path.read_text())
    inv["restart"] = restart
    path.write_text(yaml.safe_dump(inv))
    return path


def events(cluster: Cluster, state: Path, name: str) -> list[dict[str, Any]]:
    r = k3(cluster, state, "events", name, "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def wait_for(cond: Any, within: float, what: str, step: float = 0.2) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"{what}: not within {within:g}s")
