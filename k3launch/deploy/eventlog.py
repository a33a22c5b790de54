"""A deployment's event log: what its supervisors saw and did, one JSON object per line.

``<state-dir>/events/NAME.jsonl``, appended with ``O_APPEND`` (one ``write`` per event, so two
writers never interleave within a line), kept after ``down`` so a failure can be read later; the
next ``up`` of the same name moves it to ``NAME.jsonl.1``. A line that cannot be read (a disk
that filled mid-write) is skipped, never fatal.

A Slurm job that supervises itself writes its events to ``<job log dir>/events.jsonl``
(:data:`JOB_EVENTS`, the same fields, written by its controller, :mod:`k3launch.deploy.slurm.injob`): readers merge it
with the state directory's log (``also``), and ``down`` adopts it into that log, which outlives
the record.

``--on-event CMD`` runs a user command per event (for paging) with the event as JSON on stdin,
through ``bash -c`` on the login node — the user's own command, as a git hook is — bounded by
:data:`HOOK_TIMEOUT_S`; a hook that fails or hangs is itself an event, never a crash.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from pydantic import ValidationError

from k3launch.deploy.state import StateStore, io_error
from k3launch.models.supervise import Event

HOOK_TIMEOUT_S = 10.0
JOB_EVENTS = "events.jsonl"  # a self-supervising Slurm job's own event log, in its log directory


def append(store: StateStore, event: Event) -> None:
    path = store.events_path(event.deployment)
    line = (event.model_dump_json(exclude_defaults=True) + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as exc:
        raise io_error(exc, path, "append to") from None


def rotate(store: StateStore, name: str) -> None:
    """A new life for ``name``: the previous deployment's events become ``NAME.jsonl.1``."""
    rotate_file(store.events_path(name))


def rotate_file(path: Path) -> None:
    """``path`` becomes ``path.1`` (nothing to do when it does not exist)."""
    try:
        os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise io_error(exc, path, "rotate") from None


def _parse(lines: list[bytes]) -> list[Event]:
    out = []
    for raw in lines:
        try:
            out.append(Event.model_validate_json(raw))
        except (ValidationError, ValueError):
            continue
    return out


def read_file(path: Path) -> list[Event]:
    try:
        return _parse(path.read_bytes().splitlines())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise io_error(exc, path, "read") from None


def _key(e: Event) -> str:
    return e.model_dump_json(exclude_defaults=True)


def read(store: StateStore, name: str, also: Sequence[Path] = ()) -> list[Event]:
    """The events of ``name``, oldest first: its log, merged with the logs ``also`` names (a job's own), each event once."""
    seen: set[str] = set()
    out = []
    for path in (store.events_path(name), *also):
        for e in read_file(path):
            if _key(e) not in seen:
                seen.add(_key(e))
                out.append(e)
    return sorted(out, key=lambda e: e.time)


def adopt(store: StateStore, name: str, path: Path) -> int:
    """Append the events of ``path`` (a job's own log) the state directory's log lacks: it outlives
    the record and the job's log directory. How many were added."""
    have = {_key(e) for e in read(store, name)}
    new = [e for e in read_file(path) if _key(e) not in have]
    for e in new:
        append(store, e)
    return len(new)


def follow(store: StateStore, name: str, stop: Callable[[], bool], poll_s: float = 0.5, also: Sequence[Path] = ()) -> Iterator[Event]:
    """Every event (of the log and of those ``also`` names), then each new one as it is appended, until ``stop()`` says so."""
    paths = [store.events_path(name), *also]
    offsets = [0] * len(paths)
    rests = [b""] * len(paths)
    seen: set[str] = set()
    while True:
        new: list[Event] = []
        for i, path in enumerate(paths):
            try:
                with open(path, "rb") as f:
                    f.seek(offsets[i])
                    data = f.read()
            except FileNotFoundError:
                data = b""
            offsets[i] += len(data)
            *lines, rests[i] = (rests[i] + data).split(b"\n")
            new += [e for e in _parse(lines) if _key(e) not in seen]
        for e in sorted(new, key=lambda e: e.time):
            seen.add(_key(e))
            yield e
        if stop():
            return
        time.sleep(poll_s)


def run_hook(command: str, event: Event, timeout: float = HOOK_TIMEOUT_S) -> str | None:
    """Run ``command`` with ``event`` as JSON on stdin; None when it succeeded, else why not."""
    try:
        proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError as exc:
        return f"--on-event command could not run: {exc.strerror or exc}"
    try:
        out, err = proc.communicate(event.model_dump_json().encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        # the whole session: a child of the hook holding its pipes open would keep us waiting
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"--on-event command did not finish within {timeout:g}s"
    if proc.returncode != 0:
        said = (err or out).decode(errors="replace").strip().splitlines()
        return f"--on-event command exited {proc.returncode}" + (f": {said[-1][:200]}" if said else "")
    return None
