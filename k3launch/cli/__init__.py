"""The ``k3launch`` command line: parse, call the library, render (rich for people, ``--json`` for scripts).

Exit codes: 0 success; 1 ``lint`` found problems; 2 refused (bad input, a bad option, a
combination that cannot work, a deployment that does not fit, a file that cannot be written)
with a one-line reason and a hint; 130 interrupted. A Python traceback is shown only with
``--debug``.
"""
# ruff: noqa: E402  (the Ctrl-C guard below must be in place before the imports it covers)

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType


def _interrupted_while_starting(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C while the command tree is imported and built (0.1-0.3 s, more on a loaded login node)
    ends as it does later on: one line and exit 130, not a traceback from inside an import."""
    sys.stderr.write("interrupted\n")
    raise SystemExit(130)


# Only in the main thread, and only over Python's own handler: a SIGINT ignored (a background job)
# or handled by the program importing this module stays as it is.
_GUARDED = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
if _GUARDED:
    signal.signal(signal.SIGINT, _interrupted_while_starting)

import json
import logging
import types
import typing
from pathlib import Path
from typing import Annotated

import typer

from k3launch import __version__
from k3launch.cli import campaign as _cli_campaign  # registers `bench` and `campaign run/report`
from k3launch.cli import deploy as _cli_deploy  # registers up/status/logs/down/list
from k3launch.cli import recipes as _cli_recipes  # registers `recipes` and `lint`
from k3launch.cli import schema as _cli_schema  # registers `schema dump`
from k3launch.cli import weights as _cli_weights  # registers `doctor` and `weights check/fetch`
from k3launch.cli.common import INTERRUPTED, STATE, JsonOut, PlanArgs, app, console, fail, io_error, with_selection
from k3launch.errors import K3Error

__all__ = ["app", "main"]
_QUIET = logging.NullHandler()
_ = (_cli_recipes, _cli_deploy, _cli_campaign, _cli_schema, _cli_weights)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"k3launch {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    STATE.debug = debug
    # paramiko logs each failed connection with its traceback (through logging's last-resort
    # handler: ~50 lines per unreachable host) before k3launch's own one-line error says it all
    paramiko_log = logging.getLogger("paramiko")
    if debug:
        paramiko_log.removeHandler(_QUIET)
    else:
        paramiko_log.addHandler(_QUIET)  # once: addHandler skips a handler already there
    paramiko_log.propagate = debug


@app.command()
@with_selection
def plan(json_out: JsonOut = False, *, args: PlanArgs) -> None:
    """Compose every process of a deployment: argv, env, ranks, ports, provenance."""
    STATE.json = json_out
    try:
        p = args.build()
    except K3Error as err:
        fail(err)
    if json_out:
        typer.echo(p.to_json())
    else:
        from k3launch.cli import show_plan as show

        show.plan(console(), p)


@app.command()
@with_selection
def explain(
    flag: Annotated[str, typer.Argument(help="A vllm serve flag (max-num-seqs, --max-num-seqs, -tp) or an env name.")],
    process: Annotated[str | None, typer.Option("--process", help="Only this process id (e.g. decode-1).")] = None,
    json_out: JsonOut = False,
    *,
    args: PlanArgs,
) -> None:
    """Show which layers wrote FLAG, in order, and which value runs."""
    STATE.json = json_out
    from k3launch import api

    try:
        key, items = api.explain(args.build(), flag, process)
    except K3Error as err:
        fail(err)
    if json_out:
        out = {
            "flag": key,
            "histories": [{"processes": h.processes, "final": h.final, "entries": [e.model_dump() for e in h.entries]} for h in items],
        }
        typer.echo(json.dumps(out, indent=2))
    else:
        from k3launch.cli import show_plan as show

        show.history(console(), items, key)


@app.command()
@with_selection
def render(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Directory for plan.json and one launch script per node (created; must be empty).")
    ],
    force: Annotated[
        bool, typer.Option("--force", help="Write into a non-empty --out directory (overwrites same-named files only).")
    ] = False,
    json_out: JsonOut = False,
    *,
    args: PlanArgs,
) -> None:
    """Write plan.json and one runnable launch script per node (and the router) into --out."""
    STATE.json = json_out
    from k3launch.cli.writeout import write_render

    try:
        p = args.build()
        written = write_render(p, out, args, force)
    except K3Error as err:
        fail(err)
    if json_out:
        typer.echo(json.dumps({"name": p.name, "out": str(out), "files": written}, indent=2))
    else:
        typer.echo(f"plan {p.name}: wrote {len(written)} files to {out}")
        for f in written:
            typer.echo(f"  {f}")


def _evaluate_annotations(group: typer.Typer) -> None:
    """Replace the string annotations of every command callback by their values, once.

    ``from __future__ import annotations`` leaves them as strings, and Typer evaluates each one
    four times (``inspect.signature(eval_str=True)`` and ``get_type_hints``, twice per command)
    every time it builds the command tree, that is at every start, for every command, whichever
    runs. Evaluated here once, Typer reads the same objects back.
    """
    fns = [c.callback for c in group.registered_commands]
    if group.registered_callback is not None:
        fns.append(group.registered_callback.callback)
    for fn in fns:
        if isinstance(fn, types.FunctionType) and any(isinstance(a, str) for a in fn.__annotations__.values()):
            fn.__annotations__ = typing.get_type_hints(fn, include_extras=True)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _evaluate_annotations(sub.typer_instance)


_evaluate_annotations(app)
if _GUARDED:  # the command tree is built: from here Ctrl-C is a KeyboardInterrupt the commands handle
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _refuse(err: K3Error) -> None:
    typer.echo(f"error: {err.message}", err=True)
    if err.hint:
        typer.echo(f"hint: {err.hint}", err=True)
    sys.exit(2)


def main() -> None:
    """Console entry point: K3Error → exit 2; unexpected errors → one line unless --debug.

    Commands and option parsing already end this way (:class:`~k3launch.cli.common.K3Group`);
    this catches what happens around them (building the command tree, Typer's own steps)."""
    debug = "--debug" in sys.argv[1:]
    try:
        app()
    except K3Error as err:  # raised outside a command's own handler
        _refuse(err)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(INTERRUPTED)
    except Exception as exc:  # the last line of defence against tracebacks
        refusal = io_error(exc) if isinstance(exc, OSError) else None
        if debug:
            raise
        if refusal is not None:
            _refuse(refusal)
        typer.echo(f"internal error: {type(exc).__name__}: {exc}", err=True)
        typer.echo("hint: rerun with --debug for a traceback and report it", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
