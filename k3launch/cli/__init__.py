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
    """Ctrl-C while the CLI is imported (about 0.1 s, more on a loaded login node; a command's own
    module is imported later, where Ctrl-C is handled as in the command) ends as it does later on: one line and exit 130, not a traceback from inside an import."""
    sys.stderr.write("interrupted\n")
    raise SystemExit(130)


# Only in the main thread, and only over Python's own handler: a SIGINT ignored (a background job)
# or handled by the program importing this module stays as it is.
_GUARDED = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
if _GUARDED:
    signal.signal(signal.SIGINT, _interrupted_while_starting)

import functools
import gc
import importlib
import json
import os
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.core
import typer.main

from k3launch import __version__
from k3launch.cli.common import INTERRUPTED, STATE, JsonOut, K3Group, PlanArgs, app, console, io_error, refusals, say, with_selection
from k3launch.cli.labels import labelled
from k3launch.errors import K3Error
from k3launch.util.records import record

if TYPE_CHECKING:
    import logging

__all__ = ["app", "main"]
# plan, explain and render: registered here rather than on `app`, so that, like the commands of
# the other modules, they are built only when they run (see _Root)
_here = typer.Typer()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"k3launch {__version__}")
        raise typer.Exit()


# Commands that only read files and print: they never connect over SSH (so they leave paramiko's
# logger alone, and do not import logging for it) and end in a fraction of a second (see main).
_QUICK = frozenset({"plan", "explain", "render", "lint", "recipes", "schema"})


def _before_dashes(args: list[str]) -> list[str]:
    return args[: args.index("--")] if "--" in args else args


def _command_word(args: list[str]) -> str | None:
    """The word of ARGS that names the command: the first that is not an option (the group's own
    options are flags and take no value), before any ``--``."""
    return next((w for w in _before_dashes(args) if not w.startswith("-")), None)


@functools.cache
def _quiet() -> logging.Handler:
    import logging

    return logging.NullHandler()


@app.callback()
def _main(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    STATE.debug = debug
    if ctx.invoked_subcommand in _QUICK:
        return
    import logging

    # paramiko logs each failed connection with its traceback (through logging's last-resort
    # handler: ~50 lines per unreachable host) before k3launch's own one-line error says it all
    paramiko_log = logging.getLogger("paramiko")
    if debug:
        paramiko_log.removeHandler(_quiet())
    else:
        paramiko_log.addHandler(_quiet())  # once: addHandler skips a handler already there
    paramiko_log.propagate = debug


@_here.command()
@with_selection
def plan(json_out: JsonOut = False, *, args: PlanArgs) -> None:
    """Compose every process of a deployment: argv, env, ranks, ports, provenance."""
    STATE.json = json_out
    p = args.build()
    load = None
    if args.inventory_path is not None:  # a throughput is known only for an inventory's nodes
        from k3launch import api

        load = api.load_prediction(p, args.inventory, args.state_dir)
    if json_out:
        if load is None:
            typer.echo(p.to_json())
        else:  # an additive key, only when a throughput is known
            out = json.loads(p.to_json())
            out["weights_load"] = load.rows()
            typer.echo(json.dumps(out, indent=2))
    else:
        from k3launch.cli import show_plan as show

        show.plan(console(), p, load)


@_here.command()
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

    key, items = api.explain(args.build(), flag, process)
    if json_out:
        out = {
            "flag": key,
            "histories": [{"processes": h.processes, "final": h.final, "entries": [e.model_dump() for e in h.entries]} for h in items],
        }
        typer.echo(json.dumps(out, indent=2))
    else:
        from k3launch.cli import show_plan as show

        show.history(console(), items, key)


@_here.command()
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

    p = args.build()
    written = write_render(p, out, args, force)
    if json_out:
        typer.echo(json.dumps({"name": p.name, "out": str(out), "files": written}, indent=2))
    else:
        typer.echo(f"plan {p.name}: wrote {len(written)} files to {out}")
        for f in written:
            typer.echo(f"  {f}")


def _evaluate_annotations(fn: object) -> None:
    """Replace the string annotations of a command callback by their values, once.

    ``from __future__ import annotations`` leaves them as strings, and Typer evaluates each one
    four times (``inspect.signature(eval_str=True)`` and ``get_type_hints``, twice per command)
    when it builds the command. Evaluated here once, Typer reads the same objects back.
    """
    if isinstance(fn, types.FunctionType) and any(isinstance(a, str) for a in fn.__annotations__.values()):
        fn.__annotations__ = typing.get_type_hints(fn, include_extras=True)


def _evaluate_group(group: typer.Typer) -> None:
    fns = [c.callback for c in group.registered_commands]
    if group.registered_callback is not None:
        fns.append(group.registered_callback.callback)
    for fn in fns:
        _evaluate_annotations(fn)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _evaluate_group(sub.typer_instance)


@record
class Lazy:
    """A command of ``k3launch`` as its listing shows it, before its module is imported."""

    module: str  # importing it registers the command (or command group)
    help: str  # the listing's line: the command's help up to its first blank line (tests keep the two equal)


# Every command, in the order of `k3launch --help`. A command's module, and the models and
# libraries it needs, are imported only when that command runs or shows its own help.
COMMANDS: dict[str, Lazy] = {
    "bench": Lazy("k3launch.cli.campaign", "Run one `vllm bench serve` load point against a live deployment's public endpoint."),
    "up": Lazy("k3launch.cli.deploy", "Launch a deployment and wait until it serves (default: the simulated K3 on this machine)."),
    "status": Lazy("k3launch.cli.deploy", "Per process: alive, healthy; the deployment's state and endpoint."),
    "logs": Lazy("k3launch.cli.deploy", "Print the last log lines of a deployment's processes."),
    "down": Lazy("k3launch.cli.deploy", "Stop every process (router, heads, headless), then verify nothing is left and ports are free."),
    "timeline": Lazy(
        "k3launch.cli.deploy", "The bring-up's timeline: per process, each phase's start and end; the slowest rank and what it waited for."
    ),
    "supervise": Lazy("k3launch.cli.supervise", "Keep a deployment serving until it is taken down: restart what died or hung, give up cleanly."),
    "events": Lazy(
        "k3launch.cli.supervise",
        "What supervisors (on Slurm, the job itself) saw and did: detections, restarts, backoffs, cordons, give-ups (time, unit, process, node, reason).",
    ),
    "rollout": Lazy(
        "k3launch.cli.rollout",
        "Change a live deployment one unit at a time: out of the router, drained, restarted on the new plan, gated, back in.",
    ),
    "scale": Lazy("k3launch.cli.rollout", "Change how many copies of the engine serve, and how many hot standbys wait beside them."),
    "canary": Lazy(
        "k3launch.cli.canary",
        "Replay the deployment's recorded greedy answers on every engine, P/D pairing and the router, and compare (exit 1 on a difference).",
    ),
    "list": Lazy("k3launch.cli.deploy", "Deployments in the state directory."),
    "chat": Lazy("k3launch.cli.deploy", "Send one chat completion to a deployment's public endpoint and print the reply."),
    "cordon": Lazy(
        "k3launch.cli.cordon", "Keep nodes of an inventory out of every plan until `k3launch uncordon`; without NODE, list the cordoned ones."
    ),
    "uncordon": Lazy("k3launch.cli.cordon", "Put cordoned nodes of an inventory back: plans may use them again."),
    "lint": Lazy("k3launch.cli.recipes", "Check a pasted command: k3launch lint -- vllm serve MODEL --flag ... (exit 1 on findings)."),
    "doctor": Lazy(
        "k3launch.cli.weights",
        "Check every planned node as `up` would (GPUs, fabric, /dev/shm, memlock, clocks, weights, ports), starting nothing.",
    ),
    "plan": Lazy(__name__, "Compose every process of a deployment: argv, env, ranks, ports, provenance."),
    "explain": Lazy(__name__, "Show which layers wrote FLAG, in order, and which value runs."),
    "render": Lazy(__name__, "Write plan.json and one runnable launch script per node (and the router) into --out."),
    "campaign": Lazy("k3launch.cli.campaign", "Benchmark campaigns: deployments × load points, results, plots."),
    "recipes": Lazy("k3launch.cli.recipes", "List the recipes tree, or show one recipe."),
    "schema": Lazy("k3launch.cli.schema", "vLLM flag schemas: plans are checked against the schema of the vLLM that runs."),
    "weights": Lazy("k3launch.cli.weights", "The model's weights on the nodes: check them, fetch them, probe their disk."),
    "cache": Lazy("k3launch.cli.cache", "The compile/JIT caches engines keep on the nodes: list them, clear them."),
    "monitoring": Lazy("k3launch.cli.monitoring", "Prometheus targets, alert rules and dashboards of the deployments."),
    "top": Lazy(
        "k3launch.cli.top",
        "Live per engine and router: requests running/waiting, KV cache use, tokens/s, TTFT and ITL p50/p99, the controller's unit states.",
    ),
}


class _Listed(typer.core.TyperCommand):
    """A command's name and one-line help, standing in for it until it is built."""


class _Root(K3Group):
    """The ``k3launch`` group, with its commands built when used.

    Typer builds every command of a group up front: each command's options from its signature,
    which for the planning commands means importing the Selection model. Here ``commands`` holds
    a :class:`_Listed` stand-in for each command no module has registered yet; getting a command
    (to run it, or for its own ``--help``) imports its module and builds that command alone, and
    the group's own help lists the stand-ins.
    """

    _listing = False

    def __init__(self, *, commands: dict[str, Any] | None = None, **attrs: Any) -> None:
        built = dict(commands or {})  # those whose module was imported already (a test, a script)
        ordered = {n: built.pop(n) if n in built else _Listed(name=n, help=lazy.help) for n, lazy in COMMANDS.items()}
        super().__init__(commands={**ordered, **built}, **attrs)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = self.commands.get(cmd_name)
        if isinstance(cmd, _Listed) and not self._listing:
            cmd = self.commands[cmd_name] = _build(cmd_name)
        return labelled(cmd, ctx)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True  # the listing needs names and one-line helps only
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        # Build the command named first, so that error messages can name the command's path.
        name = _command_word(args)
        if name is not None and isinstance(self.commands.get(name), _Listed):
            with refusals("--json" in _before_dashes(args)):
                self.get_command(None, name)
        return super().make_context(info_name, args, parent=parent, **extra)


def _build(name: str) -> typer.core.TyperCommand | typer.core.TyperGroup:
    """Import the module of command NAME and build that command (or command group) alone."""
    importlib.import_module(COMMANDS[name].module)
    for source in (_here, app):
        for info in source.registered_commands:
            if info.callback is not None and (info.name or typer.main.get_command_name(info.callback.__name__)) == name:
                _evaluate_annotations(info.callback)
                cmd = typer.main.get_command_from_info(
                    info, pretty_exceptions_short=app.pretty_exceptions_short, rich_markup_mode=app.rich_markup_mode
                )
                assert isinstance(cmd, typer.core.TyperCommand)
                return cmd
        for group in source.registered_groups:
            if group.name == name and group.typer_instance is not None:
                _evaluate_group(group.typer_instance)
                return typer.main.get_group_from_info(
                    group,
                    pretty_exceptions_short=app.pretty_exceptions_short,
                    rich_markup_mode=app.rich_markup_mode,
                    suggest_commands=app.suggest_commands,
                )
    raise LookupError(f"{COMMANDS[name].module} registers no command {name!r}")


app.info.cls = _Root  # common.app is made with K3Group; the root builds its commands lazily
_evaluate_group(app)
if _GUARDED:  # the command tree is set up: from here Ctrl-C is a KeyboardInterrupt the commands handle
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _refuse(err: K3Error) -> None:
    say(err)
    sys.exit(2)


def main() -> None:
    """Console entry point: K3Error → exit 2; unexpected errors → one line unless --debug.

    Commands and option parsing already end this way (:class:`~k3launch.cli.common.K3Group`);
    this catches what happens around them (building the command tree, Typer's own steps).

    A quick command (:data:`_QUICK`, or none: the group's help, ``--version``) runs with Python's
    cyclic garbage collector off and leaves it no work at exit (``gc.freeze``): its passes over the
    objects that Typer's commands and pydantic's models create cost about 40 ms of such a command's
    0.2 s, for garbage a command that ends in a fraction of a second makes too little of to
    matter. Every other command, which may run for hours, runs with the collector on. A quick
    command also runs without pydantic's plugins (``PYDANTIC_DISABLE_PLUGINS``, unless set).
    """
    quick = _command_word(sys.argv[1:]) in _QUICK | {None}
    if quick:
        gc.disable()
        # pydantic looks for plugins (entry points of every installed distribution: importlib.metadata
        # and a scan of each one's metadata, about 13 ms here) the first time it builds a validator;
        # a quick command validates only its own files and options. A value the user set is kept.
        os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    else:
        gc.enable()  # k3launch.__main__ turns it off while the command line is imported
    try:
        _run("--debug" in sys.argv[1:])
    finally:
        if quick:
            gc.freeze()


def _run(debug: bool) -> None:
    try:
        app()
    except K3Error as err:  # raised outside the commands (K3Group's refusals say theirs)
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
