"""Benchmark: start-up of `k3launch plan --json` against the bare import of its dependencies.

One run alternates the commands below N times (interleaved, so machine noise hits every row
alike) and prints min and median wall times, then the ratio of medians
``plan --json / import typer, rich, pydantic, yaml`` against the 1.5x budget. Prints figures;
asserts nothing (speed targets are benchmarks, never test assertions).

    python benchmarks/bench_startup.py [--runs 15] [--importtime] [--top 10]

``--importtime`` adds a ``python -X importtime`` summary of ``plan --json``: the slowest
top-level imports (cumulative) and the slowest single modules (self time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BUDGET = 1.5
ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

BASELINE = ("import typer, rich, pydantic, yaml", [PY, "-c", "import typer, rich, pydantic, yaml"])
TARGET = ("k3launch plan --json", [PY, "-m", "k3launch", "plan", "--json"])
# The same shape as `plan` (a group whose callback has 2 options, a command with the 21 of `plan`, same types), no
# k3launch code: what Typer alone costs. Typer coerces options through pydantic TypeAdapters, so
# running any command imports pydantic's machinery and builds one adapter per option.
TYPER_FLOOR = """
import inspect
from pathlib import Path
from typing import Annotated
import typer
app = typer.Typer(add_completion=False, no_args_is_help=True)
@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug")] = False, version: Annotated[bool, typer.Option("--version", is_eager=True)] = False) -> None:
    pass
kinds = [str | None] * 7 + [str] * 2 + [int | None] * 4 + [list[str] | None] * 5 + [Path | None] * 2 + [bool]
params = [inspect.Parameter(f"o{i}", inspect.Parameter.KEYWORD_ONLY, default={bool: False, str: "x"}.get(k),
                            annotation=Annotated[k, typer.Option(f"--o{i}", help="an option")]) for i, k in enumerate(kinds)]
def plan(**kw: object) -> None:
    print("{}")
plan.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
app.command("plan")(plan)
app.command("other")(lambda: None)
app(["plan"])
"""

# The baseline imports pydantic lazily (its __init__ defers BaseModel and the schema machinery):
# the first model class k3launch, or Typer's option coercion, defines pays for that.
PYDANTIC_FLOOR = """
import typer, rich, pydantic, yaml
from pydantic import BaseModel
class M(BaseModel):
    x: int
M(x=1)
"""

INFO = [
    ("python -c pass (interpreter floor)", [PY, "-c", "pass"]),
    ("deps + one pydantic model used", [PY, "-c", PYDANTIC_FLOOR]),
    ("typer floor (plan's 23 options, no k3launch)", [PY, "-c", TYPER_FLOOR]),
    ("k3launch --help", [PY, "-m", "k3launch", "--help"]),
    ("import k3launch.api", [PY, "-c", "import k3launch.api"]),
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package has its bytecode cached; measure that, not compiling
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # this checkout, not another install
    return env


def _once(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env, cwd=ROOT)
    return time.perf_counter() - t0


def walls(rows: list[tuple[str, list[str]]], runs: int) -> dict[str, list[float]]:
    env = _env()
    for _, cmd in rows:  # warm the page cache and the bytecode caches; not counted
        _once(cmd, env)
    times: dict[str, list[float]] = {label: [] for label, _ in rows}
    for _ in range(runs):
        for label, cmd in rows:
            times[label].append(_once(cmd, env))
    return times


def _importtime(cmd: list[str]) -> list[tuple[int, int, str]]:
    """(self us, cumulative us, module) of each import CMD makes, in import order."""
    proc = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], check=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    rows = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "self [us]" not in line:
            self_us, cum_us, name = line.removeprefix("import time:").split("|")
            rows.append((int(self_us), int(cum_us), name.strip()))
    return rows


def importtime(cmd: list[str], top: int) -> None:
    """Print what CMD imports beyond the baseline: by package, the slowest modules, k3launch's own."""
    base = {r[2] for r in _importtime(BASELINE[1])}
    rows = _importtime(cmd)
    extra = [r for r in rows if r[2] not in base]
    print(f"\n-X importtime of `{' '.join(cmd[2:])}`: {len(rows)} modules, {len(extra)} beyond the baseline's {len(base)}, "
          f"{sum(r[0] for r in extra) / 1000:.1f} ms self time in those (importtime's own overhead included)")
    by_pkg: dict[str, int] = {}
    for self_us, _, name in extra:
        parts = name.split(".")
        pkg = ".".join(parts[:2]) if parts[0] in ("k3launch", "pydantic", "typer") else parts[0]
        by_pkg[pkg] = by_pkg.get(pkg, 0) + self_us
    print("  beyond the baseline, by package (self, ms):")
    for pkg, us in sorted(by_pkg.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {us / 1000:7.1f}  {pkg}")
    print("  slowest modules (self, ms; a module's self time includes work done at its import, e.g. pydantic model builds):")
    for self_us, _, name in sorted(rows, key=lambda r: -r[0])[:top]:
        print(f"    {self_us / 1000:7.1f}  {name}")
    mine = [r for r in rows if r[2] == "k3launch" or r[2].startswith("k3launch.")]
    print(f"  k3launch modules imported: {len(mine)} ({sum(r[0] for r in mine) / 1000:.1f} ms self): "
          + ", ".join(sorted(r[2] for r in mine)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--importtime", action="store_true", help="also print a -X importtime summary of plan --json")
    ap.add_argument("--top", type=int, default=10, help="rows of the importtime summary")
    a = ap.parse_args()
    rows = [BASELINE, TARGET, *INFO]
    times = walls(rows, a.runs)
    print(f"{'command':46} {'min':>8} {'median':>8}   ({a.runs} interleaved rounds, {PY})")
    for label, _ in rows:
        ts = times[label]
        print(f"{label:46} {min(ts) * 1000:6.0f}ms {statistics.median(ts) * 1000:6.0f}ms")
    base, plan = statistics.median(times[BASELINE[0]]), statistics.median(times[TARGET[0]])
    ratio = plan / base
    best = min(times[TARGET[0]]) / min(times[BASELINE[0]])
    verdict = "PASS" if ratio <= BUDGET else "OVER BUDGET"
    print(f"\nplan --json / deps import: {ratio:.2f}x of medians ({best:.2f}x of minimums); "
          f"budget {BUDGET}x = {base * BUDGET * 1000:.0f}ms: {verdict}")
    floor = statistics.median(times[INFO[2][0]])
    model = statistics.median(times[INFO[1][0]])
    print(f"one pydantic model / deps import: {model / base:.2f}x (the pydantic machinery the baseline does not load)")
    print(f"typer floor / deps import: {floor / base:.2f}x; plan --json spends {(plan - floor) * 1000:.0f}ms beyond the floor")
    if a.importtime:
        importtime(TARGET[1], a.top)


if __name__ == "__main__":
    main()
