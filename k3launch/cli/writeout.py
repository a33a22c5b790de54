"""Write a rendered plan to disk: ``plan.json`` and one launch script per node.

The one I/O step of ``k3launch render``; the text itself comes from :mod:`k3launch.render.scripts`.
Nothing is lost: the output directory must be new or empty unless ``--force``, and then only
files of the same names are replaced. Scripts are written 0755, atomically (temp file + rename).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from k3launch.cli.common import PlanArgs
from k3launch.errors import K3Error
from k3launch.models.plan import Plan


def _atomic_write(path: Path, text: str, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_render(plan: Plan, out: Path, args: PlanArgs, force: bool) -> list[str]:
    """plan.json and one script per node; for a slurm inventory, the sbatch script ``up`` would
    submit (``<deployment>.sbatch``, logs under slurm.log_dir or ``<state dir>/slurm/<deployment>``)."""
    from k3launch import api

    dry = api.dry_run(plan, args.inventory, state_dir=args.state_dir)
    if out.exists() and not out.is_dir():
        raise K3Error("bad-out", f"--out {out} exists and is not a directory", "choose a new directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise K3Error("out-not-empty", f"--out {out} is not empty", "choose a new directory, or pass --force to replace same-named files")
    try:
        out.mkdir(parents=True, exist_ok=True)
        written: list[str] = []
        _atomic_write(out / "plan.json", plan.to_json() + "\n", 0o644)
        written.append("plan.json")
        for fname, text in dry.files:
            _atomic_write(out / fname, text, 0o755)
            written.append(fname)
    except OSError as exc:
        raise K3Error("write-failed", f"cannot write to {out}: {exc.strerror}", "check the path and permissions") from None
    return written
