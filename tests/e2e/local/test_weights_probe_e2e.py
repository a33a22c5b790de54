"""``k3launch weights probe`` through the CLI on the local inventory (the command and the node-side
program: test_weights_probe.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from k3launch import api
from k3launch.deploy.ssh.probe import MIB

if TYPE_CHECKING:
    pass


@pytest.mark.e2e
def test_weights_probe_on_this_machine_through_the_cli(local_inventory: Path, tmp_path: Path) -> None:
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "250", "NO_COLOR": "1"}
    d = tmp_path / "weights dir"
    d.mkdir()
    cli = [sys.executable, "-m", "k3launch", "weights", "probe", "-i", str(local_inventory)]
    r = subprocess.run([*cli, "--path", str(d), "--bytes", str(32 * MIB), "--save", "--json"], capture_output=True, text=True, env=env, timeout=120)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"], r.stdout + r.stderr
    row = out["nodes"][0]
    assert row["bytes"] == 32 * MIB and row["read_mbps"] > 0 and row["method"] == "o_direct" and row["dir"] == str(d)
    assert list(d.iterdir()) == []
    assert [p.node for p in api.saved_probe(local_inventory, tmp_path / "state")] == [row["node"]]
    r = subprocess.run([*cli, "--path", str(d)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "MB/s" in r.stdout and "O_DIRECT" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([*cli, "--path", str(tmp_path / "none")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 2 and "error: weights probe on" in r.stderr and "hint: pass --path" in r.stderr
    r = subprocess.run([*cli, "--bytes", "17179869185"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "--bytes" in r.stderr
