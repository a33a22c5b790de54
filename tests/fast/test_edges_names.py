"""Names k3launch derives or refuses: an inventory's own name is free text and never refused as
a file name; a refused ``--name`` says it was ``--name``; the default name has the documented form."""

from __future__ import annotations

import re
from pathlib import Path

from inventory_helpers import INVENTORIES, ROOT, run_cli, write_yaml

from k3launch.deploy.state import StateStore
from k3launch.util.names import as_name, is_name


def _renamed_local(tmp_path: Path, name: str) -> Path:
    text = (INVENTORIES / "local.yaml").read_text().replace("name: local\n", f"name: {name}\n", 1)
    return write_yaml(tmp_path, text, "lab.yaml")


def test_an_inventory_named_in_capitals_can_be_planned(tmp_path: Path) -> None:
    inv = _renamed_local(tmp_path, "labA")
    res = run_cli(["plan", "-i", str(inv), "--state-dir", str(tmp_path / "state")], tmp_path)
    assert res.code == 0, res.stdout + res.stderr
    res = run_cli(["plan", "--json", "-i", str(inv), "--state-dir", str(tmp_path / "state")], tmp_path)
    assert res.code == 0 and is_name(res.json()["name"]) and res.json()["inventory"] == "labA", res.stdout


def test_any_inventory_name_has_its_own_probe_file(tmp_path: Path) -> None:
    st = StateStore(tmp_path)
    names = ["labA", "laba", "lab A/../x", "Ünïcode", "-x", "." * 100]
    files = [st.probe_path(n) for n in names]
    assert all(f.parent == tmp_path / "weights-probe" and is_name(f.stem) for f in files), files
    assert len(set(files)) == len(names)  # labA and laba do not share one
    assert st.probe_path("local").name == "local.json"  # a plain word stays itself: probes saved before still read


def test_as_name_is_a_plain_word_for_any_text() -> None:
    for text in ["labA", "", "a" * 200, "DeepSeek-V3.1", "--", "x y"]:
        assert is_name(as_name(text)), text
    assert as_name("k3-lab") == "k3-lab"


def test_a_refused_name_says_it_came_from_name(tmp_path: Path) -> None:
    err = run_cli(["plan", "--json", "--name", "labA"], tmp_path).error()
    assert err["code"] == "bad-name" and err["message"].startswith("--name 'labA'"), err


def test_the_default_name_has_the_documented_form(tmp_path: Path) -> None:
    documented = re.search(r"`--name` \|[^|]*\(default `([^`]+)`", (ROOT / "docs" / "planning.md").read_text())
    assert documented, "docs/planning.md documents the default name"
    form = documented.group(1)  # <model>-<strategy>-<hardware>-<hash>, e.g.
    pattern = re.escape(form).replace(re.escape("<model>"), "kimi-k3").replace(re.escape("<strategy>"), "(tp|tep|dep|pd)")
    pattern = pattern.replace(re.escape("<hardware>"), "b300").replace(re.escape("<hash>"), "[0-9a-f]{6}")
    for strategy in ["single_node_tp", "multi_node_tep"]:
        res = run_cli(["plan", "--json", "--strategy", strategy], tmp_path)
        assert res.code == 0, res.stderr
        assert re.fullmatch(pattern, res.json()["name"]), (form, res.json()["name"])


def test_the_digests_of_names_and_cache_keys_are_sha256_without_openssl() -> None:
    """k3launch.util.digest gives hashlib's SHA-256 (plan names, the YAML cache's keys stay as they
    were) from CPython's own implementation where it has one."""
    import hashlib

    from k3launch.util.digest import sha256

    for data in (b"", b"kimi-k3-tep-b300", bytes(range(256)) * 65):
        assert sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()
