"""``k3launch recipes [show ID]`` and ``k3launch lint`` (commands that need no plan)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from k3launch.cli.common import STATE, JsonOut, RecipesDir, VllmVersion, app, console, fail, tree
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
    from k3launch.cli import show_plan as show
    from k3launch.planning.lint import ERROR
    from k3launch.planning.lint import lint as do_lint
    from k3launch.planning.schema import load_schema

    words = list(ctx.args)
    if not words:
        fail(K3Error("no-command", "nothing to lint", "k3launch lint -- vllm serve MODEL --flag VALUE ..."))
    if len(words) == 1 and " " in words[0]:
        import shlex

        words = shlex.split(words[0])
    try:
        found = do_lint(load_schema(vllm_version), words)
    except K3Error as err:
        fail(err)
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
    from k3launch.cli import show_plan as show

    try:
        t = tree(recipes_dir)
        rows: list[tuple[str, str, str]] = []
        broken: list[dict[str, str]] = []
        for rid in t.model_ids():
            try:
                rec = t.model(rid)
            except K3Error as err:
                broken.append({"id": rid, **err.as_dict()})
                continue
            rows.append((rid, rec.meta.title, ", ".join(h for h, v in rec.meta.hardware.items() if v == "verified")))
        taxonomy = t.taxonomy
        strategies = sorted(t.strategies)
    except K3Error as err:
        fail(err)
    if json_out:
        typer.echo(json.dumps({"root": str(t.root), "recipes": [{"id": r[0], "title": r[1]} for r in rows],
                               "broken": broken, "hardware": sorted(taxonomy.hardware_profiles), "strategies": strategies}, indent=2))
        return
    con = console()
    show.recipes_list(con, rows, taxonomy, strategies)
    for b in broken:
        con.print(f"[red]broken[/] {b['id']}: {b['message']}")


@recipes_app.command("show")
def recipes_show(ctx: typer.Context, recipe_id: Annotated[str, typer.Argument(help="org/Model, Model, slug or model id")],
                 json_out: JsonOut = False) -> None:
    """Show one recipe: hardware (verified), strategies, floors, features, variants."""
    recipes_dir, parent_json = ctx.obj or (None, False)
    json_out = json_out or parent_json
    STATE.json = json_out
    from k3launch.cli import show_plan as show
    from k3launch.models.selection import Selection
    from k3launch.planning.build import build_plan
    from k3launch.planning.resolve import kv_offload_matrix

    try:
        t = tree(recipes_dir)
        rid = t.resolve(recipe_id)
        rec = t.model(rid)
        taxonomy = t.taxonomy
        # The default is what `plan --recipe ID` selects (the recipes project's rules), not only
        # the author's meta.default_hardware; a recipe that cannot be planned says why.
        try:
            p = build_plan(t, Selection(recipe=rid))
            default: dict[str, object] = {"hardware": p.hardware, "strategy": p.strategy, "nodes": p.nodes, "variant": p.variant}
        except K3Error as err:
            default = {"refused": err.code, "message": err.message}
        kv_hw = str(default.get("hardware") or rec.meta.default_hardware or next(iter(taxonomy.hardware_profiles)))
        kv = kv_offload_matrix(t, rec, kv_hw)
    except K3Error as err:
        fail(err)
    if json_out:
        typer.echo(json.dumps({"id": rid, "default": default, "recipe": rec.model_dump(mode="json"), "kv_offload_support": {kv_hw: kv}},
                              indent=2))
    else:
        show.recipe_detail(console(), rid, rec, taxonomy, kv, kv_hw, default)
