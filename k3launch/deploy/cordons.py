"""Cordoned nodes in the state directory: ``<state>/cordons.json``, keyed by inventory name and node name.

A cordon keeps a node out of every plan on its inventory until it is lifted (``k3launch uncordon``).
A supervisor sets one on a node it lost (``by`` = ``supervisor of DEPLOYMENT``), a user with
``k3launch cordon`` (``by`` = ``user``); planning reads them through ``k3launch.api``.

One file for every inventory, so that the state directory stays one place to look. Writers hold a
``flock`` on ``cordons.lock`` (a supervisor and a user may cordon at once, and each must keep the
other's cordon) and replace the file atomically, so a reader never needs the lock. A file that
cannot be read is never lost or overwritten: it is renamed ``cordons.json.corrupt-<time>-<pid>``
(evidence) and the caller is told: a writer through :attr:`CordonChange.set_aside`, a reader by
a ``bad-cordons`` refusal — its cordons no longer apply, so whoever acts next must know.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from k3launch.deploy.state import StateStore, io_error, set_aside, write_atomic
from k3launch.errors import K3Error
from k3launch.models.cordon import USER, Cordon, CordonChange
from k3launch.util.hosts import check_host
from k3launch.util.locks import locked

__all__ = ["USER", "Cordon", "CordonChange", "cordon", "cordoned", "uncordon"]

VERSION = 1


class CordonFile(BaseModel):
    """``cordons.json``: inventory name → node name → its cordon."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    version: int = VERSION
    inventories: dict[str, dict[str, Cordon]] = {}


class _Damaged(Exception):
    """The cordon file exists but is not a cordon file (garbage, truncated, another shape)."""


def _read(path: Path) -> CordonFile:
    """The file's cordons; an empty table when there is none. Raises _Damaged."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return CordonFile()
    except OSError as exc:
        raise io_error(exc, path, "read") from None
    try:
        data = CordonFile.model_validate_json(text)
    except (ValidationError, ValueError) as exc:
        raise _Damaged(type(exc).__name__) from None
    if data.version != VERSION or any(n != c.node for nodes in data.inventories.values() for n, c in nodes.items()):
        raise _Damaged(f"version {data.version}" if data.version != VERSION else "a node keyed under another name")
    return data


@contextmanager
def _writing(store: StateStore) -> Iterator[tuple[CordonFile, Path | None]]:
    """Hold the cordon lock; yield the current cordons (empty after setting a damaged file aside)
    and the path it was set aside to. The caller changes the table in place; once its block ends
    without an error the table is written back atomically, still under the lock."""
    path = store.cordons_path()
    lock_path = path.with_suffix(".lock")
    try:
        store.root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise io_error(exc, store.root, "create state directory") from None
    with ExitStack() as stack:
        try:
            stack.enter_context(locked(lock_path, remove=True))  # writers wait their turn: each keeps the others' cordons
        except OSError as exc:
            raise io_error(exc, lock_path, "create lock file") from None
        aside: Path | None = None
        try:
            data = _read(path)
        except _Damaged:
            aside, data = set_aside(path), CordonFile()
        yield data, aside
        write_atomic(path, data.model_dump_json(indent=1) + "\n")


def _ordered(table: dict[str, Cordon]) -> dict[str, Cordon]:
    """Oldest cordon first (ties by name): the order tables and notices show them in."""
    return dict(sorted(table.items(), key=lambda kv: (kv[1].since, kv[0])))


def _checked(inventory_name: str, nodes: Sequence[str]) -> list[str]:
    """The node names, each once, in the order given; refused when one could not be a host name
    (a cordoned name may reach ``sbatch --exclude``)."""
    if not inventory_name:
        raise K3Error("bad-value", "cordon: the inventory name is empty", "pass the name of the inventory the nodes belong to")
    if not nodes:
        raise K3Error("bad-value", "cordon: no node named", "name at least one node")
    for n in nodes:
        try:
            check_host(n, "node name")
        except ValueError as exc:
            raise K3Error("bad-value", str(exc), "name nodes as the inventory does") from None
    return list(dict.fromkeys(nodes))


def cordon(store: StateStore, inventory_name: str, nodes: Sequence[str], reason: str = "", by: str = USER, *,
           now: float | None = None) -> CordonChange:
    """Cordon ``nodes`` of inventory ``inventory_name``: plans on it skip them until :func:`uncordon`.

    ``by`` is ``user`` or ``supervisor of DEPLOYMENT`` (:func:`~k3launch.models.cordon.by_supervisor`).
    A node cordoned already keeps its cordon as it was (the first reason and time stay: they say
    when it went bad) and is listed in ``unchanged``. Safe against concurrent writers."""
    names = _checked(inventory_name, nodes)
    since = time.time() if now is None else now
    reason = " ".join(reason.split())  # one line: it is shown in tables and notices
    with _writing(store) as (data, aside):
        table = data.inventories.setdefault(inventory_name, {})
        new = [n for n in names if n not in table]
        for n in new:
            table[n] = Cordon(node=n, since=since, reason=reason, by=by)
        after = _ordered(table)
    return CordonChange(inventory_name, tuple(new), tuple(n for n in names if n not in new), after, aside)


def uncordon(store: StateStore, inventory_name: str, nodes: Sequence[str]) -> CordonChange:
    """Lift the cordons of ``nodes``; ``changed`` lists those removed, ``unchanged`` those that had none."""
    names = _checked(inventory_name, nodes)
    with _writing(store) as (data, aside):
        table = data.inventories.get(inventory_name, {})
        removed = [n for n in names if table.pop(n, None) is not None]
        if not table:
            data.inventories.pop(inventory_name, None)
        after = _ordered(table)
    return CordonChange(inventory_name, tuple(removed), tuple(n for n in names if n not in removed), after, aside)


def cordoned(store: StateStore, inventory_name: str) -> dict[str, Cordon]:
    """The cordoned nodes of inventory ``inventory_name`` (node → its cordon), oldest first.

    Reads without the lock (writes are atomic renames). A damaged file is set aside under the
    lock and refused once (``bad-cordons``): its cordons no longer apply, and a plan must not
    quietly use those nodes again without anyone being told."""
    path = store.cordons_path()
    try:
        data = _read(path)
    except _Damaged as why:
        with _writing(store) as (data, aside):  # set aside (if no writer replaced it meanwhile); writes an empty table
            pass
        if aside is not None:
            raise K3Error("bad-cordons", f"{path}: unreadable cordon file ({why}), kept aside as {aside.name}; the cordons it held no longer apply",
                          f"see which nodes it named (`cat {aside}`) and cordon them again: `k3launch cordon NODE... -i INVENTORY`") from None
    return _ordered(data.inventories.get(inventory_name, {}))
