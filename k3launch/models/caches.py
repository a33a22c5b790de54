"""Where an engine keeps what makes its next start warm: compile and JIT caches, per node.

A vLLM start spends minutes compiling (torch.compile's Dynamo and Inductor, Triton kernels,
DeepGEMM and FlashInfer JIT, CUDA's own kernel cache) unless it finds the results of an earlier
start. Each tool keeps them in a directory of its own, under the home directory by default, and
a container loses them at exit. k3launch gives every engine process one directory on its node,
``<compile_cache>/<key>``, and points every one of those tools into it (:data:`CACHE_ENV`); a
container gets it mounted at :data:`CONTAINER_CACHE`.

The key names what invalidates the caches: the image (or, on a bare runtime, the node's venv)
and the vLLM version, the model, and the process's parallel layout. Two processes with the same
key share a directory (a restart, a rollout of an unrelated flag, every replica of one layout);
another image or layout starts a directory of its own, so a cache is never reused across what
would make it wrong, and ``k3launch cache ls`` can say what each directory is for. The tools
key their own entries further (vLLM hashes its compile configuration), so a shared directory is
safe; the key is what a person clears by.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import dataclass

from k3launch.models.plan import Host, Plan, Process

DEFAULT_COMPILE_CACHE = "~/.cache/k3launch/compile"
CONTAINER_CACHE = "/root/.cache/k3launch-compile"
OFF = "off"
META = "k3launch.json"  # in each key's directory: what the key stands for (`cache ls`)

# env name -> its subdirectory: every cache a vLLM start fills that would otherwise live in $HOME
CACHE_ENV = {
    "VLLM_CACHE_ROOT": "vllm",  # torch.compile artefacts (torch_compile_cache/<hash>/rank_i_j), vLLM's own
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "CUDA_CACHE_PATH": "cuda",  # the driver's JIT cache of PTX
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "DG_JIT_CACHE_DIR": "deep_gemm",
}

# the flags that change what is compiled: the model's revision, the layout and the numerics
# (others, like --max-num-seqs, only change which of the compiled shapes run)
_LAYOUT_FLAGS = ("--revision", "--tensor-parallel-size", "--data-parallel-size", "--data-parallel-size-local", "--pipeline-parallel-size",
                 "--enable-expert-parallel", "--quantization", "--dtype", "--kv-cache-dtype", "--compilation-config",
                 "--all2all-backend", "--moe-backend", "--attention-backend", "--speculative-config")


def cache_root(host: Host, engine: str) -> str | None:
    """The node's cache root for engine processes, None when caches are off there: an inventory's
    ``compile_cache: off``, or the simulated engine (it compiles nothing) unless the inventory
    names a directory on purpose."""
    if host.compile_cache == OFF or (host.compile_cache is None and engine == "sim"):
        return None
    return (host.compile_cache or DEFAULT_COMPILE_CACHE).rstrip("/")


def _layout(argv: list[str]) -> list[str]:
    out: list[str] = []
    for i, word in enumerate(argv):
        name = word.split("=", 1)[0]
        if name in _LAYOUT_FLAGS:
            value = word.split("=", 1)[1] if "=" in word else (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "")
            out.append(f"{name}={value}" if value else name)
    return sorted(out)


def cache_meta(plan: Plan, proc: Process, host: Host) -> dict[str, object]:
    """What a key stands for (written beside the caches, shown by ``cache ls``)."""
    return {"runs": proc.image or f"bare {host.venv or 'vllm on PATH'}", "vllm_version": plan.vllm_version, "model": plan.model,
            "role": proc.role, "layout": _layout(proc.argv)}


def cache_key(plan: Plan, proc: Process, host: Host) -> str:
    """``<model>-<version>-<hash>``: readable enough to tell apart, unique for what invalidates it."""
    meta = cache_meta(plan, proc, host)
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:12]
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", plan.model.rstrip("/").rsplit("/", 1)[-1])[:40].strip("-.") or "model"
    version = re.sub(r"[^A-Za-z0-9._-]+", "-", plan.vllm_version)[:20]
    return f"{model}-{version}-{digest}"


# ------------------------------------------------------------------ on the nodes (`k3launch cache`)
KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class CacheDir:
    """One key's directory on one node, as ``cache ls`` found it."""

    node: str
    root: str
    key: str
    kb: int  # disk use (du -sk)
    last_used: float  # when an engine last started with it (its k3launch.json), else the directory's mtime
    meta: dict[str, object]  # what the key stands for ({} for a directory k3launch did not write)


def parse_list(node: str, root: str, text: str) -> list[CacheDir]:
    out: list[CacheDir] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("@@"):
            continue
        fields = line[2:].split("\t")
        if len(fields) != 3 or not fields[1].isdigit():
            continue
        meta: dict[str, object] = {}
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if nxt.startswith("{"):
            with contextlib.suppress(ValueError):
                loaded = json.loads(nxt)
                meta = loaded if isinstance(loaded, dict) else {}
        try:
            when = float(fields[2])
        except ValueError:
            when = 0.0
        out.append(CacheDir(node, root, fields[0], int(fields[1]), when, meta))
    return out
