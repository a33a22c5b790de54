"""Warm restarts end to end: ``up`` of a local simulated deployment keeps each engine's compile/JIT
cache in the directory of its key, and ``k3launch cache ls / clear`` find them (the keys and the
commands alone: test_caches.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from e2e_helpers import Cli, local_leftovers

from k3launch.models.caches import CACHE_ENV


@pytest.mark.e2e
def test_up_keeps_each_engines_caches_in_its_key_and_cache_ls_and_clear_find_them(state_cli: Cli, local_inventory: Path,
                                                                                  tmp_path: Path) -> None:
    cli = state_cli
    inv = yaml.safe_load(local_inventory.read_text())
    cc = tmp_path / "compile cache"
    inv["defaults"]["compile_cache"] = str(cc)
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    name = "cc-sim"
    r = cli.run("up", "-i", str(path), "--recipe", "k3launch/tiny-llama", "--strategy", "single_node_tp", "--replicas", "2",
                "--name", name, "--port-base", "23700", "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = cli.record(name)
    engines = {i: p for i, p in rec["processes"].items() if i != "router"}
    envs = {i: dict(kv.split("=", 1) for kv in Path(f"/proc/{p['handle']}/environ").read_bytes().decode().split("\0") if "=" in kv)
            for i, p in engines.items()}
    keys = {i: Path(e["VLLM_CACHE_ROOT"]).parent.name for i, e in envs.items()}
    assert len(set(keys.values())) == 1  # both copies: one layout, one key
    key = next(iter(keys.values()))
    assert all(e[k] == f"{cc}/{key}/{sub}" for e in envs.values() for k, sub in CACHE_ENV.items())
    listed = cli.json("cache", "ls", "-i", str(path))
    assert [c["key"] for c in listed["caches"]] == [key] and listed["unreadable"] == {}  # one machine: listed once
    assert listed["caches"][0]["meta"]["model"] == rec["plan"]["model"] and listed["caches"][0]["meta"]["role"] == "serve"
    d = cli.json("down", name, timeout=60)
    assert d["clean"] is True and local_leftovers(rec) == ({}, [])
    assert (cc / key / "k3launch.json").is_file()  # a cache outlives its deployment: the next `up` starts warm
    cleared = cli.json("cache", "clear", "-i", str(path), "--key", key)
    assert cleared["caches"] == [] and not (cc / key).exists()
