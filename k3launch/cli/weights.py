"""``k3launch doctor`` and ``k3launch weights check / fetch``: the nodes, before anything starts.

``doctor`` runs the pre-flight checks ``up`` runs (``--bandwidth`` adds a short all-reduce);
``weights check`` tells per node whether the model is complete in its Hugging Face cache and how
much disk is free; ``weights fetch`` brings it there; ``weights probe`` measures how fast each node reads the disk
the weights load from. Each exits 0 when every node is fine, 1
when one is not (the table or ``--json`` says which and why), 2 on a refusal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer

from k3launch.cli.common import (
    INTERRUPTED,
    STATE,
    AcceptUnknown,
    ConnectTimeout,
    JsonOut,
    PlanArgs,
    app,
    console,
    number_option,
    with_selection,
)
from k3launch.util.bounds import BUSBW, PROBE_BYTES, PROBE_TIMEOUT, PROGRESS_INTERVAL

if TYPE_CHECKING:
    from rich.console import Console

    from k3launch.models.weights import FetchProgress, NodeWeights, Probe

weights_app = typer.Typer(help="The model's weights on the nodes: check them, fetch them, probe their disk.", no_args_is_help=True)
app.add_typer(weights_app, name="weights")

@app.command()
@with_selection
def doctor(
    bandwidth: Annotated[
        bool, typer.Option("--bandwidth", help="Also run a short all_reduce_perf (nccl-tests/rccl-tests) per node and across nodes.")
    ] = False,
    min_busbw: Annotated[
        float | None, number_option("--min-busbw", BUSBW, "Bus bandwidth to pass --bandwidth (default: 100 in a node, 40 across nodes).")
    ] = None,
    accept_unknown_hosts: AcceptUnknown = False,
    connect_timeout: ConnectTimeout = 10.0,
    json_out: JsonOut = False,
    *,
    args: PlanArgs,
) -> None:
    """Check every planned node as `up` would (GPUs, fabric, /dev/shm, memlock, clocks, weights, ports), starting nothing."""
    STATE.json = json_out
    from k3launch import api

    args = args.or_local()
    plan = args.build()
    report = api.doctor(
        plan,
        args.inventory,
        state_dir=args.state_dir,
        bandwidth=bandwidth,
        min_busbw=min_busbw,
        access=api.Access(accept_unknown_hosts, connect_timeout),
    )
    load = api.load_prediction(plan, args.inventory, args.state_dir, checkpoint=report.checkpoint)  # a node's index, when one said
    if json_out:
        out: dict[str, object] = {"name": plan.name, "ok": report.ok, "checks": [asdict(c) for c in report.checks]}
        if load is not None:
            out["weights_load"] = load.rows()
        typer.echo(json.dumps(out, indent=2))
    else:
        from k3launch.cli import show_deploy  # rich: loaded by the commands that print tables, never at start-up
        from k3launch.cli.show_plan import load_lines

        con = console()
        show_deploy.doctor(con, report.checks)
        for line in load_lines(load) if load is not None else []:
            typer.echo(line)
        show_deploy.doctor_summary(con, report)
    if not report.ok:
        raise typer.Exit(1)


def _rows(rows: list[NodeWeights]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for r in rows:
        s = r.state
        out.append(
            {
                "node": r.node,
                "model": r.where.model,
                "revision": r.where.revision,
                "complete": r.complete,
                "dir": (s.dir if s else "") or r.where.repo_dir,
                "commit": s.commit if s else "",
                "files": s.files if s else 0,
                "bytes": s.bytes if s else 0,
                "index_total_bytes": s.total if s else None,  # the checkpoint's size, as its index says (null: no index)
                "free_bytes": s.free if s else None,
                "problem": r.error or (s.problem() if s else ""),
                "fetched": r.fetched,
            }
        )
    return out


def _weights_table(con: Console, rows: list[NodeWeights]) -> None:
    out: list[tuple[str, ...]] = []
    for r in rows:
        s = r.state
        free = f"{s.free / 1e9:,.0f} GB" if s is not None and s.free is not None else "?"
        where = r.error or (s.problem() if s else "") or ((s.dir if s else "") or r.where.repo_dir)
        out.append(
            (
                r.node,
                f"{r.where.model}@{r.where.revision}",
                "complete" if r.complete else "missing",
                str(s.files if s else 0),
                f"{(s.bytes if s else 0) / 1e9:,.1f}" + (f" of {s.total / 1e9:,.1f}" if s is not None and s.total else "") + " GB",
                free,
                where,
            )
        )
    from k3launch.cli import show_deploy

    show_deploy.table(con, "weights", ("node", "model", "state", "files", "size", "free", "where / problem"), out, status=2)


def _finish(rows: list[NodeWeights], json_out: bool) -> None:
    if json_out:
        typer.echo(json.dumps({"complete": all(r.complete for r in rows), "nodes": _rows(rows)}, indent=2))
    else:
        _weights_table(console(), rows)
    if not all(r.complete for r in rows):
        if not json_out:
            typer.echo(f"missing on {', '.join(r.node for r in rows if not r.complete)}", err=True)
        raise typer.Exit(1)


@weights_app.command("check")
@with_selection
def check(
    accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False, *, args: PlanArgs
) -> None:
    """Per node: is the model (at the plan's --revision) complete in its Hugging Face cache, and how much disk is free."""
    STATE.json = json_out
    from k3launch import api

    args = args.or_local()
    rows = api.weights_check(
        args.build(), args.inventory, access=api.Access(accept_unknown_hosts, connect_timeout)
    )
    _finish(rows, json_out)


def _progress_printer(json_out: bool) -> Callable[[FetchProgress], None] | None:
    def show(p: FetchProgress) -> None:
        pct = f" ({100 * p.done_bytes / p.total_bytes:.0f}%)" if p.total_bytes else ""
        eta = ""
        if 0 < p.done_bytes < p.total_bytes and p.elapsed_s > 0:
            eta = f", ETA {(p.total_bytes - p.done_bytes) / (p.done_bytes / p.elapsed_s):.0f} s"
        line = (
            f"weights fetch: {p.nodes_done}/{p.nodes} node(s) done, {p.done_bytes / 1e9:,.2f} of ~{p.total_bytes / 1e9:,.2f} GB"
            f"{pct}, {p.elapsed_s:.0f} s{eta}"
        )
        typer.echo(line, err=True)  # plain lines: never wrapped, readable in CI logs and nohup files

    return None if json_out else show


@weights_app.command("fetch")
@with_selection
def fetch(
    from_path: Annotated[
        str | None,
        typer.Option("--from-path", help="Copy from this directory every node sees (a shared HF cache, or the model's directory)."),
    ] = None,
    from_node: Annotated[str | None, typer.Option("--from-node", help="Copy from this node of the plan (over the same SSH).")] = None,
    interval: Annotated[float, number_option("--interval", PROGRESS_INTERVAL, "Seconds between progress lines.")] = 10.0,
    accept_unknown_hosts: AcceptUnknown = False,
    connect_timeout: ConnectTimeout = 10.0,
    json_out: JsonOut = False,
    *,
    args: PlanArgs,
) -> None:
    """Bring the model to every node that lacks it, in parallel: from the hub on each node (token: the inventory's hf_token_file), or copied."""
    STATE.json = json_out
    from k3launch import api

    try:
        args = args.or_local()
        rows = api.weights_fetch(
            args.build(),
            args.inventory,
            from_path=from_path,
            from_node=from_node,
            on_progress=_progress_printer(json_out),
            interval=interval,
            access=api.Access(accept_unknown_hosts, connect_timeout),
        )
    except KeyboardInterrupt:
        typer.echo("interrupted: partial downloads stay in the cache (the next fetch resumes them)", err=True)
        raise typer.Exit(INTERRUPTED) from None
    _finish(rows, json_out)


def _probe_table(con: Console, rows: list[Probe]) -> None:
    from k3launch.cli import show_deploy
    from k3launch.models.weights import METHODS

    out: list[tuple[str, ...]] = []
    for p in rows:
        if not p.ok:
            out.append((p.node, "-", "-", "-", p.error or "nothing read", p.dir))
            continue
        how = METHODS.get(p.method, p.method) + (" (cut at the time bound)" if p.timed_out else "")
        if p.resident:
            how += f"; {p.resident / 1e6:,.0f} MB still cached before the read"
        out.append((p.node, f"{p.read_mbps:,.0f} MB/s", f"{p.bytes / 1e6:,.0f} MB in {p.read_s:.2f} s",
                    f"{p.write_mbps:,.0f} MB/s", how, p.dir))
    show_deploy.table(con, "weights probe", ("node", "read", "measured", "write", "page cache", "directory"), out, status=1)


@weights_app.command("probe")
@with_selection
def probe(
    path: Annotated[
        str | None,
        typer.Option("--path", help="Probe this directory on every node (default: the inventory's weights.path, else where each node's engine looks for the model)."),
    ] = None,
    size: Annotated[int, number_option("--bytes", PROBE_BYTES, "Size of the fresh file written, read and removed per node.")] = 256 << 20,
    timeout: Annotated[float, number_option("--timeout", PROBE_TIMEOUT, "Bound of the write and of the read, each.")] = 60.0,
    save: Annotated[bool, typer.Option("--save", help="Keep the figures in the state directory: `plan` and `doctor` predict load times from them.")] = False,
    accept_unknown_hosts: AcceptUnknown = False,
    connect_timeout: ConnectTimeout = 10.0,
    json_out: JsonOut = False,
    *,
    args: PlanArgs,
) -> None:
    """Per node: the read throughput of the disk the weights load from (a fresh file, read past the page cache, then removed)."""
    STATE.json = json_out
    from k3launch import api
    from k3launch.models.weights import probe_rows

    args = args.or_local()
    rows = api.weights_probe(
        args.build(), args.inventory, path=path, size=size, timeout=timeout, save=save, state_dir=args.state_dir,
        access=api.Access(accept_unknown_hosts, connect_timeout),
    )
    if json_out:
        typer.echo(json.dumps({"ok": all(p.ok for p in rows), "nodes": probe_rows(rows)}, indent=2))
    else:
        _probe_table(console(), rows)
    if not all(p.ok for p in rows):
        if not json_out:
            typer.echo(f"no figure from {', '.join(p.node for p in rows if not p.ok)}", err=True)
        raise typer.Exit(1)
