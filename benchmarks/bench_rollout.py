"""Benchmark: how long `k3launch rollout` takes on the simulated engine, and what a client sees meanwhile.

Each scenario is one deployment per run (``local`` backend, ``inventories/local.yaml`` moved to
loopback addresses of this benchmark's own, 127.0.78.x, engine load time ``K3LAUNCH_SIM_LOAD_S``),
rolled once under a steady, bounded client load (tests/support/e2e_helpers.Load: 2 clients sending small
completions one after another through the deployment's endpoint, every failure counted), with the
command lines of tests/e2e/local/test_rollout_sim.py. The load runs 1 s before the rollout and 1 s after it,
so a unit the router did not take back shows up as failed requests. The figures are the
``rolled`` entries of ``rollout --json`` (``seconds`` per unit from its leaving the router to its
coming back, ``drained_s`` of them waiting for in-flight requests, ``downtime_s`` when no router
was in front) and the wall clock of the ``rollout`` command itself (its start, planning, the record,
each unit).

* ``copies``: two copies of tiny-llama behind the real vllm-router (``--strategy single_node_tp
  --replicas 2``), ``rollout NAME --set max-num-seqs=8 --drain-timeout 10 --json`` (16 on odd
  runs: every rollout changes a flag).
* ``copies-batch``: three copies (``--replicas 3``), ``--max-unavailable 2``: two units roll as one
  batch, then the third.
* ``surge``: K3 DEP over 2 of the 4 local nodes (the default recipe, ``--strategy multi_node_dep
  --nodes 2``), ``rollout NAME --surge --set max-num-seqs=8 --drain-timeout 10 --json``: the new
  set starts on the 2 spares, the router switches, the old set drains and stops.
* ``pd-in-place``: P/D (``--strategy pd_cluster --decode-strategy tp --decode-nodes 1``), ``rollout
  NAME --set max-num-seqs=8 --allow-downtime --drain-timeout 5 --json``. Each instance restarts
  in place (the P/D router cannot take one back once out of its lists), and with one instance
  per role each restart is an outage of the whole P/D path: failed requests are expected here,
  and printed; ``downtime_s`` is the figure (the router refuses at once, so a client's count of
  failures is its own pace times the outage).
* ``canary-caught``: two copies, ``rollout NAME --env K3LAUNCH_SIM_FAIL=other-weights
  --drain-timeout 10 --json`` (another model under the same name: health and a completion pass,
  the correctness canary does not) → exit 1, the first unit rolled back; the seconds until the
  command stopped, then ``rollout NAME --rollback --json``.

Prints one table (scenario, figure, best, median, runs) and the failed / total client requests
per scenario with the first reasons; asserts nothing (a rollout that exits otherwise than
expected is a run that did not complete: its output and the deployment's last log lines are
printed). Whatever a run started is taken down (``k3launch down``, then SIGKILL) even on Ctrl-C;
a k3launch command still running then is interrupted first (SIGINT, then SIGKILL).

Run: python benchmarks/bench_rollout.py [--runs 3] [--scenarios copies,copies-batch,surge,pd-in-place,canary-caught]
                                        [--load 1] [-v]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from e2e_helpers import Cli, Load, cleanup

ROOT = Path(__file__).resolve().parents[1]

RECIPE = "k3launch/tiny-llama"
# inventories/local.yaml puts its nodes on 127.0.0.x, where a user's deployment may run, and the
# test suite moves them to 127.0.77.x: this benchmark's own range keeps it off both, so it can run
# beside either without sharing an address or a port.
NET = "127.0.78."
# + 10 per run. 200 apart: P/D's NIXL side channels sit up to 144 above its port base.
PORTS = {"copies": 24000, "copies-batch": 24200, "surge": 24400, "canary-caught": 24600, "pd-in-place": 24800}
ROLL_TIMEOUT_S = 180  # a rollout of the sim takes seconds; this only bounds a hung one
LOAD_LIMIT = 3000  # requests per run at most (Load is bounded so that a stuck run cannot spin forever)
MARGIN_S = 1.0  # load before and after the rollout: requests that fail once it returned count too

# The k3launch commands running now, so that a Ctrl-C (or an error) can stop them before the
# cleanup: each runs in a session of its own (Cli.start) and would not see the terminal's Ctrl-C,
# and a rollout still running holds the deployment's lock, so `down` would be refused.
_RUNNING: list[subprocess.Popen[str]] = []


@dataclass
class Run:
    """One run of a scenario: figure -> seconds, and what the client saw."""

    figures: dict[str, float] = field(default_factory=dict)
    note: str = ""  # what else the run said (canary-caught: the unit rolled back, and why)
    ok: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)  # "+seconds from the rollout's start: reason"
    exhausted: bool = False  # the load sent its last request before the run ended
    outputs: list[str] = field(default_factory=list)  # each rollout's --json line (printed with -v)

    def count(self, load: Load, t0: float) -> None:
        self.ok, self.failed = load.ok, load.failed
        self.exhausted = load.ok + load.failed >= load.limit
        self.failures = [f"{t - t0:+.2f}s: {why[:120]}" for t, why in load.failures]


class Incomplete(Exception):
    """A run that did not complete (a rollout exited otherwise than expected, or timed out), with
    what the client saw until then: those failed requests are the cost of the failure."""

    def __init__(self, why: str, run: Run) -> None:
        super().__init__(why)
        self.run = run


@dataclass
class Ctx:
    tmp: Path
    load_s: float


def _run(cli: Cli, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``cli.run``, with the command kept in :data:`_RUNNING` until it returned. Not removed on
    an exception (Ctrl-C lands here while it waits): the cleanup must still find it to stop it."""
    p = cli.start(*args)
    _RUNNING.append(p)
    r = cli.wait(p, timeout, args)
    _RUNNING.remove(p)
    return r


def _stop_running() -> None:
    """Interrupt what is still running as Ctrl-C would (a rollout then records where it stopped
    and lets go of the lock), and kill what does not stop within 10 s."""
    for p in list(_RUNNING):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGINT)
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            except ProcessLookupError:
                pass
        _RUNNING.remove(p)


def _inventory(ctx: Ctx) -> Path:
    path = ctx.tmp / "inv-local.yaml"
    if path.exists():
        return path
    inv = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    for node in inv["nodes"]:
        node["address"] = NET + node["address"].removeprefix("127.0.0.")
    inv["router"]["address"] = NET + inv["router"]["address"].removeprefix("127.0.0.")
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": f"{ctx.load_s:g}"}
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def _up(ctx: Ctx, cli: Cli, name: str, port_base: int, *args: str) -> tuple[str, str]:
    """Bring the deployment up; its (endpoint, served model)."""
    r = _run(cli, "up", "-i", str(_inventory(ctx)), "--name", name, "--port-base", str(port_base), *args, "--json", timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"up {name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)["endpoint"], cli.record(name)["plan"]["model"]


def _rollout(cli: Cli, name: str, *args: str, expect: int = 0) -> tuple[float, dict[str, Any]]:
    """``rollout NAME ARGS --json``: (its wall clock seconds, its JSON). Another exit code than
    ``expect`` (SystemExit) or a timeout (AssertionError) ends the run: its figures would not be
    the rollout's."""
    t = time.monotonic()
    r = _run(cli, "rollout", name, *args, "--json", timeout=ROLL_TIMEOUT_S)
    wall = time.monotonic() - t
    try:
        out: dict[str, Any] = json.loads(r.stdout)
    except json.JSONDecodeError:
        out = {}
    if r.returncode != expect or not out:
        raise SystemExit(f"rollout {' '.join(args)}: exit {r.returncode} (expected {expect}) after {wall:.1f}s:\n"
                         f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return wall, out


def _rolled(out: dict[str, Any]) -> dict[str, float]:
    figs: dict[str, float] = {}
    for u in out["rolled"]:
        figs[f"{u['unit']} rolled"] = u["seconds"]
        figs[f"{u['unit']} drained"] = u["drained_s"]
        if u["downtime_s"]:
            figs[f"{u['unit']} not serving"] = u["downtime_s"]
    return figs


# ------------------------------------------------------------------ the scenarios
def _roll_under_load(ctx: Ctx, cli: Cli, name: str, port_base: int, up_args: list[str], roll_args: list[str]) -> Run:
    endpoint, model = _up(ctx, cli, name, port_base, *up_args)
    run, why = Run(), ""
    with Load(endpoint, model, workers=2, limit=LOAD_LIMIT, pause=0.02) as load:
        time.sleep(MARGIN_S)
        t0 = time.time()
        try:
            wall, out = _rollout(cli, name, *roll_args)
        except (SystemExit, AssertionError) as exc:
            why = str(exc)
        time.sleep(MARGIN_S)  # after a rollout that stopped too: what it left behind is what clients get
    run.count(load, t0)
    if why:
        raise Incomplete(why, run)
    run.figures = {**_rolled(out), "rollout command (wall)": wall}
    run.outputs = [json.dumps(out)]
    return run


def copies(ctx: Ctx, cli: Cli, name: str, port_base: int, i: int, replicas: int = 2, batch: int = 1) -> Run:
    return _roll_under_load(ctx, cli, name, port_base,
                            ["--recipe", RECIPE, "--strategy", "single_node_tp", "--replicas", str(replicas)],
                            ["--set", f"max-num-seqs={8 if i % 2 == 0 else 16}", "--drain-timeout", "10",
                             *(["--max-unavailable", str(batch)] if batch > 1 else [])])


def surge(ctx: Ctx, cli: Cli, name: str, port_base: int, i: int) -> Run:
    return _roll_under_load(ctx, cli, name, port_base, ["--strategy", "multi_node_dep", "--nodes", "2"],
                            ["--surge", "--set", f"max-num-seqs={8 if i % 2 == 0 else 16}", "--drain-timeout", "10"])


def pd_in_place(ctx: Ctx, cli: Cli, name: str, port_base: int, i: int) -> Run:
    return _roll_under_load(ctx, cli, name, port_base, ["--strategy", "pd_cluster", "--decode-strategy", "tp", "--decode-nodes", "1"],
                            ["--set", f"max-num-seqs={8 if i % 2 == 0 else 16}", "--allow-downtime", "--drain-timeout", "5"])


def canary_caught(ctx: Ctx, cli: Cli, name: str, port_base: int, i: int) -> Run:
    endpoint, model = _up(ctx, cli, name, port_base, "--recipe", RECIPE, "--strategy", "single_node_tp", "--replicas", "2")
    run, why = Run(), ""
    with Load(endpoint, model, workers=2, limit=LOAD_LIMIT, pause=0.02) as load:
        time.sleep(MARGIN_S)
        t0 = time.time()
        try:
            stopped, caught = _rollout(cli, name, "--env", "K3LAUNCH_SIM_FAIL=other-weights", "--drain-timeout", "10", expect=1)
            undone, back = _rollout(cli, name, "--rollback")
        except (SystemExit, AssertionError) as exc:
            why = str(exc)
        time.sleep(MARGIN_S)
    run.count(load, t0)
    if why:
        raise Incomplete(why, run)
    # the reason's first clause: which check of the canary differed (the rest is prompts and tokens)
    first = caught["reason"].split(";")[0].removeprefix(f"{caught['failed']}: ")
    run.figures = {"→ stopped, exit 1 (wall)": stopped, "then --rollback (wall)": undone}
    run.note = f"{caught['failed'] or 'no unit'} rolled back ({first}); --rollback rolled {[u['unit'] for u in back['rolled']] or 'nothing'}"
    run.outputs = [json.dumps(caught), json.dumps(back)]
    return run


SCENARIOS: dict[str, tuple[str, Callable[[Ctx, Cli, str, int, int], Run]]] = {
    "copies": ("2 sim copies behind the router, --set", copies),
    "copies-batch": ("3 sim copies, --max-unavailable 2", lambda c, cli, n, p, i: copies(c, cli, n, p, i, replicas=3, batch=2)),
    "surge": ("sim DEP over 2 nodes, --surge onto the 2 spares", surge),
    "pd-in-place": ("sim P/D (1 prefill, 1 decode), --allow-downtime", pd_in_place),
    "canary-caught": ("2 sim copies, other weights caught by the canary", canary_caught),
}


# ------------------------------------------------------------------ reporting
def _why(cli: Cli, name: str, exc: BaseException) -> None:
    """A run that did not complete: the error, and the processes' last lines."""
    print(f"  {name}: run did not complete: {str(exc)[:2500] if str(exc) else type(exc).__name__}", flush=True)
    if (cli.state_dir / "deployments" / f"{name}.json").exists():
        try:
            logs = cli.run("logs", name, "-n", "10", timeout=60).stdout
        except AssertionError as err:
            logs = str(err)
        print("\n".join(f"      | {ln[:200]}" for ln in logs.splitlines()))


def _fmt(xs: list[float]) -> str:
    return f"{min(xs):8.2f}s {statistics.median(xs):8.2f}s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario (default 3)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all)")
    ap.add_argument("--load", type=float, default=1.0, help="simulated engine load time, K3LAUNCH_SIM_LOAD_S (default 1, as the tests)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each rollout's --json output and every failed request")
    a = ap.parse_args()
    chosen = a.scenarios.split(",")
    if unknown := [s for s in chosen if s not in SCENARIOS]:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")

    load_avg = os.getloadavg()
    print(f"load average at start: {load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f} on {os.cpu_count()} CPUs; "
          f"{a.runs} run(s) per scenario; sim load {a.load:g}s", flush=True)
    results: dict[str, list[Run]] = {s: [] for s in chosen}
    incomplete: dict[str, list[Run]] = {s: [] for s in chosen}  # what the client saw in runs that did not complete
    failed_runs = dict.fromkeys(chosen, 0)
    with tempfile.TemporaryDirectory(prefix="k3launch-bench-ro-") as tmp_s:
        ctx = Ctx(Path(tmp_s), a.load)
        for scen in chosen:
            for i in range(a.runs):
                cli = Cli(ctx.tmp / f"state-{scen}-{i}")
                name = f"bro-{scen}-{i}-{os.getpid() % 10000}"
                try:
                    r = SCENARIOS[scen][1](ctx, cli, name, PORTS[scen] + 10 * (i % 10), i)
                except (AssertionError, SystemExit, Incomplete) as exc:  # a command that timed out or exited otherwise: say why, go on
                    failed_runs[scen] += 1
                    _why(cli, name, exc)
                    if isinstance(exc, Incomplete):
                        incomplete[scen].append(exc.run)
                        print(f"  {scen} run {i + 1} (did not complete): client {exc.run.failed} failed / {exc.run.ok + exc.run.failed}",
                              flush=True)
                        for line in exc.run.failures if a.verbose else []:
                            print(f"      {line}")
                    continue
                finally:
                    _stop_running()
                    cleanup(cli, [name])
                results[scen].append(r)
                figs = ", ".join(f"{k} {v:.2f}s" for k, v in r.figures.items())
                print(f"  {scen} run {i + 1}: {figs}{'; ' + r.note if r.note else ''}; client {r.failed} failed / {r.ok + r.failed}"
                      f"{'; the load ran out of requests before the end' if r.exhausted else ''}", flush=True)
                for line in [*r.outputs, *r.failures] if a.verbose else []:
                    print(f"      {line}")

    print(f"\n{'scenario':<14} {'figure (s)':<30} {'best':>9} {'median':>9} {'runs':>5}")
    for scen in chosen:
        done = results[scen]
        if failed_runs[scen]:
            print(f"{scen:<14} ({failed_runs[scen]} of {a.runs} run(s) did not complete: see above)")
        # every figure of every run, in the order first seen: not every run need roll the same units
        for fig in dict.fromkeys(f for r in done for f in r.figures):
            xs = [r.figures[fig] for r in done if fig in r.figures]
            print(f"{scen:<14} {fig:<30} {_fmt(xs)} {len(xs):>5}")
    print("\nclient requests through the endpoint during each run (failed / total; from 1 s before the rollout to 1 s after it):")
    for scen in chosen:
        seen: list[tuple[Run, list[str]]] = [(r, []) for r in results[scen]] + [(r, ["did not complete"]) for r in incomplete[scen]]
        print(f"  {scen:<14} {SCENARIOS[scen][0]}: " + ", ".join(
            f"{r.failed} / {r.ok + r.failed}" + (f" ({', '.join(tags + ['load ran out'] * r.exhausted)})" if tags or r.exhausted else "")
            for r, tags in seen))
        reasons = [f for r, _ in seen for f in r.failures]
        for f in reasons[:2] + (reasons[-1:] if len(reasons) > 2 else []):
            print(f"      failed {f} (from the rollout's start)")


if __name__ == "__main__":
    main()
