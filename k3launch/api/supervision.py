"""Keeping a deployment serving: ``supervise`` (in the foreground, or detached), its events.

The restart policy is the inventory's ``restart:`` section (the inventory the deployment was
brought up from), each field overridable by the caller (``supervise``'s flags):
:mod:`k3launch.api.policy`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3launch.api._common import load, store
from k3launch.api.policy import monitoring_settings, restart_policy
from k3launch.errors import K3Error
from k3launch.models.access import Access

if TYPE_CHECKING:
    from k3launch.deploy.control import loop as loop_mod
    from k3launch.deploy.rollout import Gate
    from k3launch.deploy.state import StateStore
    from k3launch.models.plan import Plan
    from k3launch.models.record import DeploymentRecord, Supervisor
    from k3launch.models.rollout import RolloutState
    from k3launch.models.supervise import Event, RestartPolicy


def canary_lines(st: StateStore, name: str) -> Callable[[Plan, Collection[str] | None], list[str] | None]:
    """The supervisor's canary: ``name``'s baseline replayed on a plan, one line per mismatch
    (target, prompt, expected, got); None without a baseline. A target that does not answer is
    left to the health checks; a plan the baseline no longer describes (``rebaseline``) is not
    compared: its answers may differ on purpose."""
    from k3launch.deploy import canary as io

    def lines(plan: Plan, only: Collection[str] | None) -> list[str] | None:
        report = io.check(st, name, plan, only=only)
        if report is None or report.rebaseline:
            return None
        return [m.line() for m in report.mismatches]

    return lines


def supervise(name: str, *, state_dir: str | Path | None = None, policy: RestartPolicy | Mapping[str, Any] | None = None,
              on_event: Callable[[Event], None] | None = None, on_event_command: str | None = None, stop: threading.Event | None = None,
              access: Access = Access(), detached: bool = False,
              until_converged: bool = False) -> str:
    """Watch deployment ``name`` and keep it serving until stopped (``stop`` set, SIGINT or
    SIGTERM, a ``down``); the deployment itself is never stopped by stopping this. This is the
    one controller: it also converges the deployment's spec (a rollout written by ``rollout``).

    Returns why it ended: ``"stopped"``, ``"gone"`` (taken down), ``"failed"`` (gave up: nothing
    left running; the record says why), ``"converged"`` (``until_converged``: the spec's rollout
    is done or stopped). ``on_event`` gets every event (also appended to the event log:
    :func:`events`); ``on_event_command`` runs with each event as JSON on stdin."""
    from k3launch.deploy.control import loop
    from k3launch.deploy.registry import supervise_ops
    from k3launch.models.supervise import RestartPolicy

    st = store(state_dir)
    rec = st.load(name)
    refuse_self_supervised(rec)
    pol = policy if isinstance(policy, RestartPolicy) else restart_policy(name, policy, state_dir=state_dir)
    ops = supervise_ops(rec.backend, "supervise", [access])
    stop = stop or threading.Event()
    restore = _on_signals(stop)
    try:
        return loop.supervise(name, st, ops, pol, on_event=on_event or (lambda e: None), hook=on_event_command,
                                    detached=detached, stop=stop, places=_places(rec, state_dir), canary=canary_lines(st, name),
                                    gate_for=rollout_gate(st, name), until_converged=until_converged,
                                    metrics_listen=monitoring_settings(rec).listen)
    finally:
        restore()


def rollout_gate(st: StateStore, name: str) -> Callable[[RolloutState], Gate | None]:
    """A rollout's canary gate, made from the rollout's own settings (:func:`~k3launch.api._rollgate.canary_gate`)."""
    from k3launch.api._rollgate import canary_gate

    made: dict[int, Gate | None] = {}

    def gate_for(ro: RolloutState) -> Gate | None:
        key = id(ro)  # one gate per rollout: a rebaseline's first unit records, the later ones compare
        if key not in made:
            made.clear()
            made[key] = canary_gate(st, name, ro.rebaseline)
        return made[key]

    return gate_for


def _places(rec: DeploymentRecord, state_dir: str | Path | None) -> loop_mod.Places | None:
    """Cordon and re-plan on the inventory the deployment came from (None: it cannot be re-planned:
    no inventory file, or a plan made before plans kept their origin)."""
    from k3launch.api.planning import plan
    from k3launch.deploy import cordons
    from k3launch.deploy.control.loop import Places
    from k3launch.models.cordon import by_supervisor

    origin = rec.plan.origin
    if origin is None or not rec.inventory or not Path(rec.inventory).is_file():
        return None
    inv_path = rec.inventory
    st = store(state_dir)

    def cordon(node: str, reason: str) -> None:
        cordons.cordon(st, load(inv_path).inventory.name, [node], reason, by_supervisor(rec.name))

    def replan() -> Plan:
        held = st.nodes_in_use(exclude=rec.name)  # address -> deployment: other deployments' nodes are not spares
        inv = load(inv_path)
        taken = [n.name for n in inv.inventory.nodes if (n.address or n.name) in held]
        # every slot keeps its node unless it is lost: only the lost node's units move, onto spares
        # (planning again from the origin alone would shift every copy after the lost one by a node)
        cur = st.try_load(rec.name)
        slots = list(dict.fromkeys(p.node for p in (cur or rec).plan.processes if p.role != "router"))
        return plan(inv, selection=origin.selection, name=rec.name, exclude=[*origin.exclude, *taken], port_base=origin.port_base,
                    recipes_dir=origin.recipes_dir, state_dir=state_dir, keep=slots)

    def resize(total: int) -> Plan:
        held = st.nodes_in_use(exclude=rec.name)
        inv = load(inv_path)
        taken = [n.name for n in inv.inventory.nodes if (n.address or n.name) in held]
        cur = st.try_load(rec.name)
        slots = list(dict.fromkeys(p.node for p in (cur or rec).plan.processes if p.role != "router"))
        return plan(inv, selection={**origin.selection, "replicas": total}, name=rec.name, exclude=[*origin.exclude, *taken],
                    port_base=origin.port_base, recipes_dir=origin.recipes_dir, state_dir=state_dir, keep=slots)

    return Places(cordon, replan, resize)


def refuse_self_supervised(rec: DeploymentRecord) -> None:
    """A deployment that supervises itself (a Slurm job brought up with ``--supervise``) needs no supervisor."""
    job = rec.job
    if job is not None and job.supervised is not None:
        raise K3Error("self-supervised", f"{rec.name} supervises itself: job {job.job_id} restarts failed steps inside its allocation",
                      f"`k3launch events {rec.name}` shows what it did, `k3launch status {rec.name}` its restarts")


def _on_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGINT and SIGTERM set ``stop`` (a clean end between two looks), when called on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: object) -> None:
        stop.set()

    for s in old:
        signal.signal(s, handler)

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore


def supervise_detached(name: str, *, policy: RestartPolicy | Mapping[str, Any] | None = None, on_event_command: str | None = None,
                       state_dir: str | Path | None = None, access: Access = Access()) -> Supervisor:
    """Start a controller of ``name`` in the background and return it once it runs (its host and
    pid are in the record). Its policy (the inventory's, with ``policy``'s fields over it), hook
    and SSH settings are written to the deployment's spec first, as a new revision; refused
    (``already-supervised``, naming the pid) before anything is written when one runs already."""
    from k3launch.deploy.control import process
    from k3launch.models.backends import Feature, require
    from k3launch.models.supervise import RestartPolicy

    st = store(state_dir)
    rec = st.load(name)
    refuse_self_supervised(rec)
    require(rec.backend, Feature.SUPERVISE, "supervise")
    refuse_supervised(st, rec)
    process.refuse_not_ready(rec)  # said here, in its own words: a detached controller's refusal reaches us second-hand
    pol = policy if isinstance(policy, RestartPolicy) else restart_policy(name, policy, state_dir=state_dir)
    write_spec(st, name, policy=pol, hook=on_event_command, access=access)
    return process.detach(st, name)


def refuse_supervised(st: StateStore, rec: DeploymentRecord) -> None:
    """``already-supervised`` when a controller of ``rec`` runs (its lock is held)."""
    from k3launch.deploy.control.process import already_supervised, lock_path
    from k3launch.util.locks import held

    if held(lock_path(st, rec.name)):
        raise already_supervised(rec)


def write_spec(st: StateStore, name: str, access: Access | None = None, **change: Any) -> int:
    """A new revision of ``name``'s spec with ``change`` over the last one (fields of
    :class:`~k3launch.models.control.Spec`; ``access``: the SSH settings its controller uses);
    its revision number."""
    from k3launch.deploy.control.process import read_spec
    from k3launch.deploy.control.process import write_spec as write
    from k3launch.models.control.spec import Spec

    if access is not None:
        change = {**change, "accept_unknown_hosts": access.accept_unknown_hosts, "connect_timeout": access.connect_timeout}
    last = read_spec(st, name) or Spec()
    rec = st.try_load(name)
    done = rec.control.revision if rec is not None and rec.control is not None else 0
    spec = last.model_copy(update={**change, "revision": max(last.revision, done) + 1})
    if spec.rollout is not None and "rollout" in change:
        spec.rollout.revision = spec.revision  # adopted once, by the revision that brought it
    write(st, name, spec)
    return spec.revision


def stop_supervisor(name: str, *, state_dir: str | Path | None = None) -> str | None:
    """Stop ``name``'s supervisor if one runs (the deployment keeps running); a note, or None."""
    from k3launch.deploy.control import process

    return process.stop(store(state_dir), name)


def events(name: str, *, state_dir: str | Path | None = None) -> list[Event]:
    """Every event of ``name``'s event log (kept after ``down``), oldest first; for a Slurm job that
    supervises itself, merged with the job's own (``<log dir>/events.jsonl``)."""
    from k3launch.deploy import eventlog

    st = store(state_dir)
    return eventlog.read(st, name, _job_events(st.try_load(name)))


def follow_events(name: str, stop: Callable[[], bool], *, state_dir: str | Path | None = None) -> Iterator[Event]:
    """The events of ``name`` (and of its job, as :func:`events`), then each new one as it comes, until ``stop()``."""
    from k3launch.deploy import eventlog

    st = store(state_dir)
    return eventlog.follow(st, name, stop, also=_job_events(st.try_load(name)))


def _job_events(rec: DeploymentRecord | None) -> list[Path]:
    from k3launch.deploy.eventlog import JOB_EVENTS

    job = rec.job if rec is not None else None
    return [Path(job.log_dir) / JOB_EVENTS] if job is not None and job.log_dir else []
