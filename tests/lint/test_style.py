"""The code style gates run as part of the suite: ruff clean, mypy --strict clean, the import
contracts kept. The linters carry the ``lint`` marker: ``-m "not e2e and not lint"`` is the inner
loop without them (the checks that need no linter: test_style_unit.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.lint
@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.prefix) / "bin" / "ruff").exists(), reason="ruff not installed")
def test_ruff_clean() -> None:
    out = _run("ruff", "check", "k3launch", "tests", "benchmarks")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.lint
def test_mypy_strict_clean() -> None:
    out = _run("mypy")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.lint
def test_import_layers_hold() -> None:
    """The import-linter contracts of pyproject.toml (the layers of docs/design.md)."""
    pytest.importorskip("importlinter")
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "7 kept, 0 broken" in out.stdout, out.stdout[-2000:]
    for contract in ("reached through the registry only", "The CLI goes through the API", "Campaigns go through the API",
                     "No import cycles among the modules of any package"):
        assert contract in out.stdout  # the seams' contracts are among those checked


@pytest.mark.lint
@pytest.mark.parametrize("hidden", ["none", "type_checking", "function"])
def test_the_no_cycles_contract_sees_cycles_hidden_in_type_checking_blocks_and_functions(tmp_path: Path, hidden: str) -> None:
    """pyproject.toml's no-cycles contract, run on a stand-in ``k3launch`` whose only cycle sits two
    packages down and is closed by an ``if TYPE_CHECKING:`` import and an import inside a function:
    the contract is broken, and kept once either of the two imports is gone."""
    pytest.importorskip("importlinter")
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "acyclic_siblings")
    session = {k: v for k, v in config.items() if k != "contracts"}
    lines = [f"{k} = {v!r}".replace("False", "false").replace("True", "true") for k, v in session.items()]
    lines += ["[[tool.importlinter.contracts]]", *(f"{k} = {v!r}" for k, v in contract.items())]
    (tmp_path / "pyproject.toml").write_text("[tool.importlinter]\n" + "\n".join(lines).replace("'", '"') + "\n")
    deep = tmp_path / "k3launch" / "outer" / "inner"
    deep.mkdir(parents=True)
    for init in (tmp_path / "k3launch", deep.parent, deep):
        (init / "__init__.py").write_text("")
    a = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from k3launch.outer.inner.b import f\n"
    b = "def f() -> None:\n    from k3launch.outer.inner.a import TYPE_CHECKING  # noqa: F401\n"
    (deep / "a.py").write_text("" if hidden == "type_checking" else a)
    (deep / "b.py").write_text("" if hidden == "function" else b)
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()", "--no-cache"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    if hidden == "none":
        assert out.returncode == 1 and "No cycles are allowed in k3launch.outer.inner." in out.stdout, out.stdout + out.stderr
    else:
        assert out.returncode == 0 and "1 kept, 0 broken" in out.stdout, out.stdout + out.stderr
