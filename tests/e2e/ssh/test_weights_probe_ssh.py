"""``k3launch weights probe`` over the sshd test hosts: one row per node (the command and the
node-side program: test_weights_probe.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from k3launch.deploy.ssh.probe import MIB

if TYPE_CHECKING:
    from sshhosts import Hosts


@pytest.mark.e2e
@pytest.mark.ssh
def test_weights_probe_over_ssh_hosts_per_node(ssh_hosts: Hosts, tmp_path: Path) -> None:
    n1, n2 = ssh_hosts.names[:2]
    d = tmp_path / "shared dir"
    d.mkdir()
    inv = ssh_hosts.write_inventory(tmp_path / "inv.yaml", names=[n1, n2], extra={"weights": {"path": str(d)}})
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "250", "NO_COLOR": "1"}
    r = subprocess.run([sys.executable, "-m", "k3launch", "weights", "probe", "-i", str(inv), "--strategy", "multi_node_tp", "--nodes", "2",
                        "--bytes", str(8 * MIB), "--json"], capture_output=True, text=True, env=env, timeout=180)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"], r.stdout + r.stderr
    assert {(n["node"], n["dir"], n["bytes"]) for n in out["nodes"]} == {(n1, str(d), 8 * MIB), (n2, str(d), 8 * MIB)}
    assert all(n["method"] in ("o_direct", "fadvise", "nocache") and n["read_mbps"] > 0 for n in out["nodes"])
    assert list(d.iterdir()) == []  # the inventory's weights.path was probed, and every file removed
