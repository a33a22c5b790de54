"""The processes a test started, read from /proc: a process's whole tree, and which are still alive
(the real-engine tests check that `down` leaves none of an engine's processes behind)."""

from __future__ import annotations

from pathlib import Path


def descendants(root: int) -> set[int]:
    """``root`` and every process below it (from /proc: ppid links)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


def alive_of(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (zombies and dead ones left out)."""
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            left.add(pid)
    return left
