"""File locks (``flock``): the one place k3launch takes them.

Used for the per-deployment lock of the state directory (refuse, do not wait), the campaign
results file (appenders wait their turn), a campaign's per-group lock (another process running
the group is skipped) and the Slurm bad-nodes file. ``flock`` locks are released when the file
descriptor closes, so a killed process never leaves a lock held; on NFS they need a mount
without ``nolock``.

Lock files that exist only to be locked (``remove=True``) are deleted by their holder before it
lets go, so no command leaves them behind. That needs care: a process that opened the file just
before the unlink would lock an inode no longer reachable by name, while a third process creates
and locks a new file — two holders. So after taking the lock, the holder checks that the path
still names the inode it locked, and starts over when it does not.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CREATE = os.O_CREAT | os.O_RDWR


def _acquire(path: Path, wait: bool, flags: int, mode: int, remove: bool) -> int | None:
    """An open, locked descriptor of ``path``; None when ``wait`` is False and it is held."""
    while True:
        fd = os.open(path, flags, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if not remove:
            return fd
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False  # the previous holder removed it between our open and our lock
        if same:
            return fd
        os.close(fd)


@contextmanager
def locked(path: Path, *, wait: bool = True, flags: int = CREATE, mode: int = 0o644, remove: bool = False) -> Iterator[int | None]:
    """Open ``path`` and hold an exclusive lock on it while the block runs; yields the file
    descriptor (to write through it), or None when ``wait`` is False and another process holds it.
    ``remove``: the file is only a lock; delete it on release (see the module docstring)."""
    fd = _acquire(path, wait, flags, mode, remove)
    if fd is None:
        yield None
        return
    try:
        yield fd
    finally:
        if remove:
            Path(path).unlink(missing_ok=True)  # while still holding it: nobody can be mid-check on this inode
        os.close(fd)  # releases the lock


def held(path: Path) -> bool:
    """Whether a process holds ``path``'s lock now. A lock file nobody holds is removed (its
    holder was killed before it could), so asking leaves nothing behind."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                Path(path).unlink()
        except FileNotFoundError:
            pass
        return False
    finally:
        os.close(fd)
