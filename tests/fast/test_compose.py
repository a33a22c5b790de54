"""Layered composition: last writer wins per key, provenance, notices, locks, folding."""

from __future__ import annotations

import pytest

from k3launch.errors import K3Error
from k3launch.planning.compose import Locked, Source, compose
from k3launch.planning.schema import load_schema

S = load_schema()
PROG = ["vllm", "serve", "m"]


def test_last_writer_wins_and_every_write_is_recorded() -> None:
    c = compose(S, PROG, [
        Source("base", "b", ("--max-num-seqs", "8", "--enforce-eager")),
        Source("hardware", "h", ("--max-num-seqs", "128",)),
        Source("features", "f", ("--max-num-seqs", "32",)),
    ])
    assert c.argv.count("--max-num-seqs") == 1
    assert c.argv[c.argv.index("--max-num-seqs") + 1] == "32"
    assert [(e.layer, e.value) for e in c.provenance["--max-num-seqs"]] == [("base", "8"), ("hardware", "128"), ("features", "32")]
    assert sum(n.code == "overridden" for n in c.notices) == 2


def test_boolean_pair_is_one_key_and_later_negative_wins() -> None:
    c = compose(S, PROG, [Source("hardware", "h", ("--enable-prefix-caching",)), Source("strategy", "s", ("--no-enable-prefix-caching",))][::-1])
    # strategy (earlier) says off, hardware (later) says on
    assert "--enable-prefix-caching" in c.argv and "--disable-prefix-caching" not in c.argv
    c = compose(S, PROG, [Source("strategy", "s", ("--enable-prefix-caching",)), Source("advanced", "a", ("--no-enable-prefix-caching",))])
    assert "--disable-prefix-caching" in c.argv and "--enable-prefix-caching" not in c.argv
    assert any(n.code == "normalized-flag" for n in c.notices)
    assert any(n.code == "overridden" and "--enable-prefix-caching" in n.message for n in c.notices)


def test_both_forms_in_one_source_is_an_error() -> None:
    with pytest.raises(K3Error) as e:
        compose(S, PROG, [Source("base", "recipe.yaml base_args", ("--enable-prefix-caching", "--disable-prefix-caching"))])
    assert e.value.code == "contradictory-flags" and "recipe.yaml" in e.value.message


def test_same_value_twice_in_one_source_is_fine() -> None:
    c = compose(S, PROG, [Source("strategy", "s", ("--enforce-eager", "--enforce-eager"))])
    assert c.argv.count("--enforce-eager") == 1


def test_unchanged_rewrite_is_a_notice_not_an_override() -> None:
    c = compose(S, PROG, [Source("base", "b", ("--gpu-memory-utilization", "0.95")), Source("advanced", "a", ("--gpu-memory-utilization", "0.95"))])
    codes = [n.code for n in c.notices]
    assert "unchanged" in codes and "overridden" not in codes


def test_env_layers_and_provenance() -> None:
    c = compose(S, PROG, [Source("base", "b", (), (("A", "1"),)), Source("hardware", "h", (), (("A", "2"), ("VLLM_NOT_A_REAL_VAR", "1")))])
    assert c.env["A"] == "2" and [e.value for e in c.provenance["A"]] == ["1", "2"]
    assert any(n.code == "env-unknown" and "VLLM_NOT_A_REAL_VAR" in n.message for n in c.notices)


def test_user_set_on_locked_flag_is_refused_but_same_value_is_allowed() -> None:
    srcs = [Source("base", "b", ("--moe-backend", "auto")), Source("hardware", "h", ("--moe-backend", "marlin")), Source("advanced", "preset", ())]
    lock = [Locked("--moe-backend", "hopper needs marlin")]
    with pytest.raises(K3Error) as e:
        compose(S, PROG, [*srcs, Source("advanced", "--set", ("--moe-backend", "triton"), user=True)], lock)
    assert e.value.code == "locked-by-hardware" and "marlin" in e.value.message
    c = compose(S, PROG, [*srcs, Source("advanced", "--set", ("--moe-backend", "marlin"), user=True)], lock)
    assert c.value("--moe-backend") == "marlin"


def test_lock_on_json_subkey() -> None:
    hw = Source("hardware", "h", ("--attention-config", '{"mla_prefill_backend":"TRTLLM_RAGGED","use_prefill_query_quantization":true}'))
    lock = [Locked("--attention-config.mla_prefill_backend", "blackwell")]
    for bad in (("--attention-config", '{"use_prefill_query_quantization":true}'), ("--attention-config.mla_prefill_backend", "FLASHINFER")):
        with pytest.raises(K3Error):
            compose(S, PROG, [hw, Source("advanced", "--set", bad, user=True)], lock)
    c = compose(S, PROG, [hw, Source("advanced", "--set", ("--attention-config", '{"mla_prefill_backend":"TRTLLM_RAGGED"}'), user=True)], lock)
    assert "TRTLLM_RAGGED" in c.argv[-1]


def test_reserved_flags_refused_for_user_sets_only() -> None:
    reserved = {"--tensor-parallel-size": "placement"}
    compose(S, PROG, [Source("strategy", "placement", ("-tp", "8"))], reserved=reserved)
    with pytest.raises(K3Error) as e:
        compose(S, PROG, [Source("advanced", "--set", ("-tp", "4"), user=True)], reserved=reserved)
    assert e.value.code == "reserved-flag"


def test_dotted_and_whole_json_are_folded() -> None:
    c = compose(S, PROG, [
        Source("strategy", "s", ("-cc.pass_config.fuse_allreduce_rms=false",)),
        Source("strategy", "r", ("--compilation-config", '{"cudagraph_mode":"FULL_DECODE_ONLY"}')),
    ])
    assert c.argv.count("--compilation-config") == 1
    assert not any(t.startswith("--compilation-config.") for t in c.argv)
    val = c.argv[c.argv.index("--compilation-config") + 1]
    assert '"cudagraph_mode":"FULL_DECODE_ONLY"' in val and '"fuse_allreduce_rms":false' in val
    assert any(n.code == "folded" for n in c.notices)


def test_unknown_flag_in_a_source_names_the_source() -> None:
    with pytest.raises(K3Error) as e:
        compose(S, PROG, [Source("base", "models/x.yaml model.base_args", ("--not-a-flag",))])
    assert e.value.code == "unknown-flag" and "models/x.yaml" in e.value.message
