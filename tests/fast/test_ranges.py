"""Values vLLM's config classes refuse are refused at planning (k3launch.planning.ranges), in vLLM's
own words, blamed on the layer or ``--set`` that wrote them; ``lint`` and ``rollout --set`` alike.
That real vLLM refuses exactly these is tests/test_engine_ranges.py's table."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from inventory_helpers import example, run_cli
from paths import VLLM_DATA

from k3launch import api
from k3launch.errors import K3Error
from k3launch.planning.ranges import constraints, number_of, violations
from k3launch.planning.ranges_dump import CONSTRAINTS, RULES
from k3launch.planning.recipes import default_recipes_dir
from k3launch.planning.schema import SERVE_FLAGS, load_schema, vendored_versions

TINY = "k3launch/tiny-llama"
DATA = VLLM_DATA


def _refused(**kw: object) -> K3Error:
    with pytest.raises(K3Error) as info:
        api.plan(example("local-cpu"), recipe=TINY, **kw)
    assert "\n" not in info.value.message
    return info.value


@pytest.mark.parametrize("version", vendored_versions())
def test_every_vendored_version_has_its_constraints(version: str) -> None:
    cons = constraints(version)
    assert cons.bounds["gpu_memory_utilization"].field == "CacheConfig.gpu_memory_utilization"
    assert [(x.op, x.limit) for x in cons.bounds["gpu_memory_utilization"].limits] == [("gt", 0), ("le", 1)]
    assert {r.id for r in cons.rules} == {r["id"] for r in RULES}  # every catalogued rule reproduced on both versions
    text = (DATA / version / CONSTRAINTS).read_text()
    assert text == json.dumps(json.loads(text), indent=1, sort_keys=True)  # deterministic: sorted keys, as the dump writes
    schema = load_schema(version)
    dests = {s.dest for s in schema.specs}
    assert set(cons.bounds) <= dests and all(set(r.flags) <= dests for r in cons.rules)  # every dest is a flag of that version


@pytest.mark.parametrize(("value", "words"), [("1.5", "Input should be less than or equal to 1"),
                                              ("0", "Input should be greater than 0"),
                                              ("nan", "Input should be less than or equal to 1")])  # pydantic names le first
def test_a_set_out_of_range_is_refused_with_vllms_words_and_the_set_blamed(value: str, words: str) -> None:
    err = _refused(sets=[f"gpu-memory-utilization={value}"])
    assert err.code == "value-out-of-range"
    assert err.message == (f"--gpu-memory-utilization {value} (from --set gpu-memory-utilization={value}, advanced layer): "
                           f"vLLM 0.32.0 refuses it: {words} (CacheConfig.gpu_memory_utilization)")
    assert err.hint == "correct your --set gpu-memory-utilization=" + value + ": give it a value vLLM 0.32.0 accepts"


def test_the_cli_refusal_is_one_line_exit_2(tmp_path: Path) -> None:
    res = run_cli(["plan", "-i", str(example("local-cpu")), "--recipe", TINY, "--set", "max-num-seqs=-3"], tmp_path)
    lines = res.stderr.splitlines()
    assert res.code == 2 and len(lines) == 2, res.stdout + res.stderr
    assert lines[0] == ("error: --max-num-seqs -3 (from --set max-num-seqs=-3, advanced layer): vLLM 0.32.0 refuses it: "
                        "Input should be greater than or equal to 1 (SchedulerConfig.max_num_seqs) [value-out-of-range]")
    assert lines[1] == "hint: correct your --set max-num-seqs=-3: give it a value vLLM 0.32.0 accepts"
    ok = run_cli(["plan", "-i", str(example("local-cpu")), "--recipe", TINY, "--set", "max-num-seqs=1"], tmp_path)
    assert ok.code == 0, ok.stderr  # the bound itself is in range


def test_a_recipe_value_is_blamed_on_its_layer_and_a_set_can_override_it(tmp_path: Path) -> None:
    root = tmp_path / "recipes"
    shutil.copytree(default_recipes_dir(), root)
    rel = Path("models/k3launch/tiny-llama.yaml")
    text = (root / rel).read_text()
    (root / rel).write_text(text.replace('    - "512"\n', '    - "512"\n    - "--long-prefill-token-threshold"\n    - "-1"\n', 1))
    err = _refused(recipes_dir=root)
    assert err.code == "value-out-of-range" and err.message.startswith(
        "--long-prefill-token-threshold -1 (from models/k3launch/tiny-llama.yaml model.base_args, base layer): vLLM 0.32.0 refuses it: "
        "Input should be greater than or equal to 0"), err.message
    assert err.hint == "fix the recipe, or override it with --set long-prefill-token-threshold=VALUE"
    # the value that runs is checked: a --set replacing the recipe's is what vLLM sees
    plan = api.plan(example("local-cpu"), recipe=TINY, recipes_dir=root, sets=["long-prefill-token-threshold=64"])
    assert plan.processes[0].argv[plan.processes[0].argv.index("--long-prefill-token-threshold") + 1] == "64"


def test_a_cross_field_rule_names_both_writers() -> None:
    err = _refused(sets=["max-num-seqs=64", "max-num-batched-tokens=32"])
    assert err.code == "values-conflict"
    assert err.message == ("--max-num-batched-tokens 32 (from --set max-num-batched-tokens=32, advanced layer) with --max-num-seqs 64 "
                           "(from --set max-num-seqs=64, advanced layer): vLLM 0.32.0 refuses them: max_num_batched_tokens (32) must be "
                           "greater than or equal to max_num_seqs (64). (SchedulerConfig)")
    assert err.hint == "correct your --set max-num-batched-tokens=32 and --set max-num-seqs=64: choose values vLLM 0.32.0 accepts"
    # one side from the recipe (--max-model-len 512, base layer), one from placement or vLLM's default
    err = _refused(sets=["long-prefill-token-threshold=513"])
    assert "--max-model-len 512 (from models/k3launch/tiny-llama.yaml model.base_args, base layer)" in err.message
    assert "long_prefill_token_threshold (513) cannot be greater than the max_model_len (512)." in err.message
    err = _refused(sets=["decode-context-parallel-size=2"])
    assert err.message.startswith("--tensor-parallel-size 1 (from k3launch placement, strategy layer) with --decode-context-parallel-size 2")
    assert "tp_size=1 must be divisible by dcp_size=2." in err.message
    assert err.hint == "correct your --set decode-context-parallel-size=2: choose values vLLM 0.32.0 accepts"


def test_a_rule_is_checked_only_when_vllm_checks_it() -> None:
    # --max-num-seqs alone: vLLM derives --max-num-batched-tokens at start, so no rule is known to break
    assert api.plan(example("local-cpu"), recipe=TINY, sets=["max-num-seqs=100000"]).processes
    # LoRAConfig (and its bounds) exist only with --enable-lora
    assert api.plan(example("local-cpu"), recipe=TINY, sets=["max-loras=0", "max-cpu-loras=0"]).processes
    assert _refused(sets=["enable-lora", "max-loras=0"]).code == "value-out-of-range"
    assert "max_cpu_loras (2) must be >= max_loras (4)." in _refused(sets=["enable-lora", "max-loras=4", "max-cpu-loras=2"]).message
    # max-model-len auto (-1): vLLM takes the model's length, which planning does not know
    assert api.plan(example("local-cpu"), recipe=TINY, sets=["max-model-len=auto", "long-prefill-token-threshold=100000"]).processes


def test_a_value_read_as_vllm_reads_it() -> None:
    schema = load_schema("0.32.0")
    spec = {s.dest: s for s in schema.specs}
    assert number_of(spec["max_num_batched_tokens"], "1k") == 1000 and number_of(spec["max_num_batched_tokens"], "1K") == 1024
    assert number_of(spec["max_model_len"], "auto") == -1 and number_of(spec["max_num_active_seqs"], "None") is None
    assert number_of(spec["max_num_seqs"], "many") is None  # not a number: the schema's type check says so
    args, problems = schema.parse(["--max-num-batched-tokens", "0k", "--max-num-seqs", "2"])
    assert not problems
    found = violations(schema, {a.key: a for a in args})
    assert [(v.code, v.keys, v.said) for v in found] == [  # a field's bound first: pydantic checks fields before the validators
        ("value-out-of-range", ("--max-num-batched-tokens",), "Input should be greater than or equal to 1"),
        ("values-conflict", ("--max-num-batched-tokens", "--max-num-seqs"), "max_num_batched_tokens (0) must be greater than or equal to max_num_seqs (2).")]


def test_rollout_set_is_refused_with_the_users_set_blamed(tmp_path: Path) -> None:
    from k3launch.api.rollouts import rollout_preview
    from k3launch.deploy.state import StateStore
    from k3launch.models.record import ProcessRecord, SshRecord

    inv = example("local-cpu")
    p = api.plan(inv, recipe=TINY, sets=["max-num-seqs=64"], name="rng")
    StateStore(tmp_path).save(SshRecord(name=p.name, state="ready", created=time.time(), updated=time.time(), backend="local",
                                        endpoint=p.endpoint, plan=p, inventory=str(inv),
                                        processes={x.id: ProcessRecord(id=x.id, node=x.node, runtime="bare", handle="1") for x in p.processes}))
    with pytest.raises(K3Error) as e:
        rollout_preview(p.name, sets=["gpu-memory-utilization=1.5"], state_dir=tmp_path)
    assert e.value.code == "value-out-of-range" and "(from --set gpu-memory-utilization=1.5, advanced layer)" in e.value.message
    assert e.value.hint.startswith("correct your --set gpu-memory-utilization=1.5")
    with pytest.raises(K3Error) as e:  # the deployment's own --set and the rollout's meet in vLLM's rule
        rollout_preview(p.name, sets=["max-num-batched-tokens=32"], state_dir=tmp_path)
    assert e.value.code == "values-conflict" and "--max-num-seqs 64 (from --set max-num-seqs=64, advanced layer)" in e.value.message
    assert rollout_preview(p.name, sets=["max-num-batched-tokens=64"], state_dir=tmp_path).units  # in range: it rolls


def test_lint_reports_values_vllm_refuses(tmp_path: Path) -> None:
    res = run_cli(["lint", "--vllm-version", "0.32.0", "--", "vllm", "serve", "m", "--gpu-memory-utilization", "2",
                   "--max-num-seqs", "8", "--max-num-active-seqs", "9"], tmp_path)
    assert res.code == 1, res.stdout + res.stderr
    assert "value-out-of-range: --gpu-memory-utilization 2: vLLM 0.32.0 refuses it: Input should be less than or equal to 1" in res.stdout
    assert "values-conflict: --max-num-active-seqs 9 with --max-num-seqs 8: vLLM 0.32.0 refuses them" in res.stdout, res.stdout


def test_a_users_dump_without_constraints_refuses_nothing_and_a_broken_one_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vdir = tmp_path / "schemas" / "0.32.0"
    vdir.mkdir(parents=True)
    for name in (SERVE_FLAGS, "env-vars.json"):
        shutil.copy(DATA / "0.32.0" / name, vdir / name)
    monkeypatch.setenv("K3LAUNCH_SCHEMA_DIR", str(tmp_path / "schemas"))
    assert constraints("0.32.0").bounds  # no constraints.json in the user's dump: the vendored file of that version
    (vdir / CONSTRAINTS).write_text('{"vllm_version": "0.32.0"}')
    with pytest.raises(K3Error) as e:
        api.plan(example("local-cpu"), recipe=TINY)
    assert e.value.code == "bad-schema-dump" and CONSTRAINTS in e.value.message
    (vdir / CONSTRAINTS).write_text(json.dumps({"vllm_version": "0.32.0", "source": "", "bounds": {}, "rules": []}))
    assert api.plan(example("local-cpu"), recipe=TINY, sets=["gpu-memory-utilization=1.5"]).processes  # that vLLM says nothing
