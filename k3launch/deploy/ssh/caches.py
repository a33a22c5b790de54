"""``k3launch cache ls / clear`` over SSH (or on this machine): the compile/JIT cache directories
engines keep on their nodes (:mod:`k3launch.models.caches`), listed or removed per key."""

from __future__ import annotations

from collections.abc import Sequence

from k3launch.errors import K3Error
from k3launch.models.caches import CacheDir, cache_root, parse_list
from k3launch.models.plan import Host
from k3launch.render.scripts import cache_list
from k3launch.transport.fleet import Fleet

TIMEOUT_S = 120.0  # du over a large cache takes a while; a node that does not answer is said, not waited for


def roots(hosts: Sequence[Host], engine: str, this_machine: bool) -> dict[str, str]:
    """node -> its cache root (nodes with caches off left out); on a this-machine backend every node
    is this machine, so one node per root."""
    out: dict[str, str] = {}
    for h in hosts:
        root = cache_root(h, engine) if h.role != "router" else None
        if root is not None and not (this_machine and root in out.values()):
            out[h.name] = root
    return out


def caches(fleet: Fleet, where: dict[str, str], clear: Sequence[str], clear_all: bool) -> tuple[list[CacheDir], dict[str, str]]:
    """What is kept on each node after removing ``clear`` (or everything): the directories, and
    node -> why it could not be read."""
    outcomes = fleet.run_many({n: cache_list(root, clear, clear_all) for n, root in where.items()}, timeout=TIMEOUT_S)
    found: list[CacheDir] = []
    failed: dict[str, str] = {}
    for node, out in sorted(outcomes.items()):
        if isinstance(out, K3Error):
            failed[node] = out.message
        elif not out.ok:
            failed[node] = (out.stderr.strip().splitlines() or [f"exit {out.exit_code}"])[-1]
        else:
            found += parse_list(node, where[node], out.stdout)
    return found, failed
