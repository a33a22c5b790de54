"""The SSH backend (inventories with ``backend: ssh``, and ``local`` for this machine).

Every node is reached through one :class:`~k3launch.transport.fleet.Fleet` (SSH with host keys
verified, or local commands), opened for one command and closed after it. ``up`` refuses nodes
another live deployment holds (``--force`` overrides), runs the ``doctor`` pre-flight checks,
then the shared ``up`` skeleton with :class:`~k3launch.deploy.ssh.launch.Launch`'s hooks.
Besides the lifecycle it implements the node operations (``doctor``, ``weights``, ``fleet``) and
power sampling over the fleet (its features: :mod:`k3launch.models.backends`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

from k3launch.deploy.base import Emit, Events, own, run_up
from k3launch.deploy.options import UpOptions
from k3launch.deploy.power import FleetSampler, engine_nodes
from k3launch.deploy.readiness import ready_timeout
from k3launch.deploy.ssh.bandwidth import measure
from k3launch.deploy.ssh.doctor import doctor
from k3launch.deploy.ssh.fetch import check, fetch, fetch_command
from k3launch.deploy.ssh.launch import Launch, node_script, start_steps
from k3launch.deploy.ssh.observe import follow_logs, observe, tail_logs
from k3launch.deploy.ssh.probe import probe
from k3launch.deploy.ssh.stage import stage
from k3launch.deploy.ssh.teardown import sweep, teardown
from k3launch.deploy.ssh.watch import SshWatcher
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.access import Access
from k3launch.models.backends import spec
from k3launch.models.caches import CacheDir
from k3launch.models.identity import Owned
from k3launch.models.plan import Host, Plan
from k3launch.models.power import Sampler
from k3launch.models.record import DeploymentRecord, SshRecord, Stage, Status
from k3launch.models.reports import DoctorReport, DryRun, DryRunStep, TeardownReport
from k3launch.models.weights import FetchProgress, NodeWeights, Probe, Source
from k3launch.planning.build import inventory_hosts
from k3launch.planning.inventory import Inventory
from k3launch.render.scripts import script, script_names
from k3launch.transport.fleet import Fleet
from k3launch.transport.runners import LocalRunner, SshRunner


def connect(plan: Plan, ssh_config: str | None = None, known_hosts: str | None = None, access: Access | None = None) -> Fleet:
    """The :class:`~k3launch.transport.fleet.Fleet` that reaches a plan's nodes (ssh or local)."""
    return _fleet(plan.backend, plan.hosts, ssh_config, known_hosts, access, plan)


def _fleet(backend: str, hosts: Sequence[Host], ssh_config: str | None, known_hosts: str | None, access: Access | None,
           plan: Plan | None = None) -> Fleet:
    access = access or Access()
    if backend != "none" and not spec(backend).this_machine:
        runner = SshRunner(known_hosts=known_hosts, ssh_config=ssh_config, accept_unknown_hosts=access.accept_unknown_hosts,
                           connect_timeout=access.connect_timeout)
        return Fleet.for_hosts(backend, hosts, runner, LocalRunner(), plan=plan)
    return Fleet.for_hosts(backend, hosts, plan=plan)


class SshBackend:
    """Processes over SSH (or on this machine), one round trip per node and step."""

    OPTIONS: ClassVar[tuple[type, ...]] = (Access,)

    def __init__(self, access: Access | None = None) -> None:
        self.access = access or Access()

    def _connect(self, plan: Plan, inv: Inventory | SshRecord) -> Fleet:
        if isinstance(inv, SshRecord):  # a live deployment: its plan's machines and any it was moved off
            return _fleet(plan.backend, inv.hosts(), inv.ssh_config, inv.known_hosts, self.access, plan)
        return connect(plan, inv.ssh_config, inv.known_hosts, self.access)

    # ------------------------------------------------------------------ lifecycle
    def up(self, plan: Plan, inv: Inventory, inv_path: str, store: StateStore, opts: UpOptions, events: Events) -> SshRecord:
        held = store.nodes_in_use()
        clash = sorted({f"{h.name} ({held[h.address]})" for h in plan.hosts if h.address in held and h.gpus})
        if clash and not opts.force:
            raise K3Error("nodes-in-use", f"nodes held by live deployments: {', '.join(clash)}",
                          "`k3launch down` that deployment, --exclude the nodes, or pass --force")
        with self._connect(plan, inv) as fleet:
            if plan.stage is not None:  # the engines read a node-local copy: make it complete first
                stage(plan, fleet, events.on_stage)
            if not opts.skip_doctor:
                report = doctor(plan, fleet, [r.name for r in store.list()])
                events.on_doctor(report)
                if not report.ok:
                    raise report.error()
                events.on_stage(Stage.DOCTOR, f"{len(fleet.nodes())} node(s) checked")
            launch = Launch(plan, fleet, store, inventory=inv_path, hf_token_file=inv.hf_token_file, on_stage=events.on_stage,
                            ssh_config=inv.ssh_config, known_hosts=inv.known_hosts, backend="ssh" if inv.backend == "ssh" else "local")
            run_up(launch, store, ready_timeout(plan, opts.ready_timeout), opts.keep_on_failure, events.on_failure, events.on_progress)
            return launch.record

    def status(self, rec: DeploymentRecord) -> Status:
        r = own(rec, SshRecord)
        with self._connect(r.plan, r) as fleet:
            return observe(r, fleet)

    def logs(self, rec: DeploymentRecord, ids: Sequence[str], lines: int, follow: bool, emit: Emit, everything: bool = False) -> None:
        r = own(rec, SshRecord)
        node_of = {p.id: p.node for p in r.plan.processes}
        with self._connect(r.plan, r) as fleet:
            for pid, text in tail_logs(r, fleet, ids, lines).items():
                emit(f"==> {pid} on {node_of[pid]} <==")
                emit(text.rstrip())
            if follow:
                follow_logs(r, fleet, ids, emit)

    def down(self, rec: DeploymentRecord, store: StateStore, grace_s: float) -> TeardownReport:
        r = own(rec, SshRecord)
        with self._connect(r.plan, r) as fleet:
            return teardown(r, fleet, store, grace_s=grace_s)

    def sweep(self, name: str, inv: Inventory, grace_s: float, owned: Owned) -> TeardownReport:
        hosts = inventory_hosts(inv)
        where = "this machine" if spec(inv.backend).this_machine else f"the {len(hosts)} machine(s) of inventory {inv.name}"
        with _fleet(inv.backend, hosts, inv.ssh_config, inv.known_hosts, self.access) as fleet:
            return sweep(name, fleet, where, grace_s, owned)

    def dry_run(self, plan: Plan, inv: Inventory | None, store: StateStore, opts: UpOptions) -> DryRun:
        """Exactly the text ``up`` hands to ``bash -c`` on each node, in order (nothing is connected
        to), and one runnable launch script per node (and the router)."""
        token_file = inv.hf_token_file if inv is not None else None
        fleet = Fleet.for_plan(plan)
        ident = store.new_deployment_id()  # `up` makes its own: this one is what `render`'s scripts carry
        steps = []
        if plan.stage is not None:  # what `up` runs first on each engine node whose staged copy is not complete
            steps += [DryRunStep("weights", n, fleet.host(n).address, fetch_command(plan, fleet, n, Source("path", path=plan.stage.source)))
                      for n in dict.fromkeys(p.node for p in plan.processes if p.role != "router")]
        for group in start_steps(plan):
            step = "router" if group[0].role == "router" else "engines"
            for node in dict.fromkeys(p.node for p in group):
                text = node_script(plan, fleet, [p for p in group if p.node == node], token_file, ident=ident)
                steps.append(DryRunStep(step, node, fleet.host(node).address, text))
        files = tuple((fname, script(plan, node, token_file, ident=ident)) for node, fname in script_names(plan).items())
        return DryRun(plan.name, steps=tuple(steps), files=files)

    def caches(self, inv: Inventory, nodes: Sequence[str], clear: Sequence[str], clear_all: bool) -> tuple[list[CacheDir], dict[str, str]]:
        from k3launch.deploy.ssh import caches as kept

        hosts = [h for h in inventory_hosts(inv) if not nodes or h.name in nodes]
        where = kept.roots(hosts, inv.engine, spec(inv.backend).this_machine)
        with _fleet(inv.backend, [h for h in hosts if h.name in where], inv.ssh_config, inv.known_hosts, self.access) as fleet:
            return kept.caches(fleet, where, clear, clear_all)

    # ------------------------------------------------------------------ node operations
    def doctor(self, plan: Plan, inv: Inventory, live: Sequence[str], bandwidth: bool, min_busbw: float | None) -> DoctorReport:
        with self._connect(plan, inv) as fleet:
            report = doctor(plan, fleet, list(live))
            if bandwidth:
                report.checks += measure(plan, fleet, min_busbw)
            return report

    def weights_check(self, plan: Plan, inv: Inventory) -> list[NodeWeights]:
        with self._connect(plan, inv) as fleet:
            return check(plan, fleet)

    def weights_fetch(self, plan: Plan, inv: Inventory, source: Source, on_progress: Callable[[FetchProgress], None] | None,
                      interval: float) -> list[NodeWeights]:
        with self._connect(plan, inv) as fleet:
            return fetch(plan, fleet, source, on_progress, interval)

    def weights_probe(self, plan: Plan, inv: Inventory, path: str | None, size: int, timeout_s: float) -> list[Probe]:
        with self._connect(plan, inv) as fleet:
            return probe(plan, fleet, path, size, timeout_s)

    def fleet(self, rec: DeploymentRecord) -> Fleet:
        r = own(rec, SshRecord)
        return self._connect(r.plan, r)

    def power_sampler(self, rec: DeploymentRecord) -> Sampler:
        return FleetSampler(self.fleet(rec), engine_nodes(rec))

    # ------------------------------------------------------------------ the canary
    def served_plan(self, rec: DeploymentRecord) -> Plan:
        return own(rec, SshRecord).plan  # processes bind the plan's own addresses

    # ------------------------------------------------------------------ supervision
    def watcher(self, rec: DeploymentRecord, store: StateStore) -> SshWatcher:
        r = own(rec, SshRecord)
        return SshWatcher(r, lambda now: self._connect(now.plan, now), store)
