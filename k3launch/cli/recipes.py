"""``k3launch recipes [show ID]`` and ``k3launch lint`` (commands that need no plan)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from k3launch.cli.common import STATE, JsonOut, RecipesDir, VllmVersion, app, console, fail
from k3launch.defaults import DEFAULT_VLLM_VERSION
from k3launch.errors import K3Error

recipes_app = typer.Typer(help="List the recipes tree, or show one recipe.", invoke_without_command=True)
app.add_typer(recipes_app, name="recipes")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lint(
    ctx: typer.Context,
    vllm_version: VllmVersion = DEFAULT_VLLM_VERSION,
    json_out: JsonOut = False,
) -> None:
    """Check a pasted command: k3launch lint -- vllm serve MODEL --flag ... (exit 1 on findings)."""
    STATE.json = json_out
    from k3launch import api
    from k3launch.cli import show_plan as show
    from k3launch.models.findings import ERROR

    words = list(ctx.args)
    if not words:
        fail(K3Error("no-command", "nothing to lint", "k3launch lint -- vllm serve MODEL --flag VALUE ..."))
    if len(words) == 1 and " " in words[0]:
        import shlex

        words = shlex.split(words[0])
    found = api.lint(words, vllm_version)
    if json_out:
        typer.echo(json.dumps({"vllm_version": vllm_version, "findings": [f.as_dict() for f in found]}, indent=2))
    else:
        show.findings(console(), found)
    if any(f.severity == ERROR for f in found):
        raise typer.Exit(1)


@recipes_app.callback()
def recipes(ctx: typer.Context, recipes_dir: RecipesDir = None, json_out: JsonOut = False) -> None:
    """List recipes, hardware and strategies of the tree."""
    STATE.json = json_out
    ctx.obj = (recipes_dir, json_out)
    if ctx.invoked_subcommand is not None:
        return
    from k3launch import api
    from k3launch.cli import show_plan as show

    listing = api.recipes(recipes_dir)
    if json_out:
        typer.echo(json.dumps({"root": str(listing.root), "recipes": [{"id": r[0], "title": r[1]} for r in listing.recipes],
                               "broken": listing.broken, "hardware": sorted(listing.taxonomy.hardware_profiles),
                               "strategies": listing.strategies}, indent=2))
        return
    con = console()
    show.recipes_list(con, listing.recipes, listing.taxonomy, listing.strategies)
    for b in listing.broken:
        con.print(f"[red]broken[/] {b['id']}: {b['message']}")


@recipes_app.command("show")
def recipes_show(ctx: typer.Context, recipe_id: Annotated[str, typer.Argument(help="org/Model, Model, slug or model id")],
                 json_out: JsonOut = False) -> None:
    """Show one recipe: hardware (verified), strategies, floors, features, variants."""
    recipes_dir, parent_json = ctx.obj or (None, False)
    json_out = json_out or parent_json
    STATE.json = json_out
    from k3launch import api
    from k3launch.cli import show_plan as show

    d = api.recipe(recipe_id, recipes_dir)
    if json_out:
        typer.echo(json.dumps({"id": d.id, "default": d.default, "recipe": d.recipe.model_dump(mode="json"),
                               "kv_offload_support": {d.kv_hardware: d.kv_offload}}, indent=2))
    else:
        show.recipe_detail(console(), d.id, d.recipe, d.taxonomy, d.kv_offload, d.kv_hardware, d.default, d.one_node)
