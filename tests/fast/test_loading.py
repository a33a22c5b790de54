"""The inventory chooses how the weights load (k3launch.planning.loading): ``weights.load_format``
and ``weights.load_strategy`` checked against the plan's vLLM version and written into every
engine's argv with provenance, held against the recipe, ``--set`` and hardware locks;
``weights.stage``: the engines read a node-local copy, which the plan asks ``up`` to make."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from inventory_helpers import ROOT, q, run_cli, write_yaml

from k3launch import api
from k3launch.errors import K3Error
from k3launch.planning import loading
from k3launch.planning.compose import Locked
from k3launch.planning.inventory import load_inventory
from k3launch.planning.schema import FlagSchema, load_schema

DATA = ROOT / "k3launch" / "data" / "vllm"
NODES = "nodes:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2}\n"


def inventory(tmp: Path, weights: str, runtime: str = "docker", backend: str = "ssh", env: str = "") -> Path:
    return write_yaml(tmp, f"name: lf\nbackend: {backend}\nhardware: h200\n"
                      f"defaults: {{runtime: {runtime}, iface: ib0, hf_cache: /data/hf{env}}}\n{NODES}weights:\n{weights}")


def plan(inv: Path, tmp: Path, **kw: object) -> api.Plan:
    return api.plan(inv, state_dir=tmp / "state", **kw)


def refusal(inv: Path, tmp: Path, *args: str) -> dict[str, str]:
    return run_cli(["plan", "--json", "-i", str(inv), *args], tmp).error()


# ---------------------------------------------------------------------- argv and provenance
def test_the_inventory_choice_reaches_every_engine_with_its_provenance_and_beats_the_recipe(tmp_path: Path) -> None:
    inv = inventory(tmp_path, "  load_format: SafeTensors\n  load_strategy: prefetch\n")  # vLLM lower-cases the format: so does k3launch
    p = plan(inv, tmp_path, strategy="multi_node_dep")  # DEP: a router fronts the two engines
    engines = [x for x in p.processes if x.role != "router"]
    assert len(engines) == 2
    for proc in engines:
        argv = proc.argv
        assert argv[argv.index("--load-format") + 1] == "safetensors" and argv.count("--load-format") == 1
        assert argv[argv.index("--safetensors-load-strategy") + 1] == "prefetch"
        fmt = proc.provenance["--load-format"]
        assert [(e.layer, e.value, e.origin) for e in fmt] == [
            ("base", "fastsafetensors", "models/moonshotai/Kimi-K3.yaml model.base_args"),
            ("advanced", "safetensors", "inventory lf weights.load_format")]
        assert proc.provenance["--safetensors-load-strategy"][-1].origin == "inventory lf weights.load_strategy"
    router = next(x for x in p.processes if x.role == "router")
    assert "--load-format" not in router.argv
    assert any(n.code == "overridden" and "fastsafetensors (base) overridden by safetensors (advanced)" in n.message for n in p.notices)
    assert p.stage is None and "stage" not in json.loads(p.to_json())
    same = plan(inv, tmp_path, strategy="multi_node_dep", sets=["load-format=safetensors"])  # the same value from --set: no conflict
    assert [x.argv for x in same.processes] == [x.argv for x in p.processes]


def test_a_strategy_alone_is_held_against_the_recipes_load_format(tmp_path: Path) -> None:
    """K3's recipe reads through fastsafetensors, which ignores the strategy: refused, saying who set the format."""
    err = refusal(inventory(tmp_path, "  load_strategy: prefetch\n"), tmp_path)
    assert err["code"] == "load-strategy-ignored" and "fastsafetensors (models/moonshotai/Kimi-K3.yaml model.base_args)" in err["message"]
    assert "inventory lf weights.load_strategy" in err["message"] and "weights.load_format" in err["hint"]
    # on AMD the recipe's hardware layer sets --load-format auto, which reads it
    amd = write_yaml(tmp_path, "name: lf\nbackend: ssh\nhardware: mi355x\ndefaults: {runtime: docker}\n" + NODES
                     + "weights: {load_strategy: eager}\n", "amd.yaml")
    proc = plan(amd, tmp_path).processes[0]
    assert proc.argv[proc.argv.index("--safetensors-load-strategy") + 1] == "eager"


@pytest.mark.parametrize(("weights", "args", "code", "says"), [
    ("  load_format: bogus\n", [], "load-format-unknown", "'bogus' is not a load format of vLLM 0.33.0"),
    ("  load_strategy: sideways\n", [], "load-strategy-unknown", "not a choice of vLLM 0.33.0's --safetensors-load-strategy"),
    ("  load_format: runai_streamer\n  load_strategy: eager\n", [], "load-strategy-ignored", "--load-format runai_streamer does not read it"),
    ("  load_format: safetensors\n", ["--set", "load-format=auto"], "weights-conflict", "--load-format auto (--set load-format=auto, advanced layer)"),
    ("  load_format: auto\n  load_strategy: lazy\n", ["--set", "safetensors-load-strategy=eager"], "weights-conflict", "weights.load_strategy lazy"),
    ("  load_format: auto\n  load_strategy: prefetch\n", ["--set", 'model-loader-extra-config={"enable_multithread_load": true}'],
     "load-strategy-refused", "vLLM refuses it at start"),
    ("  load_format: 'auto --trust'\n", [], "bad-inventory", "not a load format or strategy name"),
])
def test_refusals_are_one_line_with_a_hint(tmp_path: Path, weights: str, args: list[str], code: str, says: str) -> None:
    err = refusal(inventory(tmp_path, weights), tmp_path, *args)
    assert err["code"] == code and says in err["message"] and err["hint"], err
    assert "\n" not in err["message"] and "\n" not in err["hint"]


def test_a_flag_or_a_format_list_the_version_lacks_is_refused(tmp_path: Path) -> None:
    """A dumped vLLM 9.9.9 without --safetensors-load-strategy, and without a load-format list (an older dump)."""
    vdir = tmp_path / "schemas" / "9.9.9"
    vdir.mkdir(parents=True)
    for name in ("serve-flags.json", "env-vars.json"):
        doc = json.loads((DATA / "0.32.0" / name).read_text())
        doc["vllm_version"] = "9.9.9"
        if "actions" in doc:
            doc["actions"] = [a for a in doc["actions"] if "--safetensors-load-strategy" not in a.get("options", [])]
        (vdir / name).write_text(json.dumps(doc))
    env = {"K3LAUNCH_SCHEMA_DIR": str(tmp_path / "schemas")}
    args = ["--vllm-version", "9.9.9", "--json"]
    res = run_cli(["plan", "-i", str(inventory(tmp_path, "  load_strategy: lazy\n")), *args], tmp_path, env)
    err = res.error()
    assert err["code"] == "weights-unsupported" and "vLLM 9.9.9's `vllm serve` has no --safetensors-load-strategy" in err["message"]
    assert "drop weights.load_strategy" in err["hint"]
    err = run_cli(["plan", "-i", str(inventory(tmp_path, "  load_format: safetensors\n")), *args], tmp_path, env).error()
    assert err["code"] == "weights-unsupported" and "no list of vLLM 9.9.9's load formats" in err["message"]
    assert "k3launch schema dump" in err["hint"]
    shutil.copy(DATA / "0.32.0" / "load-formats.json", vdir / "load-formats.json")  # a dump that has it: accepted
    assert run_cli(["plan", "-i", str(inventory(tmp_path, "  load_format: safetensors\n")), *args], tmp_path, env).code == 0


def test_a_hardware_lock_on_the_flag_is_refused() -> None:
    from k3launch.planning.inventory import WeightSource

    inv = load_inventory(ROOT / "inventories" / "h200-pair.yaml").model_copy(update={"weights": WeightSource(load_format="safetensors")})
    with pytest.raises(K3Error) as e:
        loading.check(inv, load_schema(), "moonshotai/Kimi-K3", [Locked("--load-format", "the image reads only fastsafetensors")])
    assert e.value.code == "locked-by-hardware" and "the image reads only fastsafetensors" in e.value.message
    stage, notes = loading.check(inv, load_schema(), "moonshotai/Kimi-K3", [Locked("--moe-backend", "other flag")])
    assert stage is None and notes == []


def test_the_version_check_reads_the_flag_schema_not_a_fixed_list() -> None:
    from k3launch.planning.inventory import WeightSource

    schema = load_schema("0.32.0")
    bare = FlagSchema("0.32.0", [s for s in schema.specs if s.canonical != "--load-format"], schema.env_vars)
    inv = load_inventory(ROOT / "inventories" / "h200-pair.yaml").model_copy(update={"weights": WeightSource(load_format="auto")})
    with pytest.raises(K3Error) as e:
        loading.check(inv, bare, "m")
    assert e.value.code == "weights-unsupported"
    assert loading.check(inv, schema, "m") == (None, [])
    formats = loading.known_formats("0.32.0")
    assert formats is not None and formats.reads_strategy("mistral") and not formats.reads_strategy("fastsafetensors")
    assert not formats.reads_strategy("tensorizer") and "ipc_cache" in formats.loaders  # read from vLLM 0.32.0's registry
    assert loading.known_formats("0.0.1") is None


def test_without_an_inventory_choice_an_ignored_strategy_is_a_notice_and_a_rejected_one_refused(tmp_path: Path) -> None:
    p = api.plan(None, placeholders=True, sets=["safetensors-load-strategy=prefetch"])
    assert any(n.code == "load-strategy-ignored" and "ignored by --load-format fastsafetensors" in n.message for n in p.notices)
    with pytest.raises(K3Error) as e:
        api.plan(None, placeholders=True, sets=["load-format=auto", "safetensors-load-strategy=eager",
                                                  'model-loader-extra-config={"enable_multithread_load":true}'])
    assert e.value.code == "load-strategy-refused"
    ok = api.plan(None, placeholders=True, sets=["load-format=auto", "safetensors-load-strategy=lazy",
                                                   "model-loader-extra-config.enable_multithread_load=true"])
    assert not any(n.code.startswith("load-strategy") for n in ok.notices)


# ---------------------------------------------------------------------- staging
def test_staging_points_the_engines_at_the_node_local_copy(tmp_path: Path) -> None:
    weights = "  path: /lustre/hf\n  shared: true\n  stage: /nvme/k3/\n"
    docker = plan(inventory(tmp_path, weights), tmp_path)
    assert docker.stage is not None and (docker.stage.source, docker.stage.dir) == ("/lustre/hf", "/nvme/k3")
    assert {h.hf_cache for h in docker.hosts if h.role != "router"} == {"/nvme/k3"}  # containers mount it as their HF home
    assert all("HF_HUB_CACHE" not in p.env for p in docker.processes)
    assert json.loads(docker.to_json())["stage"] == {"source": "/lustre/hf", "dir": "/nvme/k3"}
    assert any(n.code == "weights-staged" and "from /lustre/hf to /nvme/k3" in n.message for n in docker.notices)
    bare = plan(inventory(tmp_path, weights, runtime="bare"), tmp_path)
    for proc in (p for p in bare.processes if p.role != "router"):
        assert proc.env["HF_HUB_CACHE"] == "/nvme/k3/hub"
        assert proc.provenance["HF_HUB_CACHE"][-1].origin == "inventory lf weights.stage"
    err = refusal(inventory(tmp_path, weights, runtime="bare", env=", env: {HF_HUB_CACHE: /elsewhere}"), tmp_path)
    assert err["code"] == "weights-conflict" and "HF_HUB_CACHE=/elsewhere (inventory lf env)" in err["message"]


@pytest.mark.parametrize(("weights", "says"), [
    ("  stage: /nvme/k3\n", "weights.stage needs weights.path"),
    ("  path: /lustre\n  stage: relative/dir\n", "must be an absolute directory"),
    ("  path: /lustre\n  stage: /nvme/a:b\n", "without ':' or ','"),
    ("  path: /lustre\n  stage: /lustre/\n", "the copy would be its own source"),
    ("  path: /lustre\n  stage_read_gbps: 5\n", "set weights.stage too"),
    ("  path: " + q("/a\nb") + "\n", "spans lines"),
])
def test_bad_stage_settings_are_refused_with_file_and_line(tmp_path: Path, weights: str, says: str) -> None:
    err = refusal(inventory(tmp_path, weights), tmp_path)
    assert err["code"] == "bad-inventory" and says in err["message"] and "inv.yaml:" in err["message"], err


def test_stage_needs_a_backend_that_runs_commands_first_and_a_hub_model(tmp_path: Path) -> None:
    slurm = write_yaml(tmp_path, "name: s\nbackend: slurm\nhardware: h200\nslurm: {partition: gpu}\n"
                       "weights: {path: /lustre, stage: /nvme}\n", "slurm.yaml")
    err = run_cli(["plan", "--json", "-i", str(slurm)], tmp_path).error()
    assert err["code"] == "bad-inventory" and "backend slurm runs no commands on the nodes" in err["message"]
    cpu = (ROOT / "inventories" / "local-cpu.yaml").read_text() + "weights: {path: /shared/models, stage: /nvme/models}\n"
    err = run_cli(["plan", "--json", "-i", str(write_yaml(tmp_path, cpu, "cpu.yaml")), "--recipe", "k3launch/tiny-llama"], tmp_path).error()
    assert err["code"] == "weights-stage" and "the model is the directory" in err["message"]


def test_hostile_stage_paths_stay_data(tmp_path: Path) -> None:
    """Spaces, quotes, $() and backquotes in the paths: every place they reach a shell quotes them."""
    import shlex
    import subprocess

    from k3launch.render.scripts import script

    hostile = "/nvme/it's $(touch pwned) `x`"
    weights = f"  path: {q('/lustre/a b')}\n  stage: {q(hostile)}\n"
    for runtime in ("docker", "bare"):
        p = plan(inventory(tmp_path, weights, runtime=runtime), tmp_path)
        text = script(p, p.hosts[0].name)
        assert f"the weights in {shlex.quote(hostile)}: `k3launch up` fills it first" in text
        assert f"--from-path {shlex.quote('/lustre/a b')} " in text
        word = f"HF_HUB_CACHE={hostile}/hub" if runtime == "bare" else f"{hostile}:/root/.cache/huggingface"
        assert shlex.quote(word) in text
        path = tmp_path / f"{runtime}.sh"
        path.write_text(text)
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True, timeout=30).returncode == 0
