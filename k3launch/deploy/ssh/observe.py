"""What a deployment is doing now: per-process liveness and health, and its logs.

One round trip per node for liveness (the poll ``up`` uses), HTTP probes in parallel, log tails
batched per node (one command prints every requested process's tail between markers).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from k3launch.deploy.logtail import LogCursor, cut_sections
from k3launch.errors import K3Error
from k3launch.models.phases import LogDelta
from k3launch.models.plan import CONTAINER_RUNTIMES, is_container
from k3launch.models.record import ProcessRecord, ProcessStatus, SshRecord, Status, observed_state
from k3launch.models.reports import PEER_LOSS
from k3launch.render import logread
from k3launch.render import snippets as remote
from k3launch.transport.fleet import Fleet
from k3launch.transport.http import probe_all
from k3launch.transport.runners import CommandFailed
from k3launch.util.polling import ticks

# A poll takes milliseconds; one this late has failed. A host that goes silent is noticed sooner,
# within the connect timeout, by its connection's heartbeat (k3launch.transport.heartbeat).
POLL_TIMEOUT_S = 10.0

@dataclass
class Poll:
    """One liveness check of every started process: one round trip per node."""

    dead: list[str] = field(default_factory=list)  # process ids, the first to die first
    unreachable: dict[str, str] = field(default_factory=dict)  # node → why
    tails: dict[str, str] = field(default_factory=dict)  # dead process id → its last log lines
    codes: dict[str, str] = field(default_factory=dict)  # dead process id → exit code ("?" unknown)
    logs: dict[str, LogDelta] = field(default_factory=dict)  # with a cursor: process id → what its log gained


def _log_reads(prs: list[ProcessRecord], cursor: LogCursor, logs_of: Collection[str] | None) -> list[str]:
    """Live progress: what each process's log gained, in the same round trip as the liveness check
    (``logs_of``: only these processes' logs; None: every process's)."""
    return [logread.container_log_since(p.id, p.runtime, p.handle, cursor.since.get(p.id, "")) if is_container(p.runtime)
            else logread.log_from(p.id, p.log, cursor.offsets.get(p.id, 0)) for p in prs
            if (is_container(p.runtime) or p.log) and (logs_of is None or p.id in logs_of)]


def poll(rec: SshRecord, fleet: Fleet, timeout: float = POLL_TIMEOUT_S, tail_lines: int = 30, cursor: LogCursor | None = None,
         skip: Mapping[str, str] | None = None, logs_of: Collection[str] | None = None) -> Poll:
    """Liveness of every started process (and, with ``cursor``, what each log gained since the last
    poll: every process's, or only ``logs_of``'s — a supervisor reads the logs of a restarting unit
    only). ``skip``: nodes not asked this time (known silent: node -> why), reported unreachable."""
    by_node: dict[str, list[ProcessRecord]] = {}
    for pr in rec.processes.values():
        if pr.handle and pr.node not in (skip or {}):
            by_node.setdefault(pr.node, []).append(pr)
    cmds = {}
    for node, prs in by_node.items():
        bare = [(p.handle, p.log) for p in prs if not is_container(p.runtime)]
        parts = [remote.process_status(bare, tail_lines)] if bare else []
        for rt in CONTAINER_RUNTIMES:
            names = [p.handle for p in prs if p.runtime == rt]
            if names:
                parts.append(remote.containers_alive(rt, names))
        parts += _log_reads(prs, cursor, logs_of) if cursor is not None else []  # after the status lines: they are parsed first
        cmds[node] = "\n".join(parts) or "true"
    out = Poll()
    out.unreachable.update({n: why for n, why in (skip or {}).items() if any(p.node == n for p in rec.processes.values())})
    died: dict[str, float] = {}
    for node, o in fleet.run_many(cmds, timeout=timeout).items():
        if isinstance(o, K3Error):
            out.unreachable[node] = o.message
            continue
        if o.exit_code == 124:  # the host answers keepalives but not this check (a silent host is an Unreachable above)
            out.unreachable[node] = f"{node}: no answer to the liveness check within {timeout:g}s"
            continue
        if not o.ok:
            out.unreachable[node] = CommandFailed(o).message
            continue
        stdout = o.stdout
        if cursor is not None:
            stdout, sections = cut_sections(o.stdout)
            for p in by_node[node]:
                if p.id in sections:
                    take = cursor.take_container if is_container(p.runtime) else cursor.take
                    out.logs[p.id] = take(p.id, sections[p.id])
        status: dict[str, list[str]] = {}
        tails: dict[str, list[str]] = {}
        for ln in stdout.splitlines():
            if ln.startswith("@@"):
                handle, _, text = ln[2:].partition(" ")
                tails.setdefault(handle, []).append(text)
            elif len(ln.split()) >= 2:
                status[ln.split()[0]] = ln.split()[1:]
        for p in by_node[node]:
            st = status.get(p.handle)
            if st is None:  # an answer cut short says nothing about the processes
                out.unreachable[node] = f"{node}: incomplete answer to the liveness check"
            elif st[0] != "up":
                # "down CODE TIME": CODE "?" and TIME the log's mtime when the exit was not recorded
                out.codes[p.id] = st[1] if len(st) > 2 else "?"
                died[p.id] = _float(st[2]) if len(st) > 2 else 0.0
                if p.handle in tails:
                    out.tails[p.id] = "\n".join(tails[p.handle]) + "\n"
    # The cause first: a rank whose last lines do not blame a peer, then the earliest exit (a
    # failing rank may take longer to exit than the peers it brought down); unknown times last.
    out.dead = sorted(died, key=lambda i: (bool(PEER_LOSS.search(out.tails.get(i, ""))), died[i] <= 0, died[i]))
    return out


def _float(s: str) -> float:
    try:
        return float(s.replace(",", "."))  # $EPOCHREALTIME follows the locale's decimal point
    except ValueError:
        return 0.0


def observe(rec: SshRecord, fleet: Fleet) -> Status:
    """The deployment now (:class:`~k3launch.models.record.Status`).

    A process on a node that does not answer is reported not alive (unknown is not alive);
    ``unreachable`` lists those nodes with the reason.
    """
    pl = poll(rec, fleet)
    dead = set(pl.dead)
    alive = {p.id: p.id in rec.processes and p.id not in dead and p.node not in pl.unreachable for p in rec.plan.processes}
    urls = {p.id: f"http://{p.address}:{p.http_port}" for p in rec.plan.processes if p.http_port is not None and alive[p.id]}
    ok = probe_all(urls, timeout=2.0)
    procs = [ProcessStatus(id=p.id, node=p.node, role=p.role, alive=alive[p.id], healthy=None if p.http_port is None else ok.get(p.id, False))
             for p in rec.plan.processes]
    return Status(name=rec.name, state=observed_state(rec.state, procs), endpoint=rec.endpoint, processes=procs,
                  unreachable=[why for _, why in sorted(pl.unreachable.items())])


def _log_cmd(rec: SshRecord, pid: str, lines: int) -> tuple[str, str]:
    pr = rec.processes.get(pid)
    if pr is None:
        return "", "echo '(never started)'"
    if is_container(pr.runtime):
        return pr.node, remote.container_log_tail(pr.runtime, pr.handle, lines)
    return pr.node, remote.log_tail(pr.log, lines)


def _batched(rec: SshRecord, fleet: Fleet, cmds: dict[str, tuple[str, str]], timeout: float = 20.0) -> dict[str, str]:
    """{process id: (node, command)} → {process id: output}, one round trip per node."""
    per_node: dict[str, list[str]] = {}
    for pid, (node, _) in cmds.items():
        per_node.setdefault(node, []).append(pid)
    scripts = {node: "\n".join(f"echo {shlex.quote('@@log ' + pid)}\n{{ {cmds[pid][1]}\n}}" for pid in pids) for node, pids in per_node.items()}
    out: dict[str, str] = {}
    for node, o in fleet.run_many(scripts, timeout=timeout).items():
        if isinstance(o, K3Error):
            for pid in per_node[node]:
                out[pid] = f"(unavailable: {o.message})"
            continue
        cur = None
        for line in o.stdout.splitlines(keepends=True):
            if line.startswith("@@log ") and line.split(None, 1)[1].strip() in per_node[node]:
                cur = line.split(None, 1)[1].strip()
                out[cur] = ""
            elif cur is not None:
                out[cur] += line
    return out


def tail_logs(rec: SshRecord, fleet: Fleet, ids: Iterable[str], lines: int) -> dict[str, str]:
    ids = list(ids)
    cmds = {pid: _log_cmd(rec, pid, lines) for pid in ids}
    got = _batched(rec, fleet, {pid: c for pid, c in cmds.items() if c[0]})
    return {pid: got.get(pid, "(never started)") for pid in ids}


def follow_logs(rec: SshRecord, fleet: Fleet, ids: Iterable[str], emit: Callable[[str], None], poll_s: float = 1.0,
                max_s: float | None = None) -> None:
    """Print new log lines as they appear (bare runtimes: by byte offset; containers: --since)."""
    ids = [i for i in ids if i in rec.processes]
    bare = [i for i in ids if not is_container(rec.processes[i].runtime)]
    sizes = _batched(rec, fleet, {i: (rec.processes[i].node, f"wc -c < {remote.path_word(rec.processes[i].log)} 2>/dev/null || echo 0")
                                  for i in bare})
    offsets = {i: _int(sizes.get(i, "")) for i in bare}
    since = time.time()
    for now in ticks(poll_s, max_s):
        cmds: dict[str, tuple[str, str]] = {}
        for pid in ids:
            pr = rec.processes[pid]
            if is_container(pr.runtime):
                cmds[pid] = (pr.node, f"{shlex.quote(pr.runtime)} logs --since {int(since)} {shlex.quote(pr.handle)} 2>&1 || true")
            else:
                cmds[pid] = (pr.node, f"tail -c +{offsets[pid] + 1} {remote.path_word(pr.log)} 2>/dev/null || true")
        for pid, text in _batched(rec, fleet, cmds).items():
            if text.startswith("(unavailable: "):
                continue
            if pid in offsets:
                offsets[pid] += len(text.encode())
            for line in text.splitlines():
                emit(f"{pid}| {line}")
        since = now


def _int(text: str) -> int:
    words = text.split()
    return int(words[0]) if words and words[0].isdigit() else 0


def keep_tails(dest: Path, texts: Mapping[str, str], clear: bool = False) -> list[Path]:
    """Write each process's last log lines to ``dest/<process>.log`` (``clear``: the previous
    ``*.log`` there go first); the files written. A full disk writes none: the logs stay on the nodes."""
    out = []
    try:
        if clear and dest.is_dir():
            for old in dest.glob("*.log"):
                old.unlink()
        dest.mkdir(parents=True, exist_ok=True)
        for pid, text in texts.items():
            (dest / f"{pid}.log").write_text(text, encoding="utf-8")
            out.append(dest / f"{pid}.log")
    except OSError:
        return []
    return out
