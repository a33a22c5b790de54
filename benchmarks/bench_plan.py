"""Benchmark: `k3launch plan --json` wall time next to the bare import time of its dependencies.

Prints figures; asserts nothing. Run: python benchmarks/bench_plan.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _wall(cmd: list[str], runs: int) -> tuple[float, float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    runs = ap.parse_args().runs
    py = sys.executable
    rows = [
        ("python -c pass (interpreter floor)", [py, "-c", "pass"]),
        ("import typer, rich", [py, "-c", "import typer, rich.console"]),
        ("import pydantic, yaml", [py, "-c", "import pydantic, yaml"]),
        ("import typer, rich, pydantic, yaml (all deps)", [py, "-c", "import typer, rich.console, pydantic, yaml"]),
        ("k3launch --help", [py, "-m", "k3launch", "--help"]),
        ("k3launch plan --json (b300 single node)", [py, "-m", "k3launch", "plan", "--json"]),
        ("k3launch plan --json (P/D, 3 nodes + router)", [py, "-m", "k3launch", "plan", "--json", "--strategy", "pd_cluster"]),
        ("k3launch plan (rich table)", [py, "-m", "k3launch", "plan"]),
    ]
    print(f"{'what':50} {'median':>8} {'best':>8}  ({runs} runs)")
    for label, cmd in rows:
        med, best = _wall(cmd, runs)
        print(f"{label:50} {med * 1000:7.0f}ms {best * 1000:7.0f}ms")
    t0 = time.perf_counter()
    from k3launch.models.selection import Selection
    from k3launch.planning.build import build_plan
    from k3launch.planning.recipes import RecipeTree

    tree = RecipeTree()
    build_plan(tree, Selection())
    first = time.perf_counter() - t0
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        build_plan(tree, Selection(strategy="pd_cluster"))
    per = (time.perf_counter() - t0) / n
    print(f"{'in-process: import + first plan':50} {first * 1000:7.0f}ms")
    print(f"{'in-process: one P/D plan, warm':50} {per * 1000:7.2f}ms")


if __name__ == "__main__":
    main()
