"""The Slurm backend (inventories with ``backend: slurm``): one sbatch job per deployment.

``up`` is the shared skeleton with :class:`~k3launch.deploy.slurm.launch.SlurmLaunch`'s hooks;
``status``, ``logs`` and ``down`` read Slurm and the job's shared log directory
(:mod:`k3launch.deploy.slurm.ops`). Slurm arbitrates its own nodes, so there is no SSH here.
Besides the lifecycle: power sampling as a step of the job, and job arrays (its features:
:mod:`k3launch.models.backends`); its own options are :class:`~k3launch.deploy.options.SlurmOptions`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from k3launch.deploy import eventlog
from k3launch.deploy.base import Emit, Events, own, run_up
from k3launch.deploy.options import SlurmOptions, UpOptions
from k3launch.deploy.power import engine_nodes
from k3launch.deploy.readiness import ready_timeout
from k3launch.deploy.slurm import array
from k3launch.deploy.slurm.client import ACTIVE, SlurmClient
from k3launch.deploy.slurm.job import attached_record, bind_plan
from k3launch.deploy.slurm.launch import SlurmLaunch, job_policy, log_dir_for
from k3launch.deploy.slurm.ops import cancel_job, cancel_named, follow_files, observe_job, tail_logs
from k3launch.deploy.slurm.power import SrunSampler
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.identity import Owned
from k3launch.models.plan import Plan
from k3launch.models.power import Sampler
from k3launch.models.record import DeploymentRecord, SlurmRecord, Status
from k3launch.models.reports import ArrayJob, ArrayResult, DryRun, TeardownReport
from k3launch.planning.inventory import Inventory
from k3launch.render.sbatch import make_sbatch_string


class SlurmBackend:
    """sbatch/squeue/scancel from the login node; processes are job steps."""

    OPTIONS: ClassVar[tuple[type, ...]] = (SlurmOptions,)

    def __init__(self, options: SlurmOptions | None = None, client: SlurmClient | None = None) -> None:
        self.options = options or SlurmOptions()
        self.client = client  # None: a SlurmClient made where needed (tests hand in a FakeSlurm)

    # ------------------------------------------------------------------ lifecycle
    def up(self, plan: Plan, inv: Inventory, inv_path: str, store: StateStore, opts: UpOptions, events: Events) -> SlurmRecord:
        launch = SlurmLaunch(plan, inv, store, inventory=inv_path, on_stage=events.on_stage, extra_sbatch=self.options.extra_sbatch,
                             queue_timeout=self.options.queue_timeout, doctor=not opts.skip_doctor, use_bad_nodes=not opts.skip_doctor,
                             supervise=opts.supervise)
        run_up(launch, store, ready_timeout(plan, opts.ready_timeout), opts.keep_on_failure, events.on_failure, events.on_progress)
        return launch.record

    def status(self, rec: DeploymentRecord) -> Status:
        return observe_job(own(rec, SlurmRecord))

    def logs(self, rec: DeploymentRecord, ids: Sequence[str], lines: int, follow: bool, emit: Emit, everything: bool = False) -> None:
        r = own(rec, SlurmRecord)
        hosts = {p.id: r.slurm.hosts.get(p.node, p.node) for p in r.plan.processes}
        # without a filter, the job's own output (binding, doctor, which step ended) comes first
        for pid, text in tail_logs(r, ["job", *ids] if everything else list(ids), lines).items():
            emit(f"==> job {r.slurm.job_id} output <==" if pid == "job" else f"==> {pid} on {hosts[pid]} <==")
            emit(text.rstrip())
        if follow:
            follow_files(r, ids, emit)

    def down(self, rec: DeploymentRecord, store: StateStore, grace_s: float) -> TeardownReport:
        r = own(rec, SlurmRecord)
        report = cancel_job(r, store, grace_s=grace_s)
        if report.clean and r.slurm.log_dir:  # the job's own events outlive the record in the state directory's log
            eventlog.adopt(store, r.name, Path(r.slurm.log_dir) / eventlog.JOB_EVENTS)
        return report

    def sweep(self, name: str, inv: Inventory, grace_s: float, owned: Owned) -> TeardownReport:
        return cancel_named(name, owned=owned)

    def dry_run(self, plan: Plan, inv: Inventory | None, store: StateStore, opts: UpOptions) -> DryRun:
        """The sbatch script ``up`` would submit (without the submission-time exclusions)."""
        if inv is None or inv.slurm is None:  # the inventory model requires a slurm section for backend slurm
            raise K3Error("not-slurm", "a Slurm dry run needs the slurm inventory", "pass --inventory FILE")
        text = make_sbatch_string(plan, inv.slurm, log_dir_for(store, inv, plan.name), self.options.extra_sbatch,
                                  hf_token_file=inv.hf_token_file, supervise=job_policy(plan, opts.supervise),
                                  ident=store.new_deployment_id())  # `up` makes its own: this one is what `render`'s script carries
        return DryRun(plan.name, sbatch=text, files=((f"{plan.name}.sbatch", text),))

    # ------------------------------------------------------------------ power
    def power_sampler(self, rec: DeploymentRecord) -> Sampler:
        r = own(rec, SlurmRecord)
        return SrunSampler(r.slurm.job_id, {n: r.slurm.hosts.get(n) or n for n in engine_nodes(r)})

    # ------------------------------------------------------------------ the canary
    def served_plan(self, rec: DeploymentRecord) -> Plan:
        r = own(rec, SlurmRecord)
        return bind_plan(r.plan, r.slurm.addresses)  # the plan's nodes are placeholders for the allocated hosts

    # ------------------------------------------------------------------ job arrays
    def submit_array(self, plans: Sequence[Plan], inv: Inventory, log_dir: str, work: Callable[[int, Plan], Sequence[str]] | None,
                     concurrency: int | None, name: str, extra: Sequence[str], ready_timeout: float) -> list[ArrayJob]:
        return array.submit_array(plans, inv, log_dir, work=work, concurrency=concurrency, name=name, extra_sbatch=extra,
                                  ready_timeout=ready_timeout, client=self.client)

    def wait_array(self, job: ArrayJob, timeout: float) -> ArrayResult:
        return array.wait_array(job, timeout, self.client)

    def active_tasks(self, job_ids: Sequence[str]) -> set[str]:
        cl = self.client or SlurmClient()
        # one squeue per array: a single forgotten job id would make squeue refuse a joint query
        out: set[str] = set()
        for jid in sorted(set(job_ids)):
            states = array.task_states(jid, cl)
            if states is None:  # squeue failed (a busy controller): nothing known, so every task may still run
                out.add(f"{jid}_*")
            else:
                out |= {f"{jid}_{t}" for t, state in states.items() if state in ACTIVE}
        return out

    def attached_record(self, plan: Plan, env: Mapping[str, str], inventory: str | None) -> SlurmRecord:
        return attached_record(plan, env, inventory)
