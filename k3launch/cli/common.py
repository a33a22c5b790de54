"""Shared pieces of the CLI: the Typer app, error exit, and the selection options.

The selection options (recipe, hardware, strategy, nodes, P/D pools, features, KV offload,
``--set``, Advanced, inventory, ...) are the same for ``plan``, ``explain``, ``render`` and
(later) ``up``; :func:`with_selection` adds them to a command once, and hands the command one
:class:`PlanArgs` instead of twenty parameters.
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
VllmVersion = Annotated[str, typer.Option("--vllm-version", help="vLLM flag schema to check against.")]


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


SELECTION_PARAMS = [
    _opt("recipe", str | None, None, "--recipe", help="Recipe id (org/Model), slug or model id. Default: moonshotai/Kimi-K3."),
    _opt("variant", str | None, None, "--variant", help="Recipe variant (default: the recipe's first)."),
    _opt("hardware", str | None, None, "--hardware", help="Hardware id (default: the inventory's, else the recipe's default_hardware)."),
    _opt("strategy", str | None, None, "--strategy", help="single_node_tp, multi_node_tp, multi_node_tep, multi_node_dep, pd_cluster, ..."),
    _opt("nodes", int | None, None, "--nodes", help="Node count (raised to the strategy floor with a notice)."),
    _opt("prefill_strategy", str | None, None, "--prefill-strategy", help="P/D prefill pool: tp, tep or dep (default tep)."),
    _opt("prefill_nodes", int | None, None, "--prefill-nodes", help="P/D prefill pool nodes (1-16)."),
    _opt("decode_strategy", str | None, None, "--decode-strategy", help="P/D decode pool: tp, tep or dep (default dep)."),
    _opt("decode_nodes", int | None, None, "--decode-nodes", help="P/D decode pool nodes (1-16)."),
    _opt("feature", list[str] | None, None, "--feature", help="Enable a feature (repeatable): tool_calling, reasoning, spec_decoding, text_only."),
    _opt("no_feature", list[str] | None, None, "--no-feature", help="Disable a feature the recipe enables by default (repeatable)."),
    _opt("kv_offload", str, "off", "--kv-offload", help="off, simple, lmcache or mooncake."),
    _opt("set_", list[str] | None, None, "--set", help="FLAG=VALUE applied at the Advanced layer (repeatable)."),
    _opt("advanced", list[str] | None, None, "--advanced", help="Advanced preset (repeatable): max-num-batched-tokens, max-num-seqs, gpu-memory-utilization, max-model-len, or all."),
    _opt("vllm_version", str, "0.33.0", "--vllm-version", help="vLLM flag schema to check against."),
    _opt("recipes_dir", Path | None, None, "--recipes-dir", help="A recipes tree (vLLM recipes layout) to use instead of the bundled one."),
    _opt("inventory", Path | None, None, "--inventory", "-i", help="Inventory YAML: place on its nodes (see inventories/)."),
    _opt("exclude", list[str] | None, None, "--exclude", help="Do not use this inventory node (repeatable)."),
    _opt("port_base", int | None, None, "--port-base", help="Shift every planned port so HTTP starts here (default 8000)."),
    _opt("name", str | None, None, "--name", help="Deployment name (default: recipe-strategy-hardware-<id>)."),
]


@dataclass(frozen=True)
class PlanArgs:
    values: dict[str, Any]

    def build(self) -> Plan:
        """Load recipes and inventory, build the plan; raises K3Error."""
        from k3launch.models.selection import Selection
        from k3launch.planning.build import build_plan
        from k3launch.planning.inventory import apply_ssh_config, load_inventory, read_ssh_config
        from k3launch.planning.layers import DEFAULT_ADVANCED

        v = self.values
        name = v["name"]  # checked by build_plan (the API takes names too)
        adv = tuple(v["advanced"] or ())
        sel = Selection(
            recipe=v["recipe"], variant=v["variant"], hardware=v["hardware"], strategy=v["strategy"], nodes=v["nodes"],
            prefill_strategy=v["prefill_strategy"], prefill_nodes=v["prefill_nodes"], decode_strategy=v["decode_strategy"],
            decode_nodes=v["decode_nodes"], features=tuple(v["feature"] or ()), no_features=tuple(v["no_feature"] or ()),
            kv_offload=v["kv_offload"], sets=tuple(v["set_"] or ()), advanced=tuple(DEFAULT_ADVANCED) if "all" in adv else adv,
            vllm_version=v["vllm_version"],
        )
        inv = load_inventory(v["inventory"]) if v["inventory"] is not None else None
        if inv is not None and inv.backend == "ssh":
            inv = apply_ssh_config(inv, read_ssh_config(inv))
        return build_plan(tree(v["recipes_dir"]), sel, inventory=inv, exclude=tuple(v["exclude"] or ()),
                          port_base=v["port_base"], name=name)

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
    names = [p.name for p in SELECTION_PARAMS]

    @functools.wraps(fn)
    def wrapper(**kw: Any) -> None:
        values = {n: kw.pop(n) for n in names}
        fn(args=PlanArgs(values), **kw)

    params = own + SELECTION_PARAMS
    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
