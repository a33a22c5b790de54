"""The options of a resolved selection that are not its layout: features (and their modes) and KV offload."""

from __future__ import annotations

import difflib

from k3launch.errors import K3Error
from k3launch.models.recipe import Feature, HardwareProfile, Recipe, Strategy, Variant
from k3launch.models.selection import KV_OFFLOAD_OFF, Notice, Selection
from k3launch.planning import rules
from k3launch.planning.recipes import RecipeTree


def unknown(kind: str, name: str, known: list[str]) -> K3Error:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return K3Error(f"unknown-{kind}", f"unknown {kind} {name!r}", hint + "choose one of: " + ", ".join(known))


def features(recipe: Recipe, sel: Selection, sname: str, variant: Variant, vname: str, hw_id: str, hw: HardwareProfile,
             notices: list[Notice]) -> tuple[list[str], dict[str, str]]:
    """The features that run, in the recipe's order, and the mode of each modal one.

    On by default: every feature not opt-in (``opt_in_features``, ``hardware_opt_in_features`` of
    the hardware id, generation or brand), plus those the variant's ``default_modes`` names.
    ``--feature NAME=MODE`` picks a mode."""
    asked: dict[str, str | None] = {}
    for text in sel.features:
        name, eq, mode = text.partition("=")
        asked[name] = mode if eq else None
    known = list(recipe.features)
    for f in (*asked, *sel.no_features):
        if f not in recipe.features:
            raise unknown("feature", f, known)
    both = set(asked) & set(sel.no_features)
    if both:
        raise K3Error("feature-conflict", f"--feature and --no-feature both name {', '.join(sorted(both))}", "keep one of them")
    opt_in = set(recipe.opt_in_features)
    for key in (hw_id, hw.generation, hw.brand.lower()):
        opt_in |= set(recipe.hardware_opt_in_features.get(key, []))
    forced = set(variant.default_modes)
    out: list[str] = []
    modes: dict[str, str] = {}
    defaults: list[str] = []
    for name, feat in recipe.features.items():
        on = (name in asked or name in forced or name not in opt_in) and name not in sel.no_features
        if not on:
            continue
        if feat.strategies is not None and sname not in feat.strategies:
            if name in asked:
                raise K3Error("feature-strategy", f"feature {name} does not apply to {sname}", "it applies to: " + ", ".join(feat.strategies))
            notices.append(Notice("feature-skipped", f"default feature {name} does not apply to {sname}; skipped"))
            continue
        if feat.modes:
            picked = _mode(feat, name, asked.get(name), variant, vname, hw_id, hw)
            if picked is None:
                notices.append(Notice("feature-skipped", f"feature {name} offers no mode for variant {vname} on {hw_id}; skipped"))
                continue
            modes[name] = picked
        out.append(name)
        if name not in asked:
            defaults.append(name)
    if defaults:
        notices.append(Notice("default-features", f"features on by recipe default: {', '.join(defaults)} (drop with --no-feature NAME)"))
    if modes:
        notices.append(Notice("feature-modes", "modes: " + ", ".join(f"{f}={m}" for f, m in modes.items()) + " (pick another with --feature NAME=MODE)"))
    return out, modes


def _mode(feat: Feature, name: str, asked: str | None, variant: Variant, vname: str, hw_id: str, hw: HardwareProfile) -> str | None:
    offered = rules.offered_modes(feat, vname, hw_id, hw)
    if asked is not None and asked not in offered:
        why = f"is not offered with variant {vname} on {hw_id}" if asked in feat.modes else "is not one of its modes"
        raise K3Error("unknown-feature-mode", f"feature {name}: mode {asked!r} {why}",
                      "choose one of: " + ", ".join(offered) if offered else f"this variant and hardware offer no mode of {name}")
    return rules.feature_mode(feat, name, variant, vname, hw_id, hw, asked)


def kv_offload(tree: RecipeTree, recipe: Recipe, kv: str, strategy: Strategy, hw_id: str, hw: HardwareProfile, notices: list[Notice]) -> str:
    options = tree.taxonomy.kv_offload
    known = [KV_OFFLOAD_OFF, *options, "mooncake"]
    if kv == KV_OFFLOAD_OFF:
        return kv
    if hw.is_cpu and kv in known:
        raise K3Error("kv-offload-hardware", f"KV offload {kv!r} moves GPU KV cache to host memory; {hw_id} is a CPU profile, "
                      "its KV cache is in host memory already (VLLM_CPU_KVCACHE_SPACE sizes it)", "use --kv-offload off")
    if strategy.deploy_type == "pd_cluster":
        raise K3Error("kv-offload-pd", f"KV offload {kv!r} is not available with P/D disaggregation (the NIXL KV transfer owns --kv-transfer-config)", "use --kv-offload off")
    if kv == "mooncake":
        stores = [s for s in tree.kv_stores if "mooncake" in s] or ["mooncake"]
        if all(recipe.kv_cache_strategy_hardware.get(s, {}).get(hw_id) == "unsupported" for s in stores) or not tree.kv_stores:
            raise K3Error("kv-offload-unsupported", f"Mooncake KV offload is marked unsupported on {hw_id} for {recipe.meta.title}", "use --kv-offload simple (CPU) or off")
        raise K3Error("kv-offload-unsupported", "k3launch does not deploy Mooncake stores", "use --kv-offload simple or lmcache")
    if kv not in options:
        raise unknown("kv-offload", kv, known)
    opt = options[kv]
    if opt.strategies is not None and strategy.name not in opt.strategies:
        raise K3Error("kv-offload-strategy", f"KV offload {kv!r} is not available with {strategy.name}", "it works with: " + ", ".join(opt.strategies))
    if opt.brands is not None and hw.brand not in opt.brands:
        raise K3Error("kv-offload-hardware", f"KV offload {kv!r} is not available on {hw.brand} GPUs", "use --kv-offload simple or off")
    support = recipe.kv_offload_support.get(kv)
    if support == "unsupported":
        raise K3Error("kv-offload-recipe", f"{recipe.meta.title} marks KV offload {kv!r} unsupported", "use another option")
    if opt.requires_opt_in and support is None:
        raise K3Error("kv-offload-recipe", f"{recipe.meta.title} does not list KV offload {kv!r} as supported", "use another option")
    if opt.companion is not None:
        notices.append(Notice("kv-offload-companion", f"{kv} needs its {opt.companion.label} running on each node before vllm serve"))
    return kv


def kv_offload_matrix(tree: RecipeTree, recipe: Recipe, hw_id: str) -> dict[str, dict[str, bool]]:
    """Which KV offload option works with which strategy of ``recipe`` on ``hw_id``."""
    hw = tree.taxonomy.hardware_profiles[hw_id]
    options = [KV_OFFLOAD_OFF, *tree.taxonomy.kv_offload, "mooncake"]
    out: dict[str, dict[str, bool]] = {}
    for sname in recipe.compatible_strategies or sorted(tree.strategies):
        strategy = tree.strategies.get(sname)
        if strategy is None:
            continue
        row: dict[str, bool] = {}
        for opt in options:
            try:
                kv_offload(tree, recipe, opt, strategy, hw_id, hw, [])
                row[opt] = True
            except K3Error:
                row[opt] = False
        out[sname] = row
    return out
