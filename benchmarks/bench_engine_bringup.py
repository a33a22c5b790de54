"""Benchmark: where a REAL vLLM's bring-up time goes, and what k3launch adds on top.

Brings the tiny model up on ``inventories/local-cpu.yaml`` (vLLM's CPU build; build it first with
``bash tests/infra/vllm-cpu-up.sh``) through ``k3launch.api.up``, ``--runs`` times, and prints per
stage the time since ``up`` began: k3launch's own stages (doctor, start, health noticed, first
completion, ready) and the engine's phases as vLLM logs them (process start, weights loaded,
engine initialised, API server up), each seen in the engine's log as it is written (the log is
polled every 50 ms). k3launch's overhead is everything that is not the engine's own start: the
doctor before it, the gap between vLLM's "Application startup complete" and k3launch noticing
/health, and the probe completion after.

    python benchmarks/bench_engine_bringup.py [--runs 2] [--inventory inventories/local-cpu.yaml]

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from k3launch import api

ROOT = Path(__file__).resolve().parents[1]
PHASES = [  # vLLM 0.32's own lines (the same patterns as tests/engine/test_engine_drift.py)
    ("engine: process start (banner)", re.compile(r"\bversion \d+\.\d+\.\d+")),
    ("engine: weights loaded", re.compile(r"\] Loading weights took [\d.]+ seconds")),
    ("engine: initialised (KV cache, warm-up)", re.compile(r"\] init engine \(profile, create kv cache, warmup model\) took")),
    ("engine: API server starting", re.compile(r"\] Starting vLLM server on http://")),
    ("engine: API server up", re.compile(r"^INFO:\s+Application startup complete\.", re.M)),
]


def one(inventory: Path, state: Path) -> dict[str, float]:
    name = f"bringup-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    seen: dict[str, float] = {}
    log_path: list[Path] = []
    stop = threading.Event()

    def stage(s: object, msg: str) -> None:
        key = f"k3launch: {s}"
        seen.setdefault(key, time.monotonic() - t0)
        if str(s) == "start":
            rec = api.record(name, state)
            if rec is not None and "serve-0" in rec.processes:
                log_path.append(Path(rec.processes["serve-0"].log))

    def watch() -> None:
        while not stop.wait(0.05):
            if not log_path:
                continue
            try:
                text = log_path[0].read_text(errors="replace")
            except OSError:
                continue
            for label, rx in PHASES:
                if label not in seen and rx.search(text):
                    seen[label] = time.monotonic() - t0

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    plan = api.plan(inventory, name=name)
    try:
        api.up(plan, inventory, state_dir=state, ready_timeout=900, on_stage=stage)
    finally:
        stop.set()
        th.join()
        api.down(name, state_dir=state, grace=10)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--inventory", type=Path, default=ROOT / "inventories" / "local-cpu.yaml")
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.runs):
            r = one(a.inventory, Path(d) / f"state-{i}")
            runs.append(r)
            print(f"run {i + 1}: ready in {r.get('k3launch: ready', float('nan')):.1f}s", flush=True)
    keys = sorted({k for r in runs for k in r}, key=lambda k: statistics.median(r[k] for r in runs if k in r))
    print(f"\n{'stage (seconds since up began)':<45}{'min':>8}{'median':>8}   ({a.runs} run(s), {a.inventory.name})")
    for k in keys:
        vals = [r[k] for r in runs if k in r]
        print(f"{k:<45}{min(vals):>8.1f}{statistics.median(vals):>8.1f}")
    print("\nwhere the time goes (medians):")
    med = {k: statistics.median(r[k] for r in runs if k in r) for k in keys}
    doctor = med.get("k3launch: doctor", 0.0)
    start = med.get("k3launch: start", doctor)
    up = med.get("engine: API server up", float("nan"))
    health = med.get("k3launch: health", float("nan"))
    ready = med.get("k3launch: ready", float("nan"))
    print(f"  doctor (incl. `vllm --version` per node)     {doctor:6.1f}s  k3launch")
    print(f"  start the process                            {start - doctor:6.1f}s  k3launch")
    print(f"  the engine's own start (to API server up)    {up - start:6.1f}s  vLLM")
    print(f"  /health noticed after the server was up      {health - up:6.1f}s  k3launch (poll 0.5 s)")
    print(f"  probe completion and ready                   {ready - health:6.1f}s  k3launch")
    print(f"  k3launch's overhead in all                   {ready - (up - start):6.1f}s of {ready:.1f}s")


if __name__ == "__main__":
    main()
