"""The documentation: the README stays short and its links resolve, and every ``docs/<page>.md``
(and section) the code cites exists (the strict mkdocs build, a linter: test_docs_lint.py)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from paths import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_LIMIT = 8000  # bytes, as `wc -c README.md` counts them

# [text](target) and ![alt](target), with an optional "title"; reference definitions `[x]: target`
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
# docs/design.md, or with a section: docs/design.md ("The plan JSON contract") / docs/design.md, "The backend seam"
CITATION = re.compile(r"docs/([\w./-]+\.md)(?:\s*\(\s*\"([^\"]+)\"|,\s*\"([^\"]+)\")?")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def test_every_page_is_in_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert pages, "no pages under docs/"
    assert sorted(nav) == pages, f"in nav, not in docs/: {sorted(set(nav) - set(pages))}; in docs/, not in nav: {sorted(set(pages) - set(nav))}"


def test_readme_is_short() -> None:
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes (limit {README_LIMIT}): move the detail into docs/"


def _links(markdown: str) -> list[str]:
    text = FENCE.sub("", markdown)  # commands in code blocks are not links
    text = re.sub(r"`[^`\n]*`", "", text)
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def test_readme_links_resolve() -> None:
    links = [t for t in _links(README.read_text()) if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", t)]  # not http:, mailto:, #anchor
    assert links, "README.md links to nothing in the repository (it should link into docs/)"
    missing = [t for t in links if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def _citations() -> list[tuple[Path, str, str | None]]:
    found = []
    sources = [*sorted((ROOT / "k3launch").rglob("*.py")), *sorted(p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_docs.py")]
    for path in sources:
        text = " ".join(path.read_text().split())  # a citation may wrap across docstring lines
        for m in CITATION.finditer(text):
            found.append((path, m.group(1), m.group(2) or m.group(3)))
    return found


def test_cited_docs_pages_and_sections_exist() -> None:
    cites = _citations()
    assert cites, "no docs/<page>.md citation found in the code (k3launch/models/plan.py cites docs/design.md)"
    problems = []
    for path, page, section in cites:
        where = path.relative_to(ROOT)
        target = DOCS / page
        if not target.is_file():
            problems.append(f"{where}: docs/{page} does not exist")
            continue
        if section is not None:
            headings = {re.sub(r"`", "", h).strip().lower() for h in HEADING.findall(FENCE.sub("", target.read_text()))}
            if section.strip().lower() not in headings:
                problems.append(f"{where}: docs/{page} has no section {section!r}")
    assert not problems, "\n".join(problems)
