"""The test suite's own layout: each module in the folder of its tier (tests/support/tiers.py), each
fixture defined once, no test module importing another (what they share is in tests/support).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from paths import TESTS
from tiers import folder_of, misfiled

FOLDERS = ("fast", "lint", "e2e/local", "e2e/ssh", "e2e/slurm", "e2e/podman", "engine")


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "infra" not in p.relative_to(TESTS).parts)


def _is_fixture(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Attribute) and target.attr == "fixture") or (isinstance(target, ast.Name) and target.id == "fixture")


def test_every_tier_folder_has_its_conftest_and_test_modules_sit_only_there() -> None:
    for folder in FOLDERS:
        assert (TESTS / folder / "conftest.py").is_file(), folder
    tests = [p.relative_to(TESTS) for p in TESTS.rglob("test_*.py")]
    assert len(tests) > 100
    assert [p for p in tests if p.parent.as_posix() not in FOLDERS] == []
    assert len({p.name for p in tests}) == len(tests)  # pytest imports them by their bare names (no packages)


def test_a_test_is_refused_outside_the_folder_its_markers_name() -> None:
    assert [folder_of(m) for m in ([], ["lint"], ["e2e"], ["e2e", "ssh"], ["e2e", "slurm"], ["e2e", "podman"], ["e2e", "engine"],
                                   ["e2e", "engine", "ssh", "podman"], ["e2e", "ssh", "podman"], ["upstream", "parametrize"])] == [
        "fast", "lint", "e2e/local", "e2e/ssh", "e2e/slurm", "e2e/podman", "engine", "engine", "e2e/ssh", "fast"]

    def item(path: str, marks: list[str]) -> SimpleNamespace:
        return SimpleNamespace(nodeid=f"{path}::t", path=TESTS / path, iter_markers=lambda: iter(SimpleNamespace(name=m) for m in marks))

    assert misfiled([item("fast/test_a.py", ["parametrize"]), item("e2e/ssh/test_b.py", ["e2e", "ssh"]),
                     item("engine/test_c.py", ["e2e", "engine", "slurm"]), SimpleNamespace(path=TESTS.parent / "x.py")], TESTS) == []
    assert misfiled([item("fast/test_a.py", ["e2e"]), item("test_b.py", []), item("e2e/local/test_c.py", ["e2e", "slurm"]),
                     item("lint/test_d.py", [])], TESTS) == [
        "fast/test_a.py::t: its markers put it in tests/e2e/local/, not tests/fast/",
        "test_b.py::t: its markers put it in tests/fast/, not tests/",
        "e2e/local/test_c.py::t: its markers put it in tests/e2e/slurm/, not tests/e2e/local/",
        "lint/test_d.py::t: its markers put it in tests/fast/, not tests/lint/"]


def test_each_fixture_is_defined_once() -> None:
    """One home per fixture: two definitions of a name would make a test's fixture depend on its folder."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(_is_fixture(d) for d in node.decorator_list):
                where[node.name].append(str(path.relative_to(TESTS)))
    assert {"procs", "ssh_hosts", "k3", "pair", "state_cli"} <= set(where)
    assert {name: files for name, files in where.items() if len(files) > 1} == {}


def test_no_test_module_imports_another() -> None:
    """What test modules share lives in tests/support; a test module imported by another would also
    register its fixtures twice."""
    tests = {p.stem for p in TESTS.rglob("test_*.py")}
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(TESTS)}: {n}" for n in names if n.split(".")[0] in tests]
    assert found == []
