"""A node's paths as shell words, and the words of an engine's compile caches (pure string builders).

Every value goes through :func:`shlex.quote`; ``~/...`` is the one thing left to expand, on the
node, as ``"$HOME"/'rest'`` (a :class:`Raw` word, already quoted).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from k3launch.models import caches
from k3launch.models.plan import Host, Plan, Process

CONTAINER_HF_CACHE = "/root/.cache/huggingface"
DEFAULT_HF_CACHE = "~/.cache/huggingface"  # the node's, when the inventory names none


class Raw(str):
    """A word already quoted for the shell (only built here, from quoted pieces)."""


def home_path(path: str) -> str:
    """``~/x`` → ``"$HOME"/'x'`` so the home directory expands while the rest stays data."""
    if path == "~" or path.startswith("~/"):
        return Raw('"$HOME"' + (("/" + shlex.quote(path[2:])) if path[2:] else ""))
    return path


def path_word(path: str) -> str:
    """A path on the node as one shell word: ``~/...`` expands there, the rest stays data."""
    word = home_path(path)
    return word if isinstance(word, Raw) else shlex.quote(word)


def mount_word(pairs: Sequence[tuple[str, str]], prefix: str = "") -> str:
    """``prefix`` + ``SRC:DST[,SRC:DST...]`` as one word (docker's ``-v``, apptainer's ``--bind``, pyxis's
    ``--container-mounts=``): a source ``~/...`` expands on the node, the rest stays data."""
    words = [home_path(src) for src, _ in pairs]
    if not any(isinstance(w, Raw) for w in words):
        return prefix + ",".join(f"{src}:{dst}" for src, dst in pairs)
    out = [(w if isinstance(w, Raw) else shlex.quote(w)) + shlex.quote(":" + dst) for w, (_, dst) in zip(words, pairs, strict=True)]
    return Raw((shlex.quote(prefix) if prefix else "") + shlex.quote(",").join(out))


def venv_path(venv: str | None, tools: str | None = None) -> list[str]:
    """``PATH=<venv>/bin:<tools>:"$PATH"`` as one shell word (for ``env``), or nothing without
    either: ``tools`` is a directory of programs to find before the node's own PATH."""
    words = []
    for d in ([venv.rstrip("/") + "/bin"] if venv else []) + ([tools] if tools else []):
        words.append(path_word(d))  # ~/... expands to the home directory where it runs
    return [Raw("PATH=" + ":".join(words) + ':"$PATH"')] if words else []


def cache_dir(plan: Plan, proc: Process, host: Host) -> str | None:
    """The node directory of ``proc``'s compile/JIT caches (``<root>/<key>``), None when it has
    none: the router, caches off on the node, the simulated engine by default (models.caches)."""
    root = caches.cache_root(host, plan.engine) if proc.role != "router" else None
    return None if root is None else f"{root}/{caches.cache_key(plan, proc, host)}"


def cache_env(where: str) -> list[str]:
    """``NAME=<where>/<sub>`` for every cache (``where`` may be ``~/...``: it expands on the node)."""
    out: list[str] = []
    for name, sub in caches.CACHE_ENV.items():
        word = home_path(f"{where}/{sub}")
        out.append(Raw(f"{name}=" + word) if isinstance(word, Raw) else f"{name}={word}")
    return out
