"""k3launch against the whole upstream data tree (../shared/upstream-recipes/latest-full: 173 recipes).

Every recipe loads (keys k3launch does not act on are kept and named in notices with file and
line); every recipe's default selection, one multi-node and one P/D selection where the recipe
offers them are planned: each argv parses with the vendored vLLM schema and passes the plan
invariants, and each refusal is one of the reasons listed here, explained. Each default selection
(hardware, variant, strategy, nodes, TP, features) is compared with the recipes project's own
rules, re-derived below from the raw YAML independently of k3launch's code; where they differ the
recipe must be in ``DIVERGENCES`` (the decisions of docs/planning.md), and every entry there must
still differ. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from paths import ROOT
from plan_checks import check_plan, engine_processes, flags, lint_errors

from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.selection import Selection
from k3launch.planning import pools as planning_pools
from k3launch.planning.build import build_plan
from k3launch.planning.lint import lint
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.schema import load_schema

UPSTREAM = ROOT.parent / "shared" / "upstream-recipes"
FULL = UPSTREAM / "latest-full"
if not FULL.is_dir():
    pytest.skip(f"{FULL} is absent", allow_module_level=True)

pytestmark = pytest.mark.upstream

SCHEMA = load_schema()
OMNI = "omni"
# Why a selection may be refused; anything else fails the test.
REFUSALS = {
    "omni-recipe": "served by vLLM-Omni (`vllm serve --omni`), which k3launch does not plan",
    "does-not-fit": "the weights do not fit the GPUs the layout uses",
    "recipe-layout": "the recipe sizes a multi-node layout itself",
    "unknown-field": "a config field vLLM 0.33.0 does not have",
    "unknown-flag": "a flag vllm serve 0.33.0 does not have",
    "single-node-strategy": "the strategy's GPU floor exceeds one node",
}
# Default selections k3launch plans differently from the recipes project, and why (docs/planning.md,
# "Where k3launch departs from the recipes project"). The value names what differs.
DIVERGENCES = {
    "Qwen/Qwen3.8-2.4T-A95B": "nodes,tp",  # 2 b300 nodes do not hold the weights: k3launch takes the smallest count that does
    "XiaomiMiMo/MiMo-V2.5-Pro": "does-not-fit",  # one h200 node does not hold them and no multi-node strategy is offered
    "inclusionAI/Ring-1T-FP8": "unknown-field",  # --compilation-config {"use_inductor": false}: vLLM 0.33 refuses the field
    "nvidia/NVIDIA-Nemotron-Nano-9B-v2": "unknown-flag",  # --tool-call-parser-plugin: not a flag of vllm serve 0.33.0
}


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def full_tree() -> RecipeTree:
    """The whole upstream data tree (FULL), loaded once for the module."""
    return RecipeTree(FULL)


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """The tree as plain YAML: what the re-derived upstream rules read."""
    strategies = {s["name"]: s for s in (_yaml(p) for p in sorted((FULL / "strategies").glob("*.yaml")))}
    models = {str(p.relative_to(FULL / "models").with_suffix("")): _yaml(p) for p in sorted((FULL / "models").glob("*/*.yaml"))}
    return {"taxonomy": _yaml(FULL / "taxonomy.yaml")["hardware_profiles"], "strategies": strategies, "models": models}


# ------------------------------------------------------------- the recipes project's default rules
BLACKWELL_ONLY = {"nvfp4", "fp4"}


def _keyed(table: Any, hw: str, prof: dict[str, Any]) -> Any:
    if not isinstance(table, dict):
        return table
    for key in (hw, prof["generation"], prof["brand"].lower(), "default"):
        if key in table:
            return table[key]
    return None


def _default_hardware(rec: dict[str, Any], tax: dict[str, Any]) -> str:
    """pickDefaultHardware: the author's pick if offered, Blackwell-only precisions on B200/GB200, H200, then NVIDIA/AMD/id order."""
    v = rec["variants"]["default"]
    c = v.get("precision_hardware") or ({"brand": "NVIDIA", "generation": "blackwell"} if v.get("precision") in BLACKWELL_ONLY else None)
    declared = rec["meta"].get("hardware") or {}
    allow = v.get("supported_hardware") or []
    offered = [h for h, p in tax.items()
               if (not c or (p["brand"] == c["brand"] and (not c.get("generation") or p["generation"] == c["generation"])))
               and declared.get(h) != "unsupported" and (not allow or h in allow) and (not p.get("restricted") or h in declared)]
    authored = rec["meta"].get("default_hardware")
    if authored in offered:
        return str(authored)
    if c and c.get("generation") == "blackwell":
        for h in ("b200", "gb200"):
            if h in offered:
                return h
    if "h200" in offered:
        return "h200"
    return sorted(offered, key=lambda h: ({"NVIDIA": 0, "AMD": 1}.get(tax[h]["brand"], 9), h))[0]


def upstream_default(rec: dict[str, Any], tax: dict[str, Any], strategies: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON API's default selection of one recipe (None: an omni recipe, which gets no command)."""
    if OMNI in (rec["meta"].get("tasks") or []):
        return None
    hw = _default_hardware(rec, tax)
    prof = tax[hw]
    g, v = prof["gpu_count"], rec["variants"]["default"]
    listed = rec.get("compatible_strategies") or []
    grants = rec.get("strategy_hardware") or {}
    compat = listed + [s for s, m in grants.items() if s not in listed and "supported" in m.values()]
    table = rec.get("strategy_min_gpus") or {}

    def min_gpus(s: str) -> int:
        own = next((table[k] for k in (s, f"multi_node_{s}", f"single_node_{s}") if k in table), 0)
        return max(own, table.get(hw, 0))

    def offered(s: str) -> bool:
        gate = _keyed(grants.get(s, {}), hw, prof)
        if (gate == "unsupported") if gate is not None else s not in listed:
            return False
        scales = strategies[s]["deploy_type"] in ("multi_node", "pd_cluster")
        return (16 if scales else 1) * g >= min_gpus(s) and (prof.get("scalable", True) or not (s.startswith("multi_node_") or s == "pd_cluster"))

    ok = [s for s in compat if s in strategies and offered(s)]
    fits = (v.get("vram_minimum_gb") or 0) <= prof["vram_gb"]
    base = 2 if not fits and prof.get("scalable", True) and any(s.startswith("multi_node_") for s in ok) else 1
    own = rec.get("default_strategy")
    sibling = "multi_node_" + own.removeprefix("single_node_") if own else None
    if own in compat and (base == 1 or not own.startswith("single_node_")):
        strategy = own
    elif own in compat and sibling in compat:
        strategy = sibling
    else:
        strategy = next((s for s in ("multi_node_tp", "multi_node_dep", "multi_node_tep") if base > 1 and s in compat),
                        "single_node_tp" if "single_node_tp" in compat else (compat or ["single_node_tp"])[0])
    if strategy not in ok:
        strategy = next((s for s in ok if s != "pd_cluster"), strategy)
    st = strategies[strategy]
    nodes = max(base, 2 if st["deploy_type"] == "multi_node" else 1, math.ceil(min_gpus(strategy) / g) or 1)
    return {"hardware": hw, "variant": "default", "strategy": strategy, "nodes": nodes,
            "tp": _tp(rec, v, strategy, st, hw, prof, nodes), "features": _features(rec, v, strategy, hw, prof)}


def _tp(rec: dict[str, Any], v: dict[str, Any], strategy: str, st: dict[str, Any], hw: str, prof: dict[str, Any], nodes: int) -> int:
    """resolveSingleNodeTp / the multi-node parallel flags, then any later --tensor-parallel-size of the recipe (last wins)."""
    g = prof["gpu_count"]
    if strategy == "single_node_tp":
        so = (rec.get("strategy_overrides") or {}).get("single_node_tp") or {}
        for declared in (_keyed(v.get("tp"), hw, prof), _keyed(so.get("tp"), hw, prof)):
            if isinstance(declared, int) and declared > 0:
                tp = declared if prof["generation"] == "cpu" else min(declared, g)
                break
        else:
            need = v.get("vram_minimum_gb") or 0
            tp = 1 if need and need <= prof["vram_gb"] / g else g
    elif st.get("parallel_flag") == "--data-parallel-size":
        tp = 1
    elif st.get("parallelism") in ("tp_pp", "tp_dp") or nodes == 1:
        tp = g
    else:
        tp = g * nodes
    so = (rec.get("strategy_overrides") or {}).get(strategy) or {}
    gen = prof["generation"]
    nvidia = prof["brand"] == "NVIDIA"

    def gen_block(blocks: Any) -> dict[str, Any]:
        blocks = blocks or {}
        return blocks.get(gen) or (blocks.get("nvidia") if nvidia else None) or {}

    later = list(so.get("extra_args") or []) + list(so.get("vllm_args") or [])
    if gen_block(so.get("hardware_overrides")):
        later += gen_block(so.get("hardware_overrides")).get("extra_args") or []
    else:
        later += (gen_block(rec.get("hardware_overrides")).get("extra_args") or []) + (gen_block(v.get("hardware_overrides")).get("extra_args") or [])
    for i, tok in enumerate(later[:-1]):
        if tok in ("--tensor-parallel-size", "-tp"):
            tp = int(later[i + 1])
    return tp


def _features(rec: dict[str, Any], v: dict[str, Any], strategy: str, hw: str, prof: dict[str, Any]) -> list[str]:
    """defaultFeaturesFor, less features that emit nothing here (a strategies allowlist without
    this strategy, a modal feature without a mode offered here)."""
    opt_in = set(rec.get("opt_in_features") or []) | set((rec.get("hardware_opt_in_features") or {}).get(hw, []))
    forced = set(v.get("default_modes") or {})
    out = []
    for name, feat in (rec.get("features") or {}).items():
        if name not in forced and name in opt_in:
            continue
        if feat.get("strategies") and strategy not in feat["strategies"]:
            continue
        modes = feat.get("modes") or {}
        if modes and not any((not m.get("variants") or "default" in m["variants"])
                             and "unsupported" not in ((m.get("hardware") or {}).get(prof["generation"]), (m.get("hardware") or {}).get(hw))
                             for m in modes.values()):
            continue
        out.append(name)
    return out


def _planned_default(plan: Plan) -> dict[str, Any]:
    head = engine_processes(plan)[0]
    tp = flags(SCHEMA, head).get("--tensor-parallel-size")
    return {"hardware": plan.hardware, "variant": plan.variant, "strategy": plan.strategy, "nodes": plan.nodes,
            "tp": int(tp.value) if tp is not None and tp.value else 1, "features": list(plan.features)}


# ------------------------------------------------------------------------------------ loading
def test_every_recipe_loads_and_unknown_keys_are_notices_with_their_line(full_tree: RecipeTree) -> None:
    ids = full_tree.model_ids()
    assert len(ids) == len(list((FULL / "models").glob("*/*.yaml")))
    for rid in ids:
        rec = full_tree.model(rid)
        assert rec.model.model_id and rec.meta.title
    ignored = [k for keys in full_tree.ignored.values() for k in keys]
    print(f"\nlatest-full: {len(ids)} of {len(ids)} recipes loaded; {len(ignored)} keys kept but not acted on "
          f"({len({k.file for k in ignored})} files)")
    assert ignored, "latest-full has keys k3launch does not model (labels, install notes, omni blocks)"
    for k in ignored:
        lines = (FULL / k.file).read_text(encoding="utf-8").splitlines()
        assert k.line is not None and k.path.split(".")[-1] in lines[k.line - 1], f"{k.file}:{k.line} does not hold {k.path}"
        # Keys that change upstream's serve command are modelled, never dropped.
        assert not re.search(r"(^|\.)(args|extra_args|vllm_args|env|extra_env|base_args|tp|model_id)($|\.)", k.path), k.path


def test_an_upstream_tree_marked_strict_refuses_the_same_keys(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    for sub in ("strategies", "kv_store"):
        (root / sub).mkdir(parents=True)
        for p in (FULL / sub).glob("*.yaml"):
            (root / sub / p.name).write_text(p.read_text(encoding="utf-8"), encoding="utf-8")
    (root / "taxonomy.yaml").write_text("strict_keys: true\n" + (FULL / "taxonomy.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    rid = "Qwen/Qwen3.8-2.4T-A95B"
    (root / "models" / "Qwen").mkdir(parents=True)
    (root / "models" / f"{rid}.yaml").write_text((FULL / "models" / f"{rid}.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    lenient = RecipeTree(FULL)
    lenient.model(rid)
    first = lenient.ignored[f"models/{rid}.yaml"][0]
    with pytest.raises(K3Error) as info:
        RecipeTree(root).model(rid)
    assert info.value.code == "bad-recipe" and "unknown key" in info.value.message
    assert f"{rid}.yaml:{first.line}:" in info.value.message and first.path in info.value.message


def test_a_plan_names_the_kept_keys_of_the_files_it_read(full_tree: RecipeTree) -> None:
    rid = "Qwen/Qwen3.8-2.4T-A95B"
    plan = build_plan(full_tree, Selection(recipe=rid))
    kept = full_tree.ignored[f"models/{rid}.yaml"]
    shown = [n.message for n in plan.notices if n.code == "ignored-key"]
    assert kept and shown == [f"models/{rid}.yaml:{k.line}: {k.path} {k.why}" for k in kept]
    bundled = build_plan(RecipeTree(), Selection())
    assert not any(n.code == "ignored-key" for n in bundled.notices)


# ------------------------------------------------------------------------ plans of every recipe
def _offered_on(rec: dict[str, Any], hw: str, tax: dict[str, Any], strategies: dict[str, Any]) -> list[str]:
    grants = rec.get("strategy_hardware") or {}
    out = []
    for s in rec.get("compatible_strategies") or []:
        gate = _keyed(grants.get(s, {}), hw, tax[hw])
        if s in strategies and gate != "unsupported":
            out.append(s)
    return out


def _check_refusal(where: str, err: K3Error) -> None:
    assert err.code in REFUSALS, f"{where}: {err.code}: {err.message}"
    assert err.message and err.hint, where
    if err.code == "does-not-fit":  # explained: the weights against the memory of the GPUs used
        assert re.search(r"= \d+(\.\d+)? GB cannot hold the \d+(\.\d+)? GB of weights", err.message), f"{where}: {err.message}"
    if err.code in ("unknown-field", "unknown-flag"):  # explained: which recipe block wrote it
        assert "models/" in err.message, f"{where}: {err.message}"


def test_default_multi_node_and_pd_selections_plan_or_are_refused_for_a_reason(full_tree: RecipeTree, raw: dict[str, Any]) -> None:
    tax, strategies = raw["taxonomy"], raw["strategies"]
    planned: Counter[str] = Counter()
    refused: dict[str, list[str]] = {}
    for rid, rec in raw["models"].items():
        selections = [("default", Selection(recipe=rid))]
        if OMNI not in (rec["meta"].get("tasks") or []):
            hw = _default_hardware(rec, tax)
            offered = _offered_on(rec, hw, tax, strategies)
            multi = next((s for s in offered if s.startswith("multi_node_")), None)
            if multi is not None and tax[hw].get("scalable", True):
                selections.append((multi, Selection(recipe=rid, hardware=hw, strategy=multi)))
            if "pd_cluster" in offered and tax[hw].get("scalable", True):
                selections.append(("pd_cluster", Selection(recipe=rid, hardware=hw, strategy="pd_cluster")))
        for kind, sel in selections:
            where = f"{rid} {kind}"
            try:
                plan = build_plan(full_tree, sel)
            except K3Error as err:
                _check_refusal(where, err)
                refused.setdefault(err.code, []).append(where)
                continue
            try:
                check_plan(SCHEMA, plan)
                assert lint_errors(SCHEMA, plan) == []
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from exc
            planned["pd_cluster" if kind == "pd_cluster" else "multi-node" if kind != "default" else "default"] += 1
    total = sum(planned.values()) + sum(len(v) for v in refused.values())
    print(f"\nselections: {total}; planned {sum(planned.values())} ({', '.join(f'{k} {v}' for k, v in planned.items())}); "
          f"refused {sum(len(v) for v in refused.values())}")
    for code, where in sorted(refused.items()):
        print(f"  refused {len(where)} x {code} ({REFUSALS[code]}): {', '.join(where[:6])}{' ...' if len(where) > 6 else ''}")
    refused_defaults = sum(w.endswith(" default") for v in refused.values() for w in v)
    assert planned["default"] + refused_defaults == len(raw["models"])
    assert planned["default"] >= 140 and planned["multi-node"] >= 20 and planned["pd_cluster"] >= 5, planned
    assert len(refused.get("omni-recipe", [])) == sum(OMNI in (r["meta"].get("tasks") or []) for r in raw["models"].values())


def test_default_selections_follow_the_recipes_project(full_tree: RecipeTree, raw: dict[str, Any]) -> None:
    agree, differ, rendered = 0, {}, 0
    for rid, rec in raw["models"].items():
        want = upstream_default(rec, raw["taxonomy"], raw["strategies"])
        if want is None:
            continue
        rendered += 1
        try:
            got: dict[str, Any] | str = _planned_default(build_plan(full_tree, Selection(recipe=rid)))
        except K3Error as err:
            got = err.code
        if got == want:
            agree += 1
            continue
        what = got if isinstance(got, str) else ",".join(k for k in want if got[k] != want[k])
        differ[rid] = what
    print(f"\ndefaults agreeing with upstream: {agree} of {rendered}; differing: {differ}")
    assert differ == DIVERGENCES
    assert agree == rendered - len(DIVERGENCES)


# ------------------------------------------------------------------------------ specific rules
def test_variant_nvidia_block_applies_on_hopper(full_tree: RecipeTree, raw: dict[str, Any]) -> None:
    """A variant's hardware_overrides.nvidia is the brand fallback when no generation block matches."""
    rid = "dots-studio/dots3-note-prev"
    block = raw["models"][rid]["variants"]["default"]["hardware_overrides"]["nvidia"]["extra_args"]
    assert "hopper" not in raw["models"][rid]["variants"]["default"]["hardware_overrides"]
    (proc,) = engine_processes(build_plan(full_tree, Selection(recipe=rid, hardware="h200")))
    argv = proc.argv
    assert argv[argv.index(block[0]) + 1] == block[1]
    assert proc.provenance[block[0]][-1].origin.endswith("variants.default.hardware_overrides.nvidia")


@pytest.mark.parametrize("rid", ["MiniMaxAI/MiniMax-M2.5", "thinkingmachines/Inkling-Small", "XiaomiMiMo/MiMo-V2.5", "Qwen/Qwen3-8B"])
def test_single_node_tp_follows_the_recipe(full_tree: RecipeTree, raw: dict[str, Any], rid: str) -> None:
    """Declared TP (variant, then strategy_overrides.single_node_tp; maps by hardware) or auto-fit,
    never simply the whole node; the process and the capacity count only the GPUs used."""
    rec, tax = raw["models"][rid], raw["taxonomy"]
    want = upstream_default(rec, tax, raw["strategies"])
    assert want is not None and want["strategy"] == "single_node_tp"
    assert want["tp"] < tax[want["hardware"]]["gpu_count"]
    plan = build_plan(full_tree, Selection(recipe=rid, hardware=want["hardware"], strategy="single_node_tp"))
    (proc,) = engine_processes(plan)
    assert flags(SCHEMA, proc)["--tensor-parallel-size"].value == str(want["tp"])
    assert proc.gpus == want["tp"] and plan.capacity.pools[0].gpus == want["tp"]
    per_gpu = tax[want["hardware"]]["vram_gb"] / tax[want["hardware"]]["gpu_count"]
    assert plan.capacity.pools[0].gpu_memory_gb == pytest.approx(want["tp"] * per_gpu)
    assert any(n.code == "single-node-tp" for n in plan.notices)


def test_a_recipe_sizing_its_own_one_node_layout_is_placed_as_it_asks(full_tree: RecipeTree, raw: dict[str, Any]) -> None:
    """strategy_overrides.single_node_dep --data-parallel-size 4 wins over the placement (as upstream's
    last-wins order has it), and the placement follows: 4 DP ranks, 4 local, 4 GPUs."""
    rid = "deepseek-ai/DeepSeek-V4-Flash"
    args = raw["models"][rid]["strategy_overrides"]["single_node_dep"]["extra_args"]
    dp = args[args.index("--data-parallel-size") + 1]
    plan = build_plan(full_tree, Selection(recipe=rid, hardware="h200", strategy="single_node_dep"))
    check_plan(SCHEMA, plan)
    (proc,) = engine_processes(plan)
    got = flags(SCHEMA, proc)
    assert got["--data-parallel-size"].value == got["--data-parallel-size-local"].value == dp
    assert proc.gpus == int(dp) and any(n.code == "recipe-layout" for n in plan.notices)


def test_a_pool_the_recipe_sizes_is_composed_once(full_tree: RecipeTree, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's own size is read from the pool's layers before the pool is composed: one
    composition per engine process, at the size that runs."""
    composed: list[str] = []
    real = planning_pools.compose

    def counting(*args: Any, **kwargs: Any) -> Any:
        composed.append("one")
        return real(*args, **kwargs)

    monkeypatch.setattr(planning_pools, "compose", counting)
    plan = build_plan(full_tree, Selection(recipe="deepseek-ai/DeepSeek-V4-Flash", hardware="h200", strategy="single_node_dep"))
    assert any(n.code == "recipe-layout" for n in plan.notices)
    assert len(composed) == len(engine_processes(plan)) == 1


@pytest.mark.parametrize("tree_name", ["latest-full", "seed-era", "bundled"])
def test_pd_env_strips_nvl4_only_keys_off_gb200_gb300(tree_name: str) -> None:
    """NCCL symmetric memory / cross-node NVLink / UCX device keys are for GB200/GB300 NVL4 trays:
    removed from every P/D process on other GPUs (Kimi K3 on b300 too), kept on gb300."""
    t = RecipeTree() if tree_name == "bundled" else RecipeTree(UPSTREAM / tree_name)
    nvl4 = {"VLLM_USE_NCCL_SYMM_MEM", "NCCL_CUMEM_ENABLE", "NCCL_MNNVL_ENABLE", "NCCL_NVLS_ENABLE", "UCX_NET_DEVICES"}
    on_b300 = build_plan(t, Selection(recipe="moonshotai/Kimi-K3", strategy="pd_cluster", hardware="b300"))
    on_gb300 = build_plan(t, Selection(recipe="moonshotai/Kimi-K3", strategy="pd_cluster", hardware="gb300"))
    for p in engine_processes(on_b300):
        assert not nvl4 & set(p.env), (p.id, sorted(nvl4 & set(p.env)))
        assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in p.env  # other P/D env stays
    removed = {k for p in engine_processes(on_b300) for k in nvl4 if k in p.provenance}
    kept = {k for p in engine_processes(on_gb300) for k in nvl4 if k in p.env}
    assert removed and removed == kept  # what gb300 keeps, b300 had and lost
    for k in removed:
        assert any(n.code == "overridden" and n.message.startswith(f"env {k}:") and "removed" in n.message for n in on_b300.notices)
    check_plan(SCHEMA, on_b300)


def test_seed_one_node_tep_prefill_pool_has_no_cross_node_tuning() -> None:
    """seed-era multi_node_tep carries -cc.pass_config.fuse_allreduce_rms=False for TEP across nodes;
    a one-node TEP prefill pool takes single_node_tep's args instead, a two-node one keeps it."""
    t = RecipeTree(UPSTREAM / "seed-era")
    cross = "--compilation-config.pass_config.fuse_allreduce_rms"
    assert "-cc.pass_config.fuse_allreduce_rms=False" in t.strategies["multi_node_tep"].vllm_args
    for nodes, want in ((1, False), (2, True)):
        plan = build_plan(t, Selection(recipe="moonshotai/Kimi-K3", hardware="b300", strategy="pd_cluster", prefill_nodes=nodes))
        prefill = [p for p in engine_processes(plan) if p.role == "prefill"]
        assert len(prefill) == nodes
        assert all((cross in flags(SCHEMA, p)) is want for p in prefill), (nodes, [p.argv for p in prefill])
        assert all(flags(SCHEMA, p)["--enable-expert-parallel"].polarity for p in prefill)


def test_dotted_config_keys_are_flags_as_vllm_parses_them(full_tree: RecipeTree, raw: dict[str, Any]) -> None:
    """--speculative-config.method mtp and --limit-mm-per-prompt.video 0 (upstream spellings) are
    sub-keys of JSON flags: accepted, checked, and emitted as one --flag.key=value word each."""
    glm = raw["models"]["zai-org/GLM-4.5"]["features"]["spec_decoding"]["args"]
    plan = build_plan(full_tree, Selection(recipe="zai-org/GLM-4.5", features=("spec_decoding",)))
    got = flags(SCHEMA, engine_processes(plan)[0])
    for i in range(0, len(glm), 2):
        base, _, path = glm[i].partition(".")
        assert got[f"{base}.{path}"].value == str(glm[i + 1])
    glyph = build_plan(full_tree, Selection(recipe="zai-org/Glyph"))
    assert "--limit-mm-per-prompt.video" in flags(SCHEMA, engine_processes(glyph)[0])
    args, problems = SCHEMA.parse(["--speculative-config.method", "mtp", "--limit-mm-per-prompt.video", "0", "--max-num-seqs.x", "1"])
    assert [a.key for a in args] == ["--speculative-config.method", "--limit-mm-per-prompt.video"]
    assert [p.code for p in problems] == ["bad-dotted"]  # an int flag: vLLM's int() would refuse the folded JSON


def test_config_fields_vllm_refuses_are_refused_and_linted(full_tree: RecipeTree, raw: dict[str, Any]) -> None:
    rid = "inclusionAI/Ring-1T-FP8"
    extra = raw["models"][rid]["variants"]["default"]["extra_args"]
    value = extra[extra.index("--compilation-config") + 1]
    with pytest.raises(K3Error) as info:
        build_plan(full_tree, Selection(recipe=rid))
    assert info.value.code == "unknown-field" and "use_inductor" in info.value.message and "variants.default" in info.value.message
    found = lint(SCHEMA, ["vllm", "serve", "m", "--compilation-config", value]) + lint(SCHEMA, ["vllm", "serve", "m", "-cc.use_inductr_graph_partition=True"])
    assert [(f.code, f.severity) for f in found] == [("unknown-field", "error")] * 2
    assert "use_inductor_graph_partition" in found[1].hint  # did you mean
    ok = lint(SCHEMA, ["vllm", "serve", "m", "-cc.use_inductor_graph_partition=True", "--compilation-config.pass_config.x=1"])
    assert [f.code for f in ok] == ["dotted-spellings"]  # vLLM folds -cc.* and --compilation-config.* apart: one is lost


def test_a_modal_feature_runs_one_mode(full_tree: RecipeTree, raw: dict[str, Any]) -> None:
    """A variant's default_modes turns an opt-in feature on in its mode; --feature NAME=MODE picks
    another offered mode; a mode the variant is not offered is refused."""
    rid = "deepseek-ai/DeepSeek-V4-Flash"
    rec = raw["models"][rid]
    (feature, mode), = rec["variants"]["default"]["default_modes"].items()
    assert feature in rec["opt_in_features"]
    modes = rec["features"][feature]["modes"]

    def spec(plan: Plan) -> str | None:
        arg = flags(SCHEMA, engine_processes(plan)[0]).get("--speculative-config")
        return arg.value if arg is not None else None

    plan = build_plan(full_tree, Selection(recipe=rid))
    assert feature in plan.features and spec(plan) == modes[mode]["args"][1]
    others = [m for m, body in modes.items() if m != mode and (not body.get("variants") or "default" in body["variants"])]
    hidden = [m for m, body in modes.items() if body.get("variants") and "default" not in body["variants"]]
    for other in others:
        assert spec(build_plan(full_tree, Selection(recipe=rid, features=(f"{feature}={other}",)))) == modes[other]["args"][1]
    for other in hidden:
        with pytest.raises(K3Error) as info:
            build_plan(full_tree, Selection(recipe=rid, features=(f"{feature}={other}",)))
        assert info.value.code == "unknown-feature-mode" and mode in info.value.hint
    assert others or hidden


def test_the_router_takes_the_recipes_pinned_dp_size(raw: dict[str, Any]) -> None:
    rid = "moonshotai/Kimi-K3"
    pinned = raw["models"][rid]["strategy_overrides"]["pd_cluster"]["router"]["intra_node_data_parallel_size"]
    plan = build_plan(RecipeTree(FULL), Selection(recipe=rid, strategy="pd_cluster"))
    (router,) = [p for p in plan.processes if p.role == "router"]
    assert router.argv[router.argv.index("--intra-node-data-parallel-size") + 1] == str(pinned)
    assert "--intra-node-data-parallel-size" not in next(p for p in build_plan(RecipeTree(), Selection(strategy="pd_cluster")).processes
                                                           if p.role == "router").argv


def test_recipes_show_names_the_default_selection_plan_would_make(tmp_path: Path) -> None:
    """`recipes show` states the default `plan --recipe ID` selects (the recipes project's rules),
    or why the recipe is not planned -- not only the author's meta.default_hardware."""
    from inventory_helpers import run_cli

    root = str(UPSTREAM / "latest-full")
    r = run_cli(["recipes", "--recipes-dir", root, "--json", "show", "deepseek-ai/DeepSeek-V4-Flash"], tmp_path)
    assert r.code == 0, r.stdout + r.stderr
    assert r.json()["default"] == {"hardware": "h200", "strategy": "single_node_tep", "nodes": 1, "variant": "default"}
    r = run_cli(["recipes", "--recipes-dir", root, "--json", "show", "OpenMOSS-Team/MOSS-SoundEffect"], tmp_path)
    assert r.code == 0 and r.json()["default"]["refused"] == "omni-recipe", r.stdout
