"""Warm restarts: the compile/JIT cache directory each engine keeps on its node (models.caches),
its key, and ``k3launch cache ls / clear`` (against real processes on this machine:
test_caches_e2e.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from paths import ROOT

from k3launch.api.planning import plan
from k3launch.deploy.ssh import binds
from k3launch.models.caches import cache_key, parse_list
from k3launch.render.scripts import cache_list
from k3launch.render.words import cache_dir

INV = ROOT / "inventories" / "local.yaml"


def _key(**sel: object) -> str:
    p = plan(INV, selection={"recipe": "k3launch/tiny-llama", "strategy": "single_node_tp", **sel})
    proc = p.processes[0]
    return cache_key(p, proc, next(h for h in p.hosts if h.name == proc.node))


def test_the_key_changes_with_what_invalidates_compiled_code_and_only_that() -> None:
    base = _key()
    assert _key(sets=["max-num-seqs=8"]) == base  # a rollout of a scheduling flag starts warm
    assert _key(env=["VLLM_LOGGING_LEVEL=DEBUG"]) == base
    assert _key(image="reg.example/vllm:other") != base  # other code
    assert _key(sets=["dtype=float32"]) != base  # other numerics
    assert _key(vllm_version="0.32.0") != base
    assert _key(sets=["revision=abc123"]) != base != _key(sets=["revision=def456"]) != _key(sets=["revision=abc123"])  # other weights
    assert base.startswith("tiny-llama-0.33.0-") and len(base.rsplit("-", 1)[1]) == 12


def test_the_simulated_engine_keeps_no_cache_unless_the_inventory_names_one() -> None:
    p = plan(INV, selection={"strategy": "single_node_tp"})
    proc, host = p.processes[0], p.hosts[0]
    assert p.engine == "sim" and cache_dir(p, proc, host) is None
    named = host.model_copy(update={"compile_cache": "/srv/cc"})
    assert str(cache_dir(p, proc, named)).startswith("/srv/cc/")
    assert cache_dir(p, proc, named.model_copy(update={"compile_cache": "off"})) is None


def _probe(script: str) -> dict[str, list[str]]:
    """Run the doctor's sections under bash: section name -> its lines."""
    out: dict[str, list[str]] = {}
    for line in subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines():
        if line.startswith("@@"):
            cur = out.setdefault(line[2:], [])
        elif line.strip():
            cur.append(line.strip())
    return out


@pytest.mark.parametrize("runtime", ["bare", "podman", "apptainer"])
def test_the_doctor_probes_every_engines_compile_cache_on_every_runtime_and_a_hostile_one_is_data(tmp_path: Path, runtime: str) -> None:
    """``up`` makes each engine's ``<compile_cache>/<key>`` before it starts (a container's bind source,
    a bare engine's cache variables): the doctor asks whether it can, with a file written (root's
    ``test -w`` says yes on a read-only file system), and creates nothing."""
    p = plan(INV, selection={"recipe": "k3launch/tiny-llama", "strategy": "single_node_tp"})
    proc = p.processes[0]
    base = next(h for h in p.hosts if h.name == proc.node).model_copy(update={"runtime": runtime})
    (tmp_path / "file").write_text("")
    cases = {
        f"{tmp_path}/c c/$(touch {tmp_path}/pwned) 'q\"": ("pass", "does not exist yet; `up` creates it"),
        f"{tmp_path}/file/cc": ("fail", f"does not exist and cannot be created ({tmp_path}/file is not a writable directory)"),
        str(tmp_path): ("pass", "does not exist yet; `up` creates it"),
    }
    for root, (status, detail) in cases.items():
        host = base.model_copy(update={"compile_cache": root})
        sec = _probe(binds.sections(p, host))
        assert ("hfcache" in sec) == (runtime != "bare")  # a bare engine reads no hf_cache mount
        [row] = [c for c in binds.judge(p, host, sec) if c.name == "compile-cache"]
        assert (row.status, row.detail) == (status, f"compile_cache {cache_dir(p, proc, host)} {detail}"), row
        assert bool(row.hint) == (status == "fail") and "`compile_cache:`" in (row.hint or "`compile_cache:`")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["file"]  # nothing made, nothing run
    host = base.model_copy(update={"compile_cache": str(tmp_path)})
    (row,) = [c for c in binds.judge(p, host, {"compilecache": ["unwritable"]}) if c.name == "compile-cache"]
    assert row.status == "fail" and row.detail.endswith("is not writable: the engines keep their compile caches there (warm restarts)")
    off = base.model_copy(update={"compile_cache": "off"})
    assert "compilecache" not in binds.sections(p, off) and not any(c.name == "compile-cache" for c in binds.judge(p, off, {}))


def test_listing_and_clearing_a_hostile_root_is_data(tmp_path: Path) -> None:
    root = tmp_path / "c c" / f"$(touch {tmp_path}/pwned)"
    (root / "k1").mkdir(parents=True)
    (root / "k1" / "k3launch.json").write_text(json.dumps({"model": "m"}) + "\n")
    (root / "k2").mkdir()
    (root / "k2" / "blob").write_bytes(b"x" * 5000)
    out = subprocess.run(["bash", "-c", cache_list(str(root))], capture_output=True, text=True, check=True).stdout
    found = {c.key: c for c in parse_list("n1", str(root), out)}
    assert set(found) == {"k1", "k2"} and found["k1"].meta == {"model": "m"} and found["k2"].meta == {} and found["k2"].kb >= 4
    out = subprocess.run(["bash", "-c", cache_list(str(root), clear=["k2"])], capture_output=True, text=True, check=True).stdout
    assert [c.key for c in parse_list("n1", str(root), out)] == ["k1"] and not (root / "k2").exists()
    subprocess.run(["bash", "-c", cache_list(str(root), clear_all=True)], capture_output=True, text=True, check=True)
    assert root.is_dir() and list(root.iterdir()) == [] and not (tmp_path / "pwned").exists()
