"""The predicted weight load in the CLI: ``plan`` and ``doctor`` show it only when a throughput is
known, and ``timeline`` puts it next to the engine's own figure (the prediction: test_loadtime.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3launch import api
from k3launch.deploy.state import StateStore, write_atomic
from k3launch.models.weights import Probe, probes_json


@pytest.mark.e2e  # five CLI runs
def test_plan_and_doctor_show_the_prediction_only_when_a_throughput_is_known(tmp_path: Path, local_inventory: Path) -> None:
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "250", "NO_COLOR": "1"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "k3launch", *args, "-i", str(local_inventory)], capture_output=True, text=True,
                              env=env, timeout=120)

    before = cli("plan", "--json")
    assert before.returncode == 0 and "weights_load" not in before.stdout
    assert "weights load" not in cli("plan").stdout
    name = api.load(local_inventory).inventory.name
    target = StateStore(tmp_path / "state").probe_path(name)
    target.parent.mkdir(parents=True)
    node = api.plan(local_inventory, state_dir=tmp_path / "state").processes[0].node
    write_atomic(target, probes_json(name, [Probe(node, "/w", "o_direct", 1_000_000_000, 1.0)], 0))
    after = cli("plan", "--json")
    out = json.loads(after.stdout)
    assert out["weights_load"]["total_s"] == 1400.0 and out["weights_load"]["processes"][0]["ranks"] == 8  # the checkpoint's 1400 GB
    assert {k: v for k, v in out.items() if k != "weights_load"} == json.loads(before.stdout)  # nothing else changed
    text = cli("plan").stdout
    assert "weights load (predicted, cold): 1,400 s" in text and "8 rank(s) x 175.0 GB" in text
    doc = cli("doctor", "--json")
    assert json.loads(doc.stdout)["weights_load"]["total_s"] == 1400.0, doc.stdout + doc.stderr


@pytest.mark.e2e
def test_timeline_puts_the_prediction_next_to_the_engines_own_figure(tmp_path: Path, local_inventory: Path) -> None:
    from e2e_helpers import Cli

    cli = Cli(tmp_path / "state")
    name = api.load(local_inventory).inventory.name
    target = StateStore(tmp_path / "state").probe_path(name)
    target.parent.mkdir(parents=True)
    node = api.plan(local_inventory, state_dir=tmp_path / "state").processes[0].node
    write_atomic(target, probes_json(name, [Probe(node, "/w", "o_direct", 1_000_000_000_000, 1.0)], 0))  # 1 TB/s: 1.4 s for the 1400 GB checkpoint
    up = cli.run("up", "-i", str(local_inventory), "--name", "wl-tl")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        out = cli.json("timeline", "wl-tl")
        row = out["weights_load"]["processes"][0]
        assert row["predicted_s"] == 1.4 and len(row["took_s"]) == 1 and row["took_s"][0] > 0 and row["ratio"] > 0
        text = cli.run("timeline", "wl-tl").stdout
        assert "weights load: predicted (from weights probe --save (o_direct))" in text and "predicted 1.4 s, took" in text
    finally:
        cli.run("down", "wl-tl")
