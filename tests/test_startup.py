"""What a command loads at start-up: structure, not time (the figures are benchmarks/bench_startup.py).

Each check runs in a fresh interpreter, since this test process has imported everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Never loaded to start the CLI or to plan: the deployment and campaign layers, and their heavy dependencies.
NOT_AT_START = ("k3launch.campaign", "k3launch.deploy", "k3launch.transport", "k3launch.render", "k3launch.sim",
                "matplotlib", "paramiko", "fabric", "invoke", "hostlist")
# Modules whose pydantic models are built on first use (``defer_build``), never at import.
DEFERRED_MODEL_MODULES = ("k3launch.models.recipe", "k3launch.models.plan", "k3launch.models.record", "k3launch.models.bench",
                          "k3launch.planning.inventory")

_REPORT = """
import json, sys
from pydantic import BaseModel

def built(*names):
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
    """Registering every command imports no planning, deployment or campaign code, and builds no recipe/plan model."""
    res = _run("""
        import k3launch.cli
        result = {"built": built("k3launch.models.recipe", "k3launch.models.plan")}
    """)
    assert _loaded(res["modules"], (*NOT_AT_START, "k3launch.api", "k3launch.planning")) == []
    assert res["built"] == []


def test_plan_json_loads_only_planning() -> None:
    """``plan --json`` imports planning and models only, and builds no model it does not validate."""
    res = _run("""
        import contextlib, io
        from k3launch.cli import app

        with contextlib.redirect_stdout(io.StringIO()) as out:
            app(["plan", "--json"], prog_name="k3launch", standalone_mode=False)
        plan = json.loads(out.getvalue())
        result = {"name": [plan["name"]], "built": built("k3launch.planning.inventory", "k3launch.models.recipe")}
    """)
    assert res["name"][0].startswith("kimi-k3-")
    assert _loaded(res["modules"], (*NOT_AT_START, "rich", "k3launch.planning.lint", "k3launch.planning.explain")) == []
    built = set(res["built"])
    assert {"k3launch.models.recipe.Recipe", "k3launch.models.recipe.Taxonomy", "k3launch.models.recipe.Strategy"} <= built
    # no --inventory: no inventory model is built; the KV store files are not read without Mooncake
    assert not [b for b in built if b.startswith("k3launch.planning.inventory.") or b.startswith("k3launch.models.recipe.KvStore")]


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
