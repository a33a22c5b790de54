"""``k3launch cordon / uncordon``: keep nodes of an inventory out of plans, and put them back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from k3launch.cli.common import STATE, JsonOut, app, console
from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.models.cordon import Cordon, CordonChange

Inventory = Annotated[Path, typer.Option("--inventory", "-i", help="Inventory YAML the nodes belong to (cordons are kept by its name).")]
StateDir = Annotated[Path | None, typer.Option("--state-dir", help="Where cordons are kept (default ~/.k3launch or $K3LAUNCH_STATE_DIR).")]


def _rows(cordons: dict[str, Cordon]) -> list[dict[str, object]]:
    return [c.model_dump() for c in cordons.values()]


def _change_json(ch: CordonChange) -> str:
    return json.dumps({"inventory": ch.inventory, "changed": list(ch.changed), "unchanged": list(ch.unchanged),
                       "cordoned": _rows(ch.cordoned), "set_aside": str(ch.set_aside) if ch.set_aside else None})


def _warn_set_aside(ch: CordonChange) -> None:
    if ch.set_aside is not None:  # the damaged file's cordons are gone from plans: say so even under --json
        typer.echo(f"warning: the cordon file was unreadable and is kept aside as {ch.set_aside}; the cordons it held no longer apply "
                   "(cordon those nodes again)", err=True)


def _listing(inventory: str, cordons: dict[str, Cordon]) -> None:
    from k3launch.cli import show_deploy

    con = console()
    if not cordons:
        con.print(f"no cordoned nodes in inventory {inventory}", markup=False)
        return
    rows: list[tuple[str, ...]] = [(c.node, c.when(), c.by, c.reason or "-") for c in cordons.values()]
    show_deploy.table(con, f"cordoned nodes of {inventory}", ("node", "since", "by", "reason"), rows, status=-1)


@app.command()
def cordon(
    inventory: Inventory,
    nodes: Annotated[list[str] | None, typer.Argument(metavar="NODE", help="Nodes to cordon; none: list the inventory's cordoned nodes.")] = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Why (shown in plans' notices and in the listing).")] = None,
    state_dir: StateDir = None,
    json_out: JsonOut = False,
) -> None:
    """Keep nodes of an inventory out of every plan until `k3launch uncordon`; without NODE, list the cordoned ones.

    Planning skips a cordoned node with a notice (Slurm: sbatch --exclude); `up` refuses a plan made before the cordon that uses it."""
    STATE.json = json_out
    from k3launch import api

    loaded = api.load(inventory)
    if not nodes:
        if reason is not None:
            raise K3Error("bad-usage", "--reason needs the nodes to cordon", f"k3launch cordon NODE... -i {inventory} --reason TEXT")
        found = api.cordoned(loaded, state_dir)
    else:
        change = api.cordon(loaded, nodes, reason or "", state_dir)
    name = loaded.inventory.name
    if not nodes:
        if json_out:
            typer.echo(json.dumps({"inventory": name, "cordoned": _rows(found)}))
        else:
            _listing(name, found)
        return
    _warn_set_aside(change)
    if json_out:
        typer.echo(_change_json(change))
        return
    for n in change.changed:
        typer.echo(f"cordoned {n} (inventory {name}): plans skip it until `k3launch uncordon {n} -i {inventory}`")
    for n in change.unchanged:
        typer.echo(f"{n} was {change.cordoned[n].describe()} already: left as it is")


@app.command()
def uncordon(
    inventory: Inventory,
    nodes: Annotated[list[str], typer.Argument(metavar="NODE", help="Nodes to put back.")],
    state_dir: StateDir = None,
    json_out: JsonOut = False,
) -> None:
    """Put cordoned nodes of an inventory back: plans may use them again."""
    STATE.json = json_out
    from k3launch import api

    change = api.uncordon(inventory, nodes, state_dir)
    _warn_set_aside(change)
    if json_out:
        typer.echo(_change_json(change))
        return
    for n in change.changed:
        typer.echo(f"uncordoned {n} (inventory {change.inventory}): plans may use it again")
    for n in change.unchanged:
        typer.echo(f"{n} was not cordoned")
