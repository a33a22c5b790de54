"""``k3launch cache ls / clear``: the compile/JIT caches engines keep on an inventory's nodes
(:mod:`k3launch.models.caches`: what they are, where, and what their keys stand for)."""

from __future__ import annotations

from collections.abc import Sequence

from k3launch.api._common import InventoryArg, load
from k3launch.errors import K3Error
from k3launch.models.access import Access
from k3launch.models.caches import KEY_RE, CacheDir


def cache_dirs(inventory: InventoryArg = None, *, nodes: Sequence[str] = (), clear: Sequence[str] = (), clear_all: bool = False,
               access: Access = Access()) -> tuple[list[CacheDir], dict[str, str]]:
    """Each node's cache directories (``nodes``: only these), after removing the ``clear`` keys, or
    every key with ``clear_all``; and node -> why it could not be read. A running engine keeps
    what it has open: clear a key while nothing runs with it, or the next start compiles again."""
    from k3launch.deploy.registry import cache_ops

    inv = load(inventory).inventory
    bad = [k for k in clear if not KEY_RE.fullmatch(k)]
    if bad:
        raise K3Error("bad-cache-key", f"{bad[0]!r} is not a cache key", "`k3launch cache ls -i INV` lists the keys")
    unknown = [n for n in nodes if n not in {x.name for x in inv.nodes}]
    if unknown:
        raise K3Error("unknown-node", f"no node {unknown[0]!r} in inventory {inv.name}", "nodes: " + ", ".join(n.name for n in inv.nodes))
    return cache_ops(inv.backend, [access]).caches(inv, nodes, clear, clear_all)
