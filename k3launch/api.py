"""The Python API: plan, bring up, observe and tear down deployments from a script.

The CLI commands ``up``/``status``/``down``/``list`` are thin wrappers of these functions, so a
benchmark script, a notebook or a submitit job drives deployments exactly as a user at the
shell does (same checks, same state records, same errors)::

    from k3launch import api

    plan = api.plan("inventories/h200-pair.yaml", strategy="multi_node_tep", nodes=2)
    rec = api.up(plan, "inventories/h200-pair.yaml")       # returns once a completion came back
    print(rec.endpoint)
    api.down(rec.name)

Every refusal is a :class:`~k3launch.errors.K3Error` (``code``, ``message``, ``hint``); a launch
that fails is a :class:`~k3launch.deploy.ssh.launch.LaunchFailed` naming the failing process and node,
with its last log lines. Backends: ``ssh`` and ``local`` (processes over SSH / on this machine)
and ``slurm`` (one sbatch job per deployment, :mod:`k3launch.deploy.slurm.launch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.deploy.slurm.array import ArrayJob, ArrayResult
    from k3launch.deploy.ssh.doctor import DoctorReport
    from k3launch.deploy.ssh.launch import LaunchFailed
    from k3launch.deploy.ssh.teardown import TeardownReport
    from k3launch.deploy.state import DeploymentRecord
    from k3launch.models.plan import Plan
    from k3launch.planning.inventory import Inventory
    from k3launch.transport.fleet import Fleet

StageFn = Callable[[str, str], None]


def bundled_inventory(name: str) -> Path:
    """A shipped example inventory (``local`` is the embedded default of ``up``)."""
    from k3launch.resources import bundled

    path = bundled("inventories", f"{name}.yaml")
    if path is not None:
        return path
    raise K3Error("missing-inventory", f"the bundled {name} inventory is missing", "pass --inventory FILE")


def load(inventory: str | Path | Inventory | None) -> tuple[Inventory, str]:
    """(inventory, its path as recorded); ``None`` is the bundled local inventory."""
    from k3launch.planning.inventory import Inventory, apply_ssh_config, load_inventory, read_ssh_config

    if isinstance(inventory, Inventory):
        return inventory, inventory.name
    path = Path(inventory) if inventory is not None else bundled_inventory("local")
    inv = load_inventory(path)
    if inv.backend == "ssh":
        inv = apply_ssh_config(inv, read_ssh_config(inv))
    return inv, str(path)


def plan(inventory: str | Path | Inventory | None = None, *, name: str | None = None, exclude: Sequence[str] = (),
         port_base: int | None = None, recipes_dir: str | Path | None = None, **selection: Any) -> Plan:
    """Build a plan: ``selection`` takes :class:`~k3launch.models.selection.Selection` fields
    (``strategy``, ``nodes``, ``hardware``, ``features``, ``sets``, ...)."""
    from k3launch.models.selection import Selection
    from k3launch.planning.build import build_plan
    from k3launch.planning.recipes import RecipeTree

    try:
        sel = Selection(**selection)
    except TypeError as exc:
        raise K3Error("bad-selection", f"selection: {exc}", "use Selection fields: strategy, nodes, hardware, ...") from None
    inv = load(inventory)[0]
    return build_plan(RecipeTree(Path(recipes_dir) if recipes_dir else None), sel, inventory=inv, exclude=tuple(exclude),
                      port_base=port_base, name=name)


def up(plan: Plan, inventory: str | Path | Inventory | None = None, *, state_dir: str | Path | None = None,
       ready_timeout: float | None = None, keep_on_failure: bool = False, force: bool = False, skip_doctor: bool = False,
       accept_unknown_hosts: bool = False, connect_timeout: float = 10.0, extra_sbatch: Sequence[str] = (),
       queue_timeout: float | None = None, on_stage: StageFn | None = None, on_doctor: Callable[[DoctorReport], None] | None = None,
       on_failure: Callable[[LaunchFailed], None] | None = None) -> DeploymentRecord:
    """Start ``plan`` on the inventory's nodes and return once it serves (a real completion
    came back through its endpoint). Raises K3Error / LaunchFailed; on failure everything
    started is torn down unless ``keep_on_failure``.

    Slurm: ``extra_sbatch`` lines are passed through as ``#SBATCH`` directives, ``queue_timeout``
    bounds the time in the queue (default: wait), ``skip_doctor`` leaves out the job's doctor
    step and the automatic exclusion of nodes it refused in the last day."""
    from k3launch.deploy.state import StateStore

    inv, inv_path = load(inventory)
    if plan.backend != inv.backend and not (plan.backend == "none"):
        raise K3Error("inventory-mismatch", f"the plan was built for backend {plan.backend}, the inventory is {inv.backend}",
                      "build the plan from the same inventory")
    store = StateStore(Path(state_dir) if state_dir else None)
    if store.exists(plan.name):
        raise K3Error("deployment-exists", f"a deployment named {plan.name!r} already exists", f"`k3launch down {plan.name}` first, or pass --name")
    stage = on_stage or (lambda s, m: None)
    if inv.backend == "slurm":
        from k3launch.deploy.slurm.launch import SlurmLaunch

        with store.lock(plan.name):
            sl = SlurmLaunch(plan, inv, store, inventory=inv_path, on_stage=stage, on_failure=on_failure or (lambda e: None),
                             extra_sbatch=tuple(extra_sbatch), queue_timeout=queue_timeout, doctor=not skip_doctor)
            return sl.up(timeout=ready_timeout, keep_on_failure=keep_on_failure, use_bad_nodes=not skip_doctor)
    if extra_sbatch:
        raise K3Error("not-slurm", "--extra-sbatch applies to slurm inventories only", "drop --extra-sbatch")
    from k3launch.deploy.ssh.doctor import doctor
    from k3launch.deploy.ssh.launch import Launch

    held = store.nodes_in_use()
    clash = sorted({f"{h.name} ({held[h.address]})" for h in plan.hosts if h.address in held and h.gpus})
    if clash and not force:
        raise K3Error("nodes-in-use", f"nodes held by live deployments: {', '.join(clash)}", "`k3launch down` that deployment, --exclude the nodes, or pass --force")
    fleet = fleet_for(plan, inv.ssh_config, inv.known_hosts, accept_unknown_hosts, connect_timeout)
    with store.lock(plan.name):
        try:
            if not skip_doctor:
                report = doctor(plan, fleet, [r.name for r in store.list()])
                if on_doctor:
                    on_doctor(report)
                if not report.ok:
                    raise report.error()
                stage("doctor", f"{len(fleet.nodes())} node(s) checked")
            launch = Launch(plan, fleet, store, inventory=inv_path, hf_token_file=inv.hf_token_file, on_stage=stage,
                            on_failure=on_failure or (lambda e: None), ssh_config=inv.ssh_config, known_hosts=inv.known_hosts)
            return launch.up(timeout=ready_timeout, keep_on_failure=keep_on_failure)
        finally:
            fleet.close()


def fleet_for(plan: Plan, ssh_config: str | None = None, known_hosts: str | None = None, accept_unknown: bool = False,
              connect_timeout: float = 10.0) -> Fleet:
    """The :class:`~k3launch.transport.fleet.Fleet` that reaches a plan's nodes (ssh or local)."""
    from k3launch.transport.fleet import Fleet
    from k3launch.transport.runners import LocalRunner, SshRunner

    if plan.backend == "ssh":
        runner = SshRunner(known_hosts=known_hosts, ssh_config=ssh_config, accept_unknown_hosts=accept_unknown, connect_timeout=connect_timeout)
        return Fleet.for_plan(plan, runner, LocalRunner())
    return Fleet.for_plan(plan)


def status(name: str, *, state_dir: str | Path | None = None, accept_unknown_hosts: bool = False,
           connect_timeout: float = 10.0) -> dict[str, object]:
    """``{name, state, endpoint, processes: [{id, node, role, alive, healthy}], unreachable, ...}``."""
    from k3launch.deploy.state import StateStore

    rec = StateStore(Path(state_dir) if state_dir else None).load(name)
    if rec.slurm is not None:
        from k3launch.deploy.slurm.ops import observe_job

        return observe_job(rec)
    from k3launch.deploy.ssh.observe import observe

    fleet = fleet_for(rec.plan, rec.ssh_config, rec.known_hosts, accept_unknown_hosts, connect_timeout)
    try:
        return observe(rec, fleet)
    finally:
        fleet.close()


def down(name: str, *, state_dir: str | Path | None = None, grace: float = 10.0, accept_unknown_hosts: bool = False,
         connect_timeout: float = 10.0) -> TeardownReport:
    """Stop everything of ``name`` and verify; the record is deleted only when nothing is left."""
    from k3launch.deploy.ssh.teardown import teardown
    from k3launch.deploy.state import StateStore

    store = StateStore(Path(state_dir) if state_dir else None)
    with store.lock(name):
        rec = store.load(name)
        if rec.slurm is not None:
            from k3launch.deploy.slurm.ops import cancel_job

            report = cancel_job(rec, store, grace_s=grace)
        else:
            fleet = fleet_for(rec.plan, rec.ssh_config, rec.known_hosts, accept_unknown_hosts, connect_timeout)
            try:
                report = teardown(rec, fleet, store, grace_s=grace)
            finally:
                fleet.close()
        if report.clean:
            store.delete(name)
    return report


def record(name: str, state_dir: str | Path | None = None) -> DeploymentRecord | None:
    """The record of deployment ``name``, or None when there is none (no error)."""
    from k3launch.deploy.state import StateStore

    store = StateStore(Path(state_dir) if state_dir else None)
    return store.load(name) if store.exists(name) else None


def deployments(state_dir: str | Path | None = None) -> list[DeploymentRecord]:
    from k3launch.deploy.state import StateStore

    return StateStore(Path(state_dir) if state_dir else None).list()


def submit_array(plans: Sequence[Plan], inventory: str | Path | Inventory, *, work: Callable[[int, Plan], Sequence[str]] | None = None,
                 concurrency: int | None = None, log_dir: str | Path | None = None, name: str = "k3-array",
                 extra_sbatch: Sequence[str] = (), ready_timeout: float = 1800.0, state_dir: str | Path | None = None) -> list[ArrayJob]:
    """Slurm: one job-array task per plan (one array per shape), each bringing its deployment up
    in its own allocation, running ``work(i, plan)`` (argv; ``K3LAUNCH_ENDPOINT`` set) once it
    serves, and tearing down. Returns :class:`~k3launch.deploy.slurm.array.ArrayJob` s; see :func:`wait_array`.
    Logs and per-task results go to ``log_dir`` (default ``<state dir>/slurm/arrays``)."""
    from k3launch.deploy.slurm.array import submit_array as _submit
    from k3launch.deploy.state import StateStore

    inv = load(inventory)[0]
    root = Path(log_dir) if log_dir else StateStore(Path(state_dir) if state_dir else None).root / "slurm" / "arrays"
    return _submit(plans, inv, root, work=work, concurrency=concurrency, name=name, extra_sbatch=extra_sbatch, ready_timeout=ready_timeout)


def wait_array(job: ArrayJob, timeout: float = 3600.0) -> ArrayResult:
    """Wait for every task of an array job; its :class:`~k3launch.deploy.slurm.array.ArrayResult` (per-task results)."""
    from k3launch.deploy.slurm.array import wait_array as _wait

    return _wait(job, timeout)
