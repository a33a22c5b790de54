"""A real Slurm cluster on this machine for k3launch's Slurm-backend tests.

A thin pytest-side wrapper of ``tests/infra/slurm-{up,down}.sh`` (read slurm-up.sh for what a
node is: one slurmd per network namespace, its own address and hostname, fake GPUs as device
nodes; or, without namespaces, several slurmd on 127.0.0.1). Root is needed.

    def test_something(slurm_cluster, tmp_path):
        job = slurm_cluster.sbatch("--nodes=2", "--gres=gpu:8", f"--output={tmp_path}/%j.out", "--wrap", "srun hostname")
        assert slurm_cluster.wait(job, timeout=60) == "COMPLETED"
        subprocess.run(["squeue"], env=slurm_cluster.env())      # any Slurm command, pointed at this cluster

The root ``tests/conftest.py`` registers this module as a plugin (``pytest_plugins``), so the
``slurm_cluster`` fixture is one for the whole session, whichever tier folders use it; it is loaded
before any test module, so tests may import its names at module level.

CI may own the cluster instead: ``bash tests/infra/slurm-up.sh DIR && . DIR/env.sh`` exports
``K3LAUNCH_TEST_SLURM_DIR`` (and SLURM_CONF); the helpers then reuse that cluster and never stop
it. With ``K3LAUNCH_TEST_SLURM_REQUIRED=1`` the fixture fails instead of skipping when the cluster
cannot start (so CI cannot go green by skipping). slurm-up.sh knobs in the environment
(SLURM_MODE=multi, SLURM_GPU_TYPE=h100, SLURM_ACCOUNTING=1, ...) apply to clusters started here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from infrahelpers import InfraError as InfraError
from infrahelpers import SessionInfra, in_first_free_slot, run_script, up_or_clean_up

ENV_DIR = "K3LAUNCH_TEST_SLURM_DIR"
ENV_REQUIRED = "K3LAUNCH_TEST_SLURM_REQUIRED"
NEEDS_ROOT = "the Slurm test cluster needs root (slurmd runs jobs as any user, network namespaces, mknod)"

# Job states after which nothing more happens to a job (squeue shows COMPLETING until every
# process of a cancelled or finished job is gone, so these also mean "its processes are gone").
TERMINAL = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                      "REVOKED", "SPECIAL_EXIT", "TIMEOUT"})
# Variables an enclosing Slurm job (CI running inside an allocation) or the user's shell may set:
# SLURM_JOB_ID & co. make srun/sbatch act inside *that* allocation, SBATCH_*/SRUN_*/... change
# every request. None of them may leak into commands aimed at the test cluster.
_SLURM_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCANCEL_", "SACCT_", "SCONTROL_")
# slurm-up.sh's knobs that may come from the environment. SLURM_NODES/SLURM_GPUS_PER_NODE are
# passed explicitly (Slurm itself exports SLURM_GPUS_PER_NODE inside jobs).
_KNOBS = ("SLURM_MODE", "SLURM_GPU_TYPE", "SLURM_CPUS_PER_NODE", "SLURM_MEM_MB", "SLURM_ACCOUNTING", "SLURM_NODE_PREFIX",
          "SLURM_SUBNET", "SLURM_BRIDGE", "SLURM_ETC_HOSTS", "SLURM_LINK_ETC", "SLURM_WAIT_S", "SLURMCTLD_PORT",
          "SLURMD_PORT_BASE", "SLURMDBD_PORT", "MARIADB_PORT")


class SlurmError(RuntimeError):
    """A Slurm command failed or a job did not reach the expected state in time."""


def _clean_env(keep: Iterable[str] = ()) -> dict[str, str]:
    kept = set(keep)
    return {k: v for k, v in os.environ.items() if k in kept or not k.startswith(_SLURM_ENV_PREFIXES)}


def run_infra(script: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120.0) -> str:
    """Run ``tests/infra/SCRIPT ARGS`` (this process's environment without Slurm job/input variables
    other than slurm-up.sh's knobs, plus ``env``) and return its stdout; raise InfraError on failure or
    timeout (then its whole process group is killed: infrahelpers.run_script)."""
    return run_script(script, *args, env={**_clean_env(_KNOBS), **(env or {})}, timeout=timeout)


@dataclass(frozen=True)
class Cluster:
    """A running cluster, as described by ``DIR/cluster.json``."""

    dir: Path
    mode: str  # "netns" (node = namespace with its own address and hostname) or "multi" (all on 127.0.0.1)
    conf: str  # its slurm.conf: SLURM_CONF for every Slurm command
    name: str  # ClusterName
    partition: str  # the one, default partition
    nodes: list[str]
    addresses: dict[str, str]  # node -> address its jobs' servers are reachable at
    controller: str  # slurmctld's address (the bridge's, in netns mode)
    gpus_per_node: int
    gpu_type: str  # "" when untyped (Gres=gpu:N)
    cpus_per_node: int
    accounting: bool  # slurmdbd runs: sacct works (records arrive a few seconds after the job)
    bridge: str  # the nodes' private bridge (netns mode), "" in multi mode
    owned: bool  # started by us (and so stopped by us), not by CI

    @classmethod
    def load(cls, dir: Path | str, *, owned: bool) -> Cluster:
        d = Path(dir)
        info = json.loads((d / "cluster.json").read_text())
        nodes = info["nodes"]
        return cls(dir=d, mode=info["mode"], conf=info["conf"], name=info["cluster_name"], partition=info["partition"],
                   nodes=[n["name"] for n in nodes], addresses={n["name"]: n["address"] for n in nodes},
                   controller=info["controller"]["address"], gpus_per_node=int(info["gpus_per_node"]), gpu_type=info["gpu_type"],
                   cpus_per_node=int(info["cpus_per_node"]), accounting=bool(info["accounting"]),
                   bridge=info.get("bridge", ""), owned=owned)

    # ---- commands ------------------------------------------------------------------------
    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a subprocess that talks to this cluster: this process's, minus any
        Slurm job/input variables it carries, plus SLURM_CONF (and ``extra``)."""
        return {**_clean_env(), "SLURM_CONF": self.conf, **(extra or {})}

    def run(self, *args: str, timeout: float = 30.0, check: bool = True, cwd: Path | str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (``run("squeue", "-h")``) against this cluster; SlurmError if it fails and ``check``."""
        try:
            r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=self.env(), cwd=cwd,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{' '.join(args)}: timed out after {timeout:g}s") from None
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def sbatch(self, *args: str, timeout: float = 30.0, cwd: Path | str | None = None) -> str:
        """``sbatch --parsable ARGS`` -> the job id (an array's base id); SlurmError (with sbatch's message) if refused."""
        out = self.run("sbatch", "--parsable", *args, timeout=timeout, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def states(self, job: str) -> list[str]:
        """The state of every record of ``job`` (one per array task), [] once the controller forgot it."""
        r = self.run("squeue", "-h", "-r", "-t", "all", "-j", job, "-o", "%T", check=False)
        return r.stdout.split()

    def wait(self, job: str, timeout: float = 60.0, until: Iterable[str] = TERMINAL) -> str:
        """Poll until every record of ``job`` is in one of ``until`` (default: finished); the states,
        comma-joined when they differ ("COMPLETED", "COMPLETED,FAILED"). SlurmError on timeout."""
        wanted = set(until)
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while True:
            seen = self.states(job)
            if seen and all(s in wanted for s in seen):
                return ",".join(sorted(set(seen)))
            if time.monotonic() >= deadline:
                raise SlurmError(f"job {job}: states {seen or 'unknown'} after {timeout:g}s, waited for {sorted(wanted)}")
            time.sleep(0.05)

    def cancel(self, *jobs: str) -> None:
        self.run("scancel", *jobs)

    def down(self) -> None:
        """Stop the cluster (slurm-down.sh) -- only if we started it; CI stops its own."""
        if self.owned:
            run_infra("slurm-down.sh", str(self.dir), timeout=120)


def start_cluster(dir: Path | str | None = None, nodes: int = 4, gpus: int = 8, *, reuse: bool = True,
                  env: Mapping[str, str] | None = None, timeout: float | None = None) -> Cluster:
    """Start a cluster of ``nodes`` nodes with ``gpus`` fake GPUs each, state in ``dir`` (slurm-up.sh;
    idempotent), and describe it.

    With ``reuse`` and ``K3LAUNCH_TEST_SLURM_DIR`` naming a running cluster, that one is used instead
    (``owned`` False); it must have at least ``nodes`` nodes with ``gpus`` GPUs (it is not resized:
    that would restart CI's daemons). ``env`` passes slurm-up.sh knobs (SLURM_MODE, SLURM_GPU_TYPE, ...).
    A failed start is cleaned up (slurm-down.sh) before InfraError is raised.
    """
    ci_dir = os.environ.get(ENV_DIR)
    if reuse and ci_dir and not (Path(ci_dir) / "cluster.json").is_file() and dir is None:
        raise InfraError(f"{ENV_DIR}={ci_dir} holds no running cluster (no cluster.json); run tests/infra/slurm-up.sh {ci_dir}")
    if reuse and ci_dir and (Path(ci_dir) / "cluster.json").is_file():
        cluster = Cluster.load(ci_dir, owned=False)
        if len(cluster.nodes) < nodes or cluster.gpus_per_node < gpus:
            raise InfraError(f"the cluster of {ENV_DIR}={ci_dir} has {len(cluster.nodes)} nodes x {cluster.gpus_per_node} GPUs; "
                             f"{nodes} x {gpus} are needed (restart it with SLURM_NODES/SLURM_GPUS_PER_NODE)")
        return cluster
    if dir is None:
        raise ValueError(f"start_cluster needs a state directory (or {ENV_DIR})")
    if os.geteuid() != 0:
        raise InfraError(NEEDS_ROOT)
    knobs = {**(env or {}), "SLURM_NODES": str(nodes), "SLURM_GPUS_PER_NODE": str(gpus)}
    # generous: the first run apt-get installs slurm (~5-15 s), and more with accounting
    up_or_clean_up(run_infra, "slurm-up.sh", "slurm-down.sh", dir, env=knobs, timeout=timeout or 400)
    return Cluster.load(dir, owned=True)


# ---- several clusters on one machine ------------------------------------------------------
# Developers and CI jobs may run the suite at the same time on one box. Node names, bridge,
# subnet and ports are machine-wide and slurm-up.sh refuses those another DIR holds, so each
# cluster takes the first free "slot". Slot 0 of kind "n" is slurm-up.sh's plain default (k3n*,
# 10.214.0.0/24, k3sbr0, port 6817); other kinds are for clusters a test makes of its own.
_SLOT_KNOBS = ("SLURM_NODE_PREFIX", "SLURM_SUBNET", "SLURM_BRIDGE", "SLURMCTLD_PORT")
_TAKEN = ("belongs to", "already in use")  # slurm-up.sh's refusals of what another DIR holds


def slot_env(slot: int, kind: str = "n") -> dict[str, str]:
    """slurm-up.sh knobs of slot ``slot`` (0..7) for clusters of kind ``kind`` (one letter)."""
    idx = 2 * slot + (0 if kind == "n" else 1)
    env = {"SLURM_NODE_PREFIX": f"k3{kind}{'' if slot == 0 else 'abcdefg'[slot - 1]}", "SLURM_SUBNET": f"10.214.{idx}",
           "SLURM_BRIDGE": f"k3sbr{idx}"}
    if idx:
        base = 20000 + 100 * idx  # slurmctld +17, slurmdbd +19, MariaDB +6, slurmd (multi mode) +21..
        env |= {"SLURMCTLD_PORT": str(base + 17), "SLURMDBD_PORT": str(base + 19), "MARIADB_PORT": str(base + 6),
                "SLURMD_PORT_BASE": str(base + 20)}
    return env


def start_cluster_in_free_slot(dir: Path | str, nodes: int = 4, gpus: int = 8, kind: str = "n", slots: int = 8) -> Cluster:
    """start_cluster (never reusing CI's) in the first slot no other running cluster holds.

    Knobs set explicitly in the environment (SLURM_NODE_PREFIX, ...) win and disable the search.
    """
    return in_first_free_slot(lambda env: start_cluster(dir, nodes, gpus, reuse=False, env=env), lambda slot: slot_env(slot, kind),
                              slot_knobs=_SLOT_KNOBS, taken=_TAKEN, slots=slots)


# ---- pytest fixture ----------------------------------------------------------------------
_SESSION: SessionInfra[Cluster] = SessionInfra(ENV_REQUIRED, NEEDS_ROOT, "the Slurm test cluster could not start")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The session's Slurm cluster: 4 nodes x 8 fake GPUs, partition ``gpu``.

    Skips the test (with the reason) when not root or when the cluster cannot start (fails
    instead with K3LAUNCH_TEST_SLURM_REQUIRED=1). Stops it at the end of the session, unless it
    came from K3LAUNCH_TEST_SLURM_DIR (then CI owns it).
    """

    def start() -> Cluster:
        if os.environ.get(ENV_DIR):
            return start_cluster(nodes=4, gpus=8)
        return start_cluster_in_free_slot(tmp_path_factory.mktemp("slurm"), nodes=4, gpus=8)

    yield from _SESSION.provide(start)


@pytest.fixture
def jobs(slurm_cluster: Cluster) -> Iterator[list[str]]:
    """Job ids a test submits; whatever still runs at its end is cancelled (failed asserts included)."""
    ids: list[str] = []
    yield ids
    if ids:
        slurm_cluster.run("scancel", *ids, check=False)


@pytest.fixture
def cluster(slurm_cluster: Cluster) -> Cluster:
    """The session's cluster, in network-namespace mode: every node its own address (in "multi" mode
    every node is this machine's 127.0.0.1, so engines of two nodes would share ports and processes)."""
    if slurm_cluster.mode != "netns":
        pytest.skip("multi mode: every node is this machine's 127.0.0.1, so two nodes' engines cannot be told apart")
    return slurm_cluster


@pytest.fixture
def state(tmp_path: Path, cluster: Cluster) -> Iterator[Path]:
    """A state dir; at the end, any job named after a deployment of the test is cancelled."""
    d = tmp_path / "state"
    yield d
    names = [p.stem for p in (d / "deployments").glob("*.json")] if (d / "deployments").is_dir() else []
    for n in names:
        cluster.run("scancel", "--name", f"k3-{n}", check=False)
