"""``up``: start a Plan's processes on their nodes and wait until the deployment really serves.

Lifecycle stages (each reported through ``on_stage`` so the CLI can show progress):
``doctor`` → ``start`` (engines in parallel, router last) → ``alive`` (every process running) →
``health`` (every HTTP endpoint answers ``/health`` 200; a head only does once all its ranks
joined) → ``completion`` (one real completion through the public endpoint) → ``ready``.

Fail fast: every poll re-checks that every started process is alive and every node answers; the
first death (or unreachable node) fails the deployment with the last log lines of the failing
process, and — unless ``keep_on_failure`` — everything started is torn down. The readiness
deadline is per deployment (``--ready-timeout``, else the plan's ``VLLM_ENGINE_READY_TIMEOUT_S``,
else 1800 s).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from k3launch import health, remote
from k3launch.errors import K3Error
from k3launch.nodes import Fleet
from k3launch.plan_models import Plan, Process
from k3launch.render import Raw, container_name, shell_join, start_command, token_snippet
from k3launch.runners import CommandFailed, Outcome
from k3launch.state import DeploymentRecord, ProcessRecord, StateStore
from k3launch.teardown import teardown

DEFAULT_READY_TIMEOUT_S = 1800.0
POLL_S = 0.5

StageFn = Callable[[str, str], None]  # (stage, message)


class LaunchFailed(K3Error):
    def __init__(self, message: str, hint: str, failing: str | None = None, log_tail: str = "") -> None:
        super().__init__("launch-failed", message, hint)
        self.failing = failing
        self.log_tail = log_tail


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
    cmd = start_command(plan, proc, host, log_dir)
    # The same helper the rendered scripts define, so a manual run and `up` start identically.
    prelude = (
        "k3launch_background() { local log=$1; shift; mkdir -p \"$(dirname \"$log\")\"; "
        "(cd \"$(dirname \"$log\")\" || exit 1; nohup setsid \"$@\" >\"$log\" 2>&1 </dev/null & echo \"started pid $!\"); }\n"
    )
    return prelude + token_snippet(hf_token_file) + shell_join(cmd)


def _record_for(plan: Plan, proc: Process, fleet: Fleet, out: str, log_dir: str) -> ProcessRecord:
    host = fleet.host(proc.node)
    runtime = "bare" if proc.role == "router" else host.runtime
    if runtime in ("docker", "podman"):
        return ProcessRecord(id=proc.id, node=proc.node, runtime=runtime, handle=container_name(plan, proc), started=True)
    pid = next((ln.split()[2] for ln in out.splitlines() if ln.startswith("started pid ")), "")
    log = start_command(plan, proc, host, log_dir)[1]
    return ProcessRecord(id=proc.id, node=proc.node, runtime=runtime, handle=pid, log=str(log), started=bool(pid))


@dataclass
class Launch:
    plan: Plan
    fleet: Fleet
    store: StateStore
    inventory: str | None = None
    hf_token_file: str | None = None
    log_dir: str = ""
    on_stage: StageFn = field(default=lambda s, m: None)

    def record(self) -> DeploymentRecord:
        now = time.time()
        return DeploymentRecord(name=self.plan.name, state="starting", created=now, updated=now, inventory=self.inventory,
                                endpoint=self.plan.endpoint, plan=self.plan)

    # ------------------------------------------------------------------ start
    def start(self, rec: DeploymentRecord) -> None:
        from concurrent.futures import ThreadPoolExecutor

        engines = [p for p in self.plan.processes if p.role != "router"]
        routers = [p for p in self.plan.processes if p.role == "router"]
        for group in (engines, routers):
            if not group:
                continue

            def one(p: Process) -> tuple[Process, Outcome]:
                cmd = _start_line(self.plan, p, self.fleet, self.hf_token_file, self.log_dir)
                try:
                    return p, self.fleet.run(p.node, cmd, timeout=120)
                except K3Error as exc:
                    return p, exc

            with ThreadPoolExecutor(max_workers=max(1, min(self.fleet.concurrency, len(group)))) as pool:
                outcomes = list(pool.map(one, group))
            # Record every process that did start before reporting any failure, so teardown
            # knows about all of them.
            for p, o in outcomes:
                if not isinstance(o, K3Error) and o.ok:
                    rec.processes[p.id] = _record_for(self.plan, p, self.fleet, o.stdout, self.log_dir)
            self.store.save(rec)
            for p, o in outcomes:
                if isinstance(o, K3Error):
                    raise LaunchFailed(f"could not start {p.id} on {p.node}: {o.message}", o.hint, p.id)
                if not o.ok:
                    raise LaunchFailed(f"could not start {p.id} on {p.node}: {CommandFailed(o).message}",
                                       "run the node's script from `k3launch render` by hand to see why", p.id, o.stderr[-2000:])
            self.on_stage("start", f"started {len(group)} {'router' if group is routers else 'engine'} process(es)")

    # ------------------------------------------------------------------ observe
    def dead_processes(self, rec: DeploymentRecord) -> list[str]:
        """Ids of started processes that are not running; raises on an unreachable node."""
        by_node: dict[str, list[ProcessRecord]] = {}
        for pr in rec.processes.values():
            by_node.setdefault(pr.node, []).append(pr)
        cmds = {}
        for node, prs in by_node.items():
            bare = [p.handle for p in prs if p.runtime not in ("docker", "podman") and p.handle]
            parts = [remote.alive(bare)] if bare else []
            for rt in ("docker", "podman"):
                names = [p.handle for p in prs if p.runtime == rt]
                if names:
                    parts.append(remote.containers_alive(rt, names))
            cmds[node] = "\n".join(parts) or "true"
        outcomes = self.fleet.run_many(cmds, timeout=30)
        dead: list[str] = []
        for node, o in outcomes.items():
            if isinstance(o, K3Error):
                raise LaunchFailed(f"node {node} stopped answering: {o.message}", "check the node; `k3launch down` cleans up what is reachable", None)
            status = dict(line.split()[:2] for line in o.stdout.splitlines() if len(line.split()) >= 2)
            dead += [p.id for p in by_node[node] if status.get(p.handle) != "up"]
        return dead

    def log_tail(self, rec: DeploymentRecord, pid: str, lines: int = 30) -> str:
        pr = rec.processes[pid]
        cmd = remote.container_log_tail(pr.runtime, pr.handle, lines) if pr.runtime in ("docker", "podman") else remote.log_tail(pr.log, lines)
        try:
            return self.fleet.run(pr.node, cmd, timeout=20).stdout
        except K3Error as exc:
            return f"(log unavailable: {exc.message})"

    def wait_ready(self, rec: DeploymentRecord, deadline_s: float) -> health.Completion:
        t_end = time.monotonic() + deadline_s
        http = [p for p in self.plan.processes if p.http_port is not None and p.role != "router"]
        router = next((p for p in self.plan.processes if p.role == "router"), None)
        stage = "alive"
        healthy: set[str] = set()
        while True:
            dead = self.dead_processes(rec)
            if dead:
                tail = self.log_tail(rec, dead[0])
                raise LaunchFailed(f"{dead[0]} on {rec.processes[dead[0]].node} exited during {stage}",
                                   "its last log lines are above; fix the cause and run `k3launch up` again", dead[0], tail)
            if stage == "alive":
                self.on_stage("alive", f"all {len(rec.processes)} processes running")
                stage = "health"
            if stage == "health":
                for p in http + ([router] if router else []):
                    if p.id not in healthy and health.health(f"http://{p.address}:{p.http_port}").ok:
                        healthy.add(p.id)
                        self.on_stage("health", f"{p.id} healthy ({len(healthy)}/{len(http) + (1 if router else 0)})")
                if len(healthy) == len(http) + (1 if router else 0):
                    stage = "completion"
            if stage == "completion":
                c = health.completion(self.plan.endpoint, self.plan.model)
                if c.ok:
                    self.on_stage("completion", f"completion through {self.plan.endpoint}: {c.completion_tokens} tokens in {c.seconds:.2f}s")
                    return c
                if c.detail.startswith("no tokens"):
                    raise LaunchFailed(f"the deployment answers but generated no tokens ({c.detail})", "check the engine logs (`k3launch logs`)", None)
            if time.monotonic() > t_end:
                missing = [p.id for p in http if p.id not in healthy]
                raise LaunchFailed(f"not ready after {deadline_s:g}s (stage {stage}; not healthy: {', '.join(missing) or 'none'})",
                                   "raise --ready-timeout if loads are slow, or check `k3launch logs`", missing[0] if missing else None,
                                   self.log_tail(rec, missing[0]) if missing else "")
            time.sleep(POLL_S)

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
            if not keep_on_failure:
                self.on_stage("teardown", "tearing down what was started")
                report = teardown(rec, self.fleet, self.store)
                if report.clean:
                    self.store.delete(rec.name)
            raise
        rec.state = "ready"
        rec.error = None
        self.store.save(rec)
        self.on_stage("ready", f"{self.plan.name} serving at {self.plan.endpoint}")
        return rec


__all__ = ["Launch", "LaunchFailed", "Raw", "ready_timeout"]
