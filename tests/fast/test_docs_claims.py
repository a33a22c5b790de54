"""The docs' claims against the product: error codes, cited tests and benchmarks, measured figures.

* Every error code k3launch raises is listed in docs/troubleshooting.md, and every code listed
  there is one the product raises (read from the source: a ``K3Error``'s first argument, a
  ``code=`` keyword, a lint ``Problem``'s code; codes made with an f-string count by their fixed
  prefix). The simulated engine's own error codes imitate vLLM's and are not k3launch's.
* Every ``error: ... [code]`` line the docs quote names a code the product raises.
* Every test or benchmark the docs and the README cite exists (``tests/x.py::name``: the function too).
* A figure is measured somewhere that reproduces it: each "Measured" section, and each paragraph
  that says "measured" next to a figure, sits in a section that cites a test or a benchmark.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from paths import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))
CODE = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)+|[a-z]{3,}")  # kebab-case, or one word (`replicas`)
CITE = re.compile(r"(?<![\w/])((?:tests|benchmarks)/[\w/]+\.py)(?:::(\w+))?")
FIGURE = re.compile(r"\d(?:\.\d+)?\s?(?:s|ms|%|MB|GB|GiB)\b|\d\.\d+x\b")


def _constants(node: ast.expr, names: dict[str, str]) -> list[str]:
    """The string constants an expression can evaluate to (``"a" if c else "b"`` gives both; a
    module constant, ``CONFLICT = "values-conflict"``, its value)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in names:
        return [names[node.id]]
    if isinstance(node, ast.IfExp):
        return _constants(node.body, names) + _constants(node.orelse, names)
    return []


def _prefix(node: ast.expr) -> str | None:
    """The fixed start of an f-string code (``f"unknown-{kind}"`` -> ``unknown-``)."""
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


@cache
def raised() -> tuple[frozenset[str], frozenset[str]]:
    """(codes, prefixes of f-string codes) the product's source raises, the simulated engine's aside."""
    codes: set[str] = set()
    prefixes: set[str] = set()
    for path in (ROOT / "k3launch").rglob("*.py"):
        if "sim" in path.relative_to(ROOT / "k3launch").parts[:1]:
            continue
        tree = ast.parse(path.read_text())
        names = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                 and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            found: list[ast.expr] = []
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if node.args and (name.endswith("Error") or name in ("Problem", "__init__")):  # an error type's super().__init__
                    found.append(node.args[0])
                found += [k.value for k in node.keywords if k.arg == "code"]
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "code" for t in node.targets):
                found.append(node.value)  # code = "job-cancelled" if ... else "job-ended"
            elif isinstance(node, ast.arguments):  # def __init__(..., code: str = "launch-failed")
                named = [*node.posonlyargs, *node.args][-len(node.defaults):] if node.defaults else []
                found += [d for a, d in zip(named, node.defaults, strict=True) if a.arg == "code"]
                found += [d for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True) if a.arg == "code" and d is not None]
            for expr in found:
                codes.update(c for c in _constants(expr, names) if CODE.fullmatch(c))
                if (p := _prefix(expr)) is not None and p:
                    prefixes.add(p)
    return frozenset(codes), frozenset(prefixes)


@cache
def _literals() -> frozenset[str]:
    """Every string constant of the product's source (a code passed along as a constant, e.g. a
    finding's ``Violation(OUT_OF_RANGE, ...)``, is raised by its own name elsewhere)."""
    return frozenset(n.value for p in (ROOT / "k3launch").rglob("*.py") if "sim" not in p.relative_to(ROOT / "k3launch").parts[:1]
                     for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _is_raised(code: str) -> bool:
    codes, prefixes = raised()
    return code in codes or any(code.startswith(p) for p in prefixes) or code in _literals()


def listed() -> set[str]:
    """The codes in troubleshooting.md's tables (the first column of each ``| code |`` table)."""
    out: set[str] = set()
    in_table = False
    for line in (ROOT / "docs" / "troubleshooting.md").read_text().splitlines():
        if line.startswith("| code |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            out.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return out


def test_the_source_is_read_at_all() -> None:
    codes, prefixes = raised()
    assert {"does-not-fit", "unknown-deployment", "already-supervised", "bad-policy", "process-exited"} <= codes
    assert "unknown-" in prefixes  # unknown-hardware, unknown-strategy, ... are made by one f-string


def test_every_code_the_product_raises_is_in_troubleshooting() -> None:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    missing = sorted(c for c in raised()[0] if f"`{c}`" not in text)
    assert not missing, f"codes raised but not in docs/troubleshooting.md: {missing}"


def test_every_code_troubleshooting_lists_is_raised() -> None:
    table = listed()
    assert len(table) > 150
    assert not sorted(c for c in table if not _is_raised(c)), "codes in docs/troubleshooting.md no code raises"


@pytest.mark.parametrize("page", [*DOCS, ROOT / "README.md"], ids=lambda p: p.name)
def test_quoted_errors_name_codes_the_product_raises(page: Path) -> None:
    quoted = re.findall(r"error: [^\n`]*\[([a-z][a-z0-9-]*)\]", page.read_text())
    assert not [c for c in quoted if not _is_raised(c)]


@pytest.mark.parametrize("page", [*DOCS, ROOT / "README.md"], ids=lambda p: p.name)
def test_every_cited_test_and_benchmark_exists(page: Path) -> None:
    for rel, func in CITE.findall(page.read_text()):
        path = ROOT / rel
        assert path.is_file(), f"{page.name} cites {rel}, which does not exist"
        if func:
            assert re.search(rf"^(?:async )?def {func}\(", path.read_text(), re.M), f"{page.name} cites {rel}::{func}: no such function"


def _sections(text: str) -> list[str]:
    return re.split(r"^(?=#{2,4} )", text, flags=re.M)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_measured_figures_name_what_reproduces_them(page: Path) -> None:
    for sec in _sections(page.read_text()):
        title = sec.splitlines()[0] if sec.strip() else ""
        cites = CITE.findall(sec)
        if re.match(r"#+ Measured\b", title):
            assert cites, f"{page.name} {title!r}: no test or benchmark named"
        for para in re.split(r"\n\s*\n", sec):
            if re.search(r"\b[Mm]easured\b", para) and FIGURE.search(para):
                assert cites, f"{page.name} {title!r}: figures measured, nothing named reproduces them: {para[:120]!r}"
