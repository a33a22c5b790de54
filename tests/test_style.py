"""The code style gates run as part of the suite: ruff clean and mypy --strict clean. The linters
carry the ``lint`` marker: ``-m "not e2e and not lint"`` is the inner loop without them."""

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


def test_modules_stay_small() -> None:
    """Modules stay under ~400 lines so each reads in one sitting."""
    big = {p.name: n for p in (ROOT / "k3launch").rglob("*.py") if (n := len(p.read_text().splitlines())) > 420}
    assert not big, big


def test_a_test_starting_infrastructure_must_carry_its_markers() -> None:
    """conftest.py refuses a run in which a test uses an infrastructure fixture (tests/support/tiers.py)
    without its markers: ``-m "not e2e"`` must never start sshd hosts, Slurm or podman; and one in
    which a linter (``lint``) would leave the fast tier."""
    from types import SimpleNamespace

    from tiers import misplaced_lint, missing_markers

    def item(name: str, fixtures: list[str], marks: list[str]) -> SimpleNamespace:
        return SimpleNamespace(nodeid=name, fixturenames=fixtures, iter_markers=lambda: iter(SimpleNamespace(name=m) for m in marks))

    assert missing_markers([item("unit", ["tmp_path"], []), item("ok", ["ssh_hosts", "tmp_path"], ["e2e", "ssh", "parametrize"]),
                            item("closure", ["k3", "podman_env"], ["podman", "e2e"])]) == []
    assert missing_markers([item("t::a", ["cluster", "slurm_cluster"], ["e2e"]), item("t::b", ["procs"], []),
                            item("t::c", ["podman_env", "ssh_hosts"], ["e2e", "ssh"])]) == [
        "t::a: uses slurm_cluster but is not marked slurm", "t::b: uses procs but is not marked e2e",
        "t::c: uses podman_env, ssh_hosts but is not marked podman"]
    assert misplaced_lint([item("ok", ["tmp_path"], ["lint"]), item("e2e", [], ["e2e"])]) == []
    assert misplaced_lint([item("t::d", [], ["lint", "e2e"]), item("t::e", ["procs"], ["lint"])]) == [
        "t::d: is marked lint, so it belongs to the fast tier: not e2e, no infrastructure",
        "t::e: is marked lint, so it belongs to the fast tier: not e2e, no procs"]
