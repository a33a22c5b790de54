"""Shared pieces of the CLI: the Typer app, error exit, and the selection options.

The selection options are generated from the fields of
:class:`~k3launch.models.selection.Selection` (flag, help, default), plus the placement options
(inventory, ``--exclude``, ``--port-base``, ``--name``, ``--recipes-dir``); they are the same for
``plan``, ``explain``, ``render`` and ``up``. :func:`with_selection` adds them to a command once
and hands the command one :class:`PlanArgs` instead of twenty parameters.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from k3launch.errors import K3Error

if TYPE_CHECKING:  # heavy imports stay lazy so `--help` and `plan` start fast
    from rich.console import Console

    from k3launch.models.plan import Plan
    from k3launch.models.selection import Selection
    from k3launch.planning.recipes import RecipeTree

app = typer.Typer(
    name="k3launch",
    help="Compose, place, launch and benchmark vLLM deployments of giant MoE models (Kimi K3 first).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class _State:
    debug = False
    json = False


STATE = _State()

JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON object (errors: {\"error\": {code, message, hint}}).")]
RecipesDir = Annotated[Path | None, typer.Option("--recipes-dir", help="A recipes tree (vLLM recipes layout) to use instead of the bundled one.")]
VllmVersion = Annotated[str, typer.Option("--vllm-version", help="vLLM flag schema to check against.")]  # the lint command's own


def console() -> Console:
    from rich.console import Console

    return Console(soft_wrap=False)


def tree(recipes_dir: Path | None) -> RecipeTree:
    from k3launch.planning.recipes import RecipeTree

    return RecipeTree(recipes_dir)


def fail(err: K3Error) -> NoReturn:
    if STATE.json:
        typer.echo(json.dumps({"error": err.as_dict()}))
    else:
        typer.echo(f"error: {err.message}", err=True)
        if err.hint:
            typer.echo(f"hint: {err.hint}", err=True)
    raise typer.Exit(2)


def _opt(name: str, annotation: Any, default: Any, *flags: str, help: str) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[annotation, typer.Option(*flags, help=help)])


@functools.cache
def _selection_params() -> list[inspect.Parameter]:
    """One option per :class:`~k3launch.models.selection.Selection` field: flag, help and default from the model."""
    from k3launch.models.selection import Selection

    many = Selection.list_fields()
    out = []
    for name, flag, help_, annotation in Selection.cli_fields():
        default = Selection.model_fields[name].default
        if name in many:  # repeatable: typer collects a list
            out.append(_opt(name, list[str] | None, None, flag, help=help_))
        else:
            out.append(_opt(name, annotation, default, flag, help=help_))
    return out


# Where to place the selection (not what to compose): the inventory and the deployment's name and ports.
PLACEMENT_PARAMS = [
    _opt("recipes_dir", Path | None, None, "--recipes-dir", help="A recipes tree (vLLM recipes layout) to use instead of the bundled one."),
    _opt("inventory", Path | None, None, "--inventory", "-i", help="Inventory YAML: place on its nodes (see inventories/)."),
    _opt("exclude", list[str] | None, None, "--exclude", help="Do not use this inventory node (repeatable)."),
    _opt("port_base", int | None, None, "--port-base", help="Shift every planned port so HTTP starts here (default 8000)."),
    _opt("name", str | None, None, "--name", help="Deployment name (default: recipe-strategy-hardware-<id>)."),
]


@dataclass(frozen=True)
class PlanArgs:
    values: dict[str, Any]

    def selection(self) -> Selection:
        """The :class:`~k3launch.models.selection.Selection` the options describe."""
        from k3launch.models.selection import Selection

        return Selection(**{n: self.values[n] for n in Selection.model_fields})

    def build(self) -> Plan:
        """Load recipes and inventory, build the plan; raises K3Error."""
        from k3launch.planning.build import build_plan

        v = self.values
        inv = None  # no inventory: placeholder nodes (and the inventory module is not even imported)
        if v["inventory"] is not None:
            from k3launch.planning.inventory import load_placed

            inv = load_placed(v["inventory"])
        # the name is checked by build_plan (the API takes names too)
        return build_plan(tree(v["recipes_dir"]), self.selection(), inventory=inv, exclude=tuple(v["exclude"] or ()),
                          port_base=v["port_base"], name=v["name"])

    @property
    def inventory_path(self) -> Path | None:
        p: Path | None = self.values["inventory"]
        return p


def with_selection(fn: Callable[..., None]) -> Callable[..., None]:
    """Add the selection options to a command; the command receives ``args: PlanArgs``."""
    sig = inspect.signature(fn)
    # `from __future__ import annotations` leaves strings; Typer needs the evaluated Annotated types.
    hints = typing.get_type_hints(fn, include_extras=True)
    own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values() if p.name != "args"]
    added = _selection_params() + PLACEMENT_PARAMS
    names = [p.name for p in added]

    @functools.wraps(fn)
    def wrapper(**kw: Any) -> None:
        values = {n: kw.pop(n) for n in names}
        fn(args=PlanArgs(values), **kw)

    params = own + added
    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
