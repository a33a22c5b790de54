"""``down`` stops only what is its own, end to end (issue 30's own scenario): ``up`` of a deployment
from state directory A, then ``down`` of its name from state directory B is refused and A's
deployment keeps serving (the fast cases, with stand-in processes: test_down_identity.py).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from paths import ROOT


# ------------------------------------------------------------------ the issue, end to end
@pytest.mark.e2e
def test_down_from_another_state_directory_leaves_a_running_deployment_serving(tmp_path: Path) -> None:
    """`K3LAUNCH_STATE_DIR=A k3launch up --name k3-x`, then `K3LAUNCH_STATE_DIR=B k3launch down
    k3-x`: B refuses (no such deployment there; A's named as left alone) and A stays ready."""
    import json

    import yaml
    from e2e_helpers import CLI

    inv = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    inv["nodes"] = [{"name": "t-1", "address": "127.0.78.201"}]
    inv["router"] = {"node": "login", "address": "127.0.78.200"}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    name = f"k3-x{uuid.uuid4().hex[:8]}"  # a name no other test uses

    def cli(state: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "K3LAUNCH_STATE_DIR": str(tmp_path / state), "COLUMNS": "250", "NO_COLOR": "1"}
        return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL)

    try:
        up = cli("A", "up", "-i", str(path), "--name", name, "--port-base", "24600", "--json")
        assert up.returncode == 0, up.stdout + up.stderr
        rec = json.loads((tmp_path / "A" / "deployments" / f"{name}.json").read_text())
        ident = rec["deployment_id"]
        assert ident.startswith((tmp_path / "A" / "id").read_text().strip() + "-")
        assert all(f"/k3launch/{name}.{ident}/" in p["log"] for p in rec["processes"].values()), rec["processes"]
        down = cli("B", "down", name, "--grace", "2")
        assert down.returncode == 2 and "another state directory" in down.stdout + down.stderr, down.stdout + down.stderr
        st = cli("A", "status", name, "--json")
        assert st.returncode == 0 and json.loads(st.stdout)["state"] == "ready", st.stdout + st.stderr
        down = cli("A", "down", name, "--grace", "2", "--json")
        assert down.returncode == 0 and json.loads(down.stdout)["clean"], down.stdout + down.stderr
    finally:
        cli("A", "down", name, "--grace", "1")
