"""A deployment's life: ``up`` (and ``deployed``, a context manager around ``up`` and ``down``),
``status``, ``logs``, ``chat``, ``down``, and the records of the state directory.

Each call picks the backend from the registry by the inventory's or the record's ``backend``
(:mod:`k3launch.deploy.registry`) and hands it its own options: how nodes are reached
(``access``, an :class:`~k3launch.models.access.Access`: SSH backends) and the job's settings
(``extra_sbatch``, ``queue_timeout``: Slurm, refused elsewhere).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3launch.api._common import InventoryArg, load, store
from k3launch.api.policy import self_policy
from k3launch.errors import K3Error
from k3launch.models.access import Access
from k3launch.models.identity import ANY, Owned

if TYPE_CHECKING:
    from k3launch.deploy.state import StateStore
    from k3launch.models.phases import BringUp
    from k3launch.models.plan import Plan
    from k3launch.models.record import DeploymentRecord, StageFn, Status
    from k3launch.models.reports import DoctorReport, LaunchFailed, TeardownReport


def up(plan: Plan, inventory: InventoryArg = None, *, state_dir: str | Path | None = None,
       ready_timeout: float | None = None, keep_on_failure: bool = False, force: bool = False, skip_doctor: bool = False,
       access: Access = Access(), extra_sbatch: Sequence[str] = (),
       queue_timeout: float | None = None, supervise: bool | Mapping[str, Any] = False, on_stage: StageFn | None = None,
       on_doctor: Callable[[DoctorReport], None] | None = None, on_failure: Callable[[LaunchFailed], None] | None = None,
       on_progress: Callable[[BringUp], None] | None = None, canary: bool = True) -> DeploymentRecord:
    """Start ``plan`` on the inventory's nodes and return once it serves (a real completion
    came back through its endpoint). Raises K3Error / LaunchFailed; on failure everything
    started is torn down unless ``keep_on_failure``. ``on_progress`` gets every process's phase
    after each poll; the record keeps the bring-up's timeline (``record.timeline``).

    Slurm: ``extra_sbatch`` lines are passed through as ``#SBATCH`` directives, ``queue_timeout``
    bounds the time in the queue (default: wait), ``skip_doctor`` leaves out the job's doctor
    step and the automatic exclusion of nodes it refused in the last day. ``supervise``: the job
    supervises itself — it restarts failed steps inside its allocation under the inventory's
    ``restart:`` policy (a mapping overrides its fields); backends supervised from a login node
    refuse it (start :func:`supervise_detached` after ``up`` there).

    ``canary``: once it serves, record the correctness canary's baseline (docs/canary.md) on a
    backend that has the canary; how that went is ``record.canary`` — a failure to record is said
    there, never a failed ``up``."""
    from k3launch.api.cordons import refuse_cordoned
    from k3launch.deploy.base import Events, no_op
    from k3launch.deploy.options import SlurmOptions, UpOptions
    from k3launch.deploy.registry import backend
    from k3launch.util import bounds

    loaded = load(inventory)
    inv, inv_path = loaded
    if plan.backend != inv.backend and plan.backend != "none":
        raise K3Error("inventory-mismatch", f"the plan was built for backend {plan.backend}, the inventory is {inv.backend}",
                      "build the plan from the same inventory")
    refuse_cordoned(plan, loaded, state_dir)  # a plan made before a cordon (a script's, a campaign's) would use the node
    st = store(state_dir)
    if st.exists(plan.name):
        raise K3Error("deployment-exists", f"a deployment named {plan.name!r} already exists", f"`k3launch down {plan.name}` first, or pass --name")
    opts = UpOptions(ready_timeout=None if ready_timeout is None else bounds.READY_TIMEOUT.parse("ready_timeout", ready_timeout),
                     keep_on_failure=keep_on_failure, force=force, skip_doctor=skip_doctor, supervise=self_policy(inv, supervise))
    slurm = SlurmOptions(tuple(extra_sbatch), None if queue_timeout is None else bounds.QUEUE_TIMEOUT.parse("queue_timeout", queue_timeout))
    b = backend(inv.backend, [access, slurm])
    events = Events(on_stage or no_op, on_doctor or no_op, on_failure or no_op, on_progress or no_op)
    with st.lock(plan.name):
        from k3launch.deploy import canary as canary_io
        from k3launch.deploy import eventlog
        from k3launch.models.backends import Feature, spec

        eventlog.rotate(st, plan.name)  # a new life: the previous deployment of the name keeps its events as NAME.jsonl.1
        canary_io.forget(st, plan.name)  # ... and no baseline of the previous one (a `down` that never finished)
        rec = b.up(plan, inv, inv_path, st, opts, events)
        if canary and spec(inv.backend).supports(Feature.CANARY):
            from k3launch.api.canaries import record_at_ready

            record_at_ready(rec, st)
        return rec


@contextmanager
def deployed(plan: Plan, inventory: InventoryArg = None, *, state_dir: str | Path | None = None, grace: float = 10.0,
             **up_options: Any) -> Iterator[DeploymentRecord]:
    """``with api.deployed(plan, inv) as rec:`` — ``up``, then ``down`` when the block ends, however
    it ends (a failed ``up`` has torn itself down already). ``up_options`` are :func:`up`'s."""
    rec = up(plan, inventory, state_dir=state_dir, **up_options)
    try:
        yield rec
    finally:
        down(rec.name, state_dir=state_dir, grace=grace, access=up_options.get("access", Access()))


def ready_timeout(plan: Plan, override: float | None = None) -> float:
    """How long ``up`` waits for ``plan`` to serve: ``override``, else the plan's
    ``VLLM_ENGINE_READY_TIMEOUT_S``, else 1800 s."""
    from k3launch.deploy.readiness import ready_timeout as rule

    return rule(plan, override)


def record(name: str, state_dir: str | Path | None = None) -> DeploymentRecord | None:
    """The record of deployment ``name``, or None when there is none (no error)."""
    st = store(state_dir)
    return st.load(name) if st.exists(name) else None


def deployments(state_dir: str | Path | None = None) -> list[DeploymentRecord]:
    return store(state_dir).list()


def nodes_in_use(state_dir: str | Path | None = None) -> dict[str, str]:
    """Node address -> the live deployment holding it (the rule ``up`` refuses nodes by)."""
    return store(state_dir).nodes_in_use()


def state_root(state_dir: str | Path | None = None) -> Path:
    """The state directory itself (``--state-dir``, ``$K3LAUNCH_STATE_DIR``, else ``~/.k3launch``)."""
    return store(state_dir).root


def bench_dir(name: str, state_dir: str | Path | None = None) -> Path:
    """Where ``bench`` keeps deployment ``name``'s results by default (``<state dir>/bench/NAME``)."""
    return store(state_dir).bench_dir(name)


def status(name: str, *, state_dir: str | Path | None = None, access: Access = Access()) -> Status:
    """The deployment now: per process alive and healthy, its state and endpoint (``status --json``);
    with copies (``--replicas``), each process's copy and each copy's state."""
    from k3launch.deploy.control.process import alive
    from k3launch.deploy.registry import backend
    from k3launch.models.record import SupervisorStatus, with_replicas

    st = store(state_dir)
    rec = st.load(name)
    snap = with_replicas(backend(rec.backend, [access]).status(rec), rec.plan)
    sv = rec.supervisor
    if sv is not None and alive(sv):
        snap.supervisor = SupervisorStatus(host=sv.host, pid=sv.pid, since=sv.since, detached=sv.detached,
                                         restarts=max(sv.restarts, rec.control.restarts if rec.control is not None else 0))
    if snap.state == "failed" and rec.state == "ready":  # it failed on its own (a self-supervising job gave up): say so in the record
        with contextlib.suppress(K3Error), st.lock(name):  # another command acting on it (a `down`) has the last word
            cur = st.try_load(name)
            if cur is not None and cur.state == "ready":
                cur.state, cur.error = "failed", snap.error
                st.save(cur)
    snap.error = snap.error or (rec.error if rec.state == "failed" else None)
    if rec.rollout is not None:
        from k3launch.models.rollout import RolloutStatus

        snap.rollout = RolloutStatus.of(rec.rollout)
    if rec.holds_nodes:  # ssh and local: the router is reached from here (a Slurm job's is on its allocation)
        from k3launch.api._units import unit_states

        snap.units, why = unit_states(rec, snap)
        if why is not None:
            snap.state, snap.reason = why.split(":", 1)[0], why
    return snap


def logs(name: str, emit: Callable[[str], None], *, role: str | None = None, node: str | None = None, lines: int = 40,
         follow: bool = False, state_dir: str | Path | None = None, access: Access = Access()) -> None:
    """Hand ``emit`` the last ``lines`` of each process (only ``role``/``node`` when given; without
    them the backend's own log first, e.g. a Slurm job's output); ``follow`` keeps going (Ctrl-C)."""
    from k3launch.deploy.registry import backend

    rec = store(state_dir).load(name)
    ids = [p.id for p in rec.plan.processes if (role is None or p.role == role) and (node is None or p.node == node)]
    if not ids:
        raise K3Error("no-processes", "no process matches --role/--node", "processes: " + ", ".join(f"{p.id}@{p.node}" for p in rec.plan.processes))
    backend(rec.backend, [access]).logs(rec, ids, lines, follow, _without_probes(emit),
                                                                              everything=role is None and node is None)


def _without_probes(emit: Callable[[str], None]) -> Callable[[str], None]:
    """``emit``, handed each text without the access-log lines of /health and /metrics polls (an
    engine not told to leave them out logs one every few seconds, burying its own lines)."""
    from k3launch.models.phases import probe_access

    def out(text: str) -> None:
        lines = text.split("\n")
        kept = [line for line in lines if not probe_access(line)]
        if kept or not lines:
            emit("\n".join(kept))

    return out


def down(name: str, *, state_dir: str | Path | None = None, grace: float = 10.0, access: Access = Access(),
         inventory: InventoryArg = None, any_owner: bool = False) -> TeardownReport:
    """Stop everything of ``name`` and verify; the record is deleted only when nothing is left.

    A supervisor watching it is stopped first (it never revives what ``down`` stops; one
    in the middle of a restart gives way). Works from any state. With a readable record: its
    processes, in order -- those carrying its deployment id (:mod:`k3launch.models.identity`;
    a record older than ids: every process of its name). Without one — no record, or one that
    cannot be read (garbage, empty, the wrong shape: the file is kept aside as
    ``NAME.json.corrupt-<time>``, never deleted) — the deployment's processes, containers or Slurm
    jobs are searched for by name on ``inventory``'s machines, else on those of the inventory an
    unreadable record still names, else on this machine (the report's ``hint`` then says to pass
    ``inventory`` if it ran elsewhere), and only those started from this state directory (their
    deployment id starts with its id) are stopped: a same-named deployment of another state
    directory is never touched, only named in ``report.others``. ``any_owner``: stop every
    process of the name, whoever started it (a deployment of another state directory, one started
    before deployment ids, a rendered script run by hand elsewhere).

    Idempotent for a name this state directory knows (a record, one set aside, or a clean
    ``down`` of it before: ``NAME.gone``): a clean report when nothing of ``name`` is left
    (``report.verified`` says where that was checked). A name it never knew, with nothing found,
    is a typo more likely than a deployment: K3Error ``unknown-deployment``, naming the
    deployments it holds whose names are close."""
    from k3launch.deploy.control.process import forget
    from k3launch.deploy.control.process import stop as stop_supervisor
    from k3launch.deploy.registry import backend
    from k3launch.util import bounds

    st = store(state_dir)
    grace = bounds.GRACE.parse("grace", grace)
    stopped = stop_supervisor(st, name)  # first: a supervisor must never revive what `down` stops
    with st.lock(name):
        rec = st.try_load(name)
        if rec is not None:
            report = backend(rec.backend, [access]).down(rec, st, grace)
            report.supervisor = stopped
            if rec.rollout is not None and not rec.rollout.stopped:  # its controller was stopped above: the rollout ends here
                report.rollout = " ".join(rec.rollout.changes)
            if report.clean:
                from k3launch.deploy import canary

                with contextlib.suppress(K3Error):  # a nicety: a full disk must not fail a finished teardown
                    st.mark_gone(name, rec.deployment_id)  # before the record goes: a repeated `down` of the name is a no-op, not a typo
                st.delete(name)
                forget(st, name)
                canary.forget(st, name)
            return report
        unreadable = st.exists(name)
        known = st.knew(name)
        if inventory is None and unreadable:
            inventory = _inventory_named_in(st.path(name))
        here = inventory is None
        inv = load(inventory).inventory  # None: the bundled local inventory, this machine
        aside = str(st.set_aside(name)) if unreadable else None
        report = backend(inv.backend, [access]).sweep(name, inv, grace, ANY if any_owner else Owned.from_state(st.state_id(create=False)))
        if report.clean:
            from k3launch.deploy import canary

            canary.forget(st, name)
            if report.stopped and not any_owner:  # what it stopped was this directory's: the name was too
                with contextlib.suppress(K3Error):
                    st.mark_gone(name)
        report.set_aside = aside
        where = "this machine" if here else f"the machines of inventory {inv.name}"
        if report.clean and not report.stopped and not known:
            raise _unknown(st, name, where, any_owner, report.others)
        if report.others:
            report.hint = (f"{name} also runs under another owner (another state directory's deployment, or one started before "
                           f"deployment ids) and was left alone: `k3launch down {name} --any-owner` stops it too")
        elif here:
            report.hint = f"only this machine was searched: `k3launch down {name} --inventory FILE` searches the nodes of an inventory"
        return report


def _unknown(st: StateStore, name: str, where: str, any_owner: bool, others: Mapping[str, Sequence[str]]) -> K3Error:
    """``down`` of a name this state directory never held, with nothing of it found that is its
    own: say so, and name the close ones (a typo is the likely cause) -- or, when the name runs
    under another owner (``others``), where, and how to stop it anyway."""
    if others:
        seen = "; ".join(f"{', '.join(items)} on {node}" for node, items in sorted(others.items()))
        return K3Error("unknown-deployment", f"no deployment named {name!r} in {st.root}; one of another state directory "
                       f"(or an older k3launch) runs on {where} and was left alone: {seen}",
                       f"stop it from the state directory that started it (--state-dir), or `k3launch down {name} --any-owner`")
    near = st.near_names(name)
    if near:
        hint = f"did you mean {' or '.join(near)}? `k3launch list` shows the deployments"
    else:
        known = [r.name for r in st.list()]
        hint = f"deployments here: {', '.join(known[:10])}{', ...' if len(known) > 10 else ''}" if known else "no deployment is recorded here"
        hint += "; pass --state-dir (or K3LAUNCH_STATE_DIR) if it was started from another state directory"
        if where == "this machine":
            hint += ", or --inventory FILE if it ran elsewhere"
    searched = f"nothing of it{'' if any_owner else ' started from here'} runs on {where}"
    return K3Error("unknown-deployment", f"no deployment named {name!r} in {st.root}, and {searched}", hint)


def _inventory_named_in(path: Path) -> str | None:
    """The inventory path an unreadable record still names (best effort: a truncated or
    wrong-shaped record often keeps its ``"inventory": "..."`` line), if that file exists."""
    import re

    try:
        m = re.search(r'"inventory":\s*("(?:[^"\\]|\\.)*")', path.read_text(errors="replace"))
        found = json.loads(m.group(1)) if m else None
    except (OSError, ValueError):
        return None
    return found if isinstance(found, str) and Path(found).is_file() else None


def chat(name: str, message: str, *, max_tokens: int = 64, state_dir: str | Path | None = None) -> Mapping[str, Any]:
    """One chat completion through the deployment's public endpoint: vLLM's JSON answer."""
    import urllib.error
    import urllib.request

    rec = store(state_dir).load(name)
    body = json.dumps({"model": rec.plan.model, "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(rec.endpoint + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            data: dict[str, Any] = json.loads(r.read().decode())
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
        raise K3Error("chat-failed", f"{rec.endpoint}: {getattr(exc, 'reason', exc)}", f"check `k3launch status {name}`") from None
    return data
