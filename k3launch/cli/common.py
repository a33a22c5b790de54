"""Shared pieces of the CLI: the Typer app, error exit, and the selection options.

The selection options are generated from the fields of
:class:`~k3launch.models.selection.Selection` (flag, help, default, bounds), plus the placement
options (inventory, ``--exclude``, ``--port-base``, ``--name``, ``--recipes-dir``, ``--state-dir``:
where the inventory's cordoned nodes are kept); they are the same for ``plan``, ``explain``,
``render`` and ``up``. :func:`with_selection` adds them to a
command once and hands the command one :class:`PlanArgs` instead of twenty parameters.

Every way a command can end badly ends in the same shape (:class:`K3Group`): a bad option value,
an unknown option or command, a :class:`~k3launch.errors.K3Error`, a file that cannot be written
are ``error:``/``hint:`` lines and exit 2; Ctrl-C is one ``interrupted`` line and exit 130. A
command raises its refusals and lets them go: :func:`refusals` says them (in JSON after ``--json``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import inspect
import json
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import typer.core

from k3launch.cli.labels import labelled
from k3launch.errors import K3Error
from k3launch.util.bounds import CONNECT_TIMEOUT, Bound
from k3launch.util.records import record

if TYPE_CHECKING:  # heavy imports stay lazy so `--help` and `plan` start fast
    from rich.console import Console

    from k3launch.api import Loaded
    from k3launch.models.plan import Plan

INTERRUPTED = 130  # the shell's code for a command ended by SIGINT
# Recent Typers carry their own copy of click, older ones use click itself: the exception classes
# are those of the click this Typer's commands come from.
_CLICK: Any = importlib.import_module(f"{'typer._click' if hasattr(typer.core, '_click') else 'click'}.exceptions")


class _State:
    debug = False
    json = False


STATE = _State()


def say(err: K3Error) -> None:
    """A refusal on stderr: ``error: <message> [<code>]`` (the code the troubleshooting tables list) and ``hint: <hint>``."""
    typer.echo(f"error: {err.message} [{err.code}]", err=True)
    if err.hint:
        typer.echo(f"hint: {err.hint}", err=True)


def fail(err: K3Error) -> NoReturn:
    if STATE.json:
        typer.echo(json.dumps({"error": err.as_dict()}))
    else:
        say(err)
    raise typer.Exit(2)


# What each errno means for the user; anything else gets the system's words and "check the path".
_IO_HINTS = {
    errno.ENOSPC: "free space on that filesystem, or write somewhere else",
    errno.EDQUOT: "your disk quota is used up: free space, or write somewhere else",
    errno.EROFS: "that filesystem is read-only: write somewhere else",
    errno.EACCES: "check its permissions (and its directory's), or write somewhere else",
    errno.EPERM: "check its permissions (and its directory's), or write somewhere else",
    errno.ENOENT: "check the path: a directory on the way is missing",
    errno.ENOTDIR: "check the path: a part of it is a file, not a directory",
    errno.EISDIR: "check the path: it is a directory",
}
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


def io_error(exc: OSError) -> K3Error | None:
    """An OSError about a file as a one-line refusal naming the path (or, when the error does not
    carry it, saying a write failed: a full disk reported at a flush); None for any other OSError
    (a socket, a process), which is not the user's to fix."""
    reason = exc.strerror or type(exc).__name__
    code = "write-failed" if exc.errno in _WRITE_ERRNOS else "io-error"
    hint = _IO_HINTS.get(exc.errno or 0, "check the path")
    if exc.filename is None:
        return K3Error(code, f"writing a file: {reason}", hint) if exc.errno in _WRITE_ERRNOS else None
    path = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    return K3Error(code, f"{path}: {reason}", hint)


def _usage(exc: Any, where: str) -> K3Error:
    """click's usage error (bad option value, unknown option or command, missing argument) in our
    shape; ``where`` is the command as typed (``k3launch campaign run``) when click does not say."""
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and ctx.parent is not None:
        words: list[str] = []
        while ctx.parent is not None:  # the command's path without the program's own name
            words.insert(0, ctx.info_name)
            ctx = ctx.parent
        where = " ".join(["k3launch", *words])
    message = " ".join(exc.format_message().split()).rstrip(".")  # click wraps some messages over lines
    what = "commands" if message.startswith("No such command") else "options and their values"
    return K3Error("bad-usage", message[:1].lower() + message[1:], f"`{where} --help` lists the {what}")


@contextlib.contextmanager
def refusals(json_out: bool, where: str = "k3launch") -> Iterator[None]:
    """Whatever escapes a command (or the parsing of its options) ends in our one-line shape."""
    try:
        yield
    except _CLICK.NoArgsIsHelpError:
        raise  # `k3launch` or `k3launch campaign` alone: click prints the help
    except _CLICK.ClickException as exc:
        STATE.json = STATE.json or json_out
        fail(_usage(exc, where))
    except K3Error as err:  # a command's refusal, or an option parser's: commands leave them all to this one place
        STATE.json = STATE.json or json_out
        fail(err)
    except KeyboardInterrupt:
        # a command that started something catches this itself and says what it took down
        typer.echo("interrupted", err=True)
        raise typer.Exit(INTERRUPTED) from None
    except OSError as exc:
        refusal = io_error(exc)
        if refusal is None or STATE.debug:
            raise
        STATE.json = STATE.json or json_out
        fail(refusal)


class K3Group(typer.core.TyperGroup):
    """The ``k3launch`` command group: option parsing and commands run inside :func:`refusals`."""

    _json_out = False
    _where = "k3launch"

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        words = args[: args.index("--")] if "--" in args else args
        self._json_out = "--json" in words  # an error before the command runs still answers in JSON
        STATE.json = STATE.debug = False  # not what an earlier command of this process said (tests, scripts)
        self._where = " ".join(["k3launch", *_command_words(self, words)])
        with refusals(self._json_out, self._where):
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        with refusals(self._json_out, self._where):
            return super().invoke(ctx)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        return labelled(super().get_command(ctx, cmd_name), ctx)


def _command_words(group: Any, words: Sequence[str]) -> list[str]:
    """The leading words of ``words`` that name a (sub)command: ``campaign run`` of ``campaign run F --x``."""
    out = []
    for w in words:
        cmd = getattr(group, "commands", {}).get(w)
        if cmd is None:
            break
        out.append(w)
        group = cmd
    return out


app = typer.Typer(
    name="k3launch",
    cls=K3Group,
    help="Compose, place, launch and benchmark vLLM deployments of giant MoE models (Kimi K3 first).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def bounded(bound: Bound, flag: str) -> Callable[[object], int | float]:
    """A Typer ``parser`` taking ``flag``'s value in ``bound`` (NaN, infinities, negatives and
    values out of range are refused as K3Error, before the command runs)."""

    def parse(raw: object) -> int | float:
        return bound.parse(flag, raw)

    return parse


def number_option(flag: str, bound: Bound, help: str, *more_flags: str) -> Any:
    """``typer.Option`` for a number in ``bound``; the range is added to the help."""
    metavar = "INTEGER" if bound.integer else "NUMBER"
    return typer.Option(flag, *more_flags, parser=bounded(bound, flag), metavar=metavar, help=f"{help} ({bound.describe()})")


def port_base_option(flag: str, help: str) -> Any:
    """``typer.Option`` for a port base: a port number whose block planning accepts (the same rule
    ``plan`` applies, checked here so that a command that plans later refuses it at once)."""

    def parse(raw: object) -> int:
        from k3launch import api

        try:
            base = raw if isinstance(raw, int) else int(str(raw).strip(), 10)
        except ValueError:
            raise K3Error("bad-value", f"{flag} {raw!r}: not a whole number", f"{flag} takes a port, e.g. 9000 or 20000") from None
        return api.check_port_base(base)  # its 512-port block inside 1024-65535, clear of the default ports

    return typer.Option(flag, parser=parse, metavar="PORT", help=help)


JsonOut = Annotated[bool, typer.Option("--json", help='Print one JSON object (errors: {"error": {code, message, hint}}).')]
RecipesDir = Annotated[
    Path | None, typer.Option("--recipes-dir", help="A recipes tree (vLLM recipes layout) to use instead of the bundled one.")
]
VllmVersion = Annotated[str, typer.Option("--vllm-version", help="vLLM flag schema to check against.")]  # the lint command's own
# the options of the commands that read deployment records and reach their nodes
StateDir = Annotated[Path | None, typer.Option("--state-dir", help="Deployment records (default ~/.k3launch or $K3LAUNCH_STATE_DIR).")]
AcceptUnknown = Annotated[bool, typer.Option("--accept-unknown-hosts", help="Accept (and remember) SSH host keys not in known_hosts. Off by default.")]
ConnectTimeout = Annotated[float, number_option("--connect-timeout", CONNECT_TIMEOUT,
                                                "Seconds to wait for a node's SSH connection (ssh_config ConnectTimeout wins).")]


# Off a terminal (CI logs, nohup, Slurm output, a pipe) lines are never wrapped or cut: rich's
# default of 80 columns would split messages and table rows that scripts grep for.
UNBOUNDED_WIDTH = 10_000


def console(stderr: bool = False) -> Console:
    """Rich output: the terminal's width on a terminal; off one, ``$COLUMNS`` if set, else unbounded."""
    import os

    from rich.console import Console

    c = Console(soft_wrap=False, stderr=stderr)
    if c.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return c
    return Console(soft_wrap=True, stderr=stderr, width=UNBOUNDED_WIDTH)


# A divider off a terminal: a short one, not a line as long as the unbounded width.
RULE_WIDTH = 80


def rule(con: Console, title: str = "", **kw: Any) -> None:
    """``con.rule``: across a terminal (or ``$COLUMNS``); off one, as wide as its title needs and at least :data:`RULE_WIDTH`."""
    from rich.rule import Rule

    width = con.width if con.width < UNBOUNDED_WIDTH else max(RULE_WIDTH, len(title) + 6)
    con.print(Rule(title, **kw), width=width)


def _opt(name: str, annotation: Any, default: Any, *flags: str, help: str) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[annotation, typer.Option(*flags, help=help)]
    )


@functools.cache
def _selection_names() -> tuple[str, ...]:
    from k3launch.models.selection import Selection

    return tuple(Selection.model_fields)


@functools.cache
def _selection_params() -> list[inspect.Parameter]:
    """One option per :class:`~k3launch.models.selection.Selection` field: flag, help and default from the model."""
    from k3launch.models.selection import Selection

    many = Selection.list_fields()
    out = []
    for name, flag, help_, annotation in Selection.cli_fields():
        default = Selection.model_fields[name].default
        bound = Selection.bound(name)
        if name in many:  # repeatable: typer collects a list
            out.append(_opt(name, list[str] | None, None, flag, help=help_))
        elif bound is not None:
            out.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=default,
                    annotation=Annotated[annotation, number_option(flag, bound, help_)],
                )
            )
        elif annotation in (bool, bool | None):  # an on/off switch: --x and --no-x (unset: the default's own source)
            out.append(_opt(name, annotation, default, f"{flag}/--no-{flag[2:]}", help=help_))
        else:
            out.append(_opt(name, annotation, default, flag, help=help_))
    return out


# Where to place the selection (not what to compose): the inventory and the deployment's name and ports.
PLACEMENT_PARAMS = [
    _opt("recipes_dir", Path | None, None, "--recipes-dir", help="A recipes tree (vLLM recipes layout) to use instead of the bundled one."),
    _opt("inventory", Path | None, None, "--inventory", "-i", help="Inventory YAML: place on its nodes (see inventories/)."),
    _opt("exclude", list[str] | None, None, "--exclude", help="Do not use this inventory node (repeatable)."),
    inspect.Parameter(
        "port_base",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[int | None, port_base_option("--port-base", "Shift every planned port so HTTP starts here (default 8000).")],
    ),
    _opt("name", str | None, None, "--name", help="Deployment name (default: <model>-<strategy>-<hardware>-<hash>, e.g. kimi-k3-tep-b300-1f0c2a)."),
    # every command that plans reads the inventory's cordoned nodes there, as `up` does
    _opt("state_dir", Path | None, None, "--state-dir",
         help="State directory: deployment records, cordoned nodes (default ~/.k3launch or $K3LAUNCH_STATE_DIR)."),
]


@record
class PlanArgs:
    """The selection and placement options of one command, turned into a plan by :func:`k3launch.api.plan`
    (one validation, one error code, whoever plans)."""

    values: dict[str, Any]

    @functools.cached_property
    def inventory(self) -> Loaded | None:
        """The inventory, read once (and, for ssh, resolved through ``~/.ssh/config`` once) for
        every use of this command: planning, the doctor, ``up``."""
        if self.inventory_path is None:
            return None
        from k3launch import api

        return api.load(self.inventory_path)

    def build(self) -> Plan:
        """The plan these options describe; raises K3Error."""
        from k3launch import api

        v = self.values
        inv = self.inventory  # None: placeholder nodes
        fields = {n: v[n] for n in _selection_names()}
        return api.plan(inv, selection=fields, placeholders=inv is None, exclude=tuple(v["exclude"] or ()), port_base=v["port_base"],
                        name=v["name"], recipes_dir=v["recipes_dir"], state_dir=self.state_dir)

    @property
    def inventory_path(self) -> Path | None:
        p: Path | None = self.values["inventory"]
        return p

    @property
    def state_dir(self) -> Path | None:
        p: Path | None = self.values["state_dir"]
        return p

    def or_local(self) -> PlanArgs:
        """These arguments, with the embedded default inventory (this machine) when none was given:
        what the commands that run something (`up`, `doctor`, `weights`) use."""
        if self.inventory_path is not None:
            return self
        from k3launch import api

        return PlanArgs({**self.values, "inventory": api.bundled_inventory("local")})


class _WithSelection:
    """A command callback that takes the selection options instead of twenty parameters.

    Typer reads the options from ``__signature__`` and ``__annotations__`` when it builds the
    command, which it does only when the command runs or shows its own help. They are computed
    then, not at decoration: they come from the Selection model, and importing it (which builds
    its validator) is a cost that ``k3launch --help``, which only lists the command, must not pay."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn
        # what Typer names the command and shows as its help
        self.__name__ = fn.__name__
        self.__qualname__ = fn.__qualname__
        self.__module__ = fn.__module__
        self.__doc__ = fn.__doc__

    @functools.cached_property
    def _added(self) -> list[inspect.Parameter]:
        return _selection_params() + PLACEMENT_PARAMS

    @functools.cached_property
    def __signature__(self) -> inspect.Signature:
        sig = inspect.signature(self._fn)
        # `from __future__ import annotations` leaves strings; Typer needs the evaluated Annotated types.
        hints = typing.get_type_hints(self._fn, include_extras=True)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values() if p.name != "args"]
        return sig.replace(parameters=own + self._added)

    @functools.cached_property
    def __annotations__(self) -> dict[str, Any]:  # type: ignore[override]
        return {p.name: p.annotation for p in self.__signature__.parameters.values()}

    def __call__(self, **kw: Any) -> None:
        values = {p.name: kw.pop(p.name) for p in self._added}
        self._fn(args=PlanArgs(values), **kw)


def with_selection(fn: Callable[..., None]) -> Callable[..., None]:
    """Add the selection options to a command; the command receives ``args: PlanArgs``."""
    return _WithSelection(fn)
