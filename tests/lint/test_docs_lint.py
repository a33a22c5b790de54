"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a bad anchor or a page
missing from ``nav`` fails it). A linter: marker ``lint`` (the README and cited pages: test_docs.py).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT


@pytest.mark.lint
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """A broken link or anchor, or a page missing from nav, fails the build (mkdocs.yml: validation)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                          "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").is_file()
