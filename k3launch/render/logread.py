"""Shell snippets that print what a process's log gained since the last look (pure string builders).

They ride along in the liveness poll ``up`` already makes (one round trip per node), so live
progress costs bytes and two forks per process, not connections. Each prints one section::

    @@k3log PROCESS
    <the new text, as written>
    @@k3end PROCESS

(an ``echo`` before the end marker ends an unfinished last line, which the reader takes off again:
see :func:`k3launch.deploy.logtail.cut_sections`).
"""

from __future__ import annotations

import shlex

from k3launch.render.snippets import path_word

CHUNK_BYTES = 131072  # the most one poll reads of one log; the rest comes next poll, in order
CONTAINER_LINES = 400
START, END = "@@k3log ", "@@k3end "


def _frame(pid: str, body: str) -> str:
    return f"echo {shlex.quote(START + pid)}; {body}; echo; echo {shlex.quote(END + pid)}"


def log_from(pid: str, log: str, offset: int) -> str:
    """The bytes of ``log`` from ``offset`` on (at most :data:`CHUNK_BYTES`), led by the byte before
    ``offset`` when there is one: the newline that ended the last line read, unless the offset missed
    a line start (:meth:`k3launch.deploy.logtail.LogCursor.take` checks it)."""
    offset = int(offset)
    start, size = (offset, CHUNK_BYTES + 1) if offset > 0 else (1, CHUNK_BYTES)  # tail -c +K starts at byte K, counted from 1
    return _frame(pid, f"tail -c +{start} {path_word(log)} 2>/dev/null | head -c {size}")


def container_log_since(pid: str, runtime: str, name: str, since: str) -> str:
    """A container's log lines, each led by the runtime's timestamp, from ``since`` on (all when empty)."""
    after = f"--since {shlex.quote(since)} " if since else ""
    return _frame(pid, f"{shlex.quote(runtime)} logs --timestamps {after}{shlex.quote(name)} 2>&1 | tail -n {CONTAINER_LINES}")
