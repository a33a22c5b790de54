"""Benchmark: plan time for inventories of 16, 256 and 4096 nodes (must grow no worse than linearly).

Two figures per size: loading + validating the inventory file, and building a plan that uses
*every* node (multi-node DEP on all of them: one composed process per node, port table, router).
Prints figures; asserts nothing. Run: python benchmarks/bench_inventory_scale.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import load_inventory
from k3launch.planning.recipes import RecipeTree


def write_inventory(path: Path, n: int) -> None:
    lines = ["name: bench", "backend: ssh", "hardware: b300", "defaults: {iface: ib0, cpu_memory_gb: 4096}", "nodes:"]
    lines += [f"  - {{name: gpu-{i:05d}, address: 10.{i // 65536}.{(i // 256) % 256}.{i % 256}}}" for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def timed(fn, runs: int) -> float:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    tree = RecipeTree()
    build_plan(tree, Selection())  # warm caches (schema, recipes)
    print(f"{'nodes':>6} {'load inventory':>15} {'plan (all nodes, DEP)':>22} {'per node':>10}")
    base = None
    with tempfile.TemporaryDirectory() as d:
        for n in (16, 256, 1024, 4096):
            p = Path(d) / f"inv{n}.yaml"
            write_inventory(p, n)
            runs = 5 if n < 4096 else 2
            t_load = timed(lambda p=p: load_inventory(p), runs)  # type: ignore[misc]
            inv = load_inventory(p)
            t_plan = timed(lambda inv=inv, n=n: build_plan(tree, Selection(strategy="multi_node_dep", nodes=n), inventory=inv), runs)  # type: ignore[misc]
            per = t_plan / n
            base = base or per
            print(f"{n:>6} {t_load * 1000:>13.1f}ms {t_plan * 1000:>20.1f}ms {per * 1e6:>8.0f}us  (x{per / base:.2f} per-node vs 16)")


if __name__ == "__main__":
    main()
