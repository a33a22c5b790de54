"""The Slurm test infrastructure itself (tests/infra/slurm-*.sh, tests/support/slurmcluster.py) works as promised.

A real cluster (root needed; skipped otherwise): multi-node jobs with srun steps and fake GPUs,
throttled job arrays, scancel, GRES limits enforced at submission, nodes with their own network
(netns mode), submitit, and a down that leaves nothing behind. Every wait is bounded; everything
started here is cancelled or killed here.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from infrahelpers import pid_alive, wait_until
from paths import SUPPORT

if TYPE_CHECKING:
    from slurmcluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

ALL_GPUS = "0,1,2,3,4,5,6,7"


def _read_pids(path: Path) -> list[int]:
    """Pids a job wrote to ``path`` (one line, written at once: complete or absent)."""
    try:
        return [int(p) for p in path.read_text().split()]
    except (FileNotFoundError, ValueError):
        return []


def test_two_node_job_with_srun_step(slurm_cluster: Cluster, tmp_path: Path, jobs: list[str]) -> None:
    c = slurm_cluster
    script = tmp_path / "two.sh"
    script.write_text("#!/bin/bash\n"
                      'echo "batch $SLURMD_NODENAME $(hostname) $SLURM_JOB_NUM_NODES $CUDA_VISIBLE_DEVICES"\n'
                      "srun bash -c 'echo \"step $SLURM_PROCID $SLURM_NODEID $SLURMD_NODENAME $(hostname) $CUDA_VISIBLE_DEVICES\"'\n")
    t0 = time.monotonic()
    job = c.sbatch("--nodes=2", "--ntasks-per-node=1", "--gres=gpu:8", f"--output={tmp_path}/%j.out", str(script))
    jobs.append(job)
    assert c.wait(job, timeout=60) == "COMPLETED", (tmp_path / f"{job}.out").read_text()
    turnaround = time.monotonic() - t0
    lines = (tmp_path / f"{job}.out").read_text().splitlines()
    batch = [ln.split()[1:] for ln in lines if ln.startswith("batch ")]
    steps = sorted(ln.split()[1:] for ln in lines if ln.startswith("step "))
    assert len(batch) == 1 and batch[0][2] == "2", lines
    assert [(s[0], s[1]) for s in steps] == [("0", "0"), ("1", "1")], lines  # SLURM_PROCID, SLURM_NODEID
    names = [s[2] for s in steps]
    assert len(set(names)) == 2 and set(names) <= set(c.nodes), lines
    assert batch[0][0] == names[0]  # the batch script runs on the first node of the allocation
    if c.mode == "netns":
        assert [s[3] for s in steps] == names  # every node is a host of its own
    assert all(s[4] == ALL_GPUS for s in steps) and batch[0][3] == ALL_GPUS, lines
    assert turnaround < 20, f"2-node job took {turnaround:.1f}s: is batch_sched_delay=0 in slurm.conf?"


def test_srun_from_here_spans_every_node(slurm_cluster: Cluster) -> None:
    c = slurm_cluster
    r = c.run("srun", f"--nodes={len(c.nodes)}", "--ntasks-per-node=1", "--gres=gpu:1", "bash", "-c",
              "echo $SLURM_PROCID $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES", timeout=60)
    rows = sorted(line.split() for line in r.stdout.splitlines())
    assert sorted(row[1] for row in rows) == sorted(c.nodes), r.stdout
    assert {row[2] for row in rows} == {"0"}, r.stdout


def test_job_array_is_throttled_and_writes_one_output_per_task(slurm_cluster: Cluster, tmp_path: Path, jobs: list[str]) -> None:
    c = slurm_cluster
    job = c.sbatch("--array=0-2%2", f"--output={tmp_path}/arr-%A_%a.out", "--wrap",
                   'echo "$SLURM_ARRAY_JOB_ID $SLURM_ARRAY_TASK_ID $SLURMD_NODENAME $(date +%s.%N)"; sleep 1; date +%s.%N')
    jobs.append(job)
    assert "ArrayTaskThrottle=2" in c.run("scontrol", "show", "job", job).stdout
    assert c.wait(job, timeout=60) == "COMPLETED"
    assert len(c.states(job)) == 3
    spans = []
    for task in range(3):
        first, end = (tmp_path / f"arr-{job}_{task}.out").read_text().splitlines()
        array_id, task_id, node, start = first.split()
        assert (array_id, task_id) == (job, str(task)) and node in c.nodes
        spans.append((float(start), float(end)))
    # %2: at no moment did all three run at once
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 2, spans


def test_scancel_ends_a_running_job_and_its_processes(slurm_cluster: Cluster, tmp_path: Path, jobs: list[str]) -> None:
    c = slurm_cluster
    pidfile = tmp_path / "pids"
    # the batch shell and its child; written in one go (rename) so a partial line is never read
    job = c.sbatch("--output=/dev/null", "--wrap", f'sleep 300 & echo "$$ $!" > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; wait')
    jobs.append(job)
    assert c.wait(job, timeout=30, until={"RUNNING"}) == "RUNNING"
    assert wait_until(lambda: len(_read_pids(pidfile)) == 2, 15), "the job did not start its sleep"
    pids = _read_pids(pidfile)
    assert all(pid_alive(p) for p in pids)
    t0 = time.monotonic()
    c.cancel(job)
    assert c.wait(job, timeout=30) == "CANCELLED"
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 10), f"still running after scancel: {[p for p in pids if pid_alive(p)]}"
    assert time.monotonic() - t0 < 15


def test_more_gpus_than_a_node_has_are_refused_at_submission(slurm_cluster: Cluster) -> None:
    c = slurm_cluster
    r = c.run("sbatch", f"--gres=gpu:{c.gpus_per_node + 1}", "--output=/dev/null", "--wrap", "true", check=False)
    assert r.returncode != 0 and not r.stdout.strip(), r.stdout
    assert "Requested node configuration is not available" in r.stderr, r.stderr


def test_server_started_by_a_job_is_reachable_at_its_node_address(slurm_cluster: Cluster, tmp_path: Path, jobs: list[str]) -> None:
    c = slurm_cluster
    if c.mode != "netns":
        pytest.skip("multi mode: every node shares this machine's network")
    a, b = c.nodes[0], c.nodes[1]
    addr = c.addresses[a]
    with socket.socket() as s:  # a port free on this machine's loopback, to show the server is not there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    www = tmp_path / "www"
    www.mkdir()
    job = c.sbatch(f"--nodelist={a}", f"--output={tmp_path}/server.out", "--wrap",
                   f"hostname > {www}/whoami.tmp && mv {www}/whoami.tmp {www}/whoami && "
                   f"exec {sys.executable} -m http.server --bind 0.0.0.0 --directory {www} {port}")
    jobs.append(job)
    url = f"http://{addr}:{port}/whoami"

    def fetch(u: str) -> str | None:
        try:
            with urllib.request.urlopen(u, timeout=2) as resp:
                return str(resp.read().decode().strip())
        except (urllib.error.URLError, OSError):
            return None

    assert wait_until(lambda: fetch(url) == a, 30, 0.1), f"{url} never answered {a!r}: {(tmp_path / 'server.out').read_text()}"
    with pytest.raises(ConnectionRefusedError):  # it listens in a's network, not this machine's
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    # another node reaches it by name (the tagged /etc/hosts lines) over the bridge
    r = c.run("srun", f"--nodelist={b}", sys.executable, "-c",
              f"import urllib.request as u; print(u.urlopen('http://{a}:{port}/whoami', timeout=5).read().decode())", timeout=60)
    assert r.stdout.strip() == a, r.stderr
    c.cancel(job)
    assert c.wait(job, timeout=30) == "CANCELLED"
    assert wait_until(lambda: fetch(url) is None, 10), "the server outlived its job"


def _where(x: int) -> tuple[int, str | None, str | None, str]:
    return x * 2, os.environ.get("SLURMD_NODENAME"), os.environ.get("CUDA_VISIBLE_DEVICES"), socket.gethostname()


def _submitit() -> Any:
    """Import submitit, pip-installing it first if missing (it is not a k3launch dependency)."""
    try:
        return importlib.import_module("submitit")
    except ImportError:
        pass
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "submitit"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        reason = f"submitit is not installed and pip install failed: {r.stderr.strip()[-500:]}"
        if os.environ.get("K3LAUNCH_TEST_SLURM_REQUIRED") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    importlib.invalidate_caches()
    return importlib.import_module("submitit")


def test_submitit_runs_a_function_on_the_cluster(slurm_cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = slurm_cluster
    submitit = _submitit()
    # submitit shells out to sbatch/squeue/sacct with this process's environment
    env = c.env()
    for k in set(os.environ) - set(env):
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_CONF", c.conf)
    # the job unpickles _where by module name: the job's python must find this module, and the
    # helper modules it imports (tests/support)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), str(SUPPORT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    ex = submitit.AutoExecutor(folder=tmp_path / "%j")
    assert ex.cluster == "slurm"
    ex.update_parameters(timeout_min=5, slurm_partition=c.partition, nodes=1, tasks_per_node=1, gpus_per_node=2)
    t0 = time.monotonic()
    job = ex.submit(_where, 21)
    try:
        assert wait_until(job.done, 60, 0.2), f"submitit job {job.job_id} not done after 60 s: {c.states(job.job_id)}"
        doubled, node, gpus, host = job.result()
    finally:
        c.run("scancel", job.job_id, check=False)
    assert (doubled, gpus) == (42, "0,1") and node in c.nodes
    if c.mode == "netns":
        assert host == node
    assert time.monotonic() - t0 < 60


def test_env_hides_an_enclosing_slurm_job(slurm_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "424242")
    monkeypatch.setenv("SBATCH_PARTITION", "elsewhere")
    env = slurm_cluster.env({"EXTRA": "1"})
    assert env["SLURM_CONF"] == slurm_cluster.conf and env["EXTRA"] == "1"
    assert "SLURM_JOB_ID" not in env and "SBATCH_PARTITION" not in env
    r = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_sbatch_without_slurm_conf_uses_the_etc_link(slurm_cluster: Cluster, tmp_path: Path, jobs: list[str]) -> None:
    """What an ssh session on a shared-filesystem login host sees: no SLURM_CONF, just /etc/slurm."""
    c = slurm_cluster
    if os.path.realpath("/etc/slurm/slurm.conf") != os.path.realpath(c.conf):
        pytest.skip("/etc/slurm/slurm.conf belongs to something else here (SLURM_LINK_ETC=auto left it alone)")
    env = {k: v for k, v in c.env().items() if k != "SLURM_CONF"}
    r = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/out", "--wrap", "echo $SLURM_CLUSTER_NAME"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    jobs.append(job)
    assert c.wait(job, timeout=60) == "COMPLETED"
    assert (tmp_path / "out").read_text().strip() == c.name


def test_up_again_keeps_the_running_daemons(slurm_cluster: Cluster) -> None:
    if not slurm_cluster.owned:
        pytest.skip("cluster owned by CI (K3LAUNCH_TEST_SLURM_DIR)")
    from slurmcluster import InfraError, run_infra

    run = slurm_cluster.dir / "run"
    pids = {f.name: f.read_text() for f in run.glob("*.pid")}
    assert {f"slurmd-{n}.pid" for n in slurm_cluster.nodes} | {"slurmctld.pid", "munged.pid"} <= set(pids)
    t0 = time.monotonic()
    out = run_infra("slurm-up.sh", str(slurm_cluster.dir), env={"SLURM_NODES": str(len(slurm_cluster.nodes))}, timeout=120)
    assert "0 daemon(s) started now" in out
    assert time.monotonic() - t0 < 10
    assert pids == {f.name: f.read_text() for f in run.glob("*.pid")}
    # settings that contradict the running cluster are refused, not applied half-way
    with pytest.raises(InfraError, match=r"run slurm-down\.sh"):
        run_infra("slurm-up.sh", str(slurm_cluster.dir), env={"SLURM_NODES": str(len(slurm_cluster.nodes) + 1)}, timeout=120)


def _infra_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "# k3launch-" not in line]


def test_down_leaves_nothing_behind(tmp_path: Path) -> None:
    """A cluster of its own (other names, subnet, bridge, ports), so the session's is untouched."""
    from slurmcluster import start_cluster_in_free_slot

    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster needs root")
    etc_hosts = Path("/etc/hosts").read_text()
    d = tmp_path / "slurm"
    c = start_cluster_in_free_slot(d, nodes=2, gpus=2, kind="d")
    escapee = tmp_path / "escapee"
    try:
        assert c.owned and len(c.nodes) == 2 and c.gpus_per_node == 2
        pidfiles = {f.name: int(f.read_text()) for f in (d / "run").glob("*.pid")}
        expected = {"munged.pid", "slurmctld.pid", *(f"slurmd-{n}.pid" for n in c.nodes)}
        if c.accounting:
            expected |= {"mysqld.pid", "slurmdbd.pid"}
        assert set(pidfiles) == expected
        daemons = list(pidfiles.values())
        assert all(pid_alive(p) for p in daemons)
        # a job whose child double-forks out of its step: scancel cannot see it, down must
        job = c.sbatch("--output=/dev/null", "--wrap", f"setsid sh -c 'echo $$ > {escapee}.tmp && mv {escapee}.tmp {escapee}; "
                       "exec sleep 300' </dev/null >/dev/null 2>&1 & sleep 300")
        assert c.wait(job, timeout=30, until={"RUNNING"}) == "RUNNING"
        assert wait_until(lambda: len(_read_pids(escapee)) == 1, 15)
        assert pid_alive(_read_pids(escapee)[0])
    finally:
        t0 = time.monotonic()
        c.down()
        took = time.monotonic() - t0
    c.down()  # twice is fine
    assert took < 30
    assert not any(pid_alive(p) for p in [*daemons, *_read_pids(escapee)])
    leftovers = [p for p in os.listdir("/proc") if p.isdigit() and (str(d).encode() in _proc(p, "cmdline") or
                                                                    f"K3LAUNCH_SLURM_CLUSTER_DIR={d}".encode() in _proc(p, "environ"))
                 and pid_alive(int(p))]
    assert not leftovers, leftovers
    assert not any(Path(f"/run/netns/{n}").exists() or Path(f"/sys/class/net/v-{n}").exists() for n in c.nodes)
    assert not c.bridge or not Path(f"/sys/class/net/{c.bridge}").exists()
    assert f"k3launch-sshd:{d}\n" not in Path("/etc/hosts").read_text() + "\n"
    assert _infra_lines(Path("/etc/hosts").read_text()) == _infra_lines(etc_hosts)
    registry = Path("/run/k3launch-sshd")
    assert not [f for f in registry.glob("*") if f.is_file() and f.read_text().strip() == str(d)]
    # the link is never left pointing at a dead cluster (another live one may hold it meanwhile)
    assert os.path.realpath("/etc/slurm/slurm.conf") != str(d / "slurm.conf")
    assert not (d / "cluster.json").exists() and not (d / "env.sh").exists()


def _proc(pid: str, what: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return b""

