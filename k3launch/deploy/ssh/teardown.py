"""``down``: stop every process of a deployment, in order, and verify nothing is left.

Order: the router, then the HTTP-serving heads, then headless ranks (so no request is routed to
a half-stopped deployment and heads do not wait on vanished workers). Each phase sends SIGTERM
to whole process groups (containers too: their first process leads the group; then ``stop``),
waits up to the grace period, then SIGKILLs what is left. Reality, not the record, decides what
runs: processes are found on each node by their ``K3LAUNCH_DEPLOYMENT`` marker and the
record's deployment id (``K3LAUNCH_ID``; containers by labels, :mod:`k3launch.models.identity`),
so processes whose pid was never recorded are stopped too, and a same-named deployment of another
state directory never is. Verification: no marked process or labelled container remains
and every planned port is free. Unreachable nodes are reported and kept in the record so the
next ``down`` finishes the job; ``down`` is idempotent.

Cost: every step is one round trip per node, all nodes in parallel — a phase's "find the
processes and signal the new ones" is one script (:func:`remote.find_and_signal`), and so is
the verification (processes, containers and listening ports together). A node that fails to
answer once is not asked again in the same teardown (an isolated node costs one connect
timeout, not one per step).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.identity import ANY, Owned
from k3launch.models.plan import is_container
from k3launch.models.record import ProcessRecord, SshRecord
from k3launch.models.reports import TeardownReport
from k3launch.render import snippets as remote
from k3launch.transport.fleet import Fleet
from k3launch.transport.runners import Outcome
from k3launch.util.polling import poll_until

DEFAULT_GRACE_S = 10.0
KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the kernel to reap before reporting leftovers
VERIFY_S = 5.0  # ports can take a moment to close after the last process exits
STEP_TIMEOUT_S = 30.0  # a step on a host that answers; one that goes silent is unreachable within its connect timeout


def _phases(rec: SshRecord) -> list[list[str]]:
    procs = rec.plan.processes
    router = [p.id for p in procs if p.role == "router"]
    heads = [p.id for p in procs if p.role != "router" and p.http_port is not None]
    rest = [p.id for p in procs if p.id not in router and p.id not in heads]
    return [ph for ph in (router, heads, rest) if ph]


def _run(fleet: Fleet, cmds: Mapping[str, str], report: TeardownReport, timeout: float = STEP_TIMEOUT_S) -> dict[str, str]:
    """Run on every node not known unreachable; node → stdout of those that answered."""
    todo = {n: c for n, c in cmds.items() if n not in report.unreachable}
    out: dict[str, str] = {}
    outcomes: dict[str, Outcome] = fleet.run_many(todo, timeout=timeout) if todo else {}
    for node, o in outcomes.items():
        if isinstance(o, K3Error):
            report.unreachable[node] = o.message
        elif o.exit_code == 124:
            report.unreachable[node] = f"{node}: no answer within {timeout:g}s"
        else:
            out[node] = o.stdout
    return out


def _pairs(text: str) -> list[tuple[str, str]]:
    return [(ln.split()[0], ln.split()[1] if len(ln.split()) > 1 else "") for ln in text.splitlines() if ln.strip()]


def _stop_containers(rec: SshRecord, fleet: Fleet, ids: list[str], grace_s: float, report: TeardownReport) -> None:
    containers: dict[str, list[tuple[str, str]]] = {}
    for pid in ids:
        pr = rec.processes.get(pid)
        if pr is not None and is_container(pr.runtime):
            containers.setdefault(pr.node, []).append((pr.runtime, pr.handle))
    if containers:
        cmds = {node: "\n".join(remote.stop_containers(rt, [h], int(grace_s)) for rt, h in items) for node, items in containers.items()}
        _run(fleet, cmds, report, timeout=grace_s + 60)


def _stop_phase(rec: SshRecord, fleet: Fleet, ids: list[str], grace_s: float, report: TeardownReport) -> None:
    node_of = {p.id: p.node for p in rec.plan.processes}
    _stop_containers(rec, fleet, ids, grace_s, report)
    # On a shared machine (local backend) every "node" sees every process: act only on this phase's process ids.
    _signal_until_gone(fleet, rec.name, ids, sorted({node_of[i] for i in ids}), grace_s, report, sessions(rec.processes, ids),
                       Owned.of(rec.deployment_id))
    report.stopped += ids


def stop_processes(rec: SshRecord, fleet: Fleet, ids: Iterable[str], grace_s: float, report: TeardownReport) -> None:
    """Stop some of a deployment's processes (a unit a supervisor restarts), in ``down``'s order."""
    want = set(ids)
    for phase in _phases(rec):
        mine = [i for i in phase if i in want]
        if mine:
            _stop_phase(rec, fleet, mine, grace_s, report)


def sessions(processes: Mapping[str, ProcessRecord], ids: Iterable[str]) -> dict[str, dict[str, str]]:
    """node -> {recorded pid: process id} of the bare processes among ``ids``: each leads its session (setsid)."""
    out: dict[str, dict[str, str]] = {}
    for i in ids:
        pr = processes.get(i)
        if pr is not None and not is_container(pr.runtime) and pr.handle.isdigit():
            out.setdefault(pr.node, {})[pr.handle] = i
    return out


def stop_left_behind(rec: SshRecord, fleet: Fleet, node: str, grace_s: float, report: TeardownReport) -> None:
    """Stop what a re-placement left on ``node`` (by marker and session there, never by the plan:
    the same process ids now run elsewhere)."""
    lb = rec.left_behind[node]
    ids = sorted(lb.processes)
    view = rec.model_copy(update={"processes": lb.processes, "left_behind": {}})
    _stop_containers(view, fleet, ids, grace_s, report)  # by the recorded node of each container
    _signal_until_gone(fleet, rec.name, ids, [node], grace_s, report, sessions(lb.processes, ids), Owned.of(rec.deployment_id))
    if node not in report.unreachable:
        report.stopped += [f"{pid} on {node} (left there when the node was lost)" for pid in ids]


def _signal_until_gone(fleet: Fleet, name: str, ids: list[str] | None, nodes: list[str], grace_s: float,
                       report: TeardownReport, sessions: Mapping[str, Mapping[str, str]] | None = None,
                       owned: Owned = ANY) -> dict[str, dict[str, str]]:
    """SIGTERM to each process group of ``name`` found on ``nodes`` (only those ``owned`` says are
    the deployment's, and only process ids ``ids``; None: all), and to the orphans of each recorded engine's session (``sessions``: node ->
    {leader pid: process id}), once per pid; SIGKILL every round after ``grace_s``, until none is
    found or the kill wait is over (what is left is reported by the verification). Node -> {pid:
    process id} of everything found, in the order first seen."""
    found_all: dict[str, dict[str, str]] = {n: {} for n in nodes}
    t_term = time.monotonic() + grace_s
    while nodes:
        now = time.monotonic()
        sig = "KILL" if now > t_term else "TERM"
        cmds = {n: remote.find_and_signal(name, ids, sig, found_all[n] if sig == "TERM" else (), (sessions or {}).get(n), owned) for n in nodes}
        found = {n: _pairs(text) for n, text in _run(fleet, cmds, report).items()}
        for n, items in found.items():
            for pid, proc in items:
                found_all[n].setdefault(pid, proc)
        nodes = sorted(n for n, items in found.items() if items)
        if not nodes or now > t_term + KILL_WAIT_S:
            break
        time.sleep(0.1 if sig == "TERM" else 0.25)
    return found_all


def _sections(text: str) -> dict[str, list[str]]:
    """A probe's output split at its ``@@name`` lines: name -> its non-empty lines."""
    sec: dict[str, list[str]] = {}
    cur = ""
    for line in text.splitlines():
        if line.startswith("@@"):
            cur = line[2:]
            sec.setdefault(cur, [])
        elif line.strip():
            sec.setdefault(cur, []).append(line.strip())
    return sec


def _verify_script(rec: SshRecord, node_runtimes: Iterable[str], ports: Iterable[int] = ()) -> str:
    owned = Owned.of(rec.deployment_id)
    parts = [f"echo @@procs\n{remote.find_processes(rec.name, owned)}", f"echo @@listening\n{remote.LISTENING}"]
    for rt in sorted(set(node_runtimes)):
        parts.append(f"echo @@containers\n{remote.labelled_containers(rt, rec.name, owned)}")
    ports = sorted(set(ports))
    if ports:
        parts.append(f"echo @@holders\n{remote.port_holders(ports)}")
    return "\n".join(parts)


def verify(rec: SshRecord, fleet: Fleet, report: TeardownReport) -> None:
    """One round trip per node: marked processes, labelled containers, listening ports and who
    holds the planned ones.

    Only what is ours is left over: a planned port is busy when a process of this deployment
    holds it — one found by its marker, a recorded pid, or a process in the session of one
    (engines lead their own session, and their children stay in it even when orphaned) — or when
    its holder cannot be seen (another user's process, a container's) while something of ours is
    still on the node. A port held by anything else is a note in ``report.verified``, not a leftover."""
    runtimes = {h.name: [h.runtime] if is_container(h.runtime) else [] for h in rec.plan.hosts}
    ports: dict[str, set[int]] = {}
    for use in rec.plan.ports:
        ports.setdefault(use.node, set()).add(use.port)
    cmds = {n: _verify_script(rec, runtimes.get(n, []), ports.get(n, ())) for n in fleet.nodes()}
    listening: dict[str, set[tuple[str, int]]] = {}
    holders: dict[str, list[tuple[str, int, str, str, str]]] = {}
    ours = {pr.handle for pr in rec.processes.values() if not is_container(pr.runtime) and pr.handle}
    sessions = set(ours)  # the recorded pids lead their sessions (started with setsid)
    for node, text in _run(fleet, cmds, report).items():
        sec = _sections(text)
        found = _pairs("\n".join(sec.get("procs", [])))
        ours.update(pid for pid, _ in found)
        left = [f"pid {pid} ({proc})" for pid, proc in found]
        left += [f"container {c}" for c in sec.get("containers", [])]
        if left:
            report.leftovers.setdefault(node, []).extend(left)
        listening[node] = remote.parse_listening("\n".join(sec.get("listening", [])))
        holders[node] = remote.parse_holders("\n".join(sec.get("holders", [])))
    notes: list[str] = []
    for use in rec.plan.ports:
        if use.node not in listening or not remote.port_busy(listening[use.node], use.address, use.port):
            continue
        what = f"{use.address}:{use.port} ({use.purpose} of {use.process})"
        held = [h for h in holders[use.node] if h[1] == use.port and h[0] in (use.address, "0.0.0.0")]
        seen = [h for h in held if h[2] != "?"]
        mine = any(pid in ours or sid in sessions for _, _, pid, sid, _ in seen)
        unseen = len(seen) < len(held) or not held
        if mine or (unseen and use.node in report.leftovers):
            report.busy_ports.append(what)
        else:
            who = ", ".join(sorted({f"pid {pid} ({comm})" for _, _, pid, _, comm in seen})) or "a process this user cannot see"
            notes.append(f"{what}: held by {who}, not by {rec.name}")
    report.verified = "no process or container left; planned ports free" + (f", except {'; '.join(notes)}" if notes else "")


def _running(rec: SshRecord, fleet: Fleet, report: TeardownReport) -> set[str]:
    """The process ids running before ``down`` stops anything (one look per node, no signal); a
    container's count as running (its runtime stops it, unseen here)."""
    ids = [p.id for p in rec.plan.processes]
    nodes = sorted({p.node for p in rec.plan.processes})
    owned, lead = Owned.of(rec.deployment_id), sessions(rec.processes, ids)
    cmds = {n: remote.find_and_signal(rec.name, ids, None, (), lead.get(n), owned) for n in nodes}
    seen = {proc for text in _run(fleet, cmds, report).values() for _, proc in _pairs(text)}
    return seen | {i for i, pr in rec.processes.items() if is_container(pr.runtime)}


def teardown(rec: SshRecord, fleet: Fleet, store: StateStore, grace_s: float = DEFAULT_GRACE_S,
             unreachable: Mapping[str, str] | None = None) -> TeardownReport:
    """Stop and verify. ``unreachable``: nodes already known not to answer (not tried again)."""
    report = TeardownReport(unreachable=dict(unreachable or {}))
    rec.state = "stopping"
    store.save(rec)
    running = _running(rec, fleet, report)
    for phase in _phases(rec):
        _stop_phase(rec, fleet, phase, grace_s, report)
    # a process not running before anything was stopped had exited already (a crashed engine):
    # not "stopped"; one on a node that does not answer is neither (unreachable says so)
    node_of = {p.id: p.node for p in rec.plan.processes}
    report.exited = [i for i in report.stopped if i not in running and node_of.get(i) not in report.unreachable]
    report.stopped = [i for i in report.stopped if i not in report.exited]
    for node in sorted(rec.left_behind):  # what a supervisor re-placed off a lost node
        if node not in report.unreachable:
            stop_left_behind(rec, fleet, node, grace_s, report)

    def check() -> TeardownReport:
        report.leftovers.clear()
        report.busy_ports.clear()
        verify(rec, fleet, report)
        return report

    poll_until(check, lambda r: r.clean or r.unreachable, timeout=VERIFY_S, interval=0.2)
    if not report.clean:
        rec.state = "down-incomplete"
        rec.unreachable = sorted(report.unreachable)
        store.save(rec)
    return report


def sweep(name: str, fleet: Fleet, what: str, grace_s: float = DEFAULT_GRACE_S, owned: Owned = ANY) -> TeardownReport:
    """``down`` without a (readable) record: on every machine of ``fleet`` find the processes of
    deployment ``name`` (by their marker or run directory) and its labelled containers -- only
    those ``owned`` says are the deployment's: those of this state directory's deployments, unless
    the user asked for any owner's (``down --any-owner``) -- stop them (SIGTERM to each process
    group, SIGKILL after ``grace_s``) and verify none is left. ``what`` names the machines for the
    report. Planned ports are not checked: without the plan they are unknown. Machines this host
    reaches as itself (the ``local`` backend, the login node) are searched once.

    What carries the name but is not ``owned`` is left alone and named in ``report.others`` (a
    same-named deployment of another state directory, or one started before deployment ids)."""
    nodes: list[str] = []
    local_seen = False
    for n in fleet.nodes():
        if fleet.target(n).local:
            if local_seen:
                continue
            local_seen = True
        nodes.append(n)
    report = TeardownReport(verified=f"no process or container of {name}{owned.says()} left on {what}")
    runtimes = {n: sorted({h.runtime for h in fleet.hosts if h.name == n and is_container(h.runtime)}) for n in nodes}
    listed = _run(fleet, {n: "\n".join(remote.labelled_containers(rt, name, owned) for rt in rts) for n, rts in runtimes.items() if rts}, report)
    cmds = {n: "\n".join(remote.stop_containers(rt, text.split(), int(grace_s)) for rt in runtimes[n]) for n, text in listed.items() if text.split()}
    if cmds:
        _run(fleet, cmds, report, timeout=grace_s + 60)
        report.stopped += [f"container {c} on {n}" for n, text in listed.items() for c in text.split()]
    found = _signal_until_gone(fleet, name, None, nodes, grace_s, report, owned=owned)
    report.stopped += [f"{proc or 'pid ' + pid} on {n}" for n, procs in found.items() for pid, proc in procs.items()]

    def check() -> TeardownReport:
        report.leftovers.clear()
        report.others.clear()
        scripts = {n: "\n".join([f"echo @@procs\n{remote.find_processes(name, owned)}\necho @@containers",
                                 *(remote.labelled_containers(rt, name, owned) for rt in runtimes[n]),
                                 *([] if owned.anyone else [f"echo @@others\n{remote.find_processes(name)}\necho @@other-containers",
                                                            *(remote.labelled_containers(rt, name) for rt in runtimes[n])])]) for n in nodes}
        for n, text in _run(fleet, scripts, report).items():
            sec = _sections(text)
            left = [f"pid {pid} ({proc})" for pid, proc in _pairs("\n".join(sec.get("procs", [])))]
            left += [f"container {c}" for c in sec.get("containers", [])]
            if left:
                report.leftovers[n] = left
            # the name's processes (then containers) of any owner, less ours: not touched, but said
            others = [f"pid {pid} ({proc})" for pid, proc in _pairs("\n".join(ln for ln in sec.get("others", []) if ln not in sec.get("procs", [])))]
            others += [f"container {c}" for c in sec.get("other-containers", []) if c not in sec.get("containers", [])]
            if others:
                report.others[n] = others
        return report

    poll_until(check, lambda r: r.clean or bool(r.unreachable), timeout=VERIFY_S, interval=0.2)
    return report
