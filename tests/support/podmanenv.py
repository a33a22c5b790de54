"""The container path's shared parts: the simulated-engine image's tag, an inventory of the local
backend running engines in it under podman, the CLI with its own state directory (:class:`K3`), and
what sweeps a deployment's containers, secrets and processes away.

The image itself comes from the ``podman_env`` fixture (tests/conftest.py, which runs
tests/infra/podman-image.sh); the fast tier reads only the tag and the inventory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from k3launch.deploy.state import StateStore
from k3launch.models.plan import Plan

TAG = "localhost/k3launch-sim:test"
MODEL = "moonshotai/Kimi-K3"
PREFIX = "k3pt-"  # every deployment made here; cleanup sweeps it

INVENTORY = """\
name: local-podman
backend: local
hardware: b300
engine: sim
defaults:
  runtime: podman
  image: {image}
  iface: lo
  cpu_memory_gb: 4096
  hf_cache: {hf_cache}
  env: {env}
nodes:  # the test suite's own loopback range (conftest.py): never a user's deployment's addresses
  - {{name: local-1, address: 127.0.77.11}}
  - {{name: local-2, address: 127.0.77.12}}
  - {{name: local-3, address: 127.0.77.13}}
  - {{name: local-4, address: 127.0.77.14}}
router:
  node: login
  address: 127.0.77.1
"""
FAST = {"K3LAUNCH_SIM_LOAD_S": "0.3", "K3LAUNCH_SIM_TTFT_MS": "5", "K3LAUNCH_SIM_ITL_MS": "1", "K3LAUNCH_SIM_RENDEZVOUS_TIMEOUT_S": "20"}


def podman(*args: str, timeout: float = 60, check: bool = True) -> str:
    p = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def marked_pids(prefix: str) -> list[int]:
    """Host processes whose environment marks them as part of a deployment named prefix*."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"K3LAUNCH_DEPLOYMENT=" + prefix.encode()) for e in env):
            out.append(int(d.name))
    return out


def sweep(prefix: str) -> None:
    """Remove whatever a deployment named prefix* left: containers (any state), secrets, processes."""
    ids = podman("ps", "-a", "--filter", "label=k3launch.deployment", "--format", '{{.ID}} {{index .Labels "k3launch.deployment"}}', check=False)
    for line in ids.splitlines():
        cid, _, dep = line.partition(" ")
        if dep.startswith(prefix):
            podman("rm", "-f", "-t", "0", cid, check=False)
    for name in podman("secret", "ls", "--format", "{{.Name}}", check=False).split():
        if name.startswith("k3-" + prefix):
            podman("secret", "rm", name, check=False)
    for pid in marked_pids(prefix):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


class K3:
    """The k3launch CLI with its own state dir and inventory."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        self.hf_cache = tmp / "hf-cache"  # does not exist yet: `up` must create it (podman refuses missing mounts)
        self.token = f"hf_k3pt_{uuid.uuid4().hex}"
        self.names: list[str] = []
        self.inventory = self.write_inventory(env or {})

    def write_inventory(self, env: dict[str, str]) -> Path:
        path = self.tmp / "podman.yaml"
        path.write_text(INVENTORY.format(image=TAG, hf_cache=self.hf_cache, env=json.dumps({**FAST, **env})), encoding="utf-8")
        return path

    def run(self, *args: str, timeout: float = 120, token: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "K3LAUNCH_STATE_DIR": str(self.state), "HOME": os.environ.get("HOME", "/root")}
        if token:
            env["HF_TOKEN"] = self.token  # set in the caller's environment; must never show up in a container's config
        else:
            env.pop("HF_TOKEN", None)
        return subprocess.run([sys.executable, "-m", "k3launch", *args], capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL, cwd=self.tmp)

    def up(self, name: str, *args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
        self.names.append(name)
        return self.run("up", "-i", str(self.inventory), "--name", name, "--ready-timeout", "60", *args, timeout=180, token=token)

    def down(self, name: str) -> dict[str, Any]:
        r = self.run("down", name, "--grace", "5", "--json", timeout=120)
        try:
            out: dict[str, Any] = json.loads(r.stdout)
        except json.JSONDecodeError:
            raise AssertionError(f"down {name}: exit {r.returncode}\n{r.stdout}\n{r.stderr}") from None
        return out

    def plan(self, name: str) -> Plan:
        return StateStore(self.state).load(name).plan

    def deployment_id(self, name: str) -> str:
        return StateStore(self.state).load(name).deployment_id

    def cleanup(self) -> None:
        for name in self.names:
            if StateStore(self.state).exists(name):
                self.run("down", name, "--grace", "2", timeout=120)
            sweep(name)


def containers(name: str) -> list[dict[str, Any]]:
    out = podman("ps", "-a", "--filter", f"label=k3launch.deployment={name}", "--format", "json")
    return list(json.loads(out or "[]"))
