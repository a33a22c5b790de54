"""Slurm job arrays: one task per deployment, each brought up, used and torn down inside its allocation.

``submit_array(plans, inventory, work=...)`` groups the plans by shape (nodes x GPUs per node:
Slurm gives every task of an array the same request) and submits one array per shape, with a
concurrency limit (``--array=0-N%K``). Task *i* starts deployment *i* in its own allocation,
waits until it serves (:mod:`k3launch.slurm_task`: the readiness checks of ``up``), runs its
work command with ``K3LAUNCH_ENDPOINT`` set, writes ``results/task-<i>.json`` and ends; the job
script then stops every step. ``wait_array`` polls Slurm until every task ended and returns the
per-task results (a task that never wrote one gets an entry saying why, from its output).

The work runs with the interpreter k3launch runs under (``sys.executable``), which must be
visible on the compute nodes, like the log directory.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k3launch.errors import K3Error
from k3launch.inventory import Inventory
from k3launch.plan_models import Plan
from k3launch.slurm_cmd import ACTIVE, SlurmClient
from k3launch.slurm_job import parse_output
from k3launch.slurm_render import make_array_string, node_order


@dataclass
class ArrayJob:
    job_id: str
    log_dir: str
    deployments: list[str]  # task index -> deployment name
    script: str

    def result_path(self, task: int) -> Path:
        return Path(self.log_dir) / "results" / f"task-{task}.json"


@dataclass
class ArrayResult:
    job: ArrayJob
    states: dict[int, str] = field(default_factory=dict)  # task -> Slurm state
    results: dict[int, dict[str, object]] = field(default_factory=dict)  # task -> its result JSON


def task_work(plan_path: str, result_path: str, ready_timeout: float, work: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "k3launch.slurm_task", "--plan", plan_path, "--result", result_path,
            "--ready-timeout", f"{ready_timeout:g}", "--", *work]


def submit_array(plans: Sequence[Plan], inv: Inventory, log_dir: str | Path, *, work: Callable[[int, Plan], Sequence[str]] | None = None,
                 concurrency: int | None = None, name: str = "k3-array", extra_sbatch: Sequence[str] = (), ready_timeout: float = 1800.0,
                 client: SlurmClient | None = None) -> list[ArrayJob]:
    """Submit one array per shape; task logs and results under ``log_dir/<array name>-<shape>``."""
    if inv.backend != "slurm" or inv.slurm is None:
        raise K3Error("not-slurm", f"inventory {inv.name} is not a slurm inventory", "job arrays need backend: slurm")
    if len({p.name for p in plans}) != len(plans):
        raise K3Error("duplicate-deployment", "two array tasks have the same deployment name", "give each plan its own name")
    cl = client or SlurmClient()
    shapes: dict[tuple[int, int], list[Plan]] = {}
    for p in plans:
        shapes.setdefault((len(node_order(p)), p.gpus_per_node), []).append(p)
    jobs = []
    for (nodes, gpus), group in shapes.items():
        d = Path(log_dir).expanduser().resolve() / (name if len(shapes) == 1 else f"{name}-{nodes}x{gpus}")
        tasks = []
        try:
            (d / "results").mkdir(parents=True, exist_ok=True)
            for i, p in enumerate(group):
                (d / f"task-{i}").mkdir(exist_ok=True)
                plan_path = d / f"task-{i}" / "plan.json"
                plan_path.write_text(p.to_json() + "\n")
                extra = list(work(i, p)) if work else []
                tasks.append((p, task_work(str(plan_path), str(d / "results" / f"task-{i}.json"), ready_timeout, extra)))
            text = make_array_string(tasks, inv.slurm, str(d), concurrency=concurrency, name=name, extra_sbatch=extra_sbatch,
                                     hf_token_file=inv.hf_token_file)
            script = d / "array.sbatch"
            script.write_text(text)
        except OSError as exc:
            raise K3Error("log-dir", f"cannot write the array to {d}: {exc.strerror}", "choose another log directory") from None
        jobs.append(ArrayJob(cl.sbatch(str(script), str(d)), str(d), [p.name for p in group], str(script)))
    return jobs


def task_states(job: ArrayJob, client: SlurmClient) -> dict[int, str]:
    """task -> state, from ``squeue -r`` (pending tasks expanded); tasks Slurm forgot are missing."""
    r = client.call(["squeue", "-h", "-r", "-t", "all", "-j", job.job_id, "-o", "%i|%T"])
    out: dict[int, str] = {}
    for line in r.stdout.splitlines():
        jid, _, state = line.strip().partition("|")
        _, _, task = jid.partition("_")
        if task.isdigit():
            out[int(task)] = state
    return out


def wait_array(job: ArrayJob, timeout: float, client: SlurmClient | None = None, poll_s: float = 1.0) -> ArrayResult:
    """Wait until every task ended (or ``timeout``: K3Error), then read the per-task results."""
    cl = client or SlurmClient()
    n = len(job.deployments)
    t_end = time.monotonic() + timeout
    while True:
        states = task_states(job, cl)
        done = {t: s for t, s in states.items() if s not in ACTIVE}
        gone = [t for t in range(n) if t not in states and job.result_path(t).exists()]
        if len(done) + len(gone) >= n:
            break
        if time.monotonic() > t_end:
            raise K3Error("array-timeout", f"array job {job.job_id}: {n - len(done)} task(s) still running after {timeout:g}s",
                          f"scancel {job.job_id} to stop it")
        time.sleep(poll_s)
    res = ArrayResult(job, states)
    for t in range(n):
        try:
            res.results[t] = json.loads(job.result_path(t).read_text())
        except (OSError, ValueError):
            out = Path(job.log_dir) / f"slurm-{job.job_id}_{t}.out"
            text = out.read_text(errors="replace") if out.exists() else ""
            parsed = parse_output(text)
            why = (f"{parsed.step_exit[0]} on {parsed.step_exit[1]} exited with code {parsed.step_exit[2]}" if parsed.step_exit
                   else "doctor refused " + ", ".join(parsed.doctor_failed) if parsed.doctor_failed
                   else f"task ended {states.get(t, 'GONE')} without a result; see {shlex.quote(str(out))}")
            res.results[t] = {"task": str(t), "deployment": job.deployments[t], "ok": False, "error": why}
    return res
