"""The API's names are listed once, in ``k3launch/api/__init__.py``'s ``if TYPE_CHECKING:`` block
(``from MODULE import NAME as NAME``): type checkers read the imports, and at run time the package
reads the same lines to import each name from its module on first use."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from paths import ROOT

import k3launch.api as api


def _block_imports() -> dict[str, str]:
    """The names the TYPE_CHECKING block imports, as Python reads it (not as the package does)."""
    tree = ast.parse(Path(api.__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING")
    out: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module, ast.dump(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name}: listed as `NAME as NAME`, the form that exports it"
            out[alias.name] = node.module
    return out


def test_the_package_reads_every_name_of_its_one_list() -> None:
    listed = _block_imports()
    assert api._homes() == listed  # a line the package's reading missed would be a name typed but absent at run time
    assert api.__all__ == sorted(listed) and sorted(dir(api)) == sorted(listed)


def test_every_name_resolves_to_the_object_its_module_defines() -> None:
    import importlib

    for name, module in _block_imports().items():
        assert getattr(api, name) is getattr(importlib.import_module(module), name), name


def test_importing_the_api_imports_none_of_its_modules() -> None:
    code = "import sys, k3launch.api; print(sorted(m for m in sys.modules if m.startswith('k3launch.api.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    code = "import sys; from k3launch import api; api.plan; print(sorted(m for m in sys.modules if m.startswith('k3launch.api.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['k3launch.api._common', 'k3launch.api.planning']", out.stdout
