"""The YAML parse cache (k3launch.util.yamlio): keyed by a file's bytes, never stale, best effort,
and a hit never imports PyYAML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from k3launch.errors import K3Error
from k3launch.util import yamlio


class Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    nodes: list[int] = []
    by_size: dict[int, str] = {}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("K3LAUNCH_CACHE_DIR", str(d))
    return d / "yaml"


def entries(cache: Path) -> list[Path]:
    return sorted(cache.iterdir()) if cache.is_dir() else []


def test_a_file_parsed_once_is_read_from_the_cache_with_the_same_values(cache: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("name: a\nnodes: [1, 2]\nby_size: {8: eight}\n")
    first = yamlio.load_yaml_model(f, Doc)
    assert len(entries(cache)) == 1
    monkeypatch.setattr(yamlio, "_parse", lambda *a: pytest.fail("parsed again"))
    again = yamlio.load_yaml_model(f, Doc)
    assert again == first and again.by_size == {8: "eight"}  # int keys survive (marshal, not JSON)


def test_an_edited_file_is_another_key_and_a_schema_error_still_has_its_line(cache: Path, tmp_path: Path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("name: a\n")
    assert yamlio.load_yaml_model(f, Doc).name == "a"
    f.write_text("name: b\nnodez: [1]\n")
    with pytest.raises(K3Error) as info:  # validation runs on every load, cached or not
        yamlio.load_yaml_model(f, Doc)
    assert info.value.message.endswith("a.yaml:2: unknown key 'nodez'")
    with pytest.raises(K3Error):
        yamlio.load_yaml_model(f, Doc)  # the second time from the cache: the same refusal
    f.write_text("name: c\n")
    assert yamlio.load_yaml_model(f, Doc).name == "c"


def test_a_refused_file_is_never_cached_and_refused_each_time(cache: Path, tmp_path: Path) -> None:
    f = tmp_path / "dup.yaml"
    f.write_text("name: a\nname: b\n")
    for _ in range(2):
        with pytest.raises(K3Error) as info:
            yamlio.load_yaml_model(f, Doc)
        assert info.value.code == "duplicate-key"
    assert entries(cache) == []


def test_a_damaged_entry_or_an_unwritable_cache_is_a_miss(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("name: a\n")
    yamlio.load_yaml_model(f, Doc)
    (entry,) = entries(cache)
    entry.write_bytes(b"\x00garbage")
    assert yamlio.load_yaml_model(f, Doc).name == "a"
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("K3LAUNCH_CACHE_DIR", str(blocker))  # a file where the directory would be
    assert yamlio.load_yaml_model(f, Doc).name == "a"
    monkeypatch.setenv("K3LAUNCH_CACHE_DIR", "off")
    assert yamlio.load_yaml_model(f, Doc).name == "a"


def test_a_second_plan_imports_no_yaml(tmp_path: Path) -> None:
    """What the cache is for: ``plan --json`` from a warm cache parses nothing and never imports PyYAML."""
    code = ("import sys, contextlib, io\nfrom k3launch.cli import app\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    app(['plan', '--json'], prog_name='k3launch', standalone_mode=False)\n"
            "print(__import__('json').dumps({'yaml': 'yaml' in sys.modules, 'plan': out.getvalue()}))\n")
    env = {**os.environ, "K3LAUNCH_CACHE_DIR": str(tmp_path / "cache")}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
            for _ in range(2)]
    assert [r["yaml"] for r in runs] == [True, False]
    assert runs[0]["plan"] == runs[1]["plan"]  # the same plan, byte for byte


def test_a_file_its_model_refuses_is_not_copied_into_the_cache(cache: Path, tmp_path: Path) -> None:
    """An inventory with a token in an env is refused; its text must not land in the cache either."""
    from k3launch.planning.inventory import Inventory

    f = tmp_path / "inv.yaml"
    f.write_text("name: x\nbackend: ssh\ndefaults: {env: {HF_TOKEN: hf_secret_value}}\nnodes: [{name: a}]\n")
    with pytest.raises(K3Error) as info:
        yamlio.load_yaml_model(f, Inventory, code="bad-inventory")
    assert "looks like a secret" in info.value.message
    assert entries(cache) == []
    ok = tmp_path / "ok.yaml"
    ok.write_text("name: a\n")
    yamlio.load_yaml_model(ok, Doc)
    (entry,) = entries(cache)
    assert entry.stat().st_mode & 0o777 == 0o600 and cache.stat().st_mode & 0o777 == 0o700
