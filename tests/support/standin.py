"""Stand-in node tools and Hugging Face caches for the doctor's and the weights tests.

* :func:`tools`: a copy of ``tests/infra/standin/`` (nvidia-smi, ibstat, lsmod, ip, date,
  all_reduce_perf, mpirun, vllm) with its ``standin.conf`` knobs; :func:`node_path` is the PATH to
  give a node through the inventory's ``env`` so the doctor's probe finds them first.
* :func:`two_nodes`: an inventory of two local nodes, each with a Hugging Face cache of its own.
* :func:`hf_cache`: a hub cache holding a small model in the real layout
  (``models--ORG--NAME/{refs/main, blobs/, snapshots/COMMIT/}``, snapshot files symlinked to
  blobs), with a safetensors index and shards whose headers are real; :func:`model_dir` the same
  files as a plain directory (what ``save_pretrained`` writes).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import yaml
from paths import TESTS

STANDIN = TESTS / "infra" / "standin"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tools(where: Path, **knobs: str | int | float) -> Path:
    """The stand-in tools in ``where`` (created), configured by ``knobs`` (``K3S_MTU=9000`` ...)."""
    where.mkdir(parents=True, exist_ok=True)
    for f in STANDIN.iterdir():
        if f.name != "README.md":
            shutil.copy2(f, where / f.name)
    (where / "standin.conf").write_text("".join(f"{k}='{v}'\n" for k, v in knobs.items()))
    return where


def node_path(where: Path) -> str:
    return f"{where}:{SYSTEM_PATH}"


def shard(tensors: int = 2, floats: int = 64, index: int = 0) -> bytes:
    """A safetensors file: 8-byte header length, the JSON header, the tensors' bytes (``index``
    makes each shard's bytes its own: the cache stores one blob per distinct content)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", "shard": str(index)}}
    for i in range(tensors):
        header[f"layer.{i}.weight"] = {"dtype": "F32", "shape": [floats], "data_offsets": [i * 4 * floats, (i + 1) * 4 * floats]}
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + bytes(4 * floats * tensors)


TENSOR_BYTES = 2 * 64 * 4  # a default shard's tensors: 2 x 64 F32, what the index's total_size counts per shard


def files(shards: int = 2) -> dict[str, bytes]:
    """The model's files: config.json, the index, the shards."""
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {f"s{i}.layer.{t}.weight": name for i, name in enumerate(names) for t in range(2)}
    out = {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}).encode(),
        "model.safetensors.index.json": json.dumps({"metadata": {"total_size": TENSOR_BYTES * shards}, "weight_map": weight_map}).encode(),
    }
    out.update({name: shard(index=i) for i, name in enumerate(names)})
    return out


def hf_cache(hub: Path, model: str = "moonshotai/Kimi-K3", shards: int = 2, commit: str = COMMIT, ref: str = "main") -> Path:
    """A hub cache in ``hub`` holding ``model``; returns the snapshot directory."""
    repo = hub / f"models--{model.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    for name, data in files(shards).items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path("../../blobs") / blob.name)
    return snap


def model_dir(where: Path, shards: int = 2) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    for name, data in files(shards).items():
        (where / name).write_bytes(data)
    return where


def truncate(snapshot: Path, name: str = "model-00002-of-00002.safetensors", cut: int = 64) -> None:
    """Cut the last ``cut`` bytes of a shard (its blob), as an interrupted download leaves it."""
    blob = (snapshot / name).resolve()
    blob.write_bytes(blob.read_bytes()[:-cut])


def nodes_inventory(tmp: Path, caches: dict[str, Path], env: dict[str, str] | None = None) -> Path:
    """A local inventory of the simulated engine, one node per entry of ``caches`` with ``HF_HOME`` there."""
    inv: dict[str, Any] = {
        "name": "weights-test",
        "backend": "local",
        "hardware": "b300",
        "engine": "sim",
        "defaults": {"runtime": "bare", "iface": "lo", "cpu_memory_gb": 4096},
        "nodes": [
            {"name": n, "address": f"127.0.0.{21 + i}", "env": {**(env or {}), "HF_HOME": str(c)}}
            for i, (n, c) in enumerate(caches.items())
        ],
        "router": {"node": "login", "address": "127.0.0.1"},
    }
    path = tmp / "inv.yaml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def two_nodes(tmp: Path, env: dict[str, str] | None = None) -> tuple[Path, dict[str, Path]]:
    """(inventory, node -> HF_HOME) of two nodes whose caches are still empty: ``hf_cache`` fills one."""
    caches = {"w-1": tmp / "hf-1", "w-2": tmp / "hf-2"}
    return nodes_inventory(tmp, caches, env), caches
