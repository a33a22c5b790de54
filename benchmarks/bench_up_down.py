"""Benchmark: `k3launch up` + `down` orchestration over 4, 16 and 32 real sshd hosts (DEP across N
nodes, the simulated engine, the real vllm-router on this login node), next to the floor of a
bare parallel `ssh HOST true` over the same hosts.

Figures per N (best and median of --runs):
* ``up`` and ``down``: wall time of the real CLI (a fresh process: imports, SSH connections),
  and ``up``'s own stage times (doctor → start → alive → health → completion → ready). The
  simulated load time (K3LAUNCH_SIM_LOAD_S) is inside ``up`` and printed separately; nothing is
  subtracted.
* ready → noticed: from an engine's API port starting to listen (the simulated engine binds it
  once ready; a watcher reads the hosts' socket tables every 5 ms) to ``up`` reporting it
  healthy (library API, in process): the cost of polling every 0.5 s.
* death → reported: one rank SIGKILLed during a 30 s load, to ``up`` reporting the failure
  (library API, the ``failed`` stage, before the teardown).
* ssh floor: N OpenSSH clients at once (``ssh HOST true``, full login each), as in
  benchmarks/bench_ssh_floor.py.

Hosts: those of K3LAUNCH_TEST_SSH_DIR when it holds enough, else max(--sizes) hosts started in a
free slot of tests/infra/sshd-up.sh and stopped at the end. Needs root. Prints; asserts nothing.

Run: python benchmarks/bench_up_down.py [--runs 3] [--sizes 4,16,32] [--load 0.5]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ssh_floor import _ssh_cli  # the floor, measured the same way as there
from sshhosts import ENV_DIR, Hosts, start_hosts_in_free_slot

CLI = [sys.executable, "-m", "k3launch"]
STAGE = re.compile(r"^\s*([\d.]+)s (\w+)\s")


def _inventory(hosts: Hosts, n: int, path: Path, env: dict[str, str]) -> Path:
    knobs = {"K3LAUNCH_SIM_TTFT_MS": "5", "K3LAUNCH_SIM_ITL_MS": "1", "K3LAUNCH_SIM_RENDEZVOUS_TIMEOUT_S": "60", **env}
    return hosts.write_inventory(path, names=hosts.names[:n], extra={"defaults": {"env": knobs}})


def _cli(state: Path, *args: str, timeout: float = 300) -> tuple[float, subprocess.CompletedProcess[str]]:
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(state), "COLUMNS": "200", "NO_COLOR": "1"}
    t0 = time.perf_counter()
    p = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    return time.perf_counter() - t0, p


def _stages(out: str) -> dict[str, float]:
    """When each stage was first printed by `up` (seconds since its connections began)."""
    got: dict[str, float] = {}
    for line in out.splitlines():
        m = STAGE.match(line)
        if m:
            got.setdefault(m.group(2), float(m.group(1)))
    return got


def up_down(hosts: Hosts, n: int, tmp: Path, load_s: float, port_base: int) -> tuple[float, float, dict[str, float]]:
    inv = _inventory(hosts, n, tmp / f"inv-{n}.yaml", {"K3LAUNCH_SIM_LOAD_S": str(load_s)})
    state = tmp / f"state-{n}"
    name = f"bench-{n}"
    t_up, p = _cli(state, "up", "-i", str(inv), "--strategy", "multi_node_dep", "--nodes", str(n), "--name", name,
                   "--port-base", str(port_base), "--ready-timeout", "120")
    if p.returncode != 0:
        _cli(state, "down", name, "--grace", "2")
        raise SystemExit(f"up failed for N={n}:\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}")
    t_down, d = _cli(state, "down", name)
    if d.returncode != 0:
        raise SystemExit(f"down failed for N={n}:\n{d.stdout}\n{d.stderr}")
    return t_up, t_down, _stages(p.stdout)


def _lib(hosts: Hosts, n: int, tmp: Path, env: dict[str, str], port_base: int, tag: str) -> Any:
    from k3launch.deploy.ssh.launch import Launch
    from k3launch.deploy.state import StateStore
    from k3launch.models.selection import Selection
    from k3launch.planning.build import build_plan
    from k3launch.planning.inventory import load_inventory
    from k3launch.planning.recipes import RecipeTree
    from k3launch.transport.fleet import Fleet
    from k3launch.transport.runners import LocalRunner, SshRunner

    inv_path = _inventory(hosts, n, tmp / f"inv-{tag}-{n}.yaml", env)
    inv = load_inventory(inv_path)
    plan = build_plan(RecipeTree(), Selection(strategy="multi_node_dep", nodes=n), inventory=inv, port_base=port_base, name=f"bench-{tag}-{n}")
    fleet = Fleet.for_plan(plan, SshRunner(known_hosts=inv.known_hosts), LocalRunner())
    return Launch(plan, fleet, StateStore(tmp / f"state-{tag}-{n}"), ssh_config=inv.ssh_config, known_hosts=inv.known_hosts)


def _listening(pid: str) -> set[tuple[str, int]]:
    """(address, port) of IPv4 LISTEN sockets in the network namespace of ``pid`` (a host's sshd)."""
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return set()
    out = set()
    for c in (ln.split() for ln in lines):
        if c[3] == "0A":
            addr, port = c[1].rsplit(":", 1)
            out.add((".".join(str(b) for b in bytes.fromhex(addr)[::-1]), int(port, 16)))
    return out


def ready_to_noticed(hosts: Hosts, n: int, tmp: Path, load_s: float, port_base: int) -> list[float]:
    """Per engine: seconds from its API port starting to listen (the simulated engine binds it only
    once ready) to `up` reporting the engine healthy. A watcher reads each host's socket table
    from /proc every 5 ms (no HTTP, so it is not slowed down by the engines it watches)."""
    launch = _lib(hosts, n, tmp, {"K3LAUNCH_SIM_LOAD_S": str(load_s)}, port_base, "ready")
    engines = {p.id: (p.node, (p.address, p.http_port)) for p in launch.plan.processes if p.http_port and p.role != "router"}
    sshd = {node: (hosts.dir / "run" / f"{node}.pid").read_text().split()[0] for node, _ in engines.values()}
    first_ok: dict[str, float] = {}
    noticed: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set() and len(first_ok) < len(engines):
            now = time.monotonic()
            for pid, (node, sock) in engines.items():
                if pid not in first_ok and sock in _listening(sshd[node]):
                    first_ok[pid] = now
            time.sleep(0.005)

    def on_stage(stage: str, msg: str) -> None:
        if stage == "health":
            noticed.setdefault(msg.split()[0], time.monotonic())

    launch.on_stage = on_stage
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        rec = launch.up(timeout=120)
    finally:
        stop.set()
        watcher.join(5)
    from k3launch.deploy.ssh.teardown import teardown

    teardown(rec, launch.fleet, launch.store)
    launch.store.delete(rec.name)
    launch.fleet.close()
    return [noticed[p] - first_ok[p] for p in engines if p in first_ok and p in noticed]


def death_to_reported(hosts: Hosts, n: int, tmp: Path, port_base: int) -> float:
    """SIGKILL the last rank 30 s before its load ends; seconds until `up` reports the failure."""
    launch = _lib(hosts, n, tmp, {"K3LAUNCH_SIM_LOAD_S": "30"}, port_base, "death")
    victim = launch.plan.processes[-2 if launch.plan.processes[-1].role == "router" else -1].id
    marks: dict[str, float] = {}

    def on_stage(stage: str, msg: str) -> None:
        marks.setdefault(stage, time.monotonic())
        if stage == "alive":  # every process runs and loads: kill one rank (this machine shares the hosts' kernel)
            pid = int(launch.store.load(launch.plan.name).processes[victim].handle)
            time.sleep(0.2)
            marks["kill"] = time.monotonic()
            os.kill(pid, signal.SIGKILL)

    launch.on_stage = on_stage
    try:
        launch.up(timeout=120)
        raise SystemExit("up did not fail after a rank was killed")
    except Exception as exc:
        if type(exc).__name__ != "LaunchFailed":
            raise
        if victim not in str(exc):
            print(f"  warning: the failure names another process: {exc}")
    finally:
        launch.fleet.close()
    return marks["failed"] - marks["kill"]


def _fmt(xs: list[float], unit: Callable[[float], str] = lambda x: f"{x:.2f}s") -> str:
    return f"{unit(min(xs))} / {unit(statistics.median(xs))}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", default="4,16,32")
    ap.add_argument("--load", type=float, default=0.5, help="simulated load time (K3LAUNCH_SIM_LOAD_S)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if os.geteuid() != 0:
        sys.exit("needs root (the hosts' key and sshd are root's)")
    with tempfile.TemporaryDirectory(prefix="k3launch-bench-up-") as tmp_s:
        tmp = Path(tmp_s)
        ci_dir = os.environ.get(ENV_DIR)
        t0 = time.perf_counter()
        if ci_dir and len(Hosts.load(ci_dir, owned=False).names) >= max(sizes):
            hosts = Hosts.load(ci_dir, owned=False)
        else:
            hosts = start_hosts_in_free_slot(max(sizes), tmp / "sshd")
        print(f"{len(hosts.names)} sshd hosts ({hosts.mode} mode, {'started' if hosts.owned else 'reused'} in {time.perf_counter() - t0:.1f}s); "
              f"{os.cpu_count()} CPUs; DEP across N nodes + vllm-router on this node; sim load {args.load:g}s (inside up, not subtracted); "
              f"best / median of {args.runs} runs")
        try:
            cols = ("doctor", "start", "alive", "health", "completion", "ready")
            print(f"{'N':>3} {'ssh true floor':>15} {'up (CLI)':>15} {'down (CLI)':>15}   up's stages (median s): {' '.join(cols)}")
            for i, n in enumerate(sizes):
                floor = [_ssh_cli(hosts, hosts.names[:n]) for _ in range(args.runs)]
                ups, downs, stages = [], [], []
                for _ in range(args.runs):
                    u, d, st = up_down(hosts, n, tmp, args.load, 30000 + 1000 * i)
                    ups.append(u)
                    downs.append(d)
                    stages.append(st)
                med = [statistics.median(st.get(k, float("nan")) for st in stages) for k in cols]
                print(f"{n:>3} {_fmt(floor):>15} {_fmt(ups):>15} {_fmt(downs):>15}   {' '.join(f'{x:.2f}' for x in med)}")
            print("  (stages: s since up's connections began, i.e. after CLI start-up and plan; health = first endpoint healthy; "
                  "the router reports healthy up to 1 s after its engines: --worker-startup-check-interval 1)")
            print(f"{'N':>3} {'ready→noticed (median / max over engines)':>44} {'death→reported (best / median)':>32}")
            for i, n in enumerate(sizes):
                lat = ready_to_noticed(hosts, n, tmp, args.load, 36000 + 1000 * i)
                deaths = [death_to_reported(hosts, n, tmp, 40000 + 1000 * i) for _ in range(args.runs)]
                print(f"{n:>3} {statistics.median(lat):>30.2f}s / {max(lat):.2f}s {_fmt(deaths):>31}")
        finally:
            hosts.down()


if __name__ == "__main__":
    main()
