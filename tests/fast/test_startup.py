"""What a command loads at start-up: structure, not time (the figures are benchmarks/bench_startup.py).

Each check runs in a fresh interpreter, since this test process has imported everything already.
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import typer.main
from paths import ROOT

from k3launch.cli import COMMANDS, app

# Never loaded to start the CLI or to plan: the deployment and campaign layers, and their heavy dependencies.
NOT_AT_START = ("k3launch.campaign", "k3launch.deploy", "k3launch.transport", "k3launch.render", "k3launch.sim",
                "matplotlib", "paramiko", "fabric", "invoke", "hostlist")
# The modules of the commands defined outside k3launch.cli, and the renderings and writers commands
# import: each loaded only when a command that needs it runs (or shows its own help).
COMMAND_MODULES = ("k3launch.cli.campaign", "k3launch.cli.deploy", "k3launch.cli.recipes", "k3launch.cli.schema",
                   "k3launch.cli.weights", "k3launch.cli.show_plan", "k3launch.cli.show_deploy", "k3launch.cli.show_campaign",
                   "k3launch.cli.show_progress", "k3launch.cli.writeout")
# Modules whose pydantic models are built on first use (``defer_build``), never at import.
DEFERRED_MODEL_MODULES = ("k3launch.models.recipe", "k3launch.models.plan", "k3launch.models.record", "k3launch.models.bench",
                          "k3launch.planning.inventory")

_REPORT = """
import json, sys

def built(*names):
    from pydantic import BaseModel  # here: the code under test must be the first to import pydantic, if it does

    out = []
    for name in names:
        mod = sys.modules.get(name)
        for obj in vars(mod).values() if mod else ():
            if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == name and obj.__pydantic_complete__:
                out.append(f"{name}.{obj.__qualname__}")
    return out
"""


def _run(code: str) -> dict[str, list[str]]:
    """Run CODE (which sets ``result``) in a fresh interpreter; return ``result`` and the loaded modules."""
    script = _REPORT + textwrap.dedent(code) + "\nprint(json.dumps({**result, 'modules': sorted(sys.modules)}))\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    data: dict[str, list[str]] = json.loads(proc.stdout.splitlines()[-1])
    return data


def _loaded(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_cli_import_loads_no_command_implementation() -> None:
    """Importing the CLI imports no command's module, no model, no planning, not even pydantic or yaml."""
    res = _run("""
        import k3launch.cli
        result = {}
    """)
    assert _loaded(res["modules"], (*NOT_AT_START, *COMMAND_MODULES, "k3launch.api", "k3launch.planning", "k3launch.models", "pydantic", "yaml")) == []


def test_help_lists_every_command_without_importing_one() -> None:
    """``k3launch --help`` lists every command from its name and one-line help alone: no command's
    module is imported, no command is built, so neither the models nor pydantic are loaded."""
    res = _run("""
        import contextlib, io
        from k3launch.cli import app

        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                app(["--help"], prog_name="k3launch")
            except SystemExit as exc:
                assert exc.code == 0, exc.code
        result = {"out": [out.getvalue()]}
    """)
    listing = res["out"][0]
    assert all(f" {name} " in listing for name in COMMANDS), listing
    assert _loaded(res["modules"], (*NOT_AT_START, *COMMAND_MODULES, "k3launch.planning", "k3launch.models", "pydantic",
                                    "pydantic_core", "yaml")) == []


def test_the_listing_is_each_commands_own_help() -> None:
    """The one-line helps `k3launch --help` shows without importing a command are the commands' own
    (their help up to the first blank line), in the listing's order, and no command is left out."""
    for module in {lazy.module for lazy in COMMANDS.values()}:
        importlib.import_module(module)
    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    assert list(group.commands) == list(COMMANDS)  # a command registered but not listed would come last
    for name, lazy in COMMANDS.items():
        cmd = group.get_command(typer.Context(group), name)
        assert cmd is not None and type(cmd).__name__ != "_Listed", name
        assert cmd.name == name
        assert inspect.cleandoc(cmd.short_help or cmd.help or "").split("\n\n")[0] == lazy.help, name
        assert not cmd.hidden and not cmd.deprecated and not getattr(cmd, "rich_help_panel", None), name  # as listed


def test_plan_json_loads_only_planning() -> None:
    """``plan --json`` imports planning and models only (no other command's module, no rich, no
    logging), and builds no model it does not validate."""
    res = _run("""
        import contextlib, io
        from k3launch.cli import app

        with contextlib.redirect_stdout(io.StringIO()) as out:
            app(["plan", "--json"], prog_name="k3launch", standalone_mode=False)
        plan = json.loads(out.getvalue())
        result = {"name": [plan["name"]], "built": built("k3launch.planning.inventory", "k3launch.models.recipe")}
    """)
    assert res["name"][0].startswith("kimi-k3-")
    # k3launch.util.digest: no OpenSSL binding of k3launch's own; a pydantic that loads one for any model (2.14:
    # pydantic.types -> secrets -> hmac) is the floor every pydantic program pays, so it is not counted
    floor = set(_run("""
        import pydantic

        class M(pydantic.BaseModel):
            x: int

        M(x=1)
        result = {}
    """)["modules"])
    assert _loaded([m for m in res["modules"] if m not in floor],
                   (*NOT_AT_START, *COMMAND_MODULES, "rich", "logging", "k3launch.planning.lint", "k3launch.planning.explain",
                    "k3launch.api.lifecycle", "k3launch.api.nodes", "k3launch.api.catalog", "hashlib", "_hashlib",
                    # no --inventory: the inventory's models are not even defined
                    "k3launch.planning.inventory", "k3launch.models.monitoring")) == []
    built = set(res["built"])
    assert {"k3launch.models.recipe.Recipe", "k3launch.models.recipe.Taxonomy", "k3launch.models.recipe.Strategy"} <= built
    # no --inventory: no inventory model is built; the KV store files are not read (their models not defined) without Mooncake
    assert not [b for b in built if b.startswith("k3launch.planning.inventory.")] and "k3launch.models.kvstore" not in res["modules"]


def test_a_command_imports_its_own_module_only() -> None:
    """Running one command (here `schema dump`'s help) imports its module and no other command's."""
    res = _run("""
        import contextlib, io
        from k3launch.cli import app

        with contextlib.redirect_stdout(io.StringIO()):
            try:
                app(["schema", "dump", "--help"], prog_name="k3launch")
            except SystemExit as exc:
                assert exc.code == 0, exc.code
        result = {}
    """)
    assert "k3launch.cli.schema" in res["modules"]
    assert _loaded(res["modules"], tuple(m for m in COMMAND_MODULES if m != "k3launch.cli.schema")) == []


def test_planning_without_inventory_does_not_import_it() -> None:
    res = _run("""
        import k3launch.planning.build
        result = {}
    """)
    assert _loaded(res["modules"], ("k3launch.planning.inventory", *NOT_AT_START)) == []


def test_models_are_built_on_first_use() -> None:
    """Importing the model modules builds no validator (``defer_build``; default instances would defeat it)."""
    names = ", ".join(repr(m) for m in DEFERRED_MODEL_MODULES)
    res = _run(f"""
        import importlib
        for name in ({names}):
            importlib.import_module(name)
        result = {{"built": built({names})}}
    """)
    assert res["built"] == []


def test_quick_commands_run_without_the_cycle_collector(tmp_path: Path) -> None:
    """`plan` and the group's help run with Python's cyclic garbage collector off and leave it
    nothing to do at exit (k3launch.cli.main); any other command (here `list`) runs with it on."""
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('collector', gc.isenabled(), gc.get_freeze_count() > 0, file=sys.stderr))\n"
            "sys.argv = ['k3launch', *sys.argv[1:]]\n"
            "from k3launch.__main__ import main\n"
            "main()\n")
    for args, expected in ((["plan", "--json"], "collector False True"), (["--help"], "collector False True"),
                           (["list", "--state-dir", str(tmp_path)], "collector True False")):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.splitlines()[-1] == expected, args


def test_the_benchmarks_typer_floor_has_the_options_of_plan() -> None:
    """benchmarks/bench_startup.py compares `plan --json` with a bare Typer app whose command has
    `plan`'s options: the same number of each type, so that the floor costs what Typer costs for it."""
    import ast
    import collections
    import typing

    from k3launch.cli import _build, _here

    _build("plan")
    callback = next(i.callback for i in _here.registered_commands if i.callback is not None and i.callback.__name__ == "plan")
    own = collections.Counter(typing.get_args(p.annotation)[0] if typing.get_origin(p.annotation) is typing.Annotated else p.annotation
                              for p in inspect.signature(callback).parameters.values())
    bench = ast.parse((ROOT / "benchmarks" / "bench_startup.py").read_text())
    kinds = next(n.value.value for n in bench.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "PLAN_OPTION_KINDS"
                 and isinstance(n.value, ast.Constant))
    floor = collections.Counter(eval(kinds, {"Path": Path}))
    assert floor == own, (floor, own)


def test_plan_json_compiles_no_frozen_dataclass_of_its_own() -> None:
    """Every frozen class `plan --json` defines is a ``@record`` (k3launch.util.records: only its
    ``__init__`` compiled at import), but planning.schema's, which the simulated engine's minimal
    image carries without k3launch.util."""
    res = _run("""
        import contextlib, dataclasses, io
        made = []
        process = dataclasses._process_class
        def spy(cls, *args, **kw):
            made.append((cls.__module__ + "." + cls.__qualname__, args[5]))  # (..., frozen, ...)
            return process(cls, *args, **kw)
        dataclasses._process_class = spy
        from k3launch.cli import app

        with contextlib.redirect_stdout(io.StringIO()):
            app(["plan", "--json"], prog_name="k3launch", standalone_mode=False)
        result = {"frozen": [name for name, frozen in made if frozen and name.startswith("k3launch.")]}
    """)
    assert sorted(res["frozen"]) == ["k3launch.planning.schema.Arg", "k3launch.planning.schema.FlagSpec", "k3launch.planning.schema.Problem"]
