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
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from k3launch.deploy.ssh.observe import Poll, poll, probe_all
from k3launch.deploy.ssh.teardown import teardown
from k3launch.deploy.state import DeploymentRecord, ProcessRecord, StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan, Process
from k3launch.render import snippets as remote
from k3launch.render.scripts import BACKGROUND_HELPER, Raw, container_name, start_command, start_line, token_snippet
from k3launch.transport import http as health
from k3launch.transport.fleet import Fleet

DEFAULT_READY_TIMEOUT_S = 1800.0
POLL_S = 0.5
START_TIMEOUT_S = 120.0

StageFn = Callable[[str, str], None]  # (stage, message)


class LaunchFailed(K3Error):
    def __init__(self, message: str, hint: str, failing: str | None = None, log_tail: str = "", code: str = "launch-failed",
                 node: str | None = None) -> None:
        super().__init__(code, message, hint)
        self.failing = failing
        self.log_tail = log_tail
        self.node = node


def ready_timeout(plan: Plan, override: float | None) -> float:
    if override is not None:
        return override
    for p in plan.processes:
        v = p.env.get("VLLM_ENGINE_READY_TIMEOUT_S")
        if v and v.isdigit():
            return float(v)
    return DEFAULT_READY_TIMEOUT_S


def _start_line(plan: Plan, proc: Process, fleet: Fleet, hf_token_file: str | None, log_dir: str) -> str:
    host = fleet.host(proc.node)
    return BACKGROUND_HELPER + token_snippet(hf_token_file) + start_line(plan, proc, host, log_dir)


def start_steps(plan: Plan) -> list[list[Process]]:
    """Engines first (all nodes at once), then the router (it needs the engines' addresses)."""
    engines = [p for p in plan.processes if p.role != "router"]
    routers = [p for p in plan.processes if p.role == "router"]
    return [g for g in (engines, routers) if g]


def node_script(plan: Plan, fleet: Fleet, procs: Sequence[Process], hf_token_file: str | None, log_dir: str = "") -> str:
    """What one step of ``up`` runs on one node (run by bash, whatever the login shell): each
    process's start in a subshell of its own, so one failing start does not skip the others,
    its output and exit code framed by ``@@`` markers."""
    parts = []
    for p in procs:
        parts.append(f"echo {shlex.quote('@@start ' + p.id)}\n(\n{_start_line(plan, p, fleet, hf_token_file, log_dir)}\n) 2>&1\n"
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


def _record_for(plan: Plan, proc: Process, fleet: Fleet, out: str, log_dir: str) -> ProcessRecord:
    host = fleet.host(proc.node)
    runtime = "bare" if proc.role == "router" else host.runtime
    if runtime in ("docker", "podman"):
        return ProcessRecord(id=proc.id, node=proc.node, runtime=runtime, handle=container_name(plan, proc), started=True)
    pid = next((ln.split()[2] for ln in out.splitlines() if ln.startswith("started pid ")), "")
    log = start_command(plan, proc, host, log_dir)[1]
    return ProcessRecord(id=proc.id, node=proc.node, runtime=runtime, handle=pid, log=str(log), started=bool(pid))


def rank_label(proc: Process) -> str:
    """``node rank 2`` / ``DP ranks 8-15`` / ``router`` — how people name the rank."""
    a = proc.argv

    def flag(name: str) -> str | None:
        return a[a.index(name) + 1] if name in a and a.index(name) + 1 < len(a) else None

    if (r := flag("--node-rank")) is not None:
        return f"{proc.role}, node rank {r}"
    local = flag("--data-parallel-size-local")
    if local and local.isdigit() and flag("--data-parallel-size"):
        start = int(flag("--data-parallel-start-rank") or 0)
        return f"{proc.role}, DP ranks {start}-{start + int(local) - 1}"
    return proc.role


@dataclass
class Readiness:
    """The ``health`` and ``completion`` stages, shared by every backend: every HTTP endpoint
    answers ``/health`` 200, then one real completion comes back through the public endpoint."""

    processes: Sequence[Process]  # with the addresses the processes really bind
    endpoint: str
    model: str
    on_stage: StageFn
    healthy: set[str] = field(default_factory=set)

    @property
    def missing(self) -> list[str]:
        return [p.id for p in self.processes if p.http_port is not None and p.id not in self.healthy]

    def check(self, t_end: float) -> health.Completion | None:
        """One poll: probe what is not healthy yet; once all are, try the completion."""
        n = sum(1 for p in self.processes if p.http_port is not None)
        todo = {p.id: f"http://{p.address}:{p.http_port}" for p in self.processes if p.id in self.missing}
        for pid, ok in probe_all(todo).items():
            if ok:
                self.healthy.add(pid)
                self.on_stage("health", f"{pid} healthy ({len(self.healthy)}/{n})")
        if self.missing:
            return None
        c = health.completion(self.endpoint, self.model, timeout=max(5.0, min(60.0, t_end - time.monotonic())))
        if c.ok:
            self.on_stage("completion", f"completion through {self.endpoint}: {c.completion_tokens} tokens in {c.seconds:.2f}s")
            return c
        if c.detail.startswith("no tokens"):
            raise LaunchFailed(f"completion stage: {self.endpoint} answers but generated no tokens ({c.detail})",
                               "check the engine logs (`k3launch logs`)", code="no-tokens")
        return None

    def stage(self) -> str:
        return "health" if self.missing else "completion"


@dataclass
class Launch:
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

    def record(self) -> DeploymentRecord:
        now = time.time()
        # ssh settings from the start: a `down` after a failed `up` must check the same host keys
        return DeploymentRecord(name=self.plan.name, state="starting", created=now, updated=now, inventory=self.inventory,
                                ssh_config=self.ssh_config, known_hosts=self.known_hosts, endpoint=self.plan.endpoint, plan=self.plan)

    # ------------------------------------------------------------------ start
    def start(self, rec: DeploymentRecord) -> None:
        for group in start_steps(self.plan):
            by_node: dict[str, list[Process]] = {}
            for p in group:
                by_node.setdefault(p.node, []).append(p)
            scripts = {n: "bash -c " + shlex.quote(node_script(self.plan, self.fleet, ps, self.hf_token_file, self.log_dir))
                       for n, ps in by_node.items()}
            failed: list[LaunchFailed] = []
            for node, o in self.fleet.run_many(scripts, timeout=START_TIMEOUT_S).items():
                if isinstance(o, K3Error):
                    failed.append(LaunchFailed(f"could not start {', '.join(p.id for p in by_node[node])} on {node}: {o.message}", o.hint,
                                               by_node[node][0].id, code=o.code, node=node))
                    continue
                got = _sections(o.stdout)
                for p in by_node[node]:
                    rc, text = got.get(p.id, (None, ""))
                    pr = _record_for(self.plan, p, self.fleet, text, self.log_dir)
                    if rc == 0 and not pr.started:
                        rc = -1  # a bare process without a pid: it did not start
                    if rc == 0:
                        # Record every process that did start before reporting any failure, so
                        # teardown knows about all of them.
                        rec.processes[p.id] = pr
                    else:
                        why = {None: f"did not finish (script exit {o.exit_code})", -1: "reported no pid"}.get(rc, f"exited {rc}")
                        failed.append(LaunchFailed(f"could not start {p.id} on {node}: start command {why}",
                                                   "run the node's script from `k3launch up --dry-run` by hand to see why", p.id,
                                                   (text or o.stderr)[-2000:], node=node))
            self.store.save(rec)
            if failed:
                raise failed[0]
            self.on_stage("start", f"started {len(group)} {'router' if group[0].role == 'router' else 'engine'} process(es) on {len(by_node)} node(s)")

    # ------------------------------------------------------------------ observe
    def poll(self, rec: DeploymentRecord) -> Poll:
        return poll(rec, self.fleet)

    def dead_processes(self, rec: DeploymentRecord) -> list[str]:
        """Ids of started processes that are not running (first to die first); raises on an unreachable node."""
        pl = self.poll(rec)
        if pl.unreachable:
            node, why = next(iter(sorted(pl.unreachable.items())))
            raise LaunchFailed(f"node {node} stopped answering: {why}", "check the node; `k3launch down` cleans up what is reachable",
                               None, code="node-unreachable", node=node)
        return pl.dead

    def log_tail(self, rec: DeploymentRecord, pid: str, lines: int = 30) -> str:
        pr = rec.processes[pid]
        cmd = remote.container_log_tail(pr.runtime, pr.handle, lines) if pr.runtime in ("docker", "podman") else remote.log_tail(pr.log, lines)
        try:
            return self.fleet.run(pr.node, cmd, timeout=20).stdout
        except K3Error as exc:
            return f"(log unavailable: {exc.message})"

    def _died(self, rec: DeploymentRecord, pl: Poll, stage: str) -> LaunchFailed:
        dead = pl.dead
        cause = dead[0]
        proc = next(p for p in self.plan.processes if p.id == cause)
        then = f"; then {', '.join(dead[1:])} exited too" if dead[1:] else ""
        code = pl.codes.get(cause, "?")
        how = f" with code {code}" if code != "?" else ""
        return LaunchFailed(f"{cause} ({rank_label(proc)}) on {proc.node} exited{how} during {stage}{then}",
                            "its last log lines are above; fix the cause and run `k3launch up` again", cause,
                            pl.tails.get(cause) or self.log_tail(rec, cause),
                            code="process-exited", node=proc.node)

    def wait_ready(self, rec: DeploymentRecord, deadline_s: float) -> health.Completion:
        t_end = time.monotonic() + deadline_s
        ready = Readiness(self.plan.processes, self.plan.endpoint, self.plan.model, self.on_stage)
        stage = "alive"
        while True:
            t_poll = time.monotonic()
            pl = self.poll(rec)
            if pl.unreachable:
                node, why = next(iter(sorted(pl.unreachable.items())))
                raise LaunchFailed(f"node {node} stopped answering during {stage}: {why}",
                                   "check the node (sshd, network); `k3launch down` finishes the teardown once it answers",
                                   code="node-unreachable", node=node)
            if pl.dead:
                raise self._died(rec, pl, stage)
            if stage == "alive":
                self.on_stage("alive", f"all {len(rec.processes)} processes running")
            c = ready.check(t_end)
            if c is not None:
                return c
            stage = ready.stage()
            if time.monotonic() > t_end:
                missing = ready.missing
                raise LaunchFailed(f"not ready after {deadline_s:g}s (stage {stage}; not healthy: {', '.join(missing) or 'none'})",
                                   "raise --ready-timeout if loads are slow, or check `k3launch logs`", missing[0] if missing else None,
                                   self.log_tail(rec, missing[0]) if missing and missing[0] in rec.processes else "", code="not-ready")
            # a fixed cadence: the round trips and probes of this poll are part of the interval
            time.sleep(max(0.0, POLL_S - (time.monotonic() - t_poll)))

    # ------------------------------------------------------------------ up
    def up(self, *, timeout: float | None = None, keep_on_failure: bool = False) -> DeploymentRecord:
        rec = self.record()
        self.store.save(rec)
        try:
            self.start(rec)
            self.wait_ready(rec, ready_timeout(self.plan, timeout))
        except (K3Error, KeyboardInterrupt) as exc:
            rec.state = "failed"
            rec.error = exc.message if isinstance(exc, K3Error) else "interrupted"
            self.store.save(rec)
            self.on_stage("failed", rec.error)  # now, not after a teardown that may take a while
            if isinstance(exc, LaunchFailed):
                self.on_failure(exc)
            if not keep_on_failure:
                self._teardown(rec, exc)
            raise
        rec.state = "ready"
        rec.error = None
        self.store.save(rec)
        self.on_stage("ready", f"{self.plan.name} serving at {self.plan.endpoint}")
        return rec

    def _teardown(self, rec: DeploymentRecord, exc: BaseException) -> None:
        self.on_stage("teardown", "tearing down what was started")
        # a node that just failed to answer is not waited for again (isolated: a connect timeout)
        known = {exc.node: exc.message} if isinstance(exc, LaunchFailed) and exc.node and exc.code in ("node-unreachable", "unreachable") else {}
        report = teardown(rec, self.fleet, self.store, unreachable=known)
        if report.clean:
            self.store.delete(rec.name)
            self.on_stage("teardown", "done: nothing left, ports free")
        else:
            self.on_stage("teardown", f"incomplete ({', '.join(sorted(report.unreachable)) or 'leftovers'}); record kept: "
                          f"run `k3launch down {rec.name}` once the nodes answer")


__all__ = ["Launch", "LaunchFailed", "Poll", "Raw", "node_script", "poll", "ready_timeout", "start_steps"]
