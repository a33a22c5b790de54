"""Benchmark: the floor of a bare parallel `ssh HOST true` over 4, 16 and 32 hosts.

k3launch's orchestration (reach every node, run a command, collect the result) is compared with
this: it cannot beat N OpenSSH clients started at once. A second column gives the same with
paramiko in threads (connect, exec, close), the library k3launch's SshRunner is built on.

Hosts are real sshds from tests/infra/sshd-up.sh: all those of K3LAUNCH_TEST_SSH_DIR when set,
else ``--hosts`` of them started in a temporary directory and stopped at the end. With fewer hosts
than N they are reused round robin (every connection is still a full login). Needs root.
Prints figures; asserts nothing.

Run: python benchmarks/bench_ssh_floor.py [--runs 5] [--hosts 4] [--sizes 4,16,32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from sshhosts import ENV_DIR, Hosts, start_hosts_in_free_slot  # the tests' helper (tests/support is not a package)


def _ssh_cli(hosts: Hosts, targets: list[str]) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["ssh", "-n", "-F", hosts.ssh_config, t, "true"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for t in targets]
    failed = [t for t, p in zip(targets, procs, strict=True) if p.wait(timeout=120) != 0]
    dt = time.perf_counter() - t0
    if failed:
        print(f"  warning: {len(failed)} ssh failed ({', '.join(sorted(set(failed)))})")
    return dt


def _paramiko(hosts: Hosts, targets: list[str]) -> float:
    import paramiko

    def one(name: str) -> int:
        c = paramiko.SSHClient()
        c.load_host_keys(hosts.known_hosts)
        c.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            c.connect(hosts.addresses[name], port=hosts.port, username=hosts.user, key_filename=hosts.key, look_for_keys=False,
                      allow_agent=False, timeout=30, banner_timeout=30, auth_timeout=30)
            _, out, _ = c.exec_command("true", timeout=60)
            return int(out.channel.recv_exit_status())
        finally:
            c.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(targets)) as pool:
        codes = list(pool.map(one, targets))
    dt = time.perf_counter() - t0
    if any(codes):
        print(f"  warning: {sum(1 for c in codes if c)} paramiko commands failed")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hosts", type=int, default=4, help="hosts to start when K3LAUNCH_TEST_SSH_DIR is not set (max 48)")
    ap.add_argument("--sizes", default="4,16,32")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if os.geteuid() != 0:
        sys.exit("needs root (the hosts' key and sshd are root's)")
    with tempfile.TemporaryDirectory(prefix="k3launch-bench-ssh-") as tmp:
        t0 = time.perf_counter()
        ci_dir = os.environ.get(ENV_DIR)
        # all of CI's hosts (more distinct hosts = less round robin); else a set of our own
        hosts = Hosts.load(ci_dir, owned=False) if ci_dir else start_hosts_in_free_slot(args.hosts, tmp)
        up = time.perf_counter() - t0
        try:
            origin = "started" if hosts.owned else f"reused from {hosts.dir}"
            print(f"{len(hosts.names)} sshd hosts ({hosts.mode} mode, {origin} in {up:.2f}s); {os.cpu_count()} CPUs; "
                  f"best and median of {args.runs} runs")
            print(f"{'N':>4} {'ssh CLI best':>13} {'median':>8} {'per conn':>9}   {'paramiko best':>13} {'median':>8}")
            for n in sizes:
                targets = [hosts.names[i % len(hosts.names)] for i in range(n)]
                cli = [_ssh_cli(hosts, targets) for _ in range(args.runs)]
                pmk = [_paramiko(hosts, targets) for _ in range(args.runs)]
                print(f"{n:>4} {min(cli):>12.2f}s {statistics.median(cli):>7.2f}s {min(cli) / n * 1000:>7.0f}ms"
                      f"   {min(pmk):>12.2f}s {statistics.median(pmk):>7.2f}s")
        finally:
            hosts.down()


if __name__ == "__main__":
    main()
