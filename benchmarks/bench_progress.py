"""Benchmark: the cost of live progress — the liveness poll of `up` with and without reading each
process's new log lines — over 4, 16 and 32 real sshd hosts, next to a bare parallel `ssh HOST true`.

Per N (best and median of --rounds polls over one warm Fleet, as `up` polls):
* ``poll``: the liveness check alone (one round trip per node, in parallel);
* ``+logs idle``: the same with the log reads of live progress, nothing new in the logs;
* ``+logs 2KB``: each log gained 2 KB (about 15 vLLM lines) since the last poll;
* ``first 64KB``: a whole 64 KB log per process read in one poll (the first poll after a burst);
* ``track``: classifying the 2 KB per process and building the snapshot on this machine;
* ``ssh floor``: N OpenSSH clients at once (``ssh HOST true``, a full login each), as in
  benchmarks/bench_ssh_floor.py.

Each node runs one process (``DEP`` across N nodes); its pid is the host's sshd (alive), its log
a file of that node. The test hosts share this machine's filesystem (network namespaces only), so
the logs are written here. Hosts: those of K3LAUNCH_TEST_SSH_DIR when it holds enough, else
max(--sizes) hosts started in a free slot of tests/infra/sshd-up.sh and stopped at the end.
Needs root. Prints figures; asserts nothing.

Run: python benchmarks/bench_progress.py [--rounds 20] [--sizes 4,16,32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ssh_floor import _ssh_cli  # the floor, measured the same way as there
from sshhosts import ENV_DIR, Hosts, start_hosts_in_free_slot

LINE = "(EngineCore_DP0 pid=811) INFO 03-02 10:07:31 [backends.py:548] Dynamo bytecode transform time: 18.70 s ........\n"


def _setup(hosts: Hosts, n: int, tmp: Path) -> tuple[Any, Any, dict[str, Path]]:
    from k3launch.models.record import ProcessRecord, SshRecord
    from k3launch.models.selection import Selection
    from k3launch.planning.build import build_plan
    from k3launch.planning.inventory import load_inventory
    from k3launch.planning.recipes import RecipeTree
    from k3launch.transport.fleet import Fleet
    from k3launch.transport.runners import LocalRunner, SshRunner

    inv_path = hosts.write_inventory(tmp / f"inv-{n}.yaml", names=hosts.names[:n])
    inv = load_inventory(inv_path)
    plan = build_plan(RecipeTree(), Selection(strategy="multi_node_dep", nodes=n), inventory=inv, port_base=24000, name=f"bp-{n}")
    fleet = Fleet.for_plan(plan, SshRunner(known_hosts=inv.known_hosts, ssh_config=inv.ssh_config), LocalRunner())
    logs: dict[str, Path] = {}
    procs = {}
    for p in plan.processes:
        if p.role == "router":
            continue
        logs[p.id] = tmp / f"{n}-{p.id}.log"
        logs[p.id].write_text("")
        procs[p.id] = ProcessRecord(id=p.id, node=p.node, runtime="bare", handle="1", log=str(logs[p.id]), started=True)
    now = time.time()
    rec = SshRecord(name=plan.name, state="starting", created=now, updated=now, endpoint=plan.endpoint, plan=plan, processes=procs)
    return rec, fleet, logs


def _timed(fn: Callable[[], object], rounds: int, before: Callable[[], None] = lambda: None) -> list[float]:
    out = []
    for _ in range(rounds):
        before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(hosts: Hosts, n: int, tmp: Path, rounds: int) -> dict[str, list[float]]:
    from k3launch.deploy.logtail import LogCursor
    from k3launch.deploy.progress import Tracker
    from k3launch.deploy.ssh.observe import poll

    rec, fleet, logs = _setup(hosts, n, tmp)
    cursor = LogCursor()
    chunk = LINE * (2048 // len(LINE))

    def grow(size: str = chunk) -> None:
        for path in logs.values():
            with path.open("a") as f:
                f.write(size)

    def check(p: Any) -> None:
        if p.unreachable or p.dead:
            raise SystemExit(f"poll failed: {p.unreachable or p.dead}")

    try:
        check(poll(rec, fleet))  # connect every host first: `up`'s polls run over the doctor's connections
        got: dict[str, list[float]] = {}
        got["poll"] = _timed(lambda: check(poll(rec, fleet)), rounds)
        check(poll(rec, fleet, cursor=cursor))
        got["+logs idle"] = _timed(lambda: check(poll(rec, fleet, cursor=cursor)), rounds)
        got["+logs 2KB"] = _timed(lambda: check(poll(rec, fleet, cursor=cursor)), rounds, grow)
        big = LINE * (65536 // len(LINE))
        got["first 64KB"] = _timed(lambda: check(poll(rec, fleet, cursor=cursor)), max(3, rounds // 4), lambda: grow(big))
        tracker = Tracker(rec.plan)
        from k3launch.models.phases import LogDelta

        deltas = {pid: LogDelta(chunk) for pid in logs}
        got["track"] = _timed(lambda: tracker.update(deltas, (), "alive"), rounds)
        targets = [hosts.names[i % len(hosts.names)] for i in range(n)]
        got["ssh floor"] = [_ssh_cli(hosts, targets) for _ in range(max(3, rounds // 4))]
        return got
    finally:
        fleet.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--sizes", default="4,16,32")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if os.geteuid() != 0:
        sys.exit("needs root (the hosts' key and sshd are root's)")
    with tempfile.TemporaryDirectory(prefix="k3launch-bench-progress-") as tmp:
        ci_dir = os.environ.get(ENV_DIR)
        reuse = Hosts.load(ci_dir, owned=False) if ci_dir else None
        hosts = reuse if reuse is not None and len(reuse.names) >= max(sizes) else start_hosts_in_free_slot(max(sizes), tmp)
        try:
            print(f"{len(hosts.names)} sshd hosts ({hosts.mode} mode); {os.cpu_count()} CPUs; best / median of {args.rounds} polls")
            cols = ["poll", "+logs idle", "+logs 2KB", "first 64KB", "track", "ssh floor"]
            print(f"{'N':>4} " + " ".join(f"{c:>17}" for c in cols))
            for n in sizes:
                got = measure(hosts, n, Path(tmp), args.rounds)
                cells = [f"{min(got[c]) * 1000:7.1f}/{statistics.median(got[c]) * 1000:7.1f}ms" for c in cols]
                print(f"{n:>4} " + " ".join(f"{c:>17}" for c in cells))
        finally:
            if hosts.owned:
                hosts.down()


if __name__ == "__main__":
    main()
