"""Deployment records: one JSON file per deployment in the state directory.

Default ``~/.k3launch`` (``$K3LAUNCH_STATE_DIR`` or ``--state-dir`` override). Writes are atomic
(temp file + rename) and each deployment has a lock file (``flock``) so two k3launch commands
never act on one deployment at once. A record keeps the Plan it was started from, each
process's handle (pid or container name) and log path, and hosts a ``down`` could not reach,
so the next ``down`` finishes the job. Records never hold secrets: plans never contain them.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError

from k3launch.errors import K3Error
from k3launch.models.record import LIVE_STATES, DeploymentRecord, parse_record
from k3launch.util.locks import locked


def default_state_dir() -> Path:
    return Path(os.environ.get("K3LAUNCH_STATE_DIR") or "~/.k3launch").expanduser()


class StateStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or default_state_dir()).expanduser()
        self.dir = self.root / "deployments"

    def _ensure(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise K3Error("state-dir", f"cannot create state directory {self.dir}: {exc.strerror}", "pass --state-dir DIR or set K3LAUNCH_STATE_DIR") from None

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def load(self, name: str) -> DeploymentRecord:
        p = self.path(name)
        try:
            return parse_record(p.read_text())
        except FileNotFoundError:
            known = ", ".join(r.name for r in self.list()) or "none"
            raise K3Error("unknown-deployment", f"no deployment named {name!r} in {self.root}", f"deployments: {known}") from None
        except (ValidationError, ValueError) as exc:
            raise K3Error("bad-state", f"{p}: unreadable deployment record ({type(exc).__name__})", "remove the file if the deployment is gone") from None

    def save(self, rec: DeploymentRecord) -> None:
        self._ensure()
        rec.updated = time.time()
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{rec.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(rec.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(rec.name))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)
        (self.dir / f"{name}.lock").unlink(missing_ok=True)

    def list(self) -> list[DeploymentRecord]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                out.append(parse_record(p.read_text()))
            except (ValidationError, ValueError, OSError):
                continue  # a half-written or foreign file is not a deployment
        return out

    @contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Exclusive per-deployment lock; refuses (not waits) if another command holds it."""
        self._ensure()
        with locked(self.dir / f"{name}.lock", wait=False) as fd:
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

