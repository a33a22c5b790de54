"""Slurm job arrays: one task per deployment, each brought up, used and torn down inside its allocation.

``submit_array(plans, inventory, work=...)`` groups the plans by shape (nodes x GPUs per node:
Slurm gives every task of an array the same request) and submits one array per shape, with a
concurrency limit (``--array=0-N%K``). Task *i* starts deployment *i* in its own allocation,
waits until it serves (:mod:`k3launch.deploy.slurm.task`: the readiness checks of ``up``), runs its
work command with ``K3LAUNCH_ENDPOINT`` set, writes ``results/task-<i>.json`` and ends; the job
script then stops every step. ``wait_array`` polls Slurm until every task ended and returns the
per-task results (a task that never wrote one gets an entry saying why, from its output).

The work runs with the interpreter k3launch runs under (``sys.executable``), which must be
visible on the compute nodes, like the log directory.

Every submission gets its own directory, ``log_dir/<name>[-<shape>]-<UTC time>-<6 hex>`` (the
layout inside is fixed: ``array.sbatch``, ``slurm-<job>_<task>.out``, ``task-<i>/``,
``results/task-<i>.json``). A resumed campaign submits the same array name again with other
deployments behind the same task indices; in a reused directory a task that failed before
writing its result would be reported with the previous array's result, and clearing
``results/`` first would not help against an earlier array still running (its tasks write there
when they end) and would lose that run's evidence. Old directories are left for the user.

When is a task over: Slurm says so (a state outside ``ACTIVE``), or Slurm forgot it — once
``squeue`` succeeded, a task it does not list has ended (``MinJobAge`` purges finished array
tasks one by one), and "Invalid job id" means it forgot the whole array. A failed ``squeue``
(slurmctld busy) says nothing; after ``SQUEUE_FAILURE_S`` of failures only, ``slurm-unavailable``.
A task's result counts only if it is final (it has ``ended``: :mod:`k3launch.deploy.slurm.task` first
writes a provisional one); otherwise the task ended early and its output says why.
"""

from __future__ import annotations

import json
import secrets
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from k3launch.deploy.slurm.client import ACTIVE, SLURM_HINT, SlurmClient
from k3launch.deploy.slurm.job import parse_output
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.reports import ArrayJob, ArrayResult
from k3launch.planning.inventory import Inventory
from k3launch.render.sbatch import make_array_string, node_order
from k3launch.util.names import check_name

SQUEUE_FAILURE_S = 120.0  # seconds of consecutive failed squeue polls before wait_array gives up




def task_work(plan_path: str, result_path: str, ready_timeout: float, work: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "k3launch.deploy.slurm.task", "--plan", plan_path, "--result", result_path,
            "--ready-timeout", f"{ready_timeout:g}", "--", *work]


def submission_dir(log_dir: str | Path, name: str) -> Path:
    """``log_dir/<name>-<UTC time>-<6 hex>``: one directory per submission (see the module doc)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path(log_dir).expanduser().resolve() / f"{name}-{stamp}-{secrets.token_hex(3)}"


def submit_array(plans: Sequence[Plan], inv: Inventory, log_dir: str | Path, *, work: Callable[[int, Plan], Sequence[str]] | None = None,
                 concurrency: int | None = None, name: str = "k3-array", extra_sbatch: Sequence[str] = (), ready_timeout: float = 1800.0,
                 client: SlurmClient | None = None) -> list[ArrayJob]:
    """Submit one array per shape; task logs and results under a new ``log_dir/<array name>[-<shape>]-<time>-<hex>``."""
    if inv.backend != "slurm" or inv.slurm is None:
        raise K3Error("not-slurm", f"inventory {inv.name} is not a slurm inventory", "job arrays need backend: slurm")
    if len({p.name for p in plans}) != len(plans):
        raise K3Error("duplicate-deployment", "two array tasks have the same deployment name", "give each plan its own name")
    check_name(name, "array name", "k3-sweep")
    cl = client or SlurmClient()
    shapes: dict[tuple[int, int], list[Plan]] = {}
    for p in plans:
        shapes.setdefault((len(node_order(p)), p.gpus_per_node), []).append(p)
    jobs = []
    for (nodes, gpus), group in shapes.items():
        d = submission_dir(log_dir, name if len(shapes) == 1 else f"{name}-{nodes}x{gpus}")
        tasks = []
        try:
            (d / "results").mkdir(parents=True, exist_ok=False)
            for i, p in enumerate(group):
                (d / f"task-{i}").mkdir()
                plan_path = d / f"task-{i}" / "plan.json"
                plan_path.write_text(p.to_json() + "\n")
                extra = list(work(i, p)) if work else []
                tasks.append((p, task_work(str(plan_path), str(d / "results" / f"task-{i}.json"), ready_timeout, extra)))
            # the nodelist is the candidate set here too (every other node of the partition excluded)
            outside = cl.outside(inv.slurm.partition, inv.slurm.nodelist)
            text = make_array_string(tasks, inv.slurm, str(d), concurrency=concurrency, name=name, extra_sbatch=extra_sbatch, exclude=outside,
                                     hf_token_file=inv.hf_token_file)
            script = d / "array.sbatch"
            script.write_text(text)
        except OSError as exc:
            raise K3Error("log-dir", f"cannot write the array to {d}: {exc.strerror}", "choose another log directory") from None
        jobs.append(ArrayJob(cl.sbatch(str(script), str(d), job_name=name), str(d), [p.name for p in group], str(script)))
    return jobs


def task_states(job_id: str, client: SlurmClient) -> dict[int, str] | None:
    """task -> state, from ``squeue -r`` (pending tasks expanded); a task Slurm forgot is missing
    (``{}``: "Invalid job id", Slurm forgot the whole array). ``None``: squeue failed, nothing known."""
    r = client.call(["squeue", "-h", "-r", "-t", "all", "-j", job_id, "-o", "%i|%T"])
    if r.exit_code == 127:
        raise K3Error("slurm-missing", "squeue not found on this machine", SLURM_HINT)
    if not r.ok:
        return {} if "Invalid job id" in r.stderr + r.stdout else None
    out: dict[int, str] = {}
    for line in r.stdout.splitlines():
        jid, _, state = line.strip().partition("|")
        _, _, task = jid.partition("_")
        if task.isdigit():
            out[int(task)] = state
    return out


def final_result(path: Path) -> dict[str, object] | None:
    """The task's result if it is final (``ended`` set by slurm_task); ``None`` if missing, provisional or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "ended" in data else None


def why_no_result(job: ArrayJob, task: int, state: str) -> str:
    """Why a task ended without a final result, from its output file (what the job library said)."""
    out = job.output_path(task)
    try:
        text = out.read_text(errors="replace")
    except OSError:
        text = ""
    parsed = parse_output(text)
    if parsed.step_exit:
        return f"{parsed.step_exit[0]} on {parsed.step_exit[1]} exited with code {parsed.step_exit[2]}"
    if parsed.doctor_failed:
        return "doctor refused " + "; ".join(f"{host} ({why})" for host, why in parsed.doctor_failed.items())
    if parsed.prepare_failed:
        return "could not make " + "; ".join(f"{path} on {host}" for host, path in parsed.prepare_failed.items())
    said = [ln.removeprefix("k3launch: ") for ln in text.splitlines() if ln.startswith("k3launch: ")
            and not ln.startswith(("k3launch: node ", "k3launch: started ", "k3launch: doctor: ", "k3launch: prepare: "))]
    last = f" (last said: {said[-1]})" if said else ""
    return f"task ended {state} without a result{last}; see {shlex.quote(str(out))}"


def wait_array(job: ArrayJob, timeout: float, client: SlurmClient | None = None, poll_s: float = 1.0) -> ArrayResult:
    """Wait until every task ended (or ``timeout``: K3Error), then read the per-task results."""
    cl = client or SlurmClient()
    n = len(job.deployments)
    t_end = time.monotonic() + timeout
    failing_since: float | None = None
    states: dict[int, str] = {}
    while True:
        polled = task_states(job.job_id, cl)
        now = time.monotonic()
        if polled is None:  # squeue failed: this poll says nothing
            failing_since = now if failing_since is None else failing_since
            if now - failing_since > SQUEUE_FAILURE_S:
                raise K3Error("slurm-unavailable", f"array job {job.job_id}: squeue failed for {now - failing_since:.0f}s",
                              f"{SLURM_HINT}; the tasks may still run (squeue -j {job.job_id}); their results are in {job.log_dir}/results")
        else:
            failing_since, states = None, polled
            running = [t for t in range(n) if states.get(t, "GONE") in ACTIVE]
            if not running:
                break
        if now > t_end:
            left = "unknown (squeue failing)" if polled is None else str(len(running))
            raise K3Error("array-timeout", f"array job {job.job_id}: {left} task(s) still running after {timeout:g}s",
                          f"scancel {job.job_id} to stop it")
        time.sleep(poll_s)
    res = ArrayResult(job, states)
    for t in range(n):
        final = final_result(job.result_path(t))
        if final is not None:
            res.results[t] = final
            continue
        res.results[t] = {"task": str(t), "deployment": job.deployments[t], "ok": False,
                          "error": why_no_result(job, t, states.get(t, "GONE"))}
    return res
