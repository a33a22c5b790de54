"""``k3launch cache ls / clear``: the compile/JIT caches engines keep on the nodes.

``ls`` prints per node each key's directory, its size, when an engine last started with it and
what the key stands for; ``clear`` removes keys (``--key``, repeatable) or every key (``--all``)
and prints what is left. Exit 0, 1 when a node could not be read (named), 2 on a refusal.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Annotated

import typer

from k3launch.cli.common import STATE, AcceptUnknown, ConnectTimeout, JsonOut, app, console, fail
from k3launch.errors import K3Error

cache_app = typer.Typer(help="The compile/JIT caches engines keep on the nodes: list them, clear them.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")

Inv = Annotated[str, typer.Option("--inventory", "-i", help="Inventory file.")]
Nodes = Annotated[list[str] | None, typer.Option("--node", help="Only this node (repeatable).")]


def _show(inventory: str, nodes: list[str] | None, keys: list[str], clear_all: bool, accept_unknown_hosts: bool, connect_timeout: float,
          json_out: bool) -> None:
    STATE.json = json_out
    from k3launch import api

    found, failed = api.cache_dirs(inventory, nodes=nodes or [], clear=keys, clear_all=clear_all,
                                   access=api.Access(accept_unknown_hosts, connect_timeout))
    if json_out:
        typer.echo(json.dumps({"caches": [asdict(c) for c in found], "unreadable": failed}))
    else:
        con = console()
        for c in found:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.last_used)) if c.last_used else "-"
            what = ", ".join(f"{k} {v}" for k, v in c.meta.items() if k != "layout") or "not written by k3launch"
            con.print(f"{c.node}  {c.key}  {c.kb / 1024:.1f} MiB  last start {used}  ({what})", markup=False)
        if not found:
            con.print("no compile caches kept", markup=False)
        for node, why in failed.items():
            con.print(f"{node}: could not be read: {why}", markup=False)
    if failed:
        raise typer.Exit(1)


@cache_app.command("ls")
def ls(inventory: Inv, node: Nodes = None, accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0,
       json_out: JsonOut = False) -> None:
    """Each node's cache directories: key, size, last start, what the key stands for."""
    _show(inventory, node, [], False, accept_unknown_hosts, connect_timeout, json_out)


@cache_app.command("clear")
def clear(inventory: Inv, key: Annotated[list[str] | None, typer.Option("--key", help="A key to remove (repeatable; `cache ls` lists them).")] = None,
          all_keys: Annotated[bool, typer.Option("--all", help="Remove every key's directory.")] = False, node: Nodes = None,
          accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False) -> None:
    """Remove cache directories (the next start of their key compiles again); then list what is left."""
    if not key and not all_keys:
        STATE.json = json_out
        fail(K3Error("bad-usage", "cache clear needs --key KEY or --all", "`k3launch cache ls -i INV` lists the keys"))
    _show(inventory, node, key or [], all_keys, accept_unknown_hosts, connect_timeout, json_out)
