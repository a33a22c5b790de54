"""The vendored vLLM 0.32.0 schema and the dumper that produced it (k3launch.planning.schema_dump);
against the real vLLM: test_schema_dump_engine.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from paths import VLLM_DATA

from k3launch.errors import K3Error
from k3launch.planning.layers import RESERVED
from k3launch.planning.ranges_dump import CONSTRAINTS, RULES
from k3launch.planning.schema import LOAD_FORMATS, load_schema, vendored_versions
from k3launch.planning.schema_dump import ENV_VARS, SERVE_FLAGS, check_dumped, dump

if TYPE_CHECKING:
    pass



# What a plan writes into `vllm serve` argvs: the placement's flags (RESERVED) and the usual knobs.
PLAN_FLAGS = sorted({*RESERVED, "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--served-model-name"})


def test_vendored_0_32_0_loads_with_the_plan_flags() -> None:
    assert "0.32.0" in vendored_versions()
    schema = load_schema("0.32.0")
    assert schema.version == "0.32.0"
    for flag in PLAN_FLAGS:
        assert schema.lookup(flag) is not None, f"{flag} is not in vLLM 0.32.0's schema"
    args, problems = schema.parse(["-tp", "2", "--max-model-len", "512", "--port", "8000", "--host", "127.0.0.1"])
    assert not problems
    assert [a.key for a in args] == ["--tensor-parallel-size", "--max-model-len", "--port", "--host"]
    assert "VLLM_CPU_KVCACHE_SPACE" in schema.env_vars and "VLLM_PORT" in schema.env_vars


def test_0_32_0_booleans_are_the_no_form() -> None:
    # vLLM 0.32 negates with --no-X (BooleanOptionalAction); 0.33 renamed 50 pairs to --enable/--disable.
    schema = load_schema("0.32.0")
    args, problems = schema.parse(["--no-enable-prefix-caching", "--enable-expert-parallel"])
    assert not problems
    assert [(a.key, a.polarity, a.legacy) for a in args] == [("--enable-prefix-caching", False, False), ("--enable-expert-parallel", True, False)]


@pytest.mark.parametrize("version", vendored_versions())
def test_check_dumped_reads_what_load_schema_reads(version: str) -> None:
    dumped = check_dumped(VLLM_DATA / version)
    loaded = load_schema(version)
    assert dumped.version == version
    assert dumped.schema.specs == loaded.specs
    assert dumped.schema.env_vars == loaded.env_vars


def _copy(tmp_path: Path, version: str = "0.32.0") -> Path:
    vdir = tmp_path / version
    shutil.copytree(VLLM_DATA / "0.32.0", vdir)
    return vdir


def _edit(path: Path, change: Callable[[Any], None]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=1))


def test_check_dumped_refuses_a_version_mismatch(tmp_path: Path) -> None:
    with pytest.raises(K3Error) as e:
        check_dumped(_copy(tmp_path, "0.31.0"))
    assert e.value.code == "bad-schema-dump" and "vllm_version" in e.value.message


def test_check_dumped_refuses_unsorted_env_vars(tmp_path: Path) -> None:
    vdir = _copy(tmp_path)
    _edit(vdir / ENV_VARS, lambda d: d["env_vars"].reverse())
    with pytest.raises(K3Error, match="sorted"):
        check_dumped(vdir)


def test_check_dumped_refuses_one_spelling_for_two_flags(tmp_path: Path) -> None:
    vdir = _copy(tmp_path)

    def dup(doc: dict[str, list[dict[str, Any]]]) -> None:
        flags = [a for a in doc["actions"] if a.get("dest") == "port"]
        doc["actions"].append({**flags[0], "dest": "port2"})

    _edit(vdir / SERVE_FLAGS, dup)
    with pytest.raises(K3Error, match="--port is an option of both"):
        check_dumped(vdir)


def test_check_dumped_reads_an_optional_load_format_list(tmp_path: Path) -> None:
    vdir = _copy(tmp_path)
    assert (vdir / LOAD_FORMATS).is_file() and check_dumped(vdir).version == "0.32.0"
    _edit(vdir / LOAD_FORMATS, lambda d: d.update(vllm_version="0.31.0"))
    with pytest.raises(K3Error, match=LOAD_FORMATS):
        check_dumped(vdir)
    (vdir / LOAD_FORMATS).unlink()  # a dump by an older k3launch: still a schema
    assert check_dumped(vdir).version == "0.32.0"


def test_check_dumped_reads_an_optional_constraints_file(tmp_path: Path) -> None:
    vdir = _copy(tmp_path)
    assert (vdir / CONSTRAINTS).is_file() and check_dumped(vdir).version == "0.32.0"
    _edit(vdir / CONSTRAINTS, lambda d: d["bounds"]["max_num_seqs"]["limits"][0].update(op="between"))
    with pytest.raises(K3Error, match=CONSTRAINTS):
        check_dumped(vdir)
    (vdir / CONSTRAINTS).unlink()  # a dump by an older k3launch: still a schema (nothing refused by range)
    assert check_dumped(vdir).version == "0.32.0"


def test_check_dumped_refuses_missing_files(tmp_path: Path) -> None:
    vdir = _copy(tmp_path)
    (vdir / ENV_VARS).unlink()
    with pytest.raises(K3Error, match="unreadable"):
        check_dumped(vdir)


def test_dump_refuses_a_missing_interpreter(tmp_path: Path) -> None:
    with pytest.raises(K3Error) as e:
        dump(str(tmp_path / "no-such-python"), tmp_path)
    assert e.value.code == "schema-dump-failed"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is importable here")
def test_dump_refuses_an_interpreter_without_vllm(tmp_path: Path) -> None:
    with pytest.raises(K3Error) as e:
        dump(sys.executable, tmp_path / "out")  # k3launch's own interpreter: no vLLM (and k3launch needs none)
    assert e.value.code == "schema-dump-failed" and "import vllm" in e.value.hint
    assert not any((tmp_path / "out").iterdir())


# ------------------------------------------------------------------ `k3launch schema dump` and the user's schemas
# A stand-in interpreter: `python -c SCRIPT OUT_DIR` writes 0.32.0's files as vLLM VERSION (DROP: a flag left out).
FAKE_PYTHON = """#!{python}
import json, os, sys
out, version, drop = sys.argv[3], {version!r}, {drop!r}
vdir = os.path.join(out, version)
os.makedirs(vdir, exist_ok=True)
for name in ("serve-flags.json", "env-vars.json"):
    doc = json.load(open(os.path.join({data!r}, name)))
    doc["vllm_version"] = version
    if "actions" in doc:
        doc["actions"] = [a for a in doc["actions"] if drop not in a.get("options", [])]
    with open(os.path.join(vdir, name), "w") as f:
        f.write(json.dumps(doc, indent=1))
print("noise before the result line")
print("K3LAUNCH-SCHEMA-DUMP " + json.dumps({{"version": version, "dir": vdir}}))
"""


def fake_python(tmp_path: Path, version: str = "9.9.9", drop: str = "") -> str:
    path = tmp_path / f"python-{version}"
    path.write_text(FAKE_PYTHON.format(python=sys.executable, version=version, drop=drop, data=str(VLLM_DATA / "0.32.0")))
    path.chmod(0o755)
    return str(path)


def test_api_schema_dump_writes_a_version_directory(tmp_path: Path) -> None:
    from k3launch import api

    res = api.schema_dump(fake_python(tmp_path), tmp_path / "out")
    assert (res.version, res.path) == ("9.9.9", tmp_path / "out" / "9.9.9") and not res.used
    assert res.flags == len(load_schema("0.32.0").specs) and res.env_vars == len(load_schema("0.32.0").env_vars)
    assert check_dumped(res.path).version == "9.9.9"
    assert (res.bounded, res.rules, res.rules_missing) == (0, 0, tuple(r["id"] for r in RULES))  # the stand-in writes no constraints


def test_cli_dump_then_plan_with_the_dumped_version(tmp_path: Path) -> None:
    from inventory_helpers import run_cli

    env = {"K3LAUNCH_SCHEMA_DIR": str(tmp_path / "schemas")}
    res = run_cli(["schema", "dump", "--python", fake_python(tmp_path)], tmp_path, env)
    assert res.code == 0, res.stdout + res.stderr
    assert "wrote vLLM 9.9.9's flag schema" in res.stdout and str(tmp_path / "schemas" / "9.9.9") in res.stdout
    assert "--vllm-version 9.9.9" in res.stdout
    res = run_cli(["plan", "--json", "--vllm-version", "9.9.9"], tmp_path, env)
    assert res.code == 0 and res.json()["vllm_version"] == "9.9.9", res.stdout + res.stderr
    res = run_cli(["plan", "--json", "--vllm-version", "9.9.9"], tmp_path)  # elsewhere: not there
    assert res.error()["code"] == "unknown-vllm-version"


def test_a_dumped_schema_comes_before_the_bundled_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from k3launch import api

    monkeypatch.setenv("K3LAUNCH_SCHEMA_DIR", str(tmp_path / "schemas"))
    assert load_schema("0.32.0").lookup("--max-model-len") is not None
    res = api.schema_dump(fake_python(tmp_path, "0.32.0", drop="--max-model-len"))
    assert res.used and res.path == tmp_path / "schemas" / "0.32.0"
    assert load_schema("0.32.0").lookup("--max-model-len") is None  # the user's dump of 0.32.0 wins
    from k3launch.planning.schema import available_versions, dumped_versions

    assert dumped_versions() == ["0.32.0"] and "0.33.0" in available_versions()


@pytest.mark.parametrize("json_out", [False, True])
def test_cli_dump_errors_are_one_line_and_a_hint(tmp_path: Path, json_out: bool) -> None:
    from inventory_helpers import run_cli

    bad = tmp_path / "bad-python"
    bad.write_text(f"#!{sys.executable}\nimport sys\nprint('Traceback (most recent call last):', file=sys.stderr)\n"
                   "print(\"ModuleNotFoundError: No module named 'vllm'\", file=sys.stderr)\nsys.exit(1)\n")
    bad.chmod(0o755)
    for python, says in ((str(tmp_path / "missing"), "no interpreter"), (str(bad), "No module named 'vllm'")):
        res = run_cli(["schema", "dump", "--python", python, *(["--json"] if json_out else [])], tmp_path,
                      {"K3LAUNCH_SCHEMA_DIR": str(tmp_path / "s")})
        if json_out:
            err = res.error()
            assert err["code"] == "schema-dump-failed" and says in err["message"] and "\n" not in err["message"]
        else:
            assert res.code == 2 and res.stdout == ""
            lines = res.stderr.splitlines()
            assert len(lines) == 2 and lines[0].startswith("error: ") and says in lines[0] and lines[1].startswith("hint: "), lines
