"""Energy per load point end to end: a campaign on a local simulated deployment, its GPUs' power read
from the simulated engines' stand-in source, writes rows that carry the energy of every load point
(the samples, readers, samplers and prices: test_campaign_energy.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from k3launch.sim import power as simpower


# ----------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_campaign_rows_carry_the_energy_of_every_load_point(tmp_path: Path, local_inventory: Path) -> None:
    """A local simulated deployment, the stand-in nvidia-smi on PATH: every row has valid energy,
    drawn within what the sim's knobs allow, and more power at the higher concurrency."""
    idle, per_seq, gpus = 50.0, 20.0, 8
    inv = yaml.safe_load(local_inventory.read_text())
    inv["gpu_hour_price"] = {"amount": 4.0, "currency": "USD"}
    local_inventory.write_text(yaml.safe_dump(inv, sort_keys=False))
    power_dir = tmp_path / "power"
    env = {
        "K3LAUNCH_SIM_LOAD_S": "0.3",
        "K3LAUNCH_SIM_TTFT_MS": "30",
        "K3LAUNCH_SIM_ITL_MS": "20",
        "K3LAUNCH_SIM_BATCH_COST": "0.05",
        "K3LAUNCH_SIM_IDLE_W": str(idle),
        "K3LAUNCH_SIM_WATTS_PER_SEQ": str(per_seq),
        "K3LAUNCH_SIM_POWER_DIR": str(power_dir),
    }
    name = f"energy-{uuid.uuid4().hex[:6]}"
    camp = {
        "name": name,
        "inventory": str(local_inventory),
        "port_base": 41216,
        "engine_env": env,
        "ready_timeout": 60,
        "base": {"strategy": "single_node_tp"},
        "load": {"max_concurrency": [1, 8], "input_len": 32, "output_len": 64, "num_prompts": 16},
        "references": [{"label": "vendor X", "metric": "p99_tpot_ms", "x": 25, "y": 40}],
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(camp, sort_keys=False))
    simpower.install(tmp_path / "bin")
    run_env = {
        **os.environ,
        "K3LAUNCH_STATE_DIR": str(tmp_path / "state"),
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "K3LAUNCH_SIM_POWER_DIR": str(power_dir),
        "K3LAUNCH_SIM_IDLE_W": str(idle),
        "K3LAUNCH_SIM_GPUS": str(gpus),
    }
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "k3launch", "campaign", "run", str(path), "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        env=run_env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    from k3launch.campaign.results import read_rows

    rows = {row.load.max_concurrency: row for row in read_rows(out)}
    assert set(rows) == {1, 8}
    for conc, row in rows.items():
        e, m = row.energy, row.metrics
        assert e is not None and m is not None and e.valid, (e, row.reason)
        assert e.source == "nvidia-smi" and e.nodes == 1 and e.gpus == gpus and e.joules is not None and e.mean_watts is not None
        # the draw lies between all GPUs idle and the engine's GPUs each decoding `conc` requests
        assert gpus * idle <= e.mean_watts <= gpus * (idle + per_seq * conc) + 1e-6
        assert e.j_per_output_token == pytest.approx(e.joules / m.total_output_tokens)
        assert e.j_per_total_token == pytest.approx(e.joules / (m.total_output_tokens + m.total_input_tokens))
        assert e.samples_file and (out / "bench" / e.samples_file).is_file()
    assert rows[8].energy.mean_watts > rows[1].energy.mean_watts  # type: ignore[union-attr]  # a bigger batch draws more

    rep = subprocess.run(
        [sys.executable, "-m", "k3launch", "campaign", "report", str(path), "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=run_env,
        cwd=tmp_path,
    )
    assert rep.returncode == 0, rep.stderr
    html = Path(json.loads(rep.stdout)["html"]).read_text()
    assert "energy/output token (J)" in html and "cost/M output tokens (USD)" in html and "vendor X" in html
    table = subprocess.run(
        [sys.executable, "-m", "k3launch", "campaign", "report", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**run_env, "COLUMNS": "250"},
        cwd=tmp_path,
    )
    assert "energy/output token (J)" in table.stdout and "cost/M output tokens (USD)" in table.stdout
