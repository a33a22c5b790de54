"""The controller of a Slurm job that supervises itself (``k3launch up --supervise``).

A supervised job script binds its hosts, runs its doctor and prepare steps, then becomes
``PYTHON -m k3launch.deploy.slurm.injob <log dir>/control.json`` on the batch host (the job
library's ``k3_control``; PYTHON is the interpreter ``up`` ran under, recorded in the script: the
allocation's first node needs it at that path, with k3launch importable, and the script says so
and exits 2 when it cannot import this module). This is the one controller
(:func:`k3launch.deploy.control.loop.supervise`: the decisions of
:class:`~k3launch.models.control.decisions.Supervision`, carried out by its actor) with the job's steps
as its hands (:class:`~k3launch.deploy.slurm.steps.JobWatcher`):

1. it starts every step (engines, then the router) and waits until each HTTP process answers;
   a step that ends before that fails the job at once, named as an unsupervised job names it
   (``up`` on the login node reports it);
2. then it supervises: a step that exits, an engine whose ``/health`` stays silent for
   ``unhealthy_after`` (hung: SIGSTOPped, deadlocked), vLLM's fault-tolerance states, each
   restarts or recovers its recovery unit inside the allocation under the restart policy; the
   router's worker list follows the units that serve; a rollout written to its spec
   (``<log dir>/control/supervise/NAME.spec.json``, by ``k3launch rollout`` on the login node)
   rolls one unit at a time behind the router;
3. when it gives up (a role has no unit left) every step is stopped, the job's output names the
   reason, and it exits 1: the job ends FAILED; SIGTERM (``k3launch down``) stops every step within
   the grace ``down`` left in ``<log dir>/.k3launch-grace`` and exits 0.

Its state directory is ``<log dir>/control`` (:class:`~k3launch.deploy.control.process.JobStore`:
the record as the job binds it, the memory, the spec, its own event log); each event also goes to
``<log dir>/events.jsonl`` with the allocated host's name for the plan node (the watching event:
the batch host's), which the login node merges.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from k3launch.deploy.control.loop import supervise
from k3launch.deploy.control.process import JobStore, spec_path, stop_path
from k3launch.deploy.eventlog import JOB_EVENTS
from k3launch.deploy.slurm.job import bind_plan
from k3launch.deploy.slurm.steps import JobOps, Steps, say, start_order
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import ProcessRecord, SlurmJob, SlurmRecord
from k3launch.models.supervise import Event
from k3launch.render.sbatch import JobControl, node_order
from k3launch.transport.http import probe_all

POLL_S = 0.5  # while the steps first start
DEFAULT_GRACE_S = 10.0  # SIGTERM to SIGKILL when `down` left no grace


def _grace(log_dir: Path) -> float:
    """The grace ``down --grace`` left in the log directory (else ``K3_STOP_GRACE_S``, else 10 s)."""
    try:
        return float((log_dir / ".k3launch-grace").read_text().strip())
    except (OSError, ValueError):
        with contextlib.suppress(ValueError):
            return float(os.environ.get("K3_STOP_GRACE_S", ""))
    return DEFAULT_GRACE_S


def _record(ctl: JobControl, log_dir: Path, bound: Plan, hosts: dict[str, str], addresses: dict[str, str]) -> SlurmRecord:
    job = os.environ.get("SLURM_JOB_ID", "")
    now = time.time()
    procs = {p.id: ProcessRecord(id=p.id, node=p.node, runtime="slurm", handle=f"{job}:{p.id}", log=str(log_dir / f"{p.id}.log"),
                                 started=True) for p in bound.processes}
    return SlurmRecord(name=bound.name, state="starting", created=now, updated=now, endpoint=bound.endpoint, plan=bound, processes=procs,
                       deployment_id=ctl.ident, slurm=SlurmJob(job_id=job, log_dir=str(log_dir), script="", supervised=ctl.policy,
                                                               hosts=hosts, addresses=addresses))


def _append(path: Path, e: Event) -> None:
    """One line of ``<log dir>/events.jsonl`` (best effort: an event that cannot be written there is still in the controller's own log)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (e.model_dump_json(exclude_defaults=True) + "\n").encode())
        finally:
            os.close(fd)


def bring_up(steps: Steps, plan: Plan, stop: threading.Event, timeout: float) -> str:
    """Start every step and wait until each HTTP process answers: ``ready``, ``stopped`` (SIGTERM),
    or ``failed`` (a step ended first, said as the job script says it; or not serving in time)."""
    steps.start(plan, [p.id for p in plan.processes], keep_previous=False)
    http = [p for p in plan.processes if p.http_port is not None]
    urls = {p.id: f"http://{p.address}:{p.http_port}" for p in http}
    paths = {p.id: "/liveness" for p in http if p.role == "router"}
    t_end = time.monotonic() + timeout
    while not stop.is_set():
        ended = steps.ended()
        if ended:
            first, *others = [p.id for p in start_order(plan) if p.id in ended]
            say(f"{steps.where(plan, first)} exited with code {ended[first]}; stopping the deployment", err=True)
            stop.wait(1.0)  # ranks brought down by the first one follow within moments: named, so `up` can tell the cause
            for pid in [*others, *(p for p in steps.ended() if p not in ended)]:
                say(f"then {steps.where(plan, pid)} exited with code {steps.codes[pid]}", err=True)
            return "failed"
        ok = probe_all(urls, timeout=2.0, paths=paths)
        if all(ok.values()):
            return "ready"
        if time.monotonic() > t_end:
            say(f"not serving {timeout:g}s after the steps started (not answering: {', '.join(i for i, v in ok.items() if not v)})",
                err=True)
            return "failed"
        stop.wait(POLL_S)
    return "stopped"


def run(control: Path) -> int:
    """The job's controller, from its settings file; the job's exit code."""
    ctl = JobControl.model_validate_json(control.read_text())
    log_dir = control.parent
    order = node_order(ctl.plan)
    addresses = {n: os.environ.get(f"K3_ADDR_{i}", "") for i, n in enumerate(order)}
    hosts = {n: os.environ.get(f"K3_HOST_{i}", "") for i, n in enumerate(order)}
    if not all(addresses.values()) or not all(hosts.values()):
        say("K3_ADDR_i/K3_HOST_i are not set: the controller runs inside its job script only (after k3_bind)", err=True)
        return 2
    bound = bind_plan(ctl.plan, addresses)
    store = JobStore(log_dir)
    for stale in (spec_path(store, bound.name), stop_path(store, bound.name)):  # an earlier job's, in the same log directory
        stale.unlink(missing_ok=True)
    rec = _record(ctl, log_dir, bound, hosts, addresses)
    store.save(rec)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: stop.set())
    host = socket.gethostname().split(".")[0]
    steps = Steps(log_dir, rec.slurm.job_id, ctl.slurm, ctl.ident, [hosts[n] for n in order])
    failed: list[Event] = []
    blamed: list[str] = []  # the processes give-ups named

    def on_event(e: Event) -> None:
        _append(log_dir / JOB_EVENTS, e.model_copy(update={"node": hosts.get(e.node or "", e.node) if e.kind != "watching" else host}))
        say(f"{e.kind}: {e.unit + ': ' if e.unit else ''}{e.reason}")
        if e.kind == "failed":
            failed.append(e)
        elif e.kind == "gave-up" and e.process:
            blamed.append(e.process)

    try:
        outcome = bring_up(steps, bound, stop, ctl.policy.start_timeout or 1800.0)
        if outcome == "ready":
            rec.state = "ready"
            store.save(rec)
            say(f"supervising {bound.name}: every step serves")
            outcome = supervise(bound.name, store, JobOps(steps), ctl.policy, on_event=on_event, stop=stop, detached=True)
    except K3Error as exc:
        say(f"the controller stopped: {exc.message} ({exc.hint})", err=True)
        outcome = "failed"
    except Exception as exc:  # a bug: said, and the steps are still stopped (the job must not end with them half-stopped)
        say(f"the controller failed: {type(exc).__name__}: {exc}; report this as a k3launch bug", err=True)
        outcome = "failed"
    if outcome == "failed":
        plan = (store.try_load(bound.name) or rec).plan
        for pid in blamed:
            if pid in steps.codes:  # the line `up` reads the failing process from (as the fail-fast one)
                code = steps.codes[pid]
                say(f"{steps.where(plan, pid)} exited with code {code}; supervision gave up", err=True)
        if failed:
            say(f"supervision gave up: {failed[-1].reason}; stopping the deployment", err=True)
        steps.stop(list(steps.running), _grace(log_dir))
        return 1
    if stop.is_set():
        say("stop requested (SIGTERM); stopping the deployment")
    steps.stop(list(steps.running), _grace(log_dir))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        say("usage: python -m k3launch.deploy.slurm.injob LOG_DIR/control.json (run by a supervised job script)", err=True)
        return 2
    return run(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())
