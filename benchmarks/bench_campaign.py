"""Benchmark: where a campaign's wall time goes, on the simulated engine (bundled local inventory).

Runs a campaign (default: the bundled ``local-demo``, 2 deployments x 3 load points) in process
and splits its wall time into engine starts (``api.up``: doctor → start → ready → completion),
load points (``vllm bench serve`` wall time, client start-up included; and the part the client
itself measured as ``duration``), teardowns (``api.down``) and the rest (planning, result
appends, provenance probes). Then a resume of the finished campaign (no engine start) and the
cost the same cells would have with one engine start per cell.

The simulated load time (``K3LAUNCH_SIM_LOAD_S`` in the campaign's engine_env) is inside every
engine start and printed; nothing is subtracted. Prints; asserts nothing.

Run: python benchmarks/bench_campaign.py [--campaign FILE|NAME] [--port-base 34816]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from k3launch import api
from k3launch.campaign.results import read_rows
from k3launch.campaign.run import Options, prepare, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--campaign", default="local-demo")
    ap.add_argument("--port-base", type=int, default=34816)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="k3-bench-campaign-") as tmp:
        out, state = Path(tmp) / "out", Path(tmp) / "state"
        events: list[tuple[float, str]] = []
        prep = prepare(Path(a.campaign), port_base=a.port_base)
        t0 = time.monotonic()
        s = run(prep, Options(out=out, state_dir=state, on_event=lambda m: events.append((time.monotonic(), m))))
        wall = time.monotonic() - t0
        ups = [float(m.rsplit(" ", 1)[1].rstrip("s")) for _, m in events if ": up in " in m]
        downs = []
        last_cell = None
        for t, m in events:
            if m.startswith("cell "):
                last_cell = t
            elif m.endswith(": down") and last_cell is not None:
                downs.append(t - last_cell)
        rows = read_rows(out)
        bench_wall = [(datetime.fromisoformat(r.provenance.ended) - datetime.fromisoformat(r.provenance.started)).total_seconds()
                      for r in rows if r.provenance]
        measured = [r.metrics.duration for r in rows if r.metrics]
        t1 = time.monotonic()
        again = run(prep, Options(out=out, state_dir=state))
        resume = time.monotonic() - t1
        leftover = [r.name for r in api.deployments(state)]
    env = prep.campaign.engine_env
    print(f"campaign {prep.campaign.name}: {len(prep.cells)} cells, {len(prep.groups)} deployments, "
          f"sim load {env.get('K3LAUNCH_SIM_LOAD_S', '2 (default)')} s per engine start")
    print(f"  wall                 {wall:7.2f} s  ({s.valid} valid, {s.invalid} invalid; engine starts {s.engine_starts})")
    print(f"  engine starts (up)   {sum(ups):7.2f} s  ({len(ups)} x {statistics.mean(ups) if ups else 0:.2f} s)")
    print(f"  load points          {sum(bench_wall):7.2f} s  (bench wall; client-measured {sum(measured):.2f} s)")
    print(f"  teardowns (down)     {sum(downs):7.2f} s  ({len(downs)} x {statistics.mean(downs) if downs else 0:.2f} s)")
    print(f"  everything else      {wall - sum(ups) - sum(measured) - sum(downs):7.2f} s  (planning, client start-up, appends, probes)")
    print(f"  resume when complete {resume:7.2f} s  (engine starts {again.engine_starts}, skipped {again.skipped})")
    per_cell = len(prep.cells) * ((statistics.mean(ups) if ups else 0) + (statistics.mean(downs) if downs else 0))
    print(f"  one start per cell would add {per_cell - sum(ups) - sum(downs):.2f} s of starts/teardowns here "
          f"({len(prep.cells)} instead of {len(ups)} engine starts)")
    if leftover:
        print(f"  LEFTOVER deployments: {leftover}")


if __name__ == "__main__":
    main()
