"""SLA search end to end on the simulated engine: the search finds the capacity a brute-force sweep of
the same deployment finds, and the bundled ``local-sla`` campaign runs with repeats and reports its
capacities (the pure search, repeats and resume: test_campaign_sla.py).
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
from paths import ROOT

from k3launch.campaign.results import read_rows

# ---- end to end on the simulated engine -----------------------------------------------------

e2e = pytest.mark.e2e  # local deployments of the simulated engine


SIM = {"K3LAUNCH_SIM_LOAD_S": "0.3", "K3LAUNCH_SIM_TTFT_MS": "20", "K3LAUNCH_SIM_ITL_MS": "10", "K3LAUNCH_SIM_BATCH_COST": "0.2"}


def run_campaign(tmp: Path, body: dict[str, object], *args: str, verb: str = "run",
                 env_extra: dict[str, str] | None = None) -> tuple[int, dict[str, object], Path]:
    path = tmp / f"{body['name']}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    out = tmp / f"out-{body['name']}"
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(tmp / "state"), **(env_extra or {})}
    r = subprocess.run(
        [sys.executable, "-m", "k3launch", "campaign", verb, str(path), "--out", str(out), "--json", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    try:
        return r.returncode, json.loads(r.stdout), out
    except json.JSONDecodeError:
        raise AssertionError(f"exit {r.returncode}\n{r.stdout}\n{r.stderr}") from None


@e2e
def test_the_sla_search_finds_the_capacity_a_brute_force_sweep_of_the_same_deployment_finds(tmp_path: Path, local_inventory: Path) -> None:
    slo = {"mean_tpot_ms": 19.0}  # TPOT ~ 10 ms x (1 + 0.2 x (in flight - 1)): 18 ms at 5, 20 ms at 6 (17.4 and 20.3 measured)
    common = {
        "inventory": str(local_inventory),
        "engine_env": SIM,
        "ready_timeout": 60,
        "base": {"strategy": "single_node_tp"},
        "validity": {"max_error_rate": 0.0},
    }
    load = {"input_len": 32, "output_len": 16, "num_prompts": 12}
    name = f"bf-{uuid.uuid4().hex[:6]}"
    code, s, out = run_campaign(
        tmp_path, {"name": name, "port_base": 30720, **common, "load": {**load, "max_concurrency": list(range(1, 9))}}
    )
    assert code == 0, s
    tpot = {r.load.max_concurrency: r.metrics.mean_tpot_ms for r in read_rows(out) if r.metrics}
    assert sorted(tpot) == list(range(1, 9))
    brute = max(c for c in tpot if all(tpot[x] <= slo["mean_tpot_ms"] for x in range(1, c + 1)))  # type: ignore[operator]

    sla_body = {
        "name": f"sl-{uuid.uuid4().hex[:6]}",
        "port_base": 30720,
        **common,
        "load": load,
        "sla": {"variable": "max_concurrency", "slo": slo, "start": 1, "max": 64, "tolerance": 0.1, "max_probes": 12},
    }
    code, s, out = run_campaign(tmp_path, sla_body)
    assert code == 0, s
    [found] = s["sla"]  # type: ignore[misc]
    assert found["status"] == "found", found
    probes = [p["value"] for p in found["probes"]]
    assert probes[:4] == [1, 2, 4, 8] and len(probes) <= 12  # bracketing by doubling, then bisection
    # the search's tolerance at this capacity is one request: the bracket [capacity, capacity + 1)
    assert found["bracket"] == [found["capacity"], found["capacity"] + 1]
    assert found["capacity"] == brute, (found, tpot)
    assert {r.load.max_concurrency for r in read_rows(out)} == set(probes)  # rows are the probes, one per run

    # a second run replays the search over its rows and measures nothing
    code, again, _ = run_campaign(tmp_path, sla_body)
    assert code == 0 and again["ran"] == 0 and again["engine_starts"] == 0 and again["sla"] == s["sla"]


@e2e
def test_the_bundled_local_sla_campaign_runs_with_repeats_and_reports_its_capacities(tmp_path: Path, local_inventory: Path) -> None:
    body = yaml.safe_load((ROOT / "campaigns" / "local-sla.yaml").read_text())
    body.update({"name": f"ls-{uuid.uuid4().hex[:6]}", "inventory": str(local_inventory), "port_base": 31232})
    from k3launch.sim import power as simpower

    # the stand-in power source: the simulated engines publish their draw, a stand-in nvidia-smi reads it
    simpower.install(tmp_path / "bin")
    power = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "K3LAUNCH_SIM_POWER_DIR": str(tmp_path / "power")}
    code, s, out = run_campaign(tmp_path, body, env_extra=power)
    assert code == 0, s
    found = {x["deployment"]: x for x in s["sla"]}  # type: ignore[union-attr]
    assert set(found) == {"max-num-seqs=4", "max-num-seqs=16"} and all(x["status"] == "found" for x in found.values()), found
    # the 4-slot batch queues requests past 4 in flight: TTFT caps it; the 16-slot batch is capped by TPOT, later
    assert found["max-num-seqs=4"]["capacity"] <= 4 < found["max-num-seqs=16"]["capacity"], found
    rows = read_rows(out)
    runs: dict[str, set[int]] = {}
    for r in rows:
        runs.setdefault(r.cell, set()).add(r.run)
    assert all(v == {0, 1, 2} for v in runs.values()), runs  # 3 recorded runs per probe, one row each
    measured = [r for r in rows if r.metrics is not None]
    assert measured and all(r.energy is not None and r.energy.valid and r.energy.j_per_output_token for r in measured), [
        (r.cell, r.energy) for r in measured if r.energy is None or not r.energy.valid]
    warmups = list((out / "bench").glob("*-warmup.json"))
    assert len(warmups) == len(runs)  # one unrecorded warm-up per probe
    code, rep, _ = run_campaign(tmp_path, body, verb="report", env_extra=power)
    assert code == 0, rep
    points = {p["cell"]: p for p in rep["points"]}  # type: ignore[union-attr]
    assert set(points) == set(runs) and all(p["runs"] == 3 and p["confidence"] == 0.95 for p in points.values() if p["valid"])
    for p in points.values():
        if p["valid"]:
            lo, hi = p["ci"]["output_throughput"]
            assert lo <= hi and p["median"]["output_throughput"] > 0
    assert [x["capacity"] for x in rep["sla"]] == [x["capacity"] for x in s["sla"]]  # type: ignore[union-attr]
