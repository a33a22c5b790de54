"""Files shipped with k3launch: the recipe tree, example inventories, campaigns, the Slurm job library.

An installed wheel carries them inside the package (``k3launch/_recipes``, ``_inventories``,
``_campaigns``, ``_slurm``: see ``[tool.hatch.build.targets.wheel.force-include]``); a source
checkout (editable install, tests) has them at the top of the repository (``recipes/``,
``inventories/``, ...). This is the one place that knows both layouts.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

Kind = Literal["recipes", "inventories", "campaigns", "slurm"]


def bundled_dir(kind: Kind) -> Path | None:
    """The directory of one kind of bundled file, or None when this installation lacks it."""
    pkg = Path(str(resources.files("k3launch")))
    for cand in (pkg / f"_{kind}", pkg.parent / kind):
        if cand.is_dir():
            return cand
    return None


def bundled(kind: Kind, name: str) -> Path | None:
    """A bundled file (``bundled("inventories", "local.yaml")``), or None when it is not shipped."""
    d = bundled_dir(kind)
    if d is None:
        return None
    p = d / name
    return p if p.is_file() else None
