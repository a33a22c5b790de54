"""``status``, ``logs`` and ``down`` of a Slurm deployment (its job), from the login node.

A job that supervises itself (``up --supervise``: its controller runs on the batch host,
:mod:`k3launch.deploy.slurm.injob`) says what it does in ``<log dir>/events.jsonl``:
``status`` reads its restarts there, and the reason when it gave up (state ``failed``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from k3launch.deploy import eventlog
from k3launch.deploy.slurm.client import JobInfo, SlurmClient
from k3launch.deploy.slurm.job import bind_plan, tail_file
from k3launch.deploy.state import StateStore
from k3launch.models.identity import ANY, Owned
from k3launch.models.record import JobStatus, ProcessStatus, SlurmRecord, Status, SupervisorStatus, observed_state
from k3launch.models.reports import TeardownReport
from k3launch.models.supervise import restarts_of
from k3launch.transport.http import probe_all
from k3launch.util.polling import poll_until, ticks

JOB_STOP_GRACE_S = 10.0  # the job script's TERM -> KILL grace when no --grace reaches it (K3_STOP_GRACE_S)
STOP_MARGIN_S = 5.0  # the steps' exits and Slurm's bookkeeping after that
CANCEL_WAIT_S = 90.0  # after scancel: Slurm's KillWait (30 s by default) plus epilog


def observe_job(rec: SlurmRecord, client: SlurmClient | None = None) -> Status:
    """The deployment's :class:`~k3launch.models.record.Status` from squeue and the bound addresses, with its ``job``."""
    cl = client or SlurmClient()
    info = cl.job(rec.slurm.job_id)
    steps = cl.steps(rec.slurm.job_id) if info.state == "RUNNING" else {}
    bound = bind_plan(rec.plan, rec.slurm.addresses)
    alive = {p.id: p.id in steps for p in bound.processes}
    urls = {p.id: f"http://{p.address}:{p.http_port}" for p in bound.processes if p.http_port is not None and alive[p.id]}
    ok = probe_all(urls, timeout=2.0)
    procs = [ProcessStatus(id=p.id, node=rec.slurm.hosts.get(p.node, p.node), role=p.role, alive=alive[p.id],
                           healthy=None if p.http_port is None else ok.get(p.id, False)) for p in bound.processes]
    state: str = rec.state
    sv, gave_up = self_supervision(rec)
    if gave_up is not None:
        state = "failed"
    elif info.state == "PENDING":
        state = "queued"
    elif not info.active:
        state = f"ended ({info.state})"
    else:
        state = observed_state(state, procs)
    return Status(name=rec.name, state=state, endpoint=rec.endpoint, processes=procs, unreachable=[], supervisor=sv, error=gave_up,
                  job=JobStatus(id=rec.slurm.job_id, state=info.state, nodes=info.nodes, reason=info.reason, log_dir=rec.slurm.log_dir))


_WATCHER_HOST = re.compile(r"^pid \d+ on (\S+);")  # the controller's `watching` event: "pid N on HOST; units: ..."


def self_supervision(rec: SlurmRecord) -> tuple[SupervisorStatus | None, str | None]:
    """A self-supervising job, from its events: who watches (its batch host, since when, restarts so
    far), and why it gave up if it did (None while it keeps serving)."""
    if rec.slurm.supervised is None:
        return None, None
    events = eventlog.read_file(Path(rec.slurm.log_dir) / eventlog.JOB_EVENTS) if rec.slurm.log_dir else []
    watching = next((e for e in events if e.kind == "watching"), None)
    said = _WATCHER_HOST.match(watching.reason) if watching else None
    host = (watching.node or (said.group(1) if said else "")) if watching else ""
    sv = SupervisorStatus(host=host, pid=None, since=watching.time if watching else rec.created,
                          restarts=restarts_of(events), detached=True, job=rec.slurm.job_id)
    failed = next((e for e in reversed(events) if e.kind == "failed"), None)
    return sv, None if failed is None else f"the job gave up: {failed.reason}; logs in {rec.slurm.log_dir}"


def tail_logs(rec: SlurmRecord, ids: Sequence[str], lines: int) -> dict[str, str]:
    """process id (or ``job``: the job's own output) -> its last lines, read from the shared log directory."""
    d = Path(rec.slurm.log_dir)
    return {i: tail_file(d / (f"slurm-{rec.slurm.job_id}.out" if i == "job" else f"{i}.log"), lines) for i in ids}


def follow_files(rec: SlurmRecord, ids: Sequence[str], emit: Callable[[str], None], poll_s: float = 1.0,
                 max_s: float | None = None) -> None:
    """Print new lines of the processes' logs as they appear (by byte offset)."""
    paths = {i: Path(rec.slurm.log_dir) / f"{i}.log" for i in ids}
    offsets = {i: (p.stat().st_size if p.exists() else 0) for i, p in paths.items()}
    for _ in ticks(poll_s, max_s):
        for i, p in paths.items():
            try:
                with p.open("rb") as f:
                    if os.fstat(f.fileno()).st_size < offsets[i]:
                        offsets[i] = 0  # a new log: the job restarted the step (the old one is NAME.log.1)
                    f.seek(offsets[i])
                    data = f.read()
            except OSError:
                continue
            offsets[i] += len(data)
            for line in data.decode(errors="replace").splitlines():
                emit(f"{i}| {line}")


def cancel_job(rec: SlurmRecord, store: StateStore, grace_s: float = 10.0, client: SlurmClient | None = None) -> TeardownReport:
    """The grace signal first: ``scancel --batch --signal=TERM`` makes the job script stop its
    steps (TERM, then KILL after ``grace_s``, which it reads from ``<log dir>/.k3launch-grace``)
    and end as COMPLETED; if the job is still active after that, ``scancel`` (Slurm's TERM,
    KillWait, KILL). Verified: the job is no longer active and no step of it is left. A pending
    job is simply cancelled."""
    cl = client or SlurmClient()
    job = rec.slurm.job_id
    report = TeardownReport(verified=f"job {job} ended, no step left")
    rec.state = "stopping"
    store.save(rec)

    def wait_gone(limit: float) -> JobInfo:
        return poll_until(lambda: cl.job(job), lambda info: not info.active, timeout=limit, interval=0.2)

    info = cl.job(job)
    if info.active:
        if info.state == "PENDING":
            cl.cancel(job)
        else:
            try:
                (Path(rec.slurm.log_dir) / ".k3launch-grace").write_text(f"{max(0, round(grace_s))}\n")
            except OSError:
                pass  # the job keeps its default grace (JOB_STOP_GRACE_S)
            cl.cancel(job, signal="TERM")
        info = wait_gone(grace_s + STOP_MARGIN_S)
        if info.active:
            cl.cancel(job)
            info = wait_gone(CANCEL_WAIT_S)
    steps = cl.steps(job)
    if info.active or steps:
        report.leftovers["slurm"] = [f"job {job} still {info.state}", *(f"step {s} on {n}" for s, n in steps.items())]
    report.stopped = [p.id for p in rec.plan.processes]
    if not report.clean:
        rec.state = "down-incomplete"
        store.save(rec)
    return report


def cancel_named(name: str, client: SlurmClient | None = None, wait_s: float = CANCEL_WAIT_S, owned: Owned = ANY) -> TeardownReport:
    """``down`` without a (readable) record: ``scancel`` this user's jobs named after deployment
    ``name`` (``k3-<name>``, as ``up`` submits them) whose ``--comment`` carries a deployment id
    ``owned`` matches (any, with ``down --any-owner``) and verify they ended; the other jobs of the
    name are left alone and named in ``report.others``."""
    cl = client or SlurmClient()
    job_name = f"k3-{name}"
    jobs = cl.jobs_named(job_name, owned)
    report = TeardownReport(verified=f"no job named {job_name}{owned.says()} of yours left in the queue")
    for job in jobs:
        cl.cancel(job)
        report.stopped.append(f"job {job}")
    left = poll_until(lambda: cl.jobs_named(job_name, owned), lambda ids: not ids, timeout=wait_s, interval=0.5) if jobs else []
    if left:
        report.leftovers["slurm"] = [f"job {j} still queued or running" for j in left]
    if not owned.anyone:
        others = [j for j in cl.jobs_named(job_name) if j not in jobs]
        if others:
            report.others["slurm"] = [f"job {j}" for j in others]
    return report
