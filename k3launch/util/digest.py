"""SHA-256 without loading OpenSSL's binding.

``hashlib`` imports ``_hashlib`` (OpenSSL) when it is imported, about 2 ms of every start, and
the quick commands only hash a few kilobytes: a plan's processes for its name, each YAML file's
bytes for the parse cache's key. CPython's own implementation gives the same digests (``_sha256``
in 3.11, ``_sha2`` from 3.12); ``hashlib``'s is the fallback where neither exists.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Protocol


class Digest(Protocol):
    def hexdigest(self) -> str: ...


def _sha256() -> Callable[[bytes], Digest]:
    for module in ("_sha256", "_sha2"):
        try:
            fn: Callable[[bytes], Digest] = import_module(module).sha256
            return fn
        except (ImportError, AttributeError):
            continue
    from hashlib import sha256

    return sha256


sha256 = _sha256()
