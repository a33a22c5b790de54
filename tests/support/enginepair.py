"""What the real-engine tests over SSH share: two sshd test hosts as a CPU inventory of the real
vLLM (CPU build), the CLI with its own state directory, and ``up`` on them with the tier's timeouts.

The ``pair`` fixture (tests/conftest.py) makes a :class:`Pair`; tests/engine/test_engine_ssh.py
and tests/engine/test_engine_control.py use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e2e_helpers import Cli, host_netns
from paths import ROOT

if TYPE_CHECKING:
    from sshhosts import Hosts

LOCAL_CPU = ROOT / "inventories" / "local-cpu.yaml"
RECIPE = "k3launch/tiny-llama"
UP_TIMEOUT_S = 480  # two engines starting on two busy cores: ~50 s idle, several times that on a loaded CI machine


@dataclass
class Pair:
    """Two test hosts as a CPU inventory, the CLI with its own state directory, and this session's port offset."""

    hosts: Hosts
    names: list[str]
    inv: Path
    cli: Cli
    model: str
    offset: int
    suffix: str

    def ns(self, host: str) -> str:
        return host_netns(self.hosts, host)


def up(pair: Pair, name: str, port_base: int, *args: str, json_out: bool = False) -> Any:
    """``k3launch up`` of the tiny model on the pair, its ports offset by this session's."""
    r = pair.cli.run("up", "-i", str(pair.inv), "--recipe", RECIPE, *args, "--port-base", str(port_base + pair.offset),
                     "--name", name, "--ready-timeout", str(UP_TIMEOUT_S - 60), *(["--json"] if json_out else []), timeout=UP_TIMEOUT_S)
    return r


def argv_of(pid: int) -> list[str]:
    """The command line of a running process, from /proc (the last item is empty)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
