"""Resolve a :class:`Selection` against a recipes tree: defaults, floors, capacity, features, KV offload.

Order of checks (docs/planning.md ("Defaults and the order of checks")): defaults are filled in, strategy floors raise node
counts (with a notice), then capacity is checked on the result and refused with the smallest
node count that would fit. When the user named no strategy and the recipe's default cannot hold
the weights on the chosen hardware, its multi-node sibling is taken at the smallest fitting size.
"""

from __future__ import annotations

import difflib
import math

from k3launch.defaults import DEFAULT_RECIPE
from k3launch.errors import K3Error
from k3launch.models.plan import EngineRole
from k3launch.models.recipe import HardwareProfile, Recipe, Strategy
from k3launch.models.selection import (
    KV_OFFLOAD_OFF,
    MAX_POOL_NODES,
    MULTI_NODE_SIBLING,
    POOL_FLOOR_STRATEGY,
    POOL_PARALLELISMS,
    Notice,
    Pool,
    Resolved,
    Selection,
    is_multi_node,
    parallelism_of,
)
from k3launch.planning import capacity
from k3launch.planning.capacity import HostMemory
from k3launch.planning.recipes import RecipeTree


def _unknown(kind: str, name: str, known: list[str]) -> K3Error:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return K3Error(f"unknown-{kind}", f"unknown {kind} {name!r}", hint + "choose one of: " + ", ".join(known))


def _pick_recipe(tree: RecipeTree, sel: Selection, notices: list[Notice]) -> str:
    """``--recipe``; else Kimi K3 — unless the hardware asked for (``--hardware`` or the inventory's)
    is not one K3 lists and exactly one recipe of the tree names it as its default hardware (the
    tiny CPU model on ``inventories/local-cpu.yaml``); else the tree's only recipe."""
    if sel.recipe:
        return tree.resolve(sel.recipe)
    ids = tree.model_ids()
    if DEFAULT_RECIPE in ids:
        if sel.hardware is None or sel.hardware in tree.model(DEFAULT_RECIPE).meta.hardware:
            return DEFAULT_RECIPE
        own = [i for i in ids if i != DEFAULT_RECIPE and tree.model(i).meta.default_hardware == sel.hardware]
        if len(own) == 1:
            notices.append(Notice("default-recipe", f"{own[0]}: the recipe for {sel.hardware} ({DEFAULT_RECIPE} does not list it)"))
            return own[0]
        return DEFAULT_RECIPE
    if len(ids) == 1:
        return ids[0]
    raise K3Error("no-recipe", "no --recipe given and this tree has no default", "pass --recipe ORG/MODEL")


def _pick_hardware(tree: RecipeTree, recipe: Recipe, sel: Selection, variant_hw: list[str] | None) -> str:
    profiles = tree.taxonomy.hardware_profiles
    visible = [h for h, p in profiles.items() if not p.restricted or h in recipe.meta.hardware]
    hw = sel.hardware or recipe.meta.default_hardware or next(iter(recipe.meta.hardware), None)
    if hw is None:
        raise K3Error("no-hardware", "no --hardware given and the recipe names no default", "pass --hardware ID")
    if hw not in profiles:
        raise _unknown("hardware", hw, visible)
    if profiles[hw].restricted and hw not in recipe.meta.hardware:
        listing = _recipes_listing(tree, hw)
        raise K3Error("restricted-hardware", f"{hw} is restricted and this recipe does not list it",
                      "choose: " + ", ".join(visible) + (f"; or a recipe that lists {hw}: --recipe {' | '.join(listing)}" if listing else ""))
    if variant_hw is not None and hw not in variant_hw:
        raise K3Error("variant-hardware", f"this variant supports only {', '.join(variant_hw)}", "choose one of them")
    return hw


def _recipes_listing(tree: RecipeTree, hw: str) -> list[str]:
    """Recipes of the tree that list ``hw`` (read only to word a refusal; broken files are skipped)."""
    out = []
    for rid in tree.model_ids():
        try:
            if hw in tree.model(rid).meta.hardware:
                out.append(rid)
        except K3Error:
            continue
    return out


def _strategy_allowed(recipe: Recipe, name: str, hw: str) -> bool:
    grant = recipe.strategy_hardware.get(name, {}).get(hw)
    if grant == "unsupported":
        return False
    if grant == "supported":
        return True
    return not recipe.compatible_strategies or name in recipe.compatible_strategies


def _get_strategy(tree: RecipeTree, recipe: Recipe, name: str, hw: str) -> Strategy:
    strategies = tree.strategies
    if name not in strategies:
        raise _unknown("strategy", name, sorted(strategies))
    if not _strategy_allowed(recipe, name, hw):
        ok = [s for s in strategies if _strategy_allowed(recipe, s, hw)]
        raise K3Error("incompatible-strategy", f"{recipe.meta.title} does not support {name} on {hw}", "choose one of: " + ", ".join(ok))
    return strategies[name]


def floor_nodes(recipe: Recipe, strategy_name: str, strategy: Strategy | None, hw_id: str, hw: HardwareProfile, multi: bool) -> tuple[int, str]:
    """Smallest node count a strategy (or pool floor strategy) allows on ``hw``."""
    min_gpus = recipe.strategy_min_gpus.get(strategy_name)
    if min_gpus is None:
        min_gpus = strategy.hardware_match.min_gpus if strategy else 1
    why = f"{strategy_name} needs at least {min_gpus} GPUs"
    hw_min = recipe.strategy_min_gpus.get(hw_id)
    if hw_min is not None and hw_min > min_gpus:
        min_gpus, why = hw_min, f"{hw_id} needs at least {hw_min} GPUs"
    nodes = max(1, math.ceil(min_gpus / hw.gpu_count))
    if multi and nodes < 2:
        nodes, why = 2, f"{strategy_name} is a multi-node strategy"
    return nodes, why


def _size(requested: int | None, floor: int, why: str, fit: int, label: str, notices: list[Notice], auto_fit: bool) -> int:
    """Apply the floor, then (for defaults only) grow to fit; explicit counts are checked later."""
    if requested is not None and requested < 1:
        raise K3Error("bad-nodes", f"{label} node count must be at least 1 (got {requested})", "")
    if requested is None:
        n = floor
        if auto_fit and fit > n:
            notices.append(Notice("nodes-for-capacity", f"{label}: {fit} nodes, the smallest count that holds the weights"))
            n = fit
        return n
    if requested < floor:
        notices.append(Notice("floor-raised", f"{label}: --nodes {requested} raised to {floor} ({why})"))
        return floor
    return requested


def resolve(tree: RecipeTree, sel: Selection, host_memory: HostMemory | None = None) -> Resolved:
    """``host_memory``: the inventory's node RAM, which a CPU profile's capacity is checked against."""
    notices: list[Notice] = []
    recipe_id = _pick_recipe(tree, sel, notices)
    recipe = tree.model(recipe_id)
    vname = sel.variant or ("default" if "default" in recipe.variants else next(iter(recipe.variants)))
    if vname not in recipe.variants:
        raise _unknown("variant", vname, list(recipe.variants))
    variant = recipe.variants[vname]
    hw_id = _pick_hardware(tree, recipe, sel, variant.supported_hardware)
    hw = tree.taxonomy.hardware_profiles[hw_id]
    verified = recipe.meta.hardware.get(hw_id) == "verified"
    if not verified:
        notices.append(Notice("unverified-hardware", f"{hw_id} is not marked verified by the {recipe.meta.title} recipe; the command is composed but untested there"))
    w = capacity.weights(recipe, variant)
    mem = capacity.node_memory(hw_id, hw, host_memory)
    if mem.host:
        notices.append(Notice("host-memory-capacity", f"{hw_id} is a CPU profile: capacity is checked against host memory, "
                                                      f"{capacity.gb_text(mem.gb)} GB per node ({mem.source})"))
    fit = capacity.nodes_to_fit(w.gb, mem)

    pd_asked = any(v is not None for v in (sel.prefill_strategy, sel.prefill_nodes, sel.decode_strategy, sel.decode_nodes))
    sname = sel.strategy or ("pd_cluster" if pd_asked else recipe.default_strategy or "single_node_tp")
    if sel.strategy is None and not pd_asked:
        sibling = MULTI_NODE_SIBLING.get(sname)
        wants_multi = (sel.nodes or 1) > 1 or fit > 1
        if sibling and wants_multi and _strategy_allowed(recipe, sibling, hw_id) and sibling in tree.strategies:
            why = f"{hw_id} x1 holds {mem.text()} < {w.gb:g} GB of weights" if fit > 1 else f"--nodes {sel.nodes}"
            notices.append(Notice("strategy-defaulted", f"default strategy {sname} replaced by {sibling} ({why})"))
            sname = sibling
    strategy = _get_strategy(tree, recipe, sname, hw_id)
    if pd_asked and strategy.deploy_type != "pd_cluster":
        raise K3Error("pd-options", f"--prefill-*/--decode-* apply to pd_cluster, not {sname}", "pass --strategy pd_cluster or drop them")

    if strategy.deploy_type == "pd_cluster":
        if sel.nodes is not None:
            raise K3Error("pd-nodes", "pd_cluster sizes its pools with --prefill-nodes/--decode-nodes, not --nodes", "drop --nodes")
        pools = [
            _pd_pool(tree, recipe, "prefill", sel.prefill_strategy, sel.prefill_nodes, hw_id, hw, fit, notices),
            _pd_pool(tree, recipe, "decode", sel.decode_strategy, sel.decode_nodes, hw_id, hw, fit, notices),
        ]
    else:
        multi = is_multi_node(strategy)
        floor, why = floor_nodes(recipe, sname, strategy, hw_id, hw, multi)
        if not multi and sel.nodes is not None and sel.nodes > 1:
            raise K3Error("single-node-strategy", f"{sname} runs on one node (got --nodes {sel.nodes})", f"use {MULTI_NODE_SIBLING.get(sname, 'a multi_node_* strategy')} for several nodes")
        if not multi and not capacity.fits(w.gb, mem, 1):
            sib = MULTI_NODE_SIBLING.get(sname, "a multi_node_* strategy")
            raise K3Error("does-not-fit", f"1 x {hw_id} = {mem.text()} cannot hold the {w.gb:g} GB of weights ({sname} runs on one node)",
                          f"use --strategy {sib} (smallest that fits: {max(fit, 2)} nodes); KV offload moves KV cache, never weights")
        if not multi and floor > 1:
            raise K3Error("single-node-strategy", f"{sname} needs {why.split(' needs ')[-1]}, more than one {hw_id} node ({hw.gpu_count} GPUs)",
                          f"use {MULTI_NODE_SIBLING.get(sname, 'a multi_node_* strategy')}")
        par = parallelism_of(strategy)
        if par == "replicas" and not capacity.fits(w.gb, mem, 1):
            raise K3Error("does-not-fit", f"1 x {hw_id} = {mem.text()} cannot hold the {w.gb:g} GB of weights ({sname}: every node holds a whole copy)",
                          f"use a strategy that splits the model over nodes (smallest that fits: {max(fit, 2)} nodes)")
        n = _size(sel.nodes, floor, why, 1 if par == "replicas" or not multi else fit, sname, notices, auto_fit=True)
        pools = [Pool("serve", par, n, hw.gpu_count)]

    for pool in pools:
        if not capacity.fits(w.gb, mem, 1 if pool.parallelism == "replicas" else pool.nodes):
            need = max(fit, pool.nodes + 1)
            where = f"the {pool.role} pool" if strategy.deploy_type == "pd_cluster" else "this deployment"
            flag = f"--{pool.role}-nodes" if strategy.deploy_type == "pd_cluster" else "--nodes"
            raise K3Error(
                "does-not-fit",
                f"{pool.nodes} x {hw_id} = {mem.text(pool.nodes)} cannot hold the {w.gb:g} GB of weights of {where}",
                f"use {flag} {need} or more (smallest that fits: {need}); KV offload moves KV cache, never weights",
            )
    features = _features(recipe, sel, sname, hw_id, hw, notices)
    kv = _kv_offload(tree, recipe, sel.kv_offload, strategy, hw_id, hw, notices)
    return Resolved(
        recipe_id=recipe_id, recipe=recipe, variant_name=vname, variant=variant, hardware_id=hw_id,
        hardware=hw, strategy=strategy, pools=pools, features=features, kv_offload=kv,
        weights_gb=w.gb, weights_formula=w.formula, verified=verified, selection=sel, notices=notices, node_memory_gb=mem.gb,
    )


def _pd_pool(tree: RecipeTree, recipe: Recipe, role: EngineRole, asked: str | None, nodes: int | None, hw_id: str, hw: HardwareProfile, fit: int, notices: list[Notice]) -> Pool:
    ov = recipe.strategy_overrides.get("pd_cluster")
    role_ov = getattr(ov, role) if ov else None
    default = (role_ov.parallelism if role_ov and role_ov.parallelism else None) or ("tep" if role == "prefill" else "dep")
    par = (asked or default).lower()
    par = {"multi_node_tp": "tp", "multi_node_tep": "tep", "multi_node_dep": "dep", "single_node_tp": "tp"}.get(par, par)
    pool_par = next((x for x in POOL_PARALLELISMS if x == par), None)
    if pool_par is None:
        raise _unknown(f"{role}-strategy", par, list(POOL_PARALLELISMS))
    if nodes is not None and nodes > MAX_POOL_NODES:
        raise K3Error("pool-too-large", f"--{role}-nodes {nodes}: a P/D pool has 1 to {MAX_POOL_NODES} nodes", f"use at most {MAX_POOL_NODES}")
    fs = POOL_FLOOR_STRATEGY[pool_par]
    floor, why = floor_nodes(recipe, fs, tree.strategies.get(fs), hw_id, hw, multi=False)
    requested = nodes if nodes is not None else (role_ov.nodes if role_ov and role_ov.nodes else None)
    n = _size(requested, floor, why, fit, f"{role} pool ({par})", notices, auto_fit=nodes is None)
    if n > MAX_POOL_NODES:
        raise K3Error("pool-too-large", f"the {role} pool needs {n} nodes; a P/D pool has at most {MAX_POOL_NODES}", "choose larger GPUs")
    return Pool(role, pool_par, n, hw.gpu_count)


def _features(recipe: Recipe, sel: Selection, sname: str, hw_id: str, hw: HardwareProfile, notices: list[Notice]) -> list[str]:
    known = list(recipe.features)
    for f in (*sel.features, *sel.no_features):
        if f not in recipe.features:
            raise _unknown("feature", f, known)
    both = set(sel.features) & set(sel.no_features)
    if both:
        raise K3Error("feature-conflict", f"--feature and --no-feature both name {', '.join(sorted(both))}", "keep one of them")
    opt_in = set(recipe.opt_in_features)
    for key in (hw_id, hw.generation, hw.brand.lower()):
        opt_in |= set(recipe.hardware_opt_in_features.get(key, []))
    out: list[str] = []
    defaults: list[str] = []
    for name, feat in recipe.features.items():
        asked = name in sel.features
        on = (asked or name not in opt_in) and name not in sel.no_features
        if not on:
            continue
        if feat.strategies is not None and sname not in feat.strategies:
            if asked:
                raise K3Error("feature-strategy", f"feature {name} does not apply to {sname}", "it applies to: " + ", ".join(feat.strategies))
            notices.append(Notice("feature-skipped", f"default feature {name} does not apply to {sname}; skipped"))
            continue
        out.append(name)
        if not asked:
            defaults.append(name)
    if defaults:
        notices.append(Notice("default-features", f"features on by recipe default: {', '.join(defaults)} (drop with --no-feature NAME)"))
    return out


def _kv_offload(tree: RecipeTree, recipe: Recipe, kv: str, strategy: Strategy, hw_id: str, hw: HardwareProfile, notices: list[Notice]) -> str:
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
        raise _unknown("kv-offload", kv, known)
    opt = options[kv]
    if opt.strategies is not None and strategy.name not in opt.strategies:
        raise K3Error("kv-offload-strategy", f"KV offload {kv!r} is not available with {strategy.name}", "it works with: " + ", ".join(opt.strategies))
    if opt.brands is not None and hw.brand not in opt.brands:
        raise K3Error("kv-offload-hardware", f"KV offload {kv!r} is not available on {hw.brand} GPUs", "use --kv-offload simple or off")
    if opt.requires_opt_in and recipe.kv_offload_support.get(kv) is None:
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
                _kv_offload(tree, recipe, opt, strategy, hw_id, hw, [])
                row[opt] = True
            except K3Error:
                row[opt] = False
        out[sname] = row
    return out
