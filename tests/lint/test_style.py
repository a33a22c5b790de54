"""The code style gates run as part of the suite: ruff clean, mypy --strict clean, the import
contracts kept. The linters carry the ``lint`` marker: ``-m "not e2e and not lint"`` is the inner
loop without them (the checks that need no linter: test_style_unit.py)."""

from __future__ import annotations

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
                     "No import cycles inside planning, campaign and the controller's two rooms"):
        assert contract in out.stdout  # the seams' contracts are among those checked
