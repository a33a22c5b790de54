"""``up``: start a Plan's processes on their nodes and wait until the deployment really serves.

Lifecycle stages (each reported through ``on_stage`` so the CLI can show progress):
``doctor`` → ``start`` (engines in parallel, router last) → ``alive`` (every process running) →
``health`` (every HTTP endpoint answers ``/health`` 200; a head only does once all its ranks
joined) → ``completion`` (one real completion through the public endpoint) → ``ready``.

Cost per node: ``start`` is one round trip per node and step (engines, then the router): every
process of the node starts from one script (:func:`node_script`, which ``--dry-run`` prints).
Each poll is one round trip per node, all nodes in parallel over the connections (and remote
shells, :mod:`k3launch.transport.sshshell`) opened by ``doctor``; the HTTP probes of a poll run in
parallel too.

Fail fast: every poll re-checks that every started process is alive and every node answers. The
first death fails the deployment, naming the rank that caused it (of ranks found dead in one
poll: one whose last lines do not blame a lost peer, then the earliest exit — a rank's exit
code and time are recorded by the start helper) with its last log lines; an
unreachable node fails it naming the node. The failure is reported (``failed`` stage, then
``on_failure``) *before* the teardown, and — unless ``keep_on_failure`` — everything started is
torn down; nodes known to be unreachable are not waited for again (the record keeps them, state
``down-incomplete``, for the next ``down``). The readiness deadline is per deployment
(``--ready-timeout``, else the plan's ``VLLM_ENGINE_READY_TIMEOUT_S``, else 1800 s).

:class:`Launch` is this backend's set of hooks for the shared ``up`` skeleton
(:func:`k3launch.deploy.base.run_up`).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k3launch.deploy.base import Progress, run_up
from k3launch.deploy.logtail import LogCursor
from k3launch.deploy.readiness import ready_timeout
from k3launch.deploy.ssh.observe import Poll, keep_tails, poll, tail_logs
from k3launch.deploy.ssh.teardown import teardown
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Host, Plan, Process, is_container
from k3launch.models.record import ProcessRecord, SshBackendName, SshRecord, Stage, StageFn
from k3launch.models.reports import LaunchFailed, TeardownReport, error_line
from k3launch.render import snippets as remote
from k3launch.render.runtimes import container_name
from k3launch.render.scripts import (
    BACKGROUND_HELPER,
    runs_in_apptainer,
    runs_in_background,
    start_command,
    start_line,
    token_snippet,
)
from k3launch.transport.fleet import Fleet

POLL_S = 0.5
START_TIMEOUT_S = 120.0  # a start may pull an image; a host that goes silent meanwhile fails within its connect timeout (heartbeat)
KEPT_LOG_LINES = 500  # of each failing process, kept in <state-dir>/logs/<deployment>/ after a failed up


def run_host(fleet: Fleet, node: str) -> Host:
    """``node``'s host as ``up`` runs it. A node that is this machine (the local backend, the login
    node) runs the simulated engine with k3launch's own interpreter unless the inventory names one
    (``python``): k3launch installed by pipx, or run from a venv that is not activated, is not
    what ``python3`` on PATH imports."""
    host = fleet.host(node)
    if fleet.target(node).local and not host.python and sys.executable:
        return host.model_copy(update={"python": sys.executable})
    return host


def tools_dir(fleet: Fleet, node: str) -> str | None:
    """For a node that is this machine: the directory of k3launch's interpreter, where programs
    installed with k3launch (``vllm-router``) are; bare processes find them there before PATH."""
    d = os.path.dirname(sys.executable) if sys.executable else ""
    return d if d and ":" not in d and fleet.target(node).local else None  # ':' would split PATH


def router_install_hint(node: str, local: bool) -> str:
    """How to get ``vllm-router`` where the router runs: on this machine, into k3launch's own
    environment (where ``up`` looks first); elsewhere, onto the PATH a non-interactive ssh shell has."""
    if local:
        return (f"install it with k3launch: `{shlex.quote(sys.executable or 'python3')} -m pip install vllm-router` "
                "(pipx: `pipx inject k3launch vllm-router`)")
    return f"install vllm-router on {node} (`pip install vllm-router`) where a non-interactive ssh shell finds it, or put the router on the login node"


def _start_line(plan: Plan, proc: Process, fleet: Fleet, hf_token_file: str | None, log_dir: str, ident: str) -> str:
    host = run_host(fleet, proc.node)
    helper = BACKGROUND_HELPER if runs_in_background(proc, host) else ""  # containers start without it
    return helper + token_snippet(hf_token_file, apptainer=runs_in_apptainer(proc, host)) + start_line(
        plan, proc, host, log_dir, tools_dir(fleet, proc.node), ident)


def start_steps(plan: Plan) -> list[list[Process]]:
    """Engines first (all nodes at once), then the router (it needs the engines' addresses)."""
    engines = [p for p in plan.processes if p.role != "router"]
    routers = [p for p in plan.processes if p.role == "router"]
    return [g for g in (engines, routers) if g]


def node_script(plan: Plan, fleet: Fleet, procs: Sequence[Process], hf_token_file: str | None, log_dir: str = "",
                ident: str = "") -> str:
    """What one step of ``up`` runs on one node (run by bash, whatever the login shell): each
    process's start in a subshell of its own, so one failing start does not skip the others,
    its output and exit code framed by ``@@`` markers. ``ident``: the deployment id the processes carry."""
    parts = []
    for p in procs:
        parts.append(f"echo {shlex.quote('@@start ' + p.id)}\n(\n{_start_line(plan, p, fleet, hf_token_file, log_dir, ident)}\n) 2>&1\n"
                     f"echo {shlex.quote('@@rc ' + p.id)} $?")
    return "\n".join(parts) + "\n"


def _sections(out: str) -> dict[str, tuple[int | None, str]]:
    """process id → (exit code or None when it never finished, its output) from node_script's output."""
    got: dict[str, tuple[int | None, str]] = {}
    cur: str | None = None
    lines: list[str] = []
    for line in out.splitlines():
        if line.startswith("@@start "):
            cur, lines = line.split(None, 1)[1], []
            got[cur] = (None, "")
        elif line.startswith("@@rc ") and cur is not None:
            rc = line.split()[-1]
            got[cur] = (int(rc) if rc.isdigit() else None, "\n".join(lines))
            cur = None
        elif cur is not None:
            lines.append(line)
            got[cur] = (None, "\n".join(lines))
    return got


def _record_for(plan: Plan, proc: Process, fleet: Fleet, out: str, log_dir: str, ident: str) -> ProcessRecord:
    host = fleet.host(proc.node)
    runtime = "bare" if proc.role == "router" else host.runtime
    if is_container(runtime):
        return ProcessRecord(id=proc.id, node=proc.node, runtime=runtime, handle=container_name(plan, proc), started=True)
    pid = next((ln.split()[2] for ln in out.splitlines() if ln.startswith("started pid ")), "")
    log = start_command(plan, proc, host, log_dir, ident=ident)[1]
    return ProcessRecord(id=proc.id, node=proc.node, runtime=runtime, handle=pid, log=str(log), started=bool(pid))


def start_group(plan: Plan, fleet: Fleet, group: Sequence[Process], hf_token_file: str | None,
                log_dir: str = "", ident: str = "") -> tuple[dict[str, ProcessRecord], list[LaunchFailed]]:
    """Start ``group`` (one step of ``up``, or a unit a supervisor restarts): one script per node,
    all nodes at once. The processes that started, and a failure per process that did not.
    ``ident``: the deployment's id (``record.deployment_id``), which every process carries."""
    by_node: dict[str, list[Process]] = {}
    for p in group:
        by_node.setdefault(p.node, []).append(p)
    scripts = {n: "bash -c " + shlex.quote(node_script(plan, fleet, ps, hf_token_file, log_dir, ident)) for n, ps in by_node.items()}
    started: dict[str, ProcessRecord] = {}
    failed: list[LaunchFailed] = []
    for node, o in fleet.run_many(scripts, timeout=START_TIMEOUT_S).items():
        if isinstance(o, K3Error):
            failed.append(LaunchFailed(f"could not start {', '.join(p.id for p in by_node[node])} on {node}: {o.message}", o.hint,
                                       by_node[node][0].id, code=o.code, node=node))
            continue
        got = _sections(o.stdout)
        for p in by_node[node]:
            rc, text = got.get(p.id, (None, ""))
            pr = _record_for(plan, p, fleet, text, log_dir, ident)
            if rc == 0 and not pr.started:
                rc = -1  # a bare process without a pid: it did not start
            if rc == 0:
                started[p.id] = pr
            else:
                why = {None: f"did not finish (script exit {o.exit_code})", -1: "reported no pid"}.get(rc, f"exited {rc}")
                failed.append(LaunchFailed(f"could not start {p.id} on {node}: start command {why}",
                                           "run the node's script from `k3launch up --dry-run` by hand to see why", p.id,
                                           (text or o.stderr)[-2000:], node=node))
    return started, failed


@dataclass
class Launch:
    """One ``up`` over SSH (or on this machine): start every process, then watch them per node."""

    plan: Plan
    fleet: Fleet
    store: StateStore
    inventory: str | None = None
    hf_token_file: str | None = None
    log_dir: str = ""
    on_stage: StageFn = field(default=lambda s, m: None)
    on_failure: Callable[[LaunchFailed], None] = field(default=lambda e: None)
    ssh_config: str | None = None
    known_hosts: str | None = None
    backend: SshBackendName | None = None  # default: the plan's (local when it was planned without an inventory)
    record: SshRecord = field(init=False)
    _blamed: list[str] = field(default_factory=list, init=False)  # the processes a failure names
    _cursor: LogCursor = field(default_factory=LogCursor, init=False)  # how far each log was read (live progress)

    def __post_init__(self) -> None:
        now = time.time()
        backend: SshBackendName = self.backend or ("ssh" if self.plan.backend == "ssh" else "local")
        # ssh settings from the start: a `down` after a failed `up` must check the same host keys
        self.record = SshRecord(name=self.plan.name, state="starting", created=now, updated=now, inventory=self.inventory,
                                backend=backend, ssh_config=self.ssh_config, known_hosts=self.known_hosts, endpoint=self.plan.endpoint,
                                plan=self.plan, hf_token_file=self.hf_token_file, deployment_id=self.store.new_deployment_id())

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        rec = self.record
        self.store.save(rec)
        for group in start_steps(self.plan):
            started, failed = start_group(self.plan, self.fleet, group, self.hf_token_file, self.log_dir, rec.deployment_id)
            # Record every process that did start before reporting any failure, so teardown knows about all of them.
            rec.processes.update(started)
            self.store.save(rec)
            if failed:
                raise failed[0]
            nodes = len({p.node for p in group})
            self.on_stage(Stage.START, f"started {len(group)} {'router' if group[0].role == 'router' else 'engine'} process(es) on {nodes} node(s)")

    # ------------------------------------------------------------------ hooks of run_up
    def poll(self, stage: Stage | None) -> Progress:
        rec = self.record
        pl = poll(rec, self.fleet, cursor=self._cursor)
        during = stage or Stage.ALIVE
        if pl.unreachable:
            node, why = next(iter(sorted(pl.unreachable.items())))
            raise LaunchFailed(f"node {node} stopped answering during {during}: {why}",
                               "check the node (sshd, network); `k3launch down` finishes the teardown once it answers",
                               code="node-unreachable", node=node)
        if pl.dead:
            raise self._died(rec, pl, during)
        if stage is None:
            self.on_stage(Stage.ALIVE, f"all {len(rec.processes)} processes running")
        return Progress(running=True, serving=self.plan.processes, endpoint=self.plan.endpoint, stage=Stage.ALIVE, logs=pl.logs)

    def poll_interval(self, elapsed_s: float) -> float:
        return POLL_S

    def not_ready(self, deadline_s: float, stage: Stage, missing: list[str]) -> LaunchFailed:
        rec = self.record
        self._blamed = list(missing)
        return LaunchFailed(f"not ready after {deadline_s:g}s (stage {stage}; not healthy: {', '.join(missing) or 'none'})",
                            "raise --ready-timeout if loads are slow, or read the logs", missing[0] if missing else None,
                            self.log_tail(rec, missing[0]) if missing and missing[0] in rec.processes else "", code="not-ready")

    def started(self) -> bool:
        return True  # the record is saved before anything starts; teardown finds processes by their markers

    def failed(self, exc: LaunchFailed) -> None:
        """Keep the failing processes' last log lines where the user can read them after the
        teardown (which removes the deployment, and with it ``k3launch logs``), and name them."""
        ids = self._blamed or ([exc.failing] if exc.failing else [p.id for p in self.plan.processes if p.http_port is not None])
        kept = self._keep_logs(ids, exc)
        if kept:
            where = str(kept[0]) if len(kept) == 1 else f"{kept[0].parent}/ ({', '.join(k.name for k in kept)})"
            said = f"{'log' if len(kept) == 1 else 'logs'} kept in {where}"
        else:  # nothing could be kept here (a full disk): the logs stay in the run directories on the nodes
            where = ", ".join(f"{pr.node}:{pr.log}" for i in ids if (pr := self.record.processes.get(i)) and pr.log)
            said = f"logs on the nodes: {where}"
        if where:
            exc.message += f"; {said}"
        exc.hint = exc.hint.replace("read the logs", f"read {where}" if where else "read the logs on the nodes")

    def _keep_logs(self, ids: Sequence[str], exc: LaunchFailed) -> list[Path]:
        """``<state-dir>/logs/<deployment>/<process>.log``: the last lines of each of ``ids`` (the
        start command's output for one that never started); the previous failure's files go."""
        rec = self.record
        silent = exc.node if exc.code in ("node-unreachable", "unreachable") else None  # not waited for again
        started = [i for i in ids if i in rec.processes and rec.processes[i].node != silent]
        texts = tail_logs(rec, self.fleet, started, KEPT_LOG_LINES) if started else {}
        if exc.failing and exc.failing not in rec.processes and exc.log_tail:
            texts[exc.failing] = exc.log_tail
        return keep_tails(self.store.logs_dir(rec.name), texts, clear=True)

    def teardown(self, exc: BaseException) -> TeardownReport:
        rec = self.record
        self.on_stage(Stage.TEARDOWN, "tearing down what was started")
        # a node that just failed to answer is not waited for again (isolated: a connect timeout)
        known = {exc.node: exc.message} if isinstance(exc, LaunchFailed) and exc.node and exc.code in ("node-unreachable", "unreachable") else {}
        report = teardown(rec, self.fleet, self.store, unreachable=known)
        if report.clean:
            self.on_stage(Stage.TEARDOWN, f"done: {report.verified}")
        elif report.unreachable:
            self.on_stage(Stage.TEARDOWN, f"incomplete: {', '.join(sorted(report.unreachable))} did not answer; record kept: "
                          f"run `k3launch down {rec.name}` once they answer")
        else:
            left = [f"{', '.join(items)} on {node}" for node, items in sorted(report.leftovers.items())]
            left += [f"port {p} still in use" for p in report.busy_ports]
            self.on_stage(Stage.TEARDOWN, f"incomplete: {'; '.join(left)}; record kept: run `k3launch down {rec.name}` again")
        return report

    def up(self, *, timeout: float | None = None, keep_on_failure: bool = False) -> SshRecord:
        """Start and wait until the deployment serves (the shared skeleton with this backend's hooks)."""
        run_up(self, self.store, ready_timeout(self.plan, timeout), keep_on_failure, self.on_failure)
        return self.record

    # ------------------------------------------------------------------ observe
    def poll_once(self, rec: SshRecord) -> Poll:
        return poll(rec, self.fleet)

    def dead_processes(self, rec: SshRecord) -> list[str]:
        """Ids of started processes that are not running (first to die first); raises on an unreachable node."""
        pl = self.poll_once(rec)
        if pl.unreachable:
            node, why = next(iter(sorted(pl.unreachable.items())))
            raise LaunchFailed(f"node {node} stopped answering: {why}", "check the node; `k3launch down` cleans up what is reachable",
                               None, code="node-unreachable", node=node)
        return pl.dead

    def log_tail(self, rec: SshRecord, pid: str, lines: int = 30) -> str:
        pr = rec.processes[pid]
        cmd = remote.container_log_tail(pr.runtime, pr.handle, lines) if is_container(pr.runtime) else remote.log_tail(pr.log, lines)
        try:
            return self.fleet.run(pr.node, cmd, timeout=20).stdout
        except K3Error as exc:
            return f"(log unavailable: {exc.message})"

    def _died(self, rec: SshRecord, pl: Poll, stage: str) -> LaunchFailed:
        dead = pl.dead
        cause = dead[0]
        self._blamed = list(dead)
        proc = next(p for p in self.plan.processes if p.id == cause)
        then = f"; then {', '.join(dead[1:])} exited too" if dead[1:] else ""
        code = pl.codes.get(cause, "?")
        how = f" with code {code}" if code != "?" else ""
        tail = pl.tails.get(cause) or self.log_tail(rec, cause)
        said = error_line(tail)
        hint = "its last log lines are above; fix the cause and run `k3launch up` again"
        if code == "127":  # env(1): the program is not there
            said = f"{proc.argv[0] if proc.role == 'router' else 'the engine program'} not found"
            hint = (router_install_hint(proc.node, self.fleet.target(proc.node).local) if proc.role == "router"
                    else "install the engine on the node, or set its `python:`/`venv:` in the inventory")
        return LaunchFailed(f"{cause} ({proc.rank_label()}) on {proc.node} exited{how} during {stage}{then}" + (f": {said}" if said else ""),
                            hint, cause, tail, code="process-exited", node=proc.node)
