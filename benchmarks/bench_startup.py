"""Benchmark: start-up of `k3launch plan --json` and `k3launch --help` against the Typer floor.

The floor is a Typer app with the same options as `plan` and no k3launch code: what the
required libraries cost before k3launch does anything. The target is each k3launch command
within 1.25x of the floor running its `plan`, comparing medians of one run that alternates the
commands N times (interleaved, so machine noise hits every row alike). Prints min and median
wall times, the ratios and the machine's load; asserts nothing (speed targets are benchmarks,
never test assertions; what each command imports is asserted by tests/fast/test_startup.py).

    python benchmarks/bench_startup.py [--runs 21] [--importtime] [--top 10]

``--importtime`` adds a ``python -X importtime`` summary of each k3launch command: what it
imports beyond its floor row (by package, the slowest modules, k3launch's own modules).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 1.25
ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# The types of `plan`'s options (tests/fast/test_startup.py keeps them equal to the command's own).
PLAN_OPTION_KINDS = "[str | None] * 9 + [str] + [int | None] * 5 + [list[str] | None] * 6 + [Path | None] * 3 + [bool, bool | None]"

# The same shape as `plan` (a group whose callback has 2 options, a command with the 26 of `plan`,
# same types), no k3launch code: what Typer alone costs. Typer coerces options through pydantic
# TypeAdapters, so running any command imports pydantic's machinery and builds one adapter per
# option; its help is rendered with rich, as k3launch's is. The command line picks what it runs.
TYPER_FLOOR = """
import inspect
from pathlib import Path
from typing import Annotated
import typer
app = typer.Typer(add_completion=False, no_args_is_help=True)
@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug")] = False, version: Annotated[bool, typer.Option("--version", is_eager=True)] = False) -> None:
    pass
kinds = PLAN_OPTION_KINDS
params = [inspect.Parameter(f"o{i}", inspect.Parameter.KEYWORD_ONLY, default={bool: False, str: "x"}.get(k),
                            annotation=Annotated[k, typer.Option(f"--o{i}", help="an option")]) for i, k in enumerate(kinds)]
def plan(**kw: object) -> None:
    print("{}")
plan.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
app.command("plan")(plan)
app.command("other")(lambda: None)
app(prog_name="floor")
""".replace("PLAN_OPTION_KINDS", PLAN_OPTION_KINDS)

# The bare libraries import pydantic lazily (its __init__ defers BaseModel and the schema
# machinery): the first model class, or Typer's option coercion, pays for that.
PYDANTIC_FLOOR = """
import typer, rich, pydantic, yaml
from pydantic import BaseModel
class M(BaseModel):
    x: int
M(x=1)
"""

FLOOR = ("typer floor: plan (its 28 options)", [PY, "-c", TYPER_FLOOR, "plan"])
FLOOR_HELP = ("typer floor: --help", [PY, "-c", TYPER_FLOOR, "--help"])
PLAN = ("k3launch plan --json", [PY, "-m", "k3launch", "plan", "--json"])
PLAN_COLD = ("k3launch plan --json, no YAML cache", [PY, "-m", "k3launch", "plan", "--json"])
HELP = ("k3launch --help", [PY, "-m", "k3launch", "--help"])
# The YAML parse cache (k3launch.util.yamlio) is the benchmark's own, warmed by the first, uncounted
# round; the cold row shows a first run (a new install, an edited recipe) with the cache off.
CACHE_DIR = tempfile.mkdtemp(prefix="k3launch-bench-cache-")
atexit.register(shutil.rmtree, CACHE_DIR, True)
ROW_ENV = {PLAN_COLD[0]: {"K3LAUNCH_CACHE_DIR": "off"}}
INFO = [
    ("python -c pass (interpreter floor)", [PY, "-c", "pass"]),
    ("import typer, rich, pydantic, yaml", [PY, "-c", "import typer, rich, pydantic, yaml"]),
    ("the same + one pydantic model used", [PY, "-c", PYDANTIC_FLOOR]),
    ("import k3launch.api", [PY, "-c", "import k3launch.api"]),
]
ROWS = [FLOOR, PLAN, PLAN_COLD, HELP, FLOOR_HELP, *INFO]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package has its bytecode cached; measure that, not compiling
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # this checkout, not another install
    env["K3LAUNCH_CACHE_DIR"] = CACHE_DIR
    return env


def _once(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall time, and the CPU time (user + system) the command used: on a loaded machine the wall
    time includes waiting for a CPU, which the CPU time does not."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return wall, usage.ru_utime + usage.ru_stime


def measure(rows: list[tuple[str, list[str]]], runs: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU times of each row, RUNS interleaved rounds."""
    env = _env()
    for label, cmd in rows:  # warm the page cache, the bytecode caches and the YAML cache; not counted
        _once(cmd, {**env, **ROW_ENV.get(label, {})})
    walls: dict[str, list[float]] = {label: [] for label, _ in rows}
    cpus: dict[str, list[float]] = {label: [] for label, _ in rows}
    for _ in range(runs):
        for label, cmd in rows:
            wall, cpu = _once(cmd, {**env, **ROW_ENV.get(label, {})})
            walls[label].append(wall)
            cpus[label].append(cpu)
    return walls, cpus


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


def importtime(label: str, cmd: list[str], floor: list[str], top: int) -> None:
    """Print what CMD imports beyond FLOOR: by package, the slowest modules, k3launch's own."""
    base = {r[2] for r in _importtime(floor)}
    rows = _importtime(cmd)
    extra = [r for r in rows if r[2] not in base]
    print(f"\n-X importtime of `{label}`: {len(rows)} modules, {len(extra)} beyond its floor's {len(base)}, "
          f"{sum(r[0] for r in extra) / 1000:.1f} ms self time in those (importtime's own overhead included)")
    by_pkg: dict[str, int] = {}
    for self_us, _, name in extra:
        parts = name.split(".")
        pkg = ".".join(parts[:2]) if parts[0] in ("k3launch", "pydantic", "typer") else parts[0]
        by_pkg[pkg] = by_pkg.get(pkg, 0) + self_us
    print("  beyond the floor, by package (self, ms):")
    for pkg, us in sorted(by_pkg.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {us / 1000:7.1f}  {pkg}")
    print("  slowest modules (self, ms; a module's self time includes work done at its import, e.g. pydantic model builds):")
    for self_us, _, name in sorted(rows, key=lambda r: -r[0])[:top]:
        print(f"    {self_us / 1000:7.1f}  {name}")
    mine = [r for r in rows if r[2] == "k3launch" or r[2].startswith("k3launch.")]
    print(f"  k3launch modules imported: {len(mine)} ({sum(r[0] for r in mine) / 1000:.1f} ms self): "
          + ", ".join(sorted(r[2] for r in mine)))


def _which_k3launch() -> str:
    """The k3launch the subprocesses import: this checkout's, not another install's."""
    cmd = [PY, "-c", "import k3launch; print(k3launch.__file__)"]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env(), cwd=ROOT).stdout.strip()


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=21, help="interleaved rounds (default 21)")
    ap.add_argument("--importtime", action="store_true", help="also print a -X importtime summary of each k3launch command")
    ap.add_argument("--top", type=int, default=10, help="rows of the importtime summary")
    a = ap.parse_args()
    print(f"k3launch imported from {_which_k3launch()}")
    print(f"before: {_load()}")
    times, cpus = measure(ROWS, a.runs)
    print(f"after:  {_load()}\n")
    print(f"{'command':40} {'min':>7} {'median':>7} {'CPU':>7}   ({a.runs} interleaved rounds; CPU: median user+system)")
    for label, _ in ROWS:
        ts = times[label]
        print(f"{label:40} {min(ts) * 1000:5.0f}ms {statistics.median(ts) * 1000:5.0f}ms {statistics.median(cpus[label]) * 1000:5.0f}ms")
    med = {label: statistics.median(ts) for label, ts in times.items()}
    cpu = {label: statistics.median(ts) for label, ts in cpus.items()}
    floor = med[FLOOR[0]]
    print(f"\ntarget: each k3launch command within {TARGET}x of the Typer floor's median ({floor * 1000:.0f}ms): "
          f"{floor * TARGET * 1000:.0f}ms")
    for label, _ in (PLAN, PLAN_COLD, HELP):
        ratio = med[label] / floor
        best = min(times[label]) / min(times[FLOOR[0]])
        verdict = "PASS" if ratio <= TARGET else "OVER TARGET"
        print(f"  {label:36} {ratio:.2f}x of medians ({best:.2f}x of minimums, {cpu[label] / cpu[FLOOR[0]]:.2f}x of CPU), "
              f"{(med[label] - floor) * 1000:+.0f}ms: {verdict}")
    print(f"  {'k3launch --help':22} {med[HELP[0]] / med[FLOOR_HELP[0]]:.2f}x of the floor's own --help "
          f"(which is {med[FLOOR_HELP[0]] / floor:.2f}x the floor's plan)")
    libs, model = med[INFO[1][0]], med[INFO[2][0]]
    print(f"the floor is {floor / libs:.2f}x the bare import of typer, rich, pydantic, yaml; one pydantic model used is {model / libs:.2f}x")
    if a.importtime:
        importtime(PLAN[0], PLAN[1], FLOOR[1], a.top)
        importtime(HELP[0], HELP[1], FLOOR_HELP[1], a.top)


if __name__ == "__main__":
    main()
