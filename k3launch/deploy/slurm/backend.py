"""The Slurm backend (inventories with ``backend: slurm``): one sbatch job per deployment.

``up`` is the shared skeleton with :class:`~k3launch.deploy.slurm.launch.SlurmLaunch`'s hooks;
``status``, ``logs`` and ``down`` read Slurm and the job's shared log directory
(:mod:`k3launch.deploy.slurm.ops`). Slurm arbitrates its own nodes, so there is no SSH here.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3launch.deploy.base import Access, DryRun, Emit, Events, TeardownReport, UpOptions, own, ready_timeout, run_up
from k3launch.deploy.slurm.launch import SlurmLaunch, log_dir_for
from k3launch.deploy.slurm.ops import cancel_job, cancel_named, follow_files, observe_job, tail_logs
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord, SlurmRecord, Status
from k3launch.planning.inventory import Inventory
from k3launch.render.sbatch import make_sbatch_string


class SlurmBackend:
    """sbatch/squeue/scancel from the login node; processes are job steps."""

    def up(self, plan: Plan, inv: Inventory, inv_path: str, store: StateStore, opts: UpOptions, events: Events) -> SlurmRecord:
        launch = SlurmLaunch(plan, inv, store, inventory=inv_path, on_stage=events.on_stage, extra_sbatch=opts.extra_sbatch,
                             queue_timeout=opts.queue_timeout, doctor=not opts.skip_doctor, use_bad_nodes=not opts.skip_doctor)
        run_up(launch, store, ready_timeout(plan, opts.ready_timeout), opts.keep_on_failure, events.on_failure, events.on_progress)
        return launch.record

    def status(self, rec: DeploymentRecord, access: Access) -> Status:
        return observe_job(own(rec, SlurmRecord))

    def logs(self, rec: DeploymentRecord, ids: Sequence[str], lines: int, follow: bool, emit: Emit, access: Access,
             everything: bool = False) -> None:
        r = own(rec, SlurmRecord)
        hosts = {p.id: r.slurm.hosts.get(p.node, p.node) for p in r.plan.processes}
        # without a filter, the job's own output (binding, doctor, which step ended) comes first
        for pid, text in tail_logs(r, ["job", *ids] if everything else list(ids), lines).items():
            emit(f"==> job {r.slurm.job_id} output <==" if pid == "job" else f"==> {pid} on {hosts[pid]} <==")
            emit(text.rstrip())
        if follow:
            follow_files(r, ids, emit)

    def down(self, rec: DeploymentRecord, store: StateStore, grace_s: float, access: Access) -> TeardownReport:
        return cancel_job(own(rec, SlurmRecord), store, grace_s=grace_s)

    def sweep(self, name: str, inv: Inventory, grace_s: float, access: Access) -> TeardownReport:
        return cancel_named(name)

    def dry_run(self, plan: Plan, inv: Inventory | None, store: StateStore, opts: UpOptions) -> DryRun:
        """The sbatch script ``up`` would submit (without the submission-time exclusions)."""
        if inv is None or inv.slurm is None:  # the inventory model requires a slurm section for backend slurm
            raise K3Error("not-slurm", "a Slurm dry run needs the slurm inventory", "pass --inventory FILE")
        text = make_sbatch_string(plan, inv.slurm, log_dir_for(store, inv, plan.name), opts.extra_sbatch, hf_token_file=inv.hf_token_file)
        return DryRun(plan.name, sbatch=text, files=((f"{plan.name}.sbatch", text),))
