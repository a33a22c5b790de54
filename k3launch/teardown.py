"""``down``: stop every process of a deployment, in order, and verify nothing is left.

Order: the router, then the HTTP-serving heads, then headless ranks (so no request is routed to
a half-stopped deployment and heads do not wait on vanished workers). Each phase sends SIGTERM
to whole process groups (containers: ``stop -t GRACE``), waits up to the grace period, then
SIGKILLs what is left. Reality, not the record, decides what runs: processes are found on each
node by their ``K3LAUNCH_DEPLOYMENT`` marker (containers by label), so processes whose pid was
never recorded are stopped too. Verification: no marked process or labelled container remains
and every planned port is free. Unreachable nodes are reported and kept in the record so the
next ``down`` finishes the job; ``down`` is idempotent.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from k3launch import remote
from k3launch.errors import K3Error
from k3launch.nodes import Fleet
from k3launch.state import DeploymentRecord, StateStore

DEFAULT_GRACE_S = 10.0


@dataclass
class TeardownReport:
    stopped: list[str] = field(default_factory=list)
    leftovers: dict[str, list[str]] = field(default_factory=dict)  # node -> what remains
    unreachable: dict[str, str] = field(default_factory=dict)  # node -> why
    busy_ports: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.leftovers or self.unreachable or self.busy_ports)


def _phases(rec: DeploymentRecord) -> list[list[str]]:
    procs = rec.plan.processes
    router = [p.id for p in procs if p.role == "router"]
    heads = [p.id for p in procs if p.role != "router" and p.http_port is not None]
    rest = [p.id for p in procs if p.id not in router and p.id not in heads]
    return [ph for ph in (router, heads, rest) if ph]


def _marked(fleet: Fleet, name: str, nodes: Iterable[str], report: TeardownReport) -> dict[str, list[tuple[str, str]]]:
    """node → [(pid, process id)] of live processes of deployment ``name``."""
    out: dict[str, list[tuple[str, str]]] = {}
    for node, o in fleet.run_many({n: remote.find_processes(name) for n in nodes if n not in report.unreachable}, timeout=30).items():
        if isinstance(o, K3Error):
            report.unreachable[node] = o.message
            continue
        out[node] = [(ln.split()[0], ln.split()[1] if len(ln.split()) > 1 else "") for ln in o.stdout.splitlines() if ln.strip()]
    return out


def _stop_phase(rec: DeploymentRecord, fleet: Fleet, ids: list[str], grace_s: float, report: TeardownReport) -> None:
    node_of = {p.id: p.node for p in rec.plan.processes}
    nodes = sorted({node_of[i] for i in ids})
    containers: dict[str, list[tuple[str, str]]] = {}
    for pid in ids:
        pr = rec.processes.get(pid)
        if pr is not None and pr.runtime in ("docker", "podman"):
            containers.setdefault(pr.node, []).append((pr.runtime, pr.handle))
    if containers:
        cmds = {}
        for node, items in containers.items():
            cmds[node] = "\n".join(remote.stop_containers(rt, [h], int(grace_s)) for rt, h in items)
        for node, o in fleet.run_many(cmds, timeout=grace_s + 60).items():
            if isinstance(o, K3Error):
                report.unreachable[node] = o.message
    want = set(ids)
    t_end = time.monotonic() + grace_s
    sig = "TERM"
    while True:
        found = _marked(fleet, rec.name, nodes, report)
        # On a shared machine (local backend, test hosts) every "node" sees every process:
        # act only on this phase's process ids.
        todo = {n: [pid for pid, proc in items if proc in want] for n, items in found.items()}
        todo = {n: pids for n, pids in todo.items() if pids}
        if not todo:
            break
        if time.monotonic() > t_end:
            if sig == "KILL":
                break
            sig = "KILL"
        fleet.run_many({n: remote.signal_groups(pids, sig) for n, pids in todo.items()}, timeout=30)
        time.sleep(0.2 if sig == "TERM" else 0.5)
    report.stopped += ids


def verify(rec: DeploymentRecord, fleet: Fleet, report: TeardownReport) -> None:
    nodes = fleet.nodes()
    for node, items in _marked(fleet, rec.name, nodes, report).items():
        if items:
            report.leftovers.setdefault(node, []).extend(f"pid {pid} ({proc})" for pid, proc in items)
    runtimes = {h.runtime for h in rec.plan.hosts if h.runtime in ("docker", "podman")}
    for rt in runtimes:
        for node, o in fleet.run_many({n: remote.labelled_containers(rt, rec.name) for n in nodes if n not in report.unreachable}, timeout=30).items():
            if not isinstance(o, K3Error) and o.stdout.strip():
                report.leftovers.setdefault(node, []).extend(f"container {c}" for c in o.stdout.split())
    listening: dict[str, set[tuple[str, int]]] = {}
    for node, o in fleet.run_many({n: remote.LISTENING for n in nodes if n not in report.unreachable}, timeout=30).items():
        if isinstance(o, K3Error):
            report.unreachable[node] = o.message
        else:
            listening[node] = remote.parse_listening(o.stdout)
    for use in rec.plan.ports:
        if use.node in listening and remote.port_busy(listening[use.node], use.address, use.port):
            report.busy_ports.append(f"{use.address}:{use.port} ({use.purpose} of {use.process})")


def teardown(rec: DeploymentRecord, fleet: Fleet, store: StateStore, grace_s: float = DEFAULT_GRACE_S) -> TeardownReport:
    report = TeardownReport()
    rec.state = "stopping"
    store.save(rec)
    for phase in _phases(rec):
        _stop_phase(rec, fleet, phase, grace_s, report)
    # Ports can take a moment to close after the last process exits.
    for _ in range(20):
        report.leftovers.clear()
        report.busy_ports.clear()
        verify(rec, fleet, report)
        if report.clean or report.unreachable:
            break
        time.sleep(0.25)
    if not report.clean:
        rec.state = "down-incomplete"
        rec.unreachable = sorted(report.unreachable)
        store.save(rec)
    return report
