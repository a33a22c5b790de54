"""What the isolation tests of the fault corpus share (the suite beside a user's deployment): the
CLI as a subprocess in the caller's environment plus ``env``, and a small campaign of the
simulated engine on the bundled local inventory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

FAST = {"K3LAUNCH_SIM_LOAD_S": "0.3", "K3LAUNCH_SIM_TTFT_MS": "5", "K3LAUNCH_SIM_ITL_MS": "1"}


def k3(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "k3launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def campaign_file(tmp: Path, name: str, port_base: int, seqs: tuple[int, ...] = (2, 8)) -> Path:
    body: dict[str, object] = {
        "name": name,
        "port_base": port_base,
        "engine_env": FAST,
        "ready_timeout": 60,
        "base": {"strategy": "single_node_tp"},
        "deployments": {"set": {"max-num-seqs": list(seqs)}},
        "load": {"max_concurrency": [1], "input_len": 16, "output_len": 4, "num_prompts": 4},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path
