"""Benchmark: the cost of the doctor's pre-flight (``k3launch doctor``) on N sshd hosts, next to a
bare parallel ``ssh HOST true``.

Three columns per N (best and median of ``--runs``):

* ``ssh true``: N OpenSSH clients started at once (the floor of any fan-out);
* ``doctor sim``: ``api.doctor`` of a simulated-engine plan (reachability, runtime, ports,
  leftovers, NIC/MTU; the GPU and RDMA rows are skipped);
* ``doctor full``: ``api.doctor`` of a real-engine (``engine: vllm``) plan with the stand-in GPU
  and fabric tools of tests/infra/standin first on every node's PATH and a stand-in HF cache per
  node: every row runs (GPUs, processes, ECC, HCAs, peermem, memlock, NIC, MTU, clock, /dev/shm,
  the vLLM version, the weights check's Python program, disk).

The doctor plan is ``multi_node_dep`` over N nodes (one per host); each doctor run opens its
connections (a fresh fleet, as ``up`` does). Hosts: those of K3LAUNCH_TEST_SSH_DIR when set, else
``--hosts`` started in a temporary directory. Needs root. Prints figures; asserts nothing.

Run: python benchmarks/bench_preflight.py [--runs 3] [--hosts 32] [--sizes 4,16,32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import standin  # the tests' stand-in tools and caches
from sshhosts import ENV_DIR, Hosts, start_hosts_in_free_slot

from k3launch import api


def _ssh_true(hosts: Hosts, names: list[str]) -> float:
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(["ssh", "-n", "-F", hosts.ssh_config, n, "true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for n in names
    ]
    failed = sum(1 for p in procs if p.wait(timeout=120) != 0)
    if failed:
        print(f"  warning: {failed} ssh failed")
    return time.perf_counter() - t0


def _inventory(hosts: Hosts, names: list[str], tmp: Path, full: bool) -> Path:
    nodes = []
    for n in names:
        node: dict[str, object] = {"name": n, "address": hosts.addresses[n]}
        if full:
            tools = standin.tools(tmp / "tools" / n)
            standin.hf_cache(tmp / "hf" / n / "hub")
            node.update({"env": {"PATH": standin.node_path(tools), "HF_HOME": str(tmp / "hf" / n)}})
        nodes.append(node)
    kind = "full" if full else "sim"
    return hosts.write_inventory(
        tmp / f"inv-{kind}-{len(names)}.yaml", hardware="b300", engine="vllm" if full else "sim", names=names, extra={"nodes": nodes}
    )


def _doctor(inv: Path, n: int, state: Path) -> tuple[float, int, int]:
    plan = api.plan(inv, strategy="multi_node_dep", nodes=n, port_base=25000)
    t0 = time.perf_counter()
    report = api.doctor(plan, inv, state_dir=state)
    dt = time.perf_counter() - t0
    return dt, len(report.checks), len([c for c in report.checks if c.status == "fail"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hosts", type=int, default=32, help="hosts to start when K3LAUNCH_TEST_SSH_DIR is not set")
    ap.add_argument("--sizes", default="4,16,32")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (the hosts' key and sshd are root's)")
    with tempfile.TemporaryDirectory(prefix="k3launch-bench-preflight-") as d:
        tmp = Path(d)
        ci_dir = os.environ.get(ENV_DIR)
        t0 = time.perf_counter()
        hosts = Hosts.load(ci_dir, owned=False) if ci_dir else start_hosts_in_free_slot(args.hosts, tmp / "sshd")
        try:
            print(
                f"{len(hosts.names)} sshd hosts ({hosts.mode} mode, ready in {time.perf_counter() - t0:.1f}s); {os.cpu_count()} CPUs; "
                f"best and median of {args.runs} runs"
            )
            print(
                f"{'N':>4} {'ssh true':>9} {'median':>7}   {'doctor sim':>10} {'median':>7} {'rows':>5}   "
                f"{'doctor full':>11} {'median':>7} {'rows':>5} {'fails':>5}"
            )
            for n in [s for s in (int(x) for x in args.sizes.split(",")) if s <= len(hosts.names)]:
                names = hosts.names[:n]
                floor = [_ssh_true(hosts, names) for _ in range(args.runs)]
                sim_inv, full_inv = _inventory(hosts, names, tmp, False), _inventory(hosts, names, tmp, True)
                sim = [_doctor(sim_inv, n, tmp / "state") for _ in range(args.runs)]
                full = [_doctor(full_inv, n, tmp / "state") for _ in range(args.runs)]
                s_t, f_t = [x[0] for x in sim], [x[0] for x in full]
                print(
                    f"{n:>4} {min(floor):>8.2f}s {statistics.median(floor):>6.2f}s   {min(s_t):>9.2f}s {statistics.median(s_t):>6.2f}s "
                    f"{sim[0][1]:>5}   {min(f_t):>10.2f}s {statistics.median(f_t):>6.2f}s {full[0][1]:>5} {full[0][2]:>5}"
                )
        finally:
            hosts.down()


if __name__ == "__main__":
    main()
