"""Benchmark: `up` + `down` on the local Slurm cluster, per strategy, and a job array.

Figures (best and median of --runs), library API in process (no CLI start-up):
* ``up``: submit → ready (a real completion through the endpoint), with the time to bound (the
  job runs and printed its hosts), to doctor ok (the job's pre-flight step) and to ready; the
  simulated load time (--load) is inside and printed separately.
* ``down``: the grace signal, the job script stopping its steps, the verification.
* a job array of 3 single-node deployments (concurrency 3): submit → every task's result.

Cluster: the one of K3LAUNCH_TEST_SLURM_DIR / SLURM_CONF (tests/infra/slurm-up.sh DIR; . DIR/env.sh).
Prints; asserts nothing.

Run: python benchmarks/bench_slurm_up_down.py [--runs 3] [--load 0.3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from k3launch import api

SHAPES = {"single_node_tp": {"strategy": "single_node_tp"}, "multi_node_tp x2": {"strategy": "multi_node_tp", "nodes": 2},
          "multi_node_dep x4": {"strategy": "multi_node_dep", "nodes": 4}, "pd_cluster 1+2": {"strategy": "pd_cluster"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--load", type=float, default=0.3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-slurm-"))
    inv = tmp / "inv.yaml"
    inv.write_text(yaml.safe_dump({"name": "bench", "backend": "slurm", "hardware": "b300", "engine": "sim",
                                   "defaults": {"runtime": "bare", "python": sys.executable, "env": {"K3LAUNCH_SIM_LOAD_S": str(a.load)}},
                                   "slurm": {"partition": "gpu", "container": "bare", "time_limit": "00:10:00"}}))
    print(f"simulated load {a.load:g} s per engine; {a.runs} runs; times in s (best / median)")
    print(f"{'deployment':<20} {'bound':>9} {'doctor':>9} {'ready':>9} {'down':>9}")
    for label, sel in SHAPES.items():
        rows: dict[str, list[float]] = {k: [] for k in ("bound", "doctor", "ready", "down")}
        for _ in range(a.runs):
            name = f"bench-{uuid.uuid4().hex[:6]}"
            t0 = time.monotonic()
            seen: dict[str, float] = {}

            def stage(s: str, m: str, seen: dict[str, float] = seen, t0: float = t0) -> None:
                seen.setdefault(s, time.monotonic() - t0)

            api.up(api.plan(inv, name=name, **sel), inv, state_dir=tmp / "state", ready_timeout=60, on_stage=stage)
            rows["bound"].append(seen.get("running", float("nan")))  # running, hosts bound (read from the job's output)
            rows["doctor"].append(seen.get("doctor", float("nan")))
            rows["ready"].append(seen["ready"])
            t1 = time.monotonic()
            assert api.down(name, state_dir=tmp / "state").clean
            rows["down"].append(time.monotonic() - t1)
        print(f"{label:<20} " + " ".join(f"{min(v):4.1f}/{statistics.median(v):4.1f}" for v in rows.values()))
    plans = [api.plan(inv, strategy="single_node_tp", name=f"bench-arr-{i}-{uuid.uuid4().hex[:4]}") for i in range(3)]
    t0 = time.monotonic()
    jobs = api.submit_array(plans, inv, concurrency=3, log_dir=tmp / "arrays", ready_timeout=60)
    res = api.wait_array(jobs[0], timeout=300)
    ok = sum(1 for r in res.results.values() if r.get("ok"))
    ready = [float(r["ready_s"]) for r in res.results.values() if isinstance(r.get("ready_s"), float)]
    print(f"job array, 3 tasks: {time.monotonic() - t0:.1f} s submit → all results ({ok}/3 ok; "
          f"in-task ready {min(ready):.2f}-{max(ready):.2f} s)")


if __name__ == "__main__":
    main()
