"""What a deployment is doing now: per-process liveness and health, and its logs."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Iterable

from k3launch import health, remote
from k3launch.errors import K3Error
from k3launch.nodes import Fleet
from k3launch.state import DeploymentRecord

Snapshot = dict[str, object]


def observe(rec: DeploymentRecord, fleet: Fleet) -> Snapshot:
    """``{name, state, endpoint, processes: [{id, node, role, alive, healthy}], unreachable}``."""
    from k3launch.launch import Launch

    dead: set[str] = set()
    unreachable: list[str] = []
    try:
        dead = set(Launch(rec.plan, fleet, store=None).dead_processes(rec))  # type: ignore[arg-type]
    except K3Error as exc:
        unreachable.append(exc.message)
    procs = []
    for p in rec.plan.processes:
        started = p.id in rec.processes
        alive = started and p.id not in dead and not unreachable
        healthy: bool | None = None
        if p.http_port is not None:
            healthy = alive and health.health(f"http://{p.address}:{p.http_port}", timeout=2).ok
        procs.append({"id": p.id, "node": p.node, "role": p.role, "alive": alive, "healthy": healthy})
    state: str = rec.state
    if state == "ready" and not all(p["alive"] for p in procs):
        state = "degraded"
    return {"name": rec.name, "state": state, "endpoint": rec.endpoint, "processes": procs, "unreachable": unreachable}


def _log_cmd(rec: DeploymentRecord, pid: str, lines: int) -> tuple[str, str]:
    pr = rec.processes.get(pid)
    if pr is None:
        return "", "echo '(never started)'"
    if pr.runtime in ("docker", "podman"):
        return pr.node, remote.container_log_tail(pr.runtime, pr.handle, lines)
    return pr.node, remote.log_tail(pr.log, lines)


def tail_logs(rec: DeploymentRecord, fleet: Fleet, ids: Iterable[str], lines: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for pid in ids:
        node, cmd = _log_cmd(rec, pid, lines)
        if not node:
            out[pid] = "(never started)"
            continue
        try:
            out[pid] = fleet.run(node, cmd, timeout=20).stdout
        except K3Error as exc:
            out[pid] = f"(unavailable: {exc.message})"
    return out


def follow_logs(rec: DeploymentRecord, fleet: Fleet, ids: Iterable[str], emit: Callable[[str], None], poll_s: float = 1.0,
                max_s: float | None = None) -> None:
    """Print new log lines as they appear (bare runtimes: by byte offset; containers: --since)."""
    ids = [i for i in ids if i in rec.processes]
    offsets: dict[str, int] = {}
    for pid in ids:
        pr = rec.processes[pid]
        if pr.runtime not in ("docker", "podman"):
            r = fleet.run(pr.node, f"wc -c < {shlex.quote(pr.log)} 2>/dev/null || echo 0", timeout=20)
            offsets[pid] = int((r.stdout.strip() or "0").split()[0])
    t_end = None if max_s is None else time.monotonic() + max_s
    since = time.time()
    while t_end is None or time.monotonic() < t_end:
        time.sleep(poll_s)
        now = time.time()
        for pid in ids:
            pr = rec.processes[pid]
            if pr.runtime in ("docker", "podman"):
                cmd = f"{pr.runtime} logs --since {int(since)} {shlex.quote(pr.handle)} 2>&1 || true"
            else:
                cmd = f"tail -c +{offsets[pid] + 1} {shlex.quote(pr.log)} 2>/dev/null || true"
            try:
                text = fleet.run(pr.node, cmd, timeout=20).stdout
            except K3Error:
                continue
            if pr.runtime not in ("docker", "podman"):
                offsets[pid] += len(text.encode())
            for line in text.splitlines():
                emit(f"{pid}| {line}")
        since = now
