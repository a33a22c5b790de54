"""The simulated engine's command line without a server: argparse errors, settings vLLM refuses
(exit 1), the GPU count knob, an unknown fault knob, and that it imports only the standard library
and the schema (the engine serving: test_sim.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from simproc import FAST_ENV, MODEL, SIM


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SIM, MODEL, *args], capture_output=True, text=True, timeout=20, env={**FAST_ENV, **(env or {})})


# -- argv ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag"),
        (["--no-enable-prefix-caching"], "unrecognized arguments: --no-enable-prefix-caching"),  # legacy, not in 0.33
        (["--dtype", "fp9"], "argument --dtype: invalid choice: 'fp9' (choose from 'auto', "),
        (["--port", "http"], "argument --port: invalid int value: 'http'"),
        (["--tensor-parallel-size"], "argument --tensor-parallel-size/-tp: expected one argument"),
        (["--kv-transfer-config", "{nope"], "argument --kv-transfer-config: invalid loads value"),
    ],
)
def test_bad_flag_is_an_argparse_error(args: list[str], message: str) -> None:
    out = _run(*args)
    assert out.returncode == 2
    assert out.stderr.startswith("usage: vllm serve ")
    assert f"vllm serve: error: {message}" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "2", "--node-rank", "2", "-tp", "16"], "node_rank (2) must be in [0, nnodes)"),
        (["--nnodes", "2", "--node-rank", "0", "-tp", "16", "--headless"], "--headless is not allowed on node_rank 0"),
        (["--nnodes", "2", "--node-rank", "1", "-tp", "16"], "node_rank 1 > 0 requires --headless"),
        (["-dp", "4", "-dpl", "8"], "data_parallel_size_local (8) must be <= data_parallel_size (4)"),
        (["-dp", "16", "-dpl", "8", "-dpr", "12", "--headless"], "data_parallel_start_rank (12) + data_parallel_size_local (8)"),
        (["-dp", "16", "-dpl", "8", "-dpr", "8"], "data_parallel_start_rank is only applicable in headless"),
        (["-tp", "16"], "this node needs 16 GPUs"),
        (["-tp", "4", "-dp", "4"], "this node needs 16 GPUs"),
    ],
)
def test_settings_vllm_refuses_exit_1(args: list[str], message: str) -> None:
    out = _run(*args)
    assert out.returncode == 1, out.stdout + out.stderr
    assert message in out.stdout
    assert "ValueError: " in out.stderr


def test_gpu_count_comes_from_the_knob() -> None:
    out = _run("-tp", "8", env={"K3LAUNCH_SIM_GPUS": "4"})
    assert out.returncode == 1 and "only 4 are available" in out.stdout


def test_sim_imports_only_the_stdlib_and_the_schema() -> None:
    """The sim runs inside minimal engine images: no third-party import may creep in."""
    code = (
        "import sys; before = set(sys.modules); import k3launch.sim.cli, k3launch.sim.runner; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    new = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True).stdout.split()
    third_party = {m for m in new if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "k3launch"}
    ours = {m for m in new if m.startswith("k3launch") and not m.startswith("k3launch.sim")}
    assert not third_party
    assert ours == {"k3launch", "k3launch.defaults", "k3launch.planning", "k3launch.planning.schema", "k3launch.errors"}


def test_unknown_fault_knob_is_refused() -> None:
    out = _run(env={"K3LAUNCH_SIM_FAIL": "explode"})
    assert out.returncode == 2 and "K3LAUNCH_SIM_FAIL='explode'" in out.stderr
