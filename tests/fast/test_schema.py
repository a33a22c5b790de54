"""The vendored vLLM flag schema and the argv tokenizer built on it."""

from __future__ import annotations

import pytest

from k3launch.errors import K3Error
from k3launch.planning.schema import load_schema, vendored_versions


@pytest.fixture(scope="module")
def schema():  # type: ignore[no-untyped-def]
    return load_schema("0.33.0")


def test_vendored_versions_include_default() -> None:
    assert "0.33.0" in vendored_versions()


def test_unknown_version_is_a_refusal() -> None:
    with pytest.raises(K3Error) as e:
        load_schema("0.1.0")
    assert e.value.code == "unknown-vllm-version" and "0.33.0" in e.value.hint


def test_short_and_long_spelling_are_one_key(schema) -> None:  # type: ignore[no-untyped-def]
    args, problems = schema.parse(["-tp", "8", "--tensor-parallel-size", "16"])
    assert not problems
    assert {a.key for a in args} == {"--tensor-parallel-size"}


def test_boolean_pair_polarity(schema) -> None:  # type: ignore[no-untyped-def]
    args, _ = schema.parse(["--enable-prefix-caching", "--disable-prefix-caching", "--disable-custom-all-reduce", "--enable-custom-all-reduce", "-ep"])
    got = [(a.key, a.polarity) for a in args]
    assert got == [
        ("--enable-prefix-caching", True),
        ("--enable-prefix-caching", False),
        ("--disable-custom-all-reduce", True),
        ("--disable-custom-all-reduce", False),
        ("--enable-expert-parallel", True),
    ]


def test_legacy_no_spelling_maps_to_the_schema_spelling(schema) -> None:  # type: ignore[no-untyped-def]
    args, problems = schema.parse(["--no-enable-prefix-caching", "--no-disable-hybrid-kv-cache-manager", "--no-enable-flashinfer-autotune"])
    assert not problems
    assert all(a.legacy for a in args)
    assert [a.tokens() for a in args] == [["--disable-prefix-caching"], ["--enable-hybrid-kv-cache-manager"], ["--disable-flashinfer-autotune"]]


def test_underscore_spelling_is_accepted(schema) -> None:  # type: ignore[no-untyped-def]
    args, problems = schema.parse(["--max_num_seqs", "4"])
    assert not problems and args[0].key == "--max-num-seqs"


def test_choices_and_types_are_checked(schema) -> None:  # type: ignore[no-untyped-def]
    _, problems = schema.parse(["--moe-backend", "nope", "--max-num-seqs", "many", "--gpu-memory-utilization", "high", "--speculative-config", "{bad"])
    codes = [p.code for p in problems]
    assert codes == ["bad-choice", "bad-value", "bad-value"]  # speculative-config is free text for argparse
    _, problems = schema.parse(["--compilation-config", "{bad json"])
    assert [p.code for p in problems] == ["bad-value"]


def test_max_model_len_accepts_auto_and_suffixes(schema) -> None:  # type: ignore[no-untyped-def]
    for v in ("auto", "-1", "1000000", "1m", "128k"):
        _, problems = schema.parse(["--max-model-len", v])
        assert not problems, v
    _, problems = schema.parse(["--max-model-len", "lots"])
    assert problems


def test_dotted_config_keys(schema) -> None:  # type: ignore[no-untyped-def]
    args, problems = schema.parse(["-cc.pass_config.fuse_allreduce_rms=False", "--attention-config.use_trtllm_ragged_deepseek_prefill", "True"])
    assert not problems
    assert [a.key for a in args] == ["--compilation-config.pass_config.fuse_allreduce_rms", "--attention-config.use_trtllm_ragged_deepseek_prefill"]
    _, problems = schema.parse(["--max-num-seqs.x=1"])
    assert [p.code for p in problems] == ["bad-dotted"]


def test_unknown_flag_suggests(schema) -> None:  # type: ignore[no-untyped-def]
    _, problems = schema.parse(["--max-num-seq", "4", "--trust-remote-code"])
    assert len(problems) == 1 and problems[0].code == "unknown-flag" and "--max-num-seqs" in problems[0].hint


def test_boolean_with_value_and_missing_value(schema) -> None:  # type: ignore[no-untyped-def]
    _, problems = schema.parse(["--enforce-eager=true", "--port"])
    assert [p.code for p in problems] == ["bad-value", "missing-value"]


def test_negative_numbers_are_values(schema) -> None:  # type: ignore[no-untyped-def]
    args, problems = schema.parse(["--max-model-len", "-1"])
    assert not problems and args[0].value == "-1"
