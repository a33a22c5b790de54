"""``down``'s container stop (render/snippets.stop_containers) run by bash against a stand-in
runtime: SIGTERM reaches every process of the container's group (not only its first one, as
``stop`` alone would: vLLM's API server then kills its engine core at once, and its shared memory
stays in /dev/shm), the grace period is waited out with ``wait``, and only then ``stop -t 0`` and
``rm``; a group that cannot be signalled gets ``stop -t GRACE`` as before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from k3launch.render.snippets import stop_containers

# The container: a process group whose leader and member each write "NAME TERM" on SIGTERM.
GROUP = """trap 'echo leader TERM >> {log}; exit 0' TERM
sh -c 'trap "echo member TERM >> {log}; exit 0" TERM; while :; do sleep 0.05; done' &
while :; do sleep 0.05; done
"""
# A runtime: `inspect` answers the group's pid (or none), `wait` waits for it, every call logged.
FAKE = """#!/bin/bash
echo "$*" >> {log}
case "$1" in
  inspect) cat {pidfile} 2>/dev/null || exit 1 ;;
  wait) p=$(cat {pidfile}); while [ -e /proc/$p ] && ! grep -q ') Z' /proc/$p/stat 2>/dev/null; do sleep 0.05; done ;;  # exited: gone or a zombie
esac
"""


def _runtime(tmp: Path) -> Path:
    rt = tmp / "fakert"
    rt.write_text(FAKE.format(log=tmp / "calls", pidfile=tmp / "pid"))
    rt.chmod(0o755)
    return rt


def test_the_whole_group_gets_sigterm_then_the_container_is_stopped_at_once_and_removed(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    group = subprocess.Popen(["bash", "-c", GROUP.format(log=tmp_path / "terms")], start_new_session=True)
    try:
        (tmp_path / "pid").write_text(str(group.pid))
        time.sleep(0.3)  # both traps set
        t0 = time.monotonic()
        r = subprocess.run(["bash", "-c", stop_containers(str(rt), ["k3-dep-serve-0"], 30)], capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        group.wait(timeout=5)
        terms = sorted((tmp_path / "terms").read_text().split("\n"))
        assert terms == ["", "leader TERM", "member TERM"], terms  # both, each once, on their own
        calls = (tmp_path / "calls").read_text().splitlines()
        assert calls == ["inspect -f {{.State.Pid}} k3-dep-serve-0", "wait k3-dep-serve-0", "stop -t 0 k3-dep-serve-0",
                         "rm -f k3-dep-serve-0"], calls
        assert took < 10, took  # the group ended at once: no grace period spent
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)


def test_a_container_without_a_pid_is_stopped_with_the_grace_period(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)  # no pid file: inspect fails, as for a container that is not running
    r = subprocess.run(["bash", "-c", stop_containers(str(rt), ["c1"], 7)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").read_text().splitlines() == ["inspect -f {{.State.Pid}} c1", "stop -t 7 c1", "rm -f c1"]


# A process that maps a /dev/shm file and exits on SIGTERM without unlinking it (vLLM's engine
# core killed before its cleanup, its resource tracker gone with the container's PID namespace).
MAPPER = """import mmap, signal, sys, time
f = open(sys.argv[1], "w+b"); f.write(b"x" * 4096); f.flush()
m = mmap.mmap(f.fileno(), 4096)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
open(sys.argv[2], "w").close()
while True: time.sleep(0.05)
"""


def test_the_shared_memory_the_container_mapped_is_unlinked_and_nothing_else(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    tag = uuid.uuid4().hex[:8]
    mine, other = Path(f"/dev/shm/psm_k3t{tag}"), Path(f"/dev/shm/psm_k3o{tag}")
    other.write_bytes(b"y")  # another engine's, not mapped by the group: stays
    try:
        _stop_around(tmp_path, rt, [sys.executable, "-c", MAPPER, str(mine), str(tmp_path / "ready")])
        assert not mine.exists()  # left by the process, unlinked by the stop
        assert other.exists()
    finally:
        for f in (mine, other):
            f.unlink(missing_ok=True)


def _stop_around(tmp: Path, rt: Path, argv: list[str], check: Callable[[int], None] = lambda pid: None) -> None:
    """Start ``argv`` as the container's process group, wait for its ready file, ``check`` its
    pid, then run the stop and wait for the group to end."""
    group = subprocess.Popen(argv, start_new_session=True)
    try:
        (tmp / "pid").write_text(str(group.pid))
        for _ in range(100):
            if (tmp / "ready").exists():
                break
            time.sleep(0.05)
        check(group.pid)
        r = subprocess.run(["bash", "-c", stop_containers(str(rt), ["c1"], 10)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        group.wait(timeout=5)
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)


# A named semaphore as multiprocessing makes one under spawn (tqdm's lock in vLLM's worker): glibc
# creates it under a temporary name, maps it, then renames it, so /proc/PID/maps shows
# "/dev/shm/sem.XXXXXX (deleted)", never "sem.mp-...". No resource tracker: none survives a
# container's PID namespace.
SEMAPHORE = """import _multiprocessing, signal, sys, time
lock = _multiprocessing.SemLock(1, 1, 1, sys.argv[1], False)
if len(sys.argv) > 2:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    open(sys.argv[2], "w").close()
    while True: time.sleep(0.05)
"""


def test_a_named_semaphore_the_container_mapped_is_unlinked_by_its_inode_and_nothing_else(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    tag = uuid.uuid4().hex[:8]
    mine, other = Path(f"/dev/shm/sem.mp-k3t{tag}"), Path(f"/dev/shm/sem.mp-k3o{tag}")
    subprocess.run([sys.executable, "-c", SEMAPHORE, f"/mp-k3o{tag}"], check=True, timeout=30)  # made and left by another process

    def mapped_by_inode_only(pid: int) -> None:
        assert mine.exists() and other.exists()
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert mine.name not in maps and str(mine.stat().st_ino) in maps  # mapped under another name: only the inode tells

    try:
        _stop_around(tmp_path, rt, [sys.executable, "-c", SEMAPHORE, f"/mp-k3t{tag}", str(tmp_path / "ready")], mapped_by_inode_only)
        assert not mine.exists()
        assert other.exists()  # a semaphore nobody in the group mapped stays
    finally:
        for f in (mine, other):
            f.unlink(missing_ok=True)
