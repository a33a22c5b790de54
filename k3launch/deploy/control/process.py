"""Controllers as processes: where their lock, stop request, spec and output live, who runs
one, stopping one (``down`` does, first) and starting one in the background (``--detach``).

One supervisor per deployment holds ``<state>/supervise/NAME.lock`` while it runs. ``down``
stops it with a stop request file (seen by a supervisor on any login node sharing the state
directory) and, on the same host, SIGTERM; after :data:`STOP_WAIT_S`, SIGKILL. The loop itself
is :mod:`k3launch.deploy.control.loop`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from k3launch.deploy.state import StateStore, _start_time
from k3launch.errors import K3Error
from k3launch.models.control.spec import Spec
from k3launch.models.record import DeploymentRecord, Supervisor
from k3launch.util.locks import held

STOP_WAIT_S = 60.0  # how long `down` waits for a supervisor mid-restart before SIGKILL
DETACH_WAIT_S = 30.0  # a detached supervisor must have named itself in the record by then


def lock_path(store: StateStore, name: str) -> Path:
    return store.supervise_dir() / f"{name}.lock"


def stop_path(store: StateStore, name: str) -> Path:
    return store.supervise_dir() / f"{name}.stop"


def log_path(store: StateStore, name: str) -> Path:
    return store.supervise_dir() / f"{name}.log"


def spec_path(store: StateStore, name: str) -> Path:
    return store.supervise_dir() / f"{name}.spec.json"


def read_spec(store: StateStore, name: str) -> Spec | None:
    """``name``'s spec (:mod:`k3launch.models.control`), None if none was written or it cannot be read."""
    try:
        return Spec.model_validate_json(spec_path(store, name).read_text())
    except (OSError, ValueError):
        return None


def write_spec(store: StateStore, name: str, spec: Spec) -> None:
    """Write ``spec`` (atomically; owner-only: its ``--on-event`` command may carry a webhook's token)."""
    path = spec_path(store, name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(spec.model_dump_json())
        os.replace(tmp, path)
    except OSError as exc:
        raise K3Error("state-dir", f"cannot write {path}: {exc.strerror or exc}", "pass --state-dir DIR on a writable filesystem") from None


def forget(store: StateStore, name: str) -> None:
    """A deployment's spec (``down`` of the deployment: nothing of it is kept)."""
    with contextlib.suppress(OSError):
        spec_path(store, name).unlink()


def who(info: Supervisor | None) -> str:
    if info is None:
        return "a supervisor"
    return f"the supervisor (pid {info.pid} on {info.host}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info.since))})"


def already_supervised(rec: DeploymentRecord) -> K3Error:
    """The refusal of a second controller of ``rec`` (said before anything is written or detached)."""
    return K3Error("already-supervised", f"{rec.name} is already watched by {who(rec.supervisor)}",
                   "one supervisor per deployment: `k3launch status` shows it; stop it (Ctrl-C, or kill its pid) to start another")


def refuse_not_ready(rec: DeploymentRecord) -> None:
    """Only a ready deployment is supervised: a failed or starting one has nothing to keep serving."""
    if rec.state != "ready":
        raise K3Error("not-ready", f"{rec.name} is {rec.state}: only a ready deployment can be supervised",
                      "wait for `k3launch up` to finish" if rec.state == "starting" else f"`k3launch down {rec.name}`, then `up` again")


def alive(info: Supervisor) -> bool:
    """Whether ``info``'s process still runs (only knowable on its own host: elsewhere, assume so)."""
    return info.host != socket.gethostname() or _start_time(info.pid) == info.started


def stop(store: StateStore, name: str, wait_s: float = STOP_WAIT_S) -> str | None:
    """Stop ``name``'s supervisor, if one runs (``down`` calls this first); a note saying so, or None."""
    lock = lock_path(store, name)
    if not held(lock):
        stop_path(store, name).unlink(missing_ok=True)
        return None
    rec = store.try_load(name)
    info = rec.supervisor if rec is not None else None
    path = stop_path(store, name)
    with contextlib.suppress(OSError):
        path.touch()
    # a supervisor on this host gets SIGTERM too; one in this very process (a library caller's
    # thread) sees the stop request at its next look
    here = info is not None and info.host == socket.gethostname() and info.pid != os.getpid() and alive(info)
    if here and info is not None:
        with contextlib.suppress(OSError):
            os.kill(info.pid, signal.SIGTERM)
    t_end = time.monotonic() + wait_s
    while held(lock) and time.monotonic() < t_end:
        time.sleep(0.1)
    if held(lock) and here and info is not None:
        with contextlib.suppress(OSError):
            os.kill(info.pid, signal.SIGKILL)
        time.sleep(0.5)
    if held(lock):
        raise K3Error("supervisor-running", f"{who(info)} of {name} did not stop within {wait_s:g}s",
                      f"stop it where it runs (kill {info.pid} on {info.host})" if info else "stop it, then run the command again")
    path.unlink(missing_ok=True)
    return f"stopped {who(info)}"


def detach(store: StateStore, name: str) -> Supervisor:
    """Start a controller of ``name`` in the background (its own session, output in
    ``<state>/supervise/NAME.log``), through the module entry point
    :mod:`k3launch.api._controller`: its policy, hook and SSH settings are the spec's (written
    first), not a command line. Returns once it named itself in the record."""
    sdir = store.supervise_dir()
    try:
        sdir.mkdir(parents=True, exist_ok=True)
        out = open(log_path(store, name), "ab")
    except OSError as exc:
        raise K3Error("state-dir", f"cannot write {log_path(store, name)}: {exc.strerror or exc}", "pass --state-dir DIR") from None
    cmd = [sys.executable, "-m", "k3launch.api._controller", name, str(store.root)]
    with out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    t_end = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < t_end:
        rec = store.try_load(name)
        if rec is not None and rec.supervisor is not None and rec.supervisor.pid == proc.pid:
            return rec.supervisor
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    said = _last_line(log_path(store, name))
    raise K3Error("supervise-failed", f"the detached supervisor of {name} did not start" + (f": {said}" if said else ""),
                  f"run `k3launch supervise {name}` in the foreground to see why")


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


JOB_CONTROL_DIR = "control"  # a supervised Slurm job's controller state, inside its log directory


class JobStore(StateStore):
    """The state directory of a Slurm job's own controller (:mod:`k3launch.deploy.slurm.injob`):
    ``<log dir>/control`` on the filesystem the job shares with the login node. It holds the
    controller's copy of the record (its plan as the job binds it, its memory, a rollout's
    progress), its lock and its spec, which ``rollout`` writes there. Its events (plan node names)
    stay there too; the ones the login node merges are ``<log dir>/events.jsonl``, which the
    controller writes with the allocated hosts' names."""

    def __init__(self, log_dir: str | Path) -> None:
        super().__init__(Path(log_dir) / JOB_CONTROL_DIR)
        self.log_dir = Path(log_dir)
