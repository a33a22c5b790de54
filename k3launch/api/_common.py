"""What every API function shares: inventories (a path, a loaded one, or the bundled local one)
and the state directory. How nodes are reached is one value, :class:`~k3launch.models.access.Access`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.deploy.state import StateStore
    from k3launch.planning.inventory import Inventory


class Loaded(NamedTuple):
    """An inventory as read (and, for ssh, resolved through ``~/.ssh/config``) once, and its path:
    :func:`load` returns it and every function taking an inventory accepts it."""

    inventory: Inventory
    path: str


InventoryArg: TypeAlias = "str | Path | Inventory | Loaded | None"


def bundled_inventory(name: str) -> Path:
    """A shipped example inventory (``local`` is the embedded default of ``up``)."""
    from k3launch.util.resources import bundled

    path = bundled("inventories", f"{name}.yaml")
    if path is not None:
        return path
    raise K3Error("missing-inventory", f"the bundled {name} inventory is missing", "pass --inventory FILE")


def load(inventory: InventoryArg) -> Loaded:
    """(inventory, its path as recorded); ``None`` is the bundled local inventory, an
    ``Inventory`` object is recorded by its name."""
    from k3launch.planning.inventory import Inventory, load_placed

    if isinstance(inventory, Loaded):
        return inventory
    if isinstance(inventory, Inventory):
        return Loaded(inventory, inventory.name)
    path = Path(inventory) if inventory is not None else bundled_inventory("local")
    return Loaded(load_placed(path), str(path))


def store(state_dir: str | Path | None) -> StateStore:
    from k3launch.deploy.state import StateStore

    return StateStore(Path(state_dir) if state_dir else None)
