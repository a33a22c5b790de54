"""Names that become file names: the one check every command applies to them.

A deployment's name is a state-file name (``<state>/deployments/<name>.json``), a Slurm job name,
container names, a directory on every node and ``#SBATCH`` values; an array's name is a job name
and a directory name. Plain words only (lowercase letters, digits and ``-``, at most 63, the
length of a DNS label), so no name can climb out of the state directory (``../x``), hide
(``.x``), or carry shell or option syntax (``-x``, ``$x``).
"""

from __future__ import annotations

import re

from k3launch.errors import K3Error
from k3launch.util.digest import sha256

NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
RULE = "use lowercase letters, digits and '-' (max 63, first a letter or digit)"


def is_name(name: object) -> bool:
    return isinstance(name, str) and NAME.fullmatch(name) is not None


def check_name(name: str, what: str = "deployment name", example: str = "k3-tep-lab") -> str:
    """``name`` itself when it is a plain word; else a ``bad-name`` refusal (exit 2)."""
    if not is_name(name):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise K3Error("bad-name", f"{what} {shown!r}: {RULE}", f"e.g. {example}")
    return name


def as_name(text: str) -> str:
    """A plain word standing for ``text`` (an inventory's or a recipe's own name, which are free
    text): ``text`` itself when it is one already; else lowercased, every other character a '-',
    plus a short digest of ``text``, so that ``labA`` and ``laba`` do not share a file."""
    if is_name(text):
        return text
    word = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")[:55].strip("-")
    digest = sha256(text.encode()).hexdigest()[:6]
    return f"{word}-{digest}" if word else digest
