"""Bad recipe input and bad command lines: refused with a stable code, a message naming the file,
and (on the CLI) exit code 2 with one ``error:`` line and a ``hint:`` line, never a traceback."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3launch.cli import app
from k3launch.errors import K3Error
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.recipes import RecipeTree, default_recipes_dir

K3 = Path("models/moonshotai/Kimi-K3.yaml")


@pytest.fixture
def broken(tmp_path: Path) -> Callable[[Path, Callable[[str], str]], Path]:
    """Copy the bundled tree to tmp_path and rewrite one file with ``edit``; returns the tree root."""

    def make(rel: Path, edit: Callable[[str], str]) -> Path:
        root = tmp_path / "recipes"
        shutil.copytree(default_recipes_dir(), root)
        path = root / rel
        text = path.read_text(encoding="utf-8")
        new = edit(text)
        assert new != text, "the mutation did not apply"
        path.write_text(new, encoding="utf-8")
        return root

    return make


def _refusal(root: Path, sel: Selection | None = None) -> K3Error:
    with pytest.raises(K3Error) as info:
        build_plan(RecipeTree(root), sel or Selection())
    err = info.value
    assert err.code and err.message and "\n" not in err.message
    return err


def _insert_after(anchor: str, lines: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert anchor in text, anchor
        return text.replace(anchor, anchor + lines, 1)

    return edit


def _line_of(root: Path, rel: Path, needle: str) -> int:
    for i, line in enumerate((root / rel).read_text(encoding="utf-8").splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(needle)


# ------------------------------------------------------------------------- recipe files
def test_malformed_yaml(broken: Callable[..., Path]) -> None:
    root = broken(K3, _insert_after("base_args:\n", '    - "--trust-remote-code\n    - [unclosed\n'))
    err = _refusal(root)
    assert err.code == "bad-yaml"
    assert str(root / K3) in err.message and "malformed YAML" in err.message
    assert err.hint


def test_unknown_key_names_file_and_line(broken: Callable[..., Path]) -> None:
    root = broken(K3, _insert_after("  default_hardware: b300\n", "  default_hardwre: h200\n"))
    err = _refusal(root)
    assert err.code == "bad-recipe"
    line = _line_of(root, K3, "default_hardwre")
    assert f"{root / K3}:{line}:" in err.message, err.message
    assert "default_hardwre" in err.message and "unknown key" in err.message


def test_unknown_key_in_a_nested_block_names_its_line(broken: Callable[..., Path]) -> None:
    root = broken(K3, lambda t: t.replace("    extra_env:\n      VLLM_ROCM_USE_AITER", "    extra_envs:\n      VLLM_ROCM_USE_AITER", 1))
    err = _refusal(root)
    assert err.code == "bad-recipe"
    line = _line_of(root, K3, "extra_envs:")
    assert f"{root / K3}:{line}:" in err.message and "extra_envs" in err.message, err.message


def test_unknown_key_in_a_strategy_file(broken: Callable[..., Path]) -> None:
    rel = Path("strategies/multi_node_tp.yaml")
    root = broken(rel, _insert_after("deploy_type: multi_node\n", "nodes_min: 2\n"))
    err = _refusal(root, Selection(hardware="h200"))
    assert err.code == "bad-recipe"
    assert f"{root / rel}:{_line_of(root, rel, 'nodes_min')}:" in err.message, err.message


def test_unknown_key_in_the_taxonomy(broken: Callable[..., Path]) -> None:
    rel = Path("taxonomy.yaml")
    root = broken(rel, _insert_after("    vram_gb: 2144\n", "    vram_per_gpu_gb: 268\n"))
    err = _refusal(root)
    assert err.code == "bad-recipe"
    assert f"{root / rel}:{_line_of(root, rel, 'vram_per_gpu_gb')}:" in err.message, err.message


def test_flag_unknown_to_vllm_in_base_args(broken: Callable[..., Path]) -> None:
    root = broken(K3, _insert_after("  base_args:\n", '    - "--enable-turbo-mode"\n'))
    err = _refusal(root)
    assert err.code == "unknown-flag"
    assert str(K3) in err.message and "--enable-turbo-mode" in err.message and "base_args" in err.message
    assert err.hint


def test_bad_choice_value(broken: Callable[..., Path]) -> None:
    root = broken(K3, lambda t: t.replace('    - "--moe-backend"\n    - "auto"\n', '    - "--moe-backend"\n    - "nonsense"\n', 1))
    err = _refusal(root)
    assert err.code == "bad-choice"
    assert str(K3) in err.message and "nonsense" in err.message
    assert "marlin" in err.hint  # lists the valid choices


def test_bad_typed_value(broken: Callable[..., Path]) -> None:
    root = broken(K3, lambda t: t.replace('    - "0.95"\n\nfeatures:', '    - "most"\n\nfeatures:', 1))
    err = _refusal(root)
    assert err.code == "bad-value" and str(K3) in err.message and "most" in err.message


@pytest.mark.parametrize("pair", [
    ('"--enable-prefix-caching"', '"--disable-prefix-caching"'),
    ('"--enable-prefix-caching"', '"--no-enable-prefix-caching"'),  # legacy spelling of the same key
    ('"--enforce-eager"', '"--no-enforce-eager"'),
])
def test_both_boolean_forms_in_one_layer(broken: Callable[..., Path], pair: tuple[str, str]) -> None:
    root = broken(K3, _insert_after("  base_args:\n", f"    - {pair[0]}\n    - {pair[1]}\n"))
    err = _refusal(root)
    assert err.code == "contradictory-flags"
    assert str(K3) in err.message and "base_args" in err.message


def test_both_boolean_forms_in_a_hardware_block(broken: Callable[..., Path]) -> None:
    root = broken(K3, lambda t: t.replace('      - "--enable-prefix-caching"\n', '      - "--enable-prefix-caching"\n      - "--disable-prefix-caching"\n', 1))
    err = _refusal(root)  # b300: the Blackwell block applies
    assert err.code == "contradictory-flags"
    assert str(K3) in err.message and "hardware_overrides.blackwell" in err.message
    # The same tree still plans on hardware whose blocks are sound: loading is lazy per layer.
    assert build_plan(RecipeTree(root), Selection(hardware="mi355x")).hardware == "mi355x"


def test_same_value_twice_in_one_layer_is_not_a_contradiction(broken: Callable[..., Path]) -> None:
    root = broken(K3, _insert_after("  base_args:\n", '    - "--trust-remote-code"\n'))
    assert build_plan(RecipeTree(root), Selection()).processes


def test_bad_default_strategy_names_the_recipe_file(broken: Callable[..., Path]) -> None:
    root = broken(K3, lambda t: t.replace("default_strategy: single_node_tp", "default_strategy: multi_node_tpp", 1))
    err = _refusal(root)
    assert err.code == "bad-recipe" and str(K3) in err.message, err.as_dict()


def test_unknown_opt_in_feature_is_a_recipe_error(broken: Callable[..., Path]) -> None:
    root = broken(K3, lambda t: t.replace("opt_in_features: [spec_decoding, text_only,", "opt_in_features: [spec_decoding, text_only, vision,", 1))
    err = _refusal(root)
    assert err.code == "bad-recipe" and str(K3) in err.message and "vision" in err.message


# ----------------------------------------------------------------------------------- CLI
runner = CliRunner()


def _cli_refusal(args: list[str]) -> tuple[str, str]:
    res = runner.invoke(app, ["plan", *args])
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr
    lines = res.stderr.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["error", "hint"], lines
    assert res.stdout == ""
    as_json = runner.invoke(app, ["plan", *args, "--json"])
    assert as_json.exit_code == 2
    assert "Traceback" not in as_json.stdout + as_json.stderr
    doc = json.loads(as_json.stdout)  # exactly one JSON object: json.loads rejects trailing data
    assert isinstance(doc, dict) and list(doc) == ["error"]
    assert sorted(doc["error"]) == ["code", "hint", "message"]
    assert doc["error"]["code"] and doc["error"]["message"] and doc["error"]["hint"]
    assert lines[0] == f"error: {doc['error']['message']} [{doc['error']['code']}]" and lines[1] == f"hint: {doc['error']['hint']}"
    return doc["error"]["code"], res.stderr


@pytest.mark.parametrize("args,code", [
    (["--recipe", "moonshotai/Kimi-K9"], "unknown-recipe"),
    (["--strategy", "multi_node_tpp"], "unknown-strategy"),
    (["--feature", "vision"], "unknown-feature"),
    (["--no-feature", "vision"], "unknown-feature"),
    (["--hardware", "h300"], "unknown-hardware"),
    (["--set", "max-num-seqs"], "bad-set"),
    (["--set", "tensor-parallel-size=4"], "reserved-flag"),
    (["--kv-offload", "mooncake"], "kv-offload-unsupported"),
    (["--hardware", "h100", "--strategy", "multi_node_tp", "--nodes", "2"], "does-not-fit"),
    (["--recipes-dir", "/nonexistent/recipes"], "no-recipes"),
])
def test_cli_refusals(args: list[str], code: str) -> None:
    got, stderr = _cli_refusal(args)
    assert got == code, stderr


def test_cli_suggests_close_names() -> None:
    _, stderr = _cli_refusal(["--strategy", "multi_node_tpp"])
    assert "did you mean multi_node_tp" in stderr


def test_cli_broken_recipe_tree_names_the_file(broken: Callable[..., Path]) -> None:
    root = broken(K3, _insert_after("  default_hardware: b300\n", "  default_hardwre: h200\n"))
    code, stderr = _cli_refusal(["--recipes-dir", str(root)])
    assert code == "bad-recipe"
    assert f"{root / K3}:{_line_of(root, K3, 'default_hardwre')}:" in stderr


def test_cli_json_plan_is_one_object() -> None:
    res = runner.invoke(app, ["plan", "--json"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    for key in ("recipe", "variant", "hardware", "strategy", "nodes", "gpus_per_node", "verified", "capacity", "notices", "processes"):
        assert key in doc
    assert doc["processes"][0]["argv"][:3] == ["vllm", "serve", "moonshotai/Kimi-K3"]


def test_cli_refuses_hardware_that_is_neither_cuda_rocm_nor_cpu(broken: Callable[..., Path]) -> None:
    """A TPU profile (as upstream's ``ironwood``: brand Google, no platform) is refused in one line
    that names the hardware k3launch plans on, not failed on deep in planning."""
    tpu = ("  ironwood:\n    brand: Google\n    generation: tpu\n    display_name: \"TPU7x\"\n"
           "    gpu_count: 4\n    vram_gb: 768\n    multi_node: true\n")
    root = broken(Path("taxonomy.yaml"), _insert_after("hardware_profiles:\n", tpu))
    code, stderr = _cli_refusal(["--recipes-dir", str(root), "--hardware", "ironwood"])
    assert code == "unsupported-platform", stderr
    error, hint = stderr.splitlines()
    assert error == "error: ironwood is Google tpu: k3launch plans vLLM on CUDA, ROCm and CPU hardware only [unsupported-platform]"
    # Kimi K3's own hardware, all CUDA or ROCm, is what the hint offers
    assert hint.startswith("hint: choose: --hardware ") and "b300" in hint.split() and "ironwood" not in hint, hint
