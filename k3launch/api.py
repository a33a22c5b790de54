"""The Python API: plan, bring up, observe and tear down deployments from a script.

The CLI is a thin layer over these functions, so a benchmark script, a notebook or a submitit
job drives deployments exactly as a user at the shell does (same checks, same state records,
same errors)::

    from k3launch import api

    plan = api.plan("inventories/h200-pair.yaml", strategy="multi_node_tep", nodes=2)
    rec = api.up(plan, "inventories/h200-pair.yaml")       # returns once a completion came back
    print(rec.endpoint, api.status(rec.name).state)
    api.down(rec.name)

Every refusal is a :class:`~k3launch.errors.K3Error` (``code``, ``message``, ``hint``); a launch
that fails is a :class:`~k3launch.deploy.base.LaunchFailed` naming the failing process and node,
with its last log lines. This module is the only caller of the backends: it picks one from the
registry (:mod:`k3launch.deploy.registry`) by the inventory's or the record's ``backend``
(``ssh`` and ``local``: processes over SSH / on this machine; ``slurm``: one sbatch job per
deployment).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.deploy.base import Access, DoctorReport, DryRun, LaunchFailed, TeardownReport
    from k3launch.deploy.slurm.array import ArrayJob, ArrayResult
    from k3launch.deploy.ssh.fetch import NodeWeights
    from k3launch.deploy.ssh.fetch import Progress as FetchProgress
    from k3launch.deploy.state import StateStore
    from k3launch.models.phases import BringUp
    from k3launch.models.plan import Plan
    from k3launch.models.record import DeploymentRecord, StageFn, Status
    from k3launch.models.selection import Selection
    from k3launch.planning.inventory import Inventory
    from k3launch.transport.fleet import Fleet


def bundled_inventory(name: str) -> Path:
    """A shipped example inventory (``local`` is the embedded default of ``up``)."""
    from k3launch.util.resources import bundled

    path = bundled("inventories", f"{name}.yaml")
    if path is not None:
        return path
    raise K3Error("missing-inventory", f"the bundled {name} inventory is missing", "pass --inventory FILE")


def load(inventory: str | Path | Inventory | None) -> tuple[Inventory, str]:
    """(inventory, its path as recorded); ``None`` is the bundled local inventory."""
    from k3launch.planning.inventory import Inventory, load_placed

    if isinstance(inventory, Inventory):
        return inventory, inventory.name
    path = Path(inventory) if inventory is not None else bundled_inventory("local")
    return load_placed(path), str(path)


def plan(inventory: str | Path | Inventory | None = None, *, selection: Selection | Mapping[str, Any] | None = None,
         name: str | None = None, exclude: Sequence[str] = (), port_base: int | None = None, recipes_dir: str | Path | None = None,
         **fields: Any) -> Plan:
    """Build a plan from a :class:`~k3launch.models.selection.Selection` (or its fields as a mapping),
    and/or its fields as keywords (``strategy``, ``nodes``, ``hardware``, ``features``, ``sets``, ...;
    keywords win)."""
    from pydantic import ValidationError

    from k3launch.models.selection import Selection
    from k3launch.planning.build import build_plan
    from k3launch.planning.recipes import RecipeTree

    base = selection.model_dump() if isinstance(selection, Selection) else dict(selection or {})
    try:
        sel = Selection.model_validate({**base, **fields})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "selection"
        raise K3Error("bad-selection", f"selection {where}: {err['msg']}", "use Selection fields: " + ", ".join(Selection.model_fields)) from None
    inv = load(inventory)[0]
    return build_plan(RecipeTree(Path(recipes_dir) if recipes_dir else None), sel, inventory=inv, exclude=tuple(exclude),
                      port_base=port_base, name=name)


@dataclass(frozen=True)
class SchemaDumped:
    """What :func:`schema_dump` wrote: vLLM ``version``'s flag schema in ``path`` (``<out>/<version>/``)."""

    version: str
    path: Path
    flags: int  # `vllm serve` options (argparse actions with option strings)
    env_vars: int
    used: bool  # ``path`` is where plans look for schemas (:func:`~k3launch.planning.schema.user_schema_dir`)


def schema_dump(python: str | Path, out: str | Path | None = None) -> SchemaDumped:
    """Dump the ``vllm serve`` flag schema and the env names of the vLLM that ``python`` imports
    (vLLM runs in a child process of that interpreter, never in this one) into ``out/<version>/``;
    ``out`` defaults to where plans look first: ``$K3LAUNCH_SCHEMA_DIR``, else ``~/.k3launch/schemas``
    (the state directory's ``schemas/``). Plans then take ``--vllm-version <version>``."""
    from k3launch.planning.schema import user_schema_dir
    from k3launch.planning.schema_dump import check_dumped, dump

    root = Path(out).expanduser() if out is not None else user_schema_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise K3Error("write-failed", f"cannot create {root}: {exc.strerror}", "pass --out DIR (a writable directory)") from None
    vdir = dump(str(python), root)
    dumped = check_dumped(vdir)
    used = root.resolve() == user_schema_dir().resolve()
    return SchemaDumped(dumped.version, vdir, len(dumped.schema.specs), len(dumped.env_vars), used)


def _access(accept_unknown_hosts: bool, connect_timeout: float) -> Access:
    """How nodes are reached, with the same bounds as the CLI's options (a library caller's NaN
    or negative timeout is refused, not waited on forever)."""
    from k3launch.deploy.base import Access
    from k3launch.util import bounds

    return Access(accept_unknown_hosts, bounds.CONNECT_TIMEOUT.parse("connect_timeout", connect_timeout))


def _store(state_dir: str | Path | None) -> StateStore:
    from k3launch.deploy.state import StateStore

    return StateStore(Path(state_dir) if state_dir else None)


def up(plan: Plan, inventory: str | Path | Inventory | None = None, *, state_dir: str | Path | None = None,
       ready_timeout: float | None = None, keep_on_failure: bool = False, force: bool = False, skip_doctor: bool = False,
       accept_unknown_hosts: bool = False, connect_timeout: float = 10.0, extra_sbatch: Sequence[str] = (),
       queue_timeout: float | None = None, on_stage: StageFn | None = None, on_doctor: Callable[[DoctorReport], None] | None = None,
       on_failure: Callable[[LaunchFailed], None] | None = None, on_progress: Callable[[BringUp], None] | None = None) -> DeploymentRecord:
    """Start ``plan`` on the inventory's nodes and return once it serves (a real completion
    came back through its endpoint). Raises K3Error / LaunchFailed; on failure everything
    started is torn down unless ``keep_on_failure``. ``on_progress`` gets every process's phase
    after each poll; the record keeps the bring-up's timeline (``record.timeline``).

    Slurm: ``extra_sbatch`` lines are passed through as ``#SBATCH`` directives, ``queue_timeout``
    bounds the time in the queue (default: wait), ``skip_doctor`` leaves out the job's doctor
    step and the automatic exclusion of nodes it refused in the last day."""
    from k3launch.deploy.base import Events, UpOptions, no_op
    from k3launch.deploy.registry import backend

    inv, inv_path = load(inventory)
    if plan.backend != inv.backend and plan.backend != "none":
        raise K3Error("inventory-mismatch", f"the plan was built for backend {plan.backend}, the inventory is {inv.backend}",
                      "build the plan from the same inventory")
    store = _store(state_dir)
    if store.exists(plan.name):
        raise K3Error("deployment-exists", f"a deployment named {plan.name!r} already exists", f"`k3launch down {plan.name}` first, or pass --name")
    from k3launch.util import bounds

    opts = UpOptions(ready_timeout=None if ready_timeout is None else bounds.READY_TIMEOUT.parse("ready_timeout", ready_timeout),
                     keep_on_failure=keep_on_failure, force=force, skip_doctor=skip_doctor, access=_access(accept_unknown_hosts, connect_timeout),
                     extra_sbatch=tuple(extra_sbatch), queue_timeout=None if queue_timeout is None else bounds.QUEUE_TIMEOUT.parse("queue_timeout", queue_timeout))
    events = Events(on_stage or no_op, on_doctor or no_op, on_failure or no_op, on_progress or no_op)
    with store.lock(plan.name):
        return backend(inv.backend).up(plan, inv, inv_path, store, opts, events)


def dry_run(plan: Plan, inventory: str | Path | Inventory | None = None, *, state_dir: str | Path | None = None,
            extra_sbatch: Sequence[str] = ()) -> DryRun:
    """What ``up`` would run for ``plan`` (per-node scripts, or the sbatch script), and the same as
    files for ``render``; starts nothing. Without an inventory, a plan on placeholder nodes gets
    the SSH backend's scripts."""
    from k3launch.deploy.base import UpOptions
    from k3launch.deploy.registry import backend

    inv = load(inventory)[0] if inventory is not None else None
    name = inv.backend if inv is not None else plan.backend if plan.backend != "none" else "ssh"
    return backend(name).dry_run(plan, inv, _store(state_dir), UpOptions(extra_sbatch=tuple(extra_sbatch)))


def record(name: str, state_dir: str | Path | None = None) -> DeploymentRecord | None:
    """The record of deployment ``name``, or None when there is none (no error)."""
    store = _store(state_dir)
    return store.load(name) if store.exists(name) else None


def deployments(state_dir: str | Path | None = None) -> list[DeploymentRecord]:
    return _store(state_dir).list()


def status(name: str, *, state_dir: str | Path | None = None, accept_unknown_hosts: bool = False,
           connect_timeout: float = 10.0) -> Status:
    """The deployment now: per process alive and healthy, its state and endpoint (``status --json``)."""
    from k3launch.deploy.registry import backend

    rec = _store(state_dir).load(name)
    return backend(rec.backend).status(rec, _access(accept_unknown_hosts, connect_timeout))


def logs(name: str, emit: Callable[[str], None], *, role: str | None = None, node: str | None = None, lines: int = 40,
         follow: bool = False, state_dir: str | Path | None = None, accept_unknown_hosts: bool = False,
         connect_timeout: float = 10.0) -> None:
    """Hand ``emit`` the last ``lines`` of each process (only ``role``/``node`` when given; without
    them the backend's own log first, e.g. a Slurm job's output); ``follow`` keeps going (Ctrl-C)."""
    from k3launch.deploy.registry import backend

    rec = _store(state_dir).load(name)
    ids = [p.id for p in rec.plan.processes if (role is None or p.role == role) and (node is None or p.node == node)]
    if not ids:
        raise K3Error("no-processes", "no process matches --role/--node", "processes: " + ", ".join(f"{p.id}@{p.node}" for p in rec.plan.processes))
    backend(rec.backend).logs(rec, ids, lines, follow, emit, _access(accept_unknown_hosts, connect_timeout),
                              everything=role is None and node is None)


def down(name: str, *, state_dir: str | Path | None = None, grace: float = 10.0, accept_unknown_hosts: bool = False,
         connect_timeout: float = 10.0, inventory: str | Path | Inventory | None = None) -> TeardownReport:
    """Stop everything of ``name`` and verify; the record is deleted only when nothing is left.

    Works from any state. With a readable record: its processes, in order. With an unreadable one:
    the file is kept aside (``NAME.json.corrupt-<time>``, never deleted) and the deployment's
    processes, containers or Slurm jobs are searched for by name where ``inventory`` (else the one
    the record names, when that much can be read) runs deployments. Without a record: the same
    search, on ``inventory``'s machines or, without one, on this machine. Idempotent: a clean
    report when nothing of ``name`` is left (``report.verified`` says where that was checked)."""
    from k3launch.deploy.registry import backend

    store = _store(state_dir)
    from k3launch.util import bounds

    grace = bounds.GRACE.parse("grace", grace)
    access = _access(accept_unknown_hosts, connect_timeout)
    with store.lock(name):
        rec = store.try_load(name)
        if rec is not None:
            report = backend(rec.backend).down(rec, store, grace, access)
            if report.clean:
                store.delete(name)
            return report
        aside = None
        if store.exists(name):
            inventory = inventory if inventory is not None else _inventory_named_in(store.path(name))
            if inventory is None:
                raise K3Error("bad-state", f"{store.path(name)}: unreadable deployment record, and it does not say which inventory it ran on",
                              f"`k3launch down {name} --inventory FILE` keeps the file aside and stops what runs on the inventory's nodes")
            inv = load(inventory)[0]
            aside = str(store.set_aside(name))
        else:
            inv = load(inventory)[0]
        report = backend(inv.backend).sweep(name, inv, grace, access)
        report.set_aside = aside
        return report


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

    rec = _store(state_dir).load(name)
    body = json.dumps({"model": rec.plan.model, "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(rec.endpoint + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            data: dict[str, Any] = json.loads(r.read().decode())
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
        raise K3Error("chat-failed", f"{rec.endpoint}: {getattr(exc, 'reason', exc)}", f"check `k3launch status {name}`") from None
    return data


def fleet(rec: DeploymentRecord, accept_unknown_hosts: bool = False, connect_timeout: float = 10.0) -> Fleet:
    """A :class:`~k3launch.transport.fleet.Fleet` reaching the nodes of an ssh/local deployment, for
    commands on them (``bench --client engine``); the caller closes it."""
    from k3launch.deploy.ssh.backend import connect
    from k3launch.models.record import SshRecord

    if not isinstance(rec, SshRecord):
        raise K3Error("not-ssh", f"{rec.name} runs on {rec.backend}: its nodes are not reached over SSH", "use --client local")
    return connect(rec.plan, rec.ssh_config, rec.known_hosts, _access(accept_unknown_hosts, connect_timeout))


def submit_array(plans: Sequence[Plan], inventory: str | Path | Inventory, *, work: Callable[[int, Plan], Sequence[str]] | None = None,
                 concurrency: int | None = None, log_dir: str | Path | None = None, name: str = "k3-array",
                 extra_sbatch: Sequence[str] = (), ready_timeout: float = 1800.0, state_dir: str | Path | None = None) -> list[ArrayJob]:
    """Slurm: one job-array task per plan (one array per shape), each bringing its deployment up
    in its own allocation, running ``work(i, plan)`` (argv; ``K3LAUNCH_ENDPOINT`` set) once it
    serves, and tearing down. Returns :class:`~k3launch.deploy.slurm.array.ArrayJob` s; see :func:`wait_array`.
    Logs and per-task results go to ``log_dir`` (default ``<state dir>/slurm/arrays``)."""
    from k3launch.deploy.slurm.array import submit_array as _submit

    inv = load(inventory)[0]
    root = Path(log_dir) if log_dir else _store(state_dir).root / "slurm" / "arrays"
    return _submit(plans, inv, root, work=work, concurrency=concurrency, name=name, extra_sbatch=extra_sbatch, ready_timeout=ready_timeout)


def wait_array(job: ArrayJob, timeout: float = 3600.0) -> ArrayResult:
    """Wait for every task of an array job; its :class:`~k3launch.deploy.slurm.array.ArrayResult` (per-task results)."""
    from k3launch.deploy.slurm.array import wait_array as _wait

    return _wait(job, timeout)


def _ssh_fleet(plan: Plan, inventory: str | Path | Inventory | None, what: str, accept_unknown_hosts: bool,
               connect_timeout: float) -> tuple[Inventory, Fleet]:
    """The fleet reaching a plan's nodes for a command run on them outside a deployment (ssh/local)."""
    from k3launch.deploy.ssh.backend import connect

    inv = load(inventory)[0]
    if inv.backend == "slurm":
        raise K3Error("not-ssh", f"{what} reaches nodes over SSH; inventory {inv.name} runs Slurm jobs",
                      "on Slurm the job's own doctor step checks each node when `up` submits it")
    return inv, connect(plan, inv.ssh_config, inv.known_hosts, _access(accept_unknown_hosts, connect_timeout))


def doctor(plan: Plan, inventory: str | Path | Inventory | None = None, *, state_dir: str | Path | None = None, bandwidth: bool = False,
           min_busbw: float | None = None, accept_unknown_hosts: bool = False, connect_timeout: float = 10.0) -> DoctorReport:
    """The pre-flight checks ``up`` runs, on the plan's nodes, without starting anything; with
    ``bandwidth``, a short all-reduce per node and across nodes (``min_busbw`` GB/s to pass)."""
    from k3launch.deploy.ssh.bandwidth import measure
    from k3launch.deploy.ssh.doctor import doctor as run_doctor
    from k3launch.util import bounds

    if min_busbw is not None:
        min_busbw = bounds.BUSBW.parse("min_busbw", min_busbw)
    _, nodes = _ssh_fleet(plan, inventory, "doctor", accept_unknown_hosts, connect_timeout)
    try:
        report = run_doctor(plan, nodes, [r.name for r in _store(state_dir).list()])
        if bandwidth:
            report.checks += measure(plan, nodes, min_busbw)
        return report
    finally:
        nodes.close()


def weights_check(plan: Plan, inventory: str | Path | Inventory | None = None, *, accept_unknown_hosts: bool = False,
                  connect_timeout: float = 10.0) -> list[NodeWeights]:
    """Per engine node: is ``plan.model`` (at its ``--revision``) complete in the node's Hugging
    Face cache, and how much disk is free there (:mod:`k3launch.deploy.ssh.weights`)."""
    from k3launch.deploy.ssh.fetch import check

    _, nodes = _ssh_fleet(plan, inventory, "weights check", accept_unknown_hosts, connect_timeout)
    try:
        return check(plan, nodes)
    finally:
        nodes.close()


def weights_fetch(plan: Plan, inventory: str | Path | Inventory | None = None, *, from_path: str | None = None,
                  from_node: str | None = None, on_progress: Callable[[FetchProgress], None] | None = None, interval: float = 10.0,
                  accept_unknown_hosts: bool = False, connect_timeout: float = 10.0) -> list[NodeWeights]:
    """Bring ``plan.model`` to every engine node that lacks it, in parallel: from the hub on each
    node (the inventory's ``hf_token_file`` as the token), or copied from ``from_path`` (a
    directory the nodes share) or ``from_node`` (over the same SSH); ``on_progress`` every ``interval`` s."""
    from k3launch.deploy.ssh.fetch import Source, fetch
    from k3launch.util import bounds

    interval = bounds.PROGRESS_INTERVAL.parse("interval", interval)
    if from_path and from_node:
        raise K3Error("bad-source", "--from-path and --from-node both given", "pick one source (neither: the hub)")
    inv, nodes = _ssh_fleet(plan, inventory, "weights fetch", accept_unknown_hosts, connect_timeout)
    src = (Source("path", path=from_path) if from_path else Source("node", node=from_node) if from_node
           else Source("hub", token_file=inv.hf_token_file))
    try:
        return fetch(plan, nodes, src, on_progress, interval)
    finally:
        nodes.close()
