"""File locks (``flock``): the one place k3launch takes them.

Used for the per-deployment lock of the state directory (refuse, do not wait), the campaign
results file (appenders wait their turn), a campaign's per-group lock (another process running
the group is skipped) and the Slurm bad-nodes file. ``flock`` locks are released when the file
descriptor closes, so a killed process never leaves a lock held; on NFS they need a mount
without ``nolock``.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CREATE = os.O_CREAT | os.O_RDWR


@contextmanager
def locked(path: Path, *, wait: bool = True, flags: int = CREATE, mode: int = 0o644) -> Iterator[int | None]:
    """Open ``path`` and hold an exclusive lock on it while the block runs; yields the file
    descriptor (to write through it), or None when ``wait`` is False and another process holds it."""
    fd = os.open(path, flags, mode)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield fd
    finally:
        os.close(fd)  # releases the lock
