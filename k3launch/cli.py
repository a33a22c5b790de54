"""The ``k3launch`` command line: parse, call the library, render (rich for people, ``--json`` for scripts).

Exit codes: 0 success; 1 ``lint`` found problems; 2 refused (bad input, a combination that
cannot work, a deployment that does not fit) with a one-line reason and a hint. A Python
traceback is shown only with ``--debug``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from k3launch import __version__
from k3launch.errors import K3Error

if TYPE_CHECKING:  # heavy imports stay lazy so `--help` and `plan` start fast
    from rich.console import Console

    from k3launch.recipes import RecipeTree
    from k3launch.selection import Selection

app = typer.Typer(
    name="k3launch",
    help="Compose, place, launch and benchmark vLLM deployments of giant MoE models (Kimi K3 first).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
recipes_app = typer.Typer(help="List the recipes tree, or show one recipe.", invoke_without_command=True)
app.add_typer(recipes_app, name="recipes")


class _State:
    debug = False
    json = False


STATE = _State()

RecipesDir = Annotated[Path | None, typer.Option("--recipes-dir", help="A recipes tree (vLLM recipes layout) to use instead of the bundled one.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON object (errors: {\"error\": {code, message, hint}}).")]


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


def _console() -> Console:
    from rich.console import Console

    return Console(soft_wrap=False)


def _tree(recipes_dir: Path | None) -> RecipeTree:
    from k3launch.recipes import RecipeTree

    return RecipeTree(recipes_dir)


def fail(err: K3Error) -> NoReturn:
    if STATE.json:
        typer.echo(json.dumps({"error": err.as_dict()}))
    else:
        typer.echo(f"error: {err.message}", err=True)
        if err.hint:
            typer.echo(f"hint: {err.hint}", err=True)
    raise typer.Exit(2)


ADVANCED_ALL = ("max-num-batched-tokens", "max-num-seqs", "gpu-memory-utilization", "max-model-len")


def _selection(
    *, recipe: str | None, variant: str | None, hardware: str | None, strategy: str | None, nodes: int | None,
    prefill_strategy: str | None, prefill_nodes: int | None, decode_strategy: str | None, decode_nodes: int | None,
    feature: list[str] | None, no_feature: list[str] | None, kv_offload: str, sets: list[str] | None,
    advanced: list[str] | None, vllm_version: str,
) -> Selection:
    from k3launch.selection import Selection

    for s in sets or ():
        if "=" not in s and not s.lstrip("-").startswith(("enable-", "disable-", "no-")):
            raise K3Error("bad-set", f"--set {s!r} has no '='", "write --set FLAG=VALUE, e.g. --set max-num-seqs=64")
    adv = tuple(advanced or ())
    if "all" in adv:
        adv = ADVANCED_ALL
    return Selection(
        recipe=recipe, variant=variant, hardware=hardware, strategy=strategy, nodes=nodes,
        prefill_strategy=prefill_strategy, prefill_nodes=prefill_nodes, decode_strategy=decode_strategy,
        decode_nodes=decode_nodes, features=tuple(feature or ()), no_features=tuple(no_feature or ()),
        kv_offload=kv_offload, sets=tuple(sets or ()), advanced=adv, vllm_version=vllm_version,
    )


# Selection options, shared by plan and explain.
Recipe_ = Annotated[str | None, typer.Option("--recipe", help="Recipe id (org/Model), slug or model id. Default: moonshotai/Kimi-K3.")]
Variant_ = Annotated[str | None, typer.Option("--variant", help="Recipe variant (default: the recipe's first).")]
Hardware_ = Annotated[str | None, typer.Option("--hardware", help="Hardware id from the taxonomy (default: the recipe's default_hardware).")]
Strategy_ = Annotated[str | None, typer.Option("--strategy", help="single_node_tp, multi_node_tp, multi_node_tep, multi_node_dep, pd_cluster, ...")]
Nodes_ = Annotated[int | None, typer.Option("--nodes", help="Node count (raised to the strategy floor with a notice).")]
PStrat = Annotated[str | None, typer.Option("--prefill-strategy", help="P/D prefill pool: tp, tep or dep (default tep).")]
PNodes = Annotated[int | None, typer.Option("--prefill-nodes", help="P/D prefill pool nodes (1-16).")]
DStrat = Annotated[str | None, typer.Option("--decode-strategy", help="P/D decode pool: tp, tep or dep (default dep).")]
DNodes = Annotated[int | None, typer.Option("--decode-nodes", help="P/D decode pool nodes (1-16).")]
Feature_ = Annotated[list[str] | None, typer.Option("--feature", help="Enable a feature (repeatable): tool_calling, reasoning, spec_decoding, text_only.")]
NoFeature = Annotated[list[str] | None, typer.Option("--no-feature", help="Disable a feature the recipe enables by default (repeatable).")]
KvOffload = Annotated[str, typer.Option("--kv-offload", help="off, simple, lmcache or mooncake.")]
Set_ = Annotated[list[str] | None, typer.Option("--set", help="FLAG=VALUE applied at the Advanced layer (repeatable).")]
Advanced_ = Annotated[list[str] | None, typer.Option("--advanced", help="Advanced preset (repeatable): max-num-batched-tokens, max-num-seqs, gpu-memory-utilization, max-model-len, or all.")]
VllmVersion = Annotated[str, typer.Option("--vllm-version", help="vLLM flag schema to check against.")]


@app.command()
def plan(
    recipe: Recipe_ = None, variant: Variant_ = None, hardware: Hardware_ = None, strategy: Strategy_ = None,
    nodes: Nodes_ = None, prefill_strategy: PStrat = None, prefill_nodes: PNodes = None,
    decode_strategy: DStrat = None, decode_nodes: DNodes = None, feature: Feature_ = None, no_feature: NoFeature = None,
    kv_offload: KvOffload = "off", set_: Set_ = None, advanced: Advanced_ = None, vllm_version: VllmVersion = "0.33.0",
    recipes_dir: RecipesDir = None, json_out: JsonOut = False,
) -> None:
    """Compose every process of a deployment: argv, env, ranks, ports, provenance."""
    STATE.json = json_out
    from k3launch.plan import build_plan

    try:
        sel = _selection(recipe=recipe, variant=variant, hardware=hardware, strategy=strategy, nodes=nodes,
                         prefill_strategy=prefill_strategy, prefill_nodes=prefill_nodes, decode_strategy=decode_strategy,
                         decode_nodes=decode_nodes, feature=feature, no_feature=no_feature, kv_offload=kv_offload,
                         sets=set_, advanced=advanced, vllm_version=vllm_version)
        p = build_plan(_tree(recipes_dir), sel)
    except K3Error as err:
        fail(err)
    if json_out:
        typer.echo(p.to_json())
    else:
        from k3launch import show

        show.plan(_console(), p)


@app.command()
def explain(
    flag: Annotated[str, typer.Argument(help="A vllm serve flag (max-num-seqs, --max-num-seqs, -tp) or an env name.")],
    process: Annotated[str | None, typer.Option("--process", help="Only this process id (e.g. decode-1).")] = None,
    recipe: Recipe_ = None, variant: Variant_ = None, hardware: Hardware_ = None, strategy: Strategy_ = None,
    nodes: Nodes_ = None, prefill_strategy: PStrat = None, prefill_nodes: PNodes = None,
    decode_strategy: DStrat = None, decode_nodes: DNodes = None, feature: Feature_ = None, no_feature: NoFeature = None,
    kv_offload: KvOffload = "off", set_: Set_ = None, advanced: Advanced_ = None, vllm_version: VllmVersion = "0.33.0",
    recipes_dir: RecipesDir = None, json_out: JsonOut = False,
) -> None:
    """Show which layers wrote FLAG, in order, and which value runs."""
    STATE.json = json_out
    from k3launch import show
    from k3launch.explain import explain as do_explain
    from k3launch.explain import flag_key
    from k3launch.plan import build_plan

    try:
        sel = _selection(recipe=recipe, variant=variant, hardware=hardware, strategy=strategy, nodes=nodes,
                         prefill_strategy=prefill_strategy, prefill_nodes=prefill_nodes, decode_strategy=decode_strategy,
                         decode_nodes=decode_nodes, feature=feature, no_feature=no_feature, kv_offload=kv_offload,
                         sets=set_, advanced=advanced, vllm_version=vllm_version)
        p = build_plan(_tree(recipes_dir), sel)
        key = flag_key(p, flag)
        items = do_explain(p, flag, process)
    except K3Error as err:
        fail(err)
    if json_out:
        out = {"flag": key, "histories": [{"processes": h.processes, "final": h.final,
                                           "entries": [e.model_dump() for e in h.entries]} for h in items]}
        typer.echo(json.dumps(out, indent=2))
    else:
        show.history(_console(), items, key)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lint(
    ctx: typer.Context,
    vllm_version: VllmVersion = "0.33.0",
    json_out: JsonOut = False,
) -> None:
    """Check a pasted command: k3launch lint -- vllm serve MODEL --flag ... (exit 1 on findings)."""
    STATE.json = json_out
    from k3launch import show
    from k3launch.lint import ERROR
    from k3launch.lint import lint as do_lint
    from k3launch.schema import load_schema

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
        show.findings(_console(), found)
    if any(f.severity == ERROR for f in found):
        raise typer.Exit(1)


@recipes_app.callback()
def recipes(ctx: typer.Context, recipes_dir: RecipesDir = None, json_out: JsonOut = False) -> None:
    """List recipes, hardware and strategies of the tree."""
    STATE.json = json_out
    ctx.obj = (recipes_dir, json_out)
    if ctx.invoked_subcommand is not None:
        return
    from k3launch import show

    try:
        tree = _tree(recipes_dir)
        rows: list[tuple[str, str, str]] = []
        broken: list[dict[str, str]] = []
        for rid in tree.model_ids():
            try:
                rec = tree.model(rid)
            except K3Error as err:
                broken.append({"id": rid, **err.as_dict()})
                continue
            rows.append((rid, rec.meta.title, ", ".join(h for h, v in rec.meta.hardware.items() if v == "verified")))
        taxonomy = tree.taxonomy
        strategies = sorted(tree.strategies)
    except K3Error as err:
        fail(err)
    if json_out:
        typer.echo(json.dumps({"root": str(tree.root), "recipes": [{"id": r[0], "title": r[1]} for r in rows],
                               "broken": broken, "hardware": sorted(taxonomy.hardware_profiles), "strategies": strategies}, indent=2))
        return
    console = _console()
    show.recipes_list(console, rows, taxonomy, strategies)
    for b in broken:
        console.print(f"[red]broken[/] {b['id']}: {b['message']}")


@recipes_app.command("show")
def recipes_show(ctx: typer.Context, recipe_id: Annotated[str, typer.Argument(help="org/Model, Model, slug or model id")],
                 json_out: JsonOut = False) -> None:
    """Show one recipe: hardware (verified), strategies, floors, features, variants."""
    recipes_dir, parent_json = ctx.obj or (None, False)
    json_out = json_out or parent_json
    STATE.json = json_out
    from k3launch import show
    from k3launch.resolve import kv_offload_matrix

    try:
        tree = _tree(recipes_dir)
        rid = tree.resolve(recipe_id)
        rec = tree.model(rid)
        taxonomy = tree.taxonomy
        kv_hw = rec.meta.default_hardware or next(iter(taxonomy.hardware_profiles))
        kv = kv_offload_matrix(tree, rec, kv_hw)
    except K3Error as err:
        fail(err)
    if json_out:
        typer.echo(json.dumps({"id": rid, "recipe": rec.model_dump(mode="json"), "kv_offload_support": {kv_hw: kv}}, indent=2))
    else:
        show.recipe_detail(_console(), rid, rec, taxonomy, kv, kv_hw)


def main() -> None:
    """Console entry point: K3Error → exit 2; unexpected errors → one line unless --debug."""
    debug = "--debug" in sys.argv[1:]
    try:
        app()
    except K3Error as err:  # raised outside a command's own handler
        fail_exit = 2
        typer.echo(f"error: {err.message}", err=True)
        if err.hint:
            typer.echo(f"hint: {err.hint}", err=True)
        sys.exit(fail_exit)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # the last line of defence against tracebacks
        if debug:
            raise
        typer.echo(f"internal error: {type(exc).__name__}: {exc}", err=True)
        typer.echo("hint: rerun with --debug for a traceback and report it", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
