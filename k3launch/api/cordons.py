"""Cordoned nodes: ``cordon``, ``uncordon``, ``cordoned``, and what planning and ``up`` make of them.

A cordon keeps a node of an inventory out of every plan on it until it is lifted; it lives in the
state directory (:mod:`k3launch.deploy.cordons`), keyed by the inventory's name. Node names are
checked against the inventory here, so a typo is refused rather than cordoning nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch.api._common import InventoryArg, Loaded, load, store
from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.models.cordon import Cordon, CordonChange
    from k3launch.models.plan import Plan
    from k3launch.planning.build import Cordoned
    from k3launch.planning.inventory import Inventory


def _known(inv: Inventory) -> list[str] | None:
    """The node names a cordon on ``inv`` may name; None: any host name (a Slurm inventory with
    neither nodes nor a nodelist: its nodes are whatever the partition has)."""
    if inv.nodes:
        return [n.name for n in inv.nodes]
    if inv.slurm is not None and inv.slurm.nodelist:
        from k3launch.planning.inventory import expand_nodelist

        return expand_nodelist(inv.slurm.nodelist)
    return None


def _check_nodes(inv: Inventory, nodes: Sequence[str], also: Sequence[str] = ()) -> None:
    """Refuse a node name the inventory does not have (``also``: names accepted all the same)."""
    if not nodes:
        raise K3Error("bad-value", "no node named", f"name one or more nodes of inventory {inv.name}")
    known = _known(inv)
    if known is None:
        return
    unknown = [n for n in nodes if n not in known and n not in also]
    if unknown:
        listed = ", ".join(known[:20]) + (f", ... ({len(known)} in all)" if len(known) > 20 else "")
        raise K3Error("unknown-node", f"node {unknown[0]}: no such node in inventory {inv.name}", f"its nodes: {listed}")


def cordon(inventory: InventoryArg, nodes: Sequence[str], reason: str = "", state_dir: str | Path | None = None) -> CordonChange:
    """Cordon ``nodes`` of ``inventory``: plans on it skip them (with a ``cordoned`` notice; Slurm:
    ``sbatch --exclude``) until :func:`uncordon`. A node cordoned already keeps its first cordon."""
    from k3launch.deploy.cordons import cordon as write

    inv = load(inventory).inventory
    _check_nodes(inv, nodes)
    return write(store(state_dir), inv.name, nodes, reason)


def uncordon(inventory: InventoryArg, nodes: Sequence[str], state_dir: str | Path | None = None) -> CordonChange:
    """Lift the cordons of ``nodes`` of ``inventory``; a node that has none is listed in ``unchanged``.
    A cordoned name the inventory no longer has is accepted (that is how it is lifted)."""
    from k3launch.deploy.cordons import cordoned as read
    from k3launch.deploy.cordons import uncordon as write

    inv = load(inventory).inventory
    st = store(state_dir)
    _check_nodes(inv, nodes, also=list(read(st, inv.name)) if nodes else ())
    return write(st, inv.name, nodes)


def cordoned(inventory: InventoryArg, state_dir: str | Path | None = None) -> dict[str, Cordon]:
    """The cordoned nodes of ``inventory``: node → :class:`~k3launch.models.cordon.Cordon`
    (``node``, ``since`` in epoch seconds, ``reason``, ``by``), oldest first."""
    from k3launch.deploy.cordons import cordoned as read

    return read(store(state_dir), load(inventory).inventory.name)


def for_planning(loaded: Loaded, state_dir: str | Path | None, cordons: Mapping[str, Cordon] | None = None) -> Cordoned:
    """The inventory's cordons as planning takes them (``cordons``: these instead of the state
    directory's, e.g. a campaign's, read once for all its plans)."""
    from k3launch.planning.build import Cordoned

    found = cordoned(loaded, state_dir) if cordons is None else cordons
    return Cordoned({n: c.describe() for n, c in found.items()}, loaded.path)


def refuse_cordoned(plan: Plan, loaded: Loaded, state_dir: str | Path | None) -> None:
    """Refuse a plan made before a node it may use was cordoned: where k3launch places processes
    itself, a plan that puts one on a cordoned node; where a scheduler picks the nodes, a plan
    whose job would not exclude every cordoned one (``plan.exclude``)."""
    from k3launch.models.backends import spec

    c = for_planning(loaded, state_dir)
    if not c.why:
        return
    if spec(loaded.inventory.backend).holds_nodes:
        used = {h.name for h in plan.hosts}
        stale = [n for n in c.kept_out(loaded.inventory) if n in used]
    else:
        stale = [n for n in c.kept_out(loaded.inventory) if n not in plan.exclude]
    if stale:
        raise K3Error("cordoned-node", f"plan {plan.name} was made before node {stale[0]} was {c.why[stale[0]]}",
                      f"plan again (planning skips cordoned nodes), or {c.hint(stale)}")
