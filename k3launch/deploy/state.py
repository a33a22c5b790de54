"""Deployment records: one JSON file per deployment in the state directory.

Default ``~/.k3launch`` (``$K3LAUNCH_STATE_DIR`` or ``--state-dir`` override). Writes are atomic
(temp file + rename) and each deployment has a lock file (``flock``, removed on release) so two
k3launch commands never act on one deployment at once. A record keeps the Plan it was started
from, each process's handle (pid or container name) and log path, and hosts a ``down`` could not
reach, so the next ``down`` finishes the job. Records never hold secrets: plans never contain them.

Every name is checked (:func:`~k3launch.util.names.check_name`) before it becomes a path, so no
command creates a file outside ``<state>/deployments``. A record that cannot be read is never
deleted: :meth:`StateStore.set_aside` renames it ``NAME.json.corrupt-<time>`` (``down`` does, then
finds the deployment's processes on its nodes without it). While ``up`` or ``down`` holds a record
in a transient state it writes its own identity into it (``owner``); read back after that
command was killed, the record says ``interrupted`` instead of pretending to start or stop.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import cache
from pathlib import Path

from pydantic import ValidationError

from k3launch.errors import K3Error
from k3launch.models import identity
from k3launch.models.record import LIVE_STATES, TRANSIENT_STATES, DeploymentRecord, Owner, parse_record
from k3launch.util.locks import locked
from k3launch.util.names import as_name, check_name


def default_state_dir() -> Path:
    return Path(os.environ.get("K3LAUNCH_STATE_DIR") or "~/.k3launch").expanduser()


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks since boot); None: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


@cache
def me() -> Owner:
    return Owner(host=socket.gethostname(), pid=os.getpid(), started=_start_time(os.getpid()) or "?")


def owner_gone(owner: Owner) -> bool:
    """True only when the owner certainly no longer runs: on this host, and its pid is gone or reused."""
    return owner.host == socket.gethostname() and _start_time(owner.pid) != owner.started


def io_error(exc: OSError, path: Path | str, doing: str) -> K3Error:
    """An I/O failure on the state directory as one line naming the path."""
    hint = {errno.ENOSPC: "free space on that filesystem, or pass --state-dir DIR elsewhere",
            errno.EDQUOT: "free space on that filesystem, or pass --state-dir DIR elsewhere",
            errno.EACCES: "fix the directory's permissions, or pass --state-dir DIR (or set K3LAUNCH_STATE_DIR)",
            errno.EPERM: "fix the directory's permissions, or pass --state-dir DIR (or set K3LAUNCH_STATE_DIR)",
            errno.EROFS: "pass --state-dir DIR on a writable filesystem (or set K3LAUNCH_STATE_DIR)"}
    return K3Error("state-dir", f"cannot {doing} {path}: {exc.strerror or exc}", hint.get(exc.errno or 0, "pass --state-dir DIR or set K3LAUNCH_STATE_DIR"))


def set_aside(path: Path) -> Path:
    """Rename an unreadable state file ``<name>.corrupt-<time>-<pid>`` beside it: never deleted, it
    may be evidence (a half-written file, another program's, a disk error)."""
    stem = f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    aside, n = path.with_name(stem), 1
    while aside.exists():  # set aside twice within a second by this process: the rename must not replace the first
        aside, n = path.with_name(f"{stem}-{n}"), n + 1
    try:
        os.replace(path, aside)
    except OSError as exc:
        raise io_error(exc, path, "set aside") from None
    return aside


def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Write ``path`` whole or not at all: a temporary file in its directory, synced, then renamed
    over it, so a reader (or a command killed mid-write) never sees half a file. ``mode``: its
    permissions (default the temporary file's, owner-only)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.")
    except OSError as exc:
        raise io_error(exc, path.parent, "write a file in") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
            if mode is not None:
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise io_error(exc, path, "write") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class StateStore:
    """The state directory (``--state-dir``, ``$K3LAUNCH_STATE_DIR``, else ``~/.k3launch``): every
    path k3launch keeps there is spelled here, once.

    ``id`` (this directory's id, the first part of every deployment id made here:
    :mod:`k3launch.models.identity`), ``deployments/NAME.json`` (the records),
    ``deployments/NAME.gone`` (left by a clean ``down``), ``logs/NAME/`` (a failed ``up``'s last log lines),
    ``bench/NAME/`` (``bench`` results), ``slurm/NAME/`` (a Slurm job's shared logs, unless the
    inventory's ``slurm.log_dir`` says otherwise), ``slurm/arrays/`` (job arrays),
    ``slurm-bad-nodes.json`` (nodes a Slurm job's doctor refused), ``cordons.json`` (cordoned nodes
    per inventory: :mod:`k3launch.deploy.cordons`), ``events/NAME.jsonl`` (what supervisors saw
    and did), ``supervise/`` (their locks, stop requests and output), ``canary/NAME.json`` (the
    canary's baseline, owner-only: :mod:`k3launch.deploy.canary`), ``weights-probe/INVENTORY.json``
    (the last saved ``weights probe``), ``monitoring/targets/NAME.json`` (Prometheus targets).
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or default_state_dir()).expanduser()
        self.dir = self.root / "deployments"

    def logs_dir(self, name: str) -> Path:
        return self.root / "logs" / check_name(name)

    def bench_dir(self, name: str) -> Path:
        return self.root / "bench" / check_name(name)

    def slurm_dir(self) -> Path:
        return self.root / "slurm"

    def arrays_dir(self) -> Path:
        return self.slurm_dir() / "arrays"

    def bad_nodes_path(self) -> Path:
        return self.root / "slurm-bad-nodes.json"

    def events_path(self, name: str) -> Path:
        """A deployment's event log (JSON lines, appended): kept after ``down``; the next ``up`` of
        the name moves it to ``NAME.jsonl.1``."""
        return self.root / "events" / f"{check_name(name)}.jsonl"

    def supervise_dir(self) -> Path:
        """Supervisors' lock files (held while one runs), stop requests and detached ones' output."""
        return self.root / "supervise"

    def canary_path(self, name: str) -> Path:
        """A deployment's canary baseline (written by ``up`` and ``canary --rebaseline``, removed by ``down``)."""
        return self.root / "canary" / f"{check_name(name)}.json"

    def probe_path(self, inventory_name: str) -> Path:
        """The last ``weights probe --save`` on an inventory: each node's read throughput of its weight source."""
        # an inventory's name is free text (``labA``): its file is named by a plain word for it
        return self.root / "weights-probe" / f"{as_name(inventory_name)}.json"

    def targets_dir(self) -> Path:
        """Prometheus ``file_sd`` target files: ``NAME.json`` for each deployment that is ready,
        rewritten with its record (docs/monitoring.md)."""
        return self.root / "monitoring" / "targets"

    def cordons_path(self) -> Path:
        return self.root / "cordons.json"

    def state_id(self, create: bool = True) -> str | None:
        """This state directory's id (``<state>/id``, 8 hex, made once): the first part of every
        deployment id made here, so ``down`` of a name whose record is lost still knows which
        processes this directory started (:mod:`k3launch.models.identity`). None when there is
        none yet and ``create`` is false (nothing started from here carries one)."""
        path = self.root / "id"
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            if not create:
                return None
            self._ensure()
            tmp = self.root / f".id.{os.getpid()}"
            try:  # whole (written aside first) and made once: two first commands at once agree on one id
                write_atomic(tmp, identity.new_state_id() + "\n")
                os.link(tmp, path)
            except FileExistsError:
                pass
            except OSError as exc:
                raise io_error(exc, path, "write") from None
            finally:
                tmp.unlink(missing_ok=True)
            return self.state_id(create=False)
        except OSError as exc:
            raise io_error(exc, path, "read") from None
        if not identity.STATE_ID.fullmatch(text):
            raise K3Error("bad-state", f"{path}: not a state directory id (8 hex digits)",
                          "restore it, or remove it if no deployment started from this state directory runs (a new one is made)")
        return text

    def new_deployment_id(self) -> str:
        """A new deployment's id: this state directory's id, then 6 random hex."""
        return identity.new_deployment_id(self.state_id() or "")

    def gone_path(self, name: str) -> Path:
        """Left by a clean ``down`` (the deployment id and when): the name was this directory's,
        so a repeated ``down`` of it is a no-op, not an unknown name."""
        return self.dir / f"{check_name(name)}.gone"

    def mark_gone(self, name: str, deployment_id: str = "") -> None:
        self._ensure()
        write_atomic(self.gone_path(name), json.dumps({"deployment_id": deployment_id, "down": time.time()}) + "\n")

    def knew(self, name: str) -> bool:
        """Whether this directory ever held ``name``: a record, one set aside, or a clean ``down`` of it."""
        return self.exists(name) or self.gone_path(name).is_file() or any(self.dir.glob(f"{check_name(name)}.json.corrupt-*"))

    def near_names(self, name: str) -> list[str]:
        """Live deployment names close to ``name`` (a typo's likely meaning), best first."""
        import difflib

        return difflib.get_close_matches(name, [r.name for r in self.list()], n=3, cutoff=0.6)

    def _ensure(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise io_error(exc, self.dir, "create state directory") from None

    def path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}.json"

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def _parse(self, text: str | bytes) -> DeploymentRecord:
        rec = parse_record(text)
        if rec.state in TRANSIENT_STATES and rec.owner is not None and rec.owner != me() and owner_gone(rec.owner):
            rec.state = "interrupted"
        return rec

    def load(self, name: str) -> DeploymentRecord:
        p = self.path(name)
        try:
            return self._parse(p.read_bytes())
        except FileNotFoundError:
            known = ", ".join(r.name for r in self.list()) or "none"
            raise K3Error("unknown-deployment", f"no deployment named {name!r} in {self.root}", f"deployments: {known}") from None
        except (ValidationError, ValueError) as exc:
            raise K3Error("bad-state", f"{p}: unreadable deployment record ({type(exc).__name__})",
                          f"`k3launch down {name} --inventory FILE` keeps the file aside and stops what still runs on the inventory's nodes") from None
        except OSError as exc:
            raise io_error(exc, p, "read") from None

    def try_load(self, name: str) -> DeploymentRecord | None:
        """``name``'s record, or None when it is missing or unreadable (no error)."""
        try:
            return self._parse(self.path(name).read_bytes())
        except (ValidationError, ValueError, OSError):
            return None

    def set_aside(self, name: str) -> Path:
        """Rename an unreadable record ``NAME.json.corrupt-<time>`` (never deleted: it may be evidence)."""
        return set_aside(self.path(name))

    def save(self, rec: DeploymentRecord) -> None:
        check_name(rec.name)
        self._ensure()
        rec.updated = time.time()
        rec.owner = me() if rec.state in TRANSIENT_STATES else None
        write_atomic(self.path(rec.name), rec.to_json())
        self._targets(rec)

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)
        (self.targets_dir() / f"{check_name(name)}.json").unlink(missing_ok=True)

    def _targets(self, rec: DeploymentRecord) -> None:
        """A ready deployment's processes are Prometheus targets; any other is none (a bring-up
        that takes an hour is not an hour of engines down)."""
        path = self.targets_dir() / f"{rec.name}.json"
        if rec.state != "ready":
            path.unlink(missing_ok=True)
            return
        from k3launch.render.monitoring import targets_json

        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, targets_json(rec), mode=0o644)  # read by a Prometheus running as another user

    def list(self) -> list[DeploymentRecord]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                out.append(self._parse(p.read_bytes()))
            except (ValidationError, ValueError, OSError):
                continue  # a half-written or foreign file is not a deployment
        return out

    @contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Exclusive per-deployment lock; refuses (not waits) if another command holds it. The lock
        file is removed on release, whatever the command's outcome."""
        path = self.dir / f"{check_name(name)}.lock"
        self._ensure()
        with ExitStack() as stack:
            try:
                fd = stack.enter_context(locked(path, wait=False, remove=True))
            except OSError as exc:
                raise io_error(exc, path, "create lock file") from None
            if fd is None:
                raise K3Error("deployment-busy", f"another k3launch command is acting on {name!r}", "wait for it to finish")
            yield

    def nodes_in_use(self, exclude: str | None = None) -> dict[str, str]:
        """address → deployment name, for every node held by a live deployment."""
        held: dict[str, str] = {}
        for rec in self.list():
            if rec.name == exclude or rec.state not in LIVE_STATES or not rec.holds_nodes:
                continue  # Slurm itself arbitrates its nodes
            for h in rec.plan.hosts:
                if h.role != "router" or h.gpus:
                    held[h.address] = rec.name
        return held
