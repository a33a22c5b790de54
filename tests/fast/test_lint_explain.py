"""`k3launch lint` findings and `k3launch explain` histories, through the library and the CLI."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from k3launch.cli import app
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.explain import explain, flag_key
from k3launch.planning.lint import lint
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.schema import load_schema

S = load_schema()
runner = CliRunner()


def codes(words: list[str]) -> list[str]:
    return [f.code for f in lint(S, words)]


def test_clean_command_has_no_findings() -> None:
    assert codes(["vllm", "serve", "moonshotai/Kimi-K3", "--trust-remote-code", "-tp", "8"]) == []


def test_contradictory_booleans_are_found() -> None:
    assert "contradictory-boolean" in codes(["vllm", "serve", "m", "--enable-prefix-caching", "--disable-prefix-caching"])


def test_duplicates_with_different_values() -> None:
    found = lint(S, ["vllm", "serve", "m", "-tp", "8", "--tensor-parallel-size", "16"])
    assert [f.code for f in found] == ["duplicate-flag"] and found[0].severity == "error"


def test_legacy_boolean_and_unknown_and_bad_choice() -> None:
    got = codes(["vllm", "serve", "m", "--no-enable-prefix-caching", "--max-num-seq", "3", "--moe-backend", "x"])
    assert got == ["unknown-flag", "bad-choice", "legacy-boolean"]


def test_env_prefix_words() -> None:
    found = lint(S, ["VLLM_NO_SUCH=1", "VLLM_HOST_IP=1.2.3.4", "vllm", "serve", "m"])
    assert [(f.code, f.severity) for f in found] == [("env-unknown", "warning")]


def test_not_serve() -> None:
    assert codes(["vllm", "bench", "serve"]) == ["not-serve"]


def test_cli_lint_exit_codes() -> None:
    ok = runner.invoke(app, ["lint", "--", "vllm", "serve", "m", "--enforce-eager"])
    assert ok.exit_code == 0 and "clean" in ok.output
    bad = runner.invoke(app, ["lint", "--json", "--", "vllm", "serve", "m", "--enforce-eager", "--no-enforce-eager"])
    assert bad.exit_code == 1
    assert json.loads(bad.output)["findings"][0]["code"] == "contradictory-boolean"
    empty = runner.invoke(app, ["lint"])
    assert empty.exit_code == 2


def test_explain_history_in_layer_order() -> None:
    plan = build_plan(RecipeTree(), Selection(hardware="mi355x", features=("spec_decoding",), advanced=("max-num-seqs",)))
    [h] = explain(plan, "max-num-seqs")
    assert [e.layer for e in h.entries] == ["hardware", "advanced", "features"]
    assert h.final == "128"
    assert flag_key(plan, "-tp") == "--tensor-parallel-size"
    assert flag_key(plan, "VLLM_ROCM_USE_AITER") == "VLLM_ROCM_USE_AITER"


def test_explain_groups_processes_with_the_same_history() -> None:
    plan = build_plan(RecipeTree(), Selection(strategy="pd_cluster"))
    hist = explain(plan, "--max-num-batched-tokens")
    by_proc = {p: h.final for h in hist for p in h.processes}
    assert by_proc == {"prefill-0": "16384", "decode-0": "32", "decode-1": "32"}


def test_cli_explain_unknown_flag_and_process() -> None:
    r = runner.invoke(app, ["explain", "--json", "max-num-seq"])
    assert r.exit_code == 2 and json.loads(r.output)["error"]["code"] == "unknown-flag"
    r = runner.invoke(app, ["explain", "--json", "max-num-seqs", "--process", "nope-9"])
    assert r.exit_code == 2 and json.loads(r.output)["error"]["code"] == "unknown-process"


def test_cli_explain_table() -> None:
    r = runner.invoke(app, ["explain", "moe-backend", "--hardware", "h200"])
    assert r.exit_code == 0
    assert "marlin" in r.output and "hardware" in r.output and "runs" in r.output
