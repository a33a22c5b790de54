"""Resolve a :class:`Selection` against a recipes tree: defaults, floors, capacity, features, KV offload.

Order of checks (docs/planning.md ("Defaults and the order of checks")): defaults are filled in
by the recipes project's rules (:mod:`.rules`: hardware, strategy, single-node TP, features),
strategy floors raise node counts (with a notice), then capacity is checked on the result and
refused with the smallest node count that would fit. When the user named no strategy and one node
cannot hold the weights, the recipe's multi-node recommendation is taken at the smallest fitting
size.
"""

from __future__ import annotations

import math

from k3launch.defaults import DEFAULT_RECIPE
from k3launch.errors import K3Error
from k3launch.models.plan import EngineRole
from k3launch.models.recipe import HardwareProfile, Recipe, Strategy, Variant
from k3launch.models.selection import (
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
from k3launch.planning import capacity, options, rules
from k3launch.planning.capacity import HostMemory, NodeMemory
from k3launch.planning.options import kv_offload_matrix
from k3launch.planning.options import unknown as _unknown
from k3launch.planning.recipes import RecipeTree

__all__ = ["floor_nodes", "kv_offload_matrix", "resolve"]


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


def _pick_hardware(tree: RecipeTree, recipe: Recipe, variant: Variant, sel: Selection, notices: list[Notice]) -> str:
    profiles = tree.taxonomy.hardware_profiles
    visible = [h for h, p in profiles.items() if not p.restricted or h in recipe.meta.hardware]
    hw = sel.hardware
    if hw is None:
        found = rules.default_hardware(profiles, recipe, variant)
        if found is not None:
            hw, rule = found
            if hw != recipe.meta.default_hardware:
                notices.append(Notice("default-hardware", f"{hw}: {rule} (choose with --hardware)"))
        else:
            hw = recipe.meta.default_hardware or next(iter(recipe.meta.hardware), None)
    if hw is None:
        raise K3Error("no-hardware", "no --hardware given and the recipe names no default", "pass --hardware ID")
    if hw not in profiles:
        raise _unknown("hardware", hw, visible)
    if profiles[hw].restricted and hw not in recipe.meta.hardware:
        listing = _recipes_listing(tree, hw)
        raise K3Error("restricted-hardware", f"{hw} is restricted and this recipe does not list it",
                      "choose: " + ", ".join(visible) + (f"; or a recipe that lists {hw}: --recipe {' | '.join(listing)}" if listing else ""))
    if profiles[hw].vendor_platform == "other":
        # TPU, XPU, NPU profiles of the upstream tree: their engines need another vLLM build and
        # other device flags than the CUDA, ROCm and CPU runtimes k3launch renders
        listed = [h for h in recipe.meta.hardware if h in profiles and profiles[h].vendor_platform != "other"]
        others = [h for h in visible if profiles[h].vendor_platform != "other"]
        p = profiles[hw]
        raise K3Error("unsupported-platform", f"{hw} is {p.brand} {p.generation}: k3launch plans vLLM on CUDA, ROCm and CPU hardware only",
                      f"choose: --hardware {' | '.join(listed)}" if listed else
                      f"this recipe is verified on no CUDA, ROCm or CPU hardware; choose one anyway: --hardware {' | '.join(others[:6])}{' | ...' if len(others) > 6 else ''}")
    allowed = variant.supported_hardware
    if allowed and hw not in allowed:
        raise K3Error("variant-hardware", f"this variant supports only {', '.join(allowed)}", "choose one of them")
    c = rules.precision_constraint(variant)
    if not rules.precision_matches(profiles[hw], c) and c is not None:
        notices.append(Notice("precision-hardware", f"{variant.precision or 'this'} checkpoint targets {c.brand} {c.generation or ''} GPUs; "
                                                    f"{hw} is {profiles[hw].brand} {profiles[hw].generation} (the recipe page does not offer it there)"))
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


def _get_strategy(tree: RecipeTree, recipe: Recipe, name: str, hw_id: str, hw: HardwareProfile) -> Strategy:
    strategies = tree.strategies
    if name not in strategies:
        raise _unknown("strategy", name, sorted(strategies))
    if not rules.strategy_offered(recipe, name, hw_id, hw):
        ok = [s for s in strategies if rules.strategy_offered(recipe, s, hw_id, hw)]
        raise K3Error("incompatible-strategy", f"{recipe.meta.title} does not support {name} on {hw_id}", "choose one of: " + ", ".join(ok))
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


def resolve(tree: RecipeTree, sel: Selection, host_memory: HostMemory | None = None, replicas_default: int | None = None) -> Resolved:
    """``host_memory``: the inventory's node RAM, which a CPU profile's capacity is checked against;
    ``replicas_default``: the inventory's copies, where ``--replicas`` does not say (the recipe's
    come after it)."""
    notices: list[Notice] = []
    recipe_id = _pick_recipe(tree, sel, notices)
    recipe = tree.model(recipe_id)
    if rules.OMNI_TASK in recipe.meta.tasks:
        raise K3Error("omni-recipe", f"{recipe.meta.title} is served by vLLM-Omni (`vllm serve ... --omni`), which k3launch does not plan",
                      "choose a recipe without the omni task (`k3launch recipes` lists them)")
    vname = sel.variant or ("default" if "default" in recipe.variants else next(iter(recipe.variants)))
    if vname not in recipe.variants:
        raise _unknown("variant", vname, list(recipe.variants))
    variant = recipe.variants[vname]
    hw_id = _pick_hardware(tree, recipe, variant, sel, notices)
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
    sname = sel.strategy or ("pd_cluster" if pd_asked else _default_strategy(tree, recipe, hw_id, hw, sel, fit, mem, w.gb, notices))
    strategy = _get_strategy(tree, recipe, sname, hw_id, hw)
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
        pools = [_serve_pool(tree, recipe, variant, vname, strategy, hw_id, hw, sel, fit, mem, w.gb, notices)]

    for pool in pools:
        held = capacity.pool_fit(w.gb, mem, pool, hw)
        if not held.fits:
            if pool.nodes == 1 and pool.gpus_per_node < hw.gpu_count:
                raise K3Error("does-not-fit", f"TP {pool.gpus_per_node} x {hw_id} = {held.node.text()} cannot hold the {w.gb:g} GB of weights "
                              f"({sname} on {pool.gpus_per_node} of the node's {hw.gpu_count} GPUs, as the recipe declares)",
                              "choose hardware with larger GPUs, or a strategy that uses the whole node")
            need = max(fit, pool.nodes + 1)
            where = f"the {pool.role} pool" if strategy.deploy_type == "pd_cluster" else "this deployment"
            flag = f"--{pool.role}-nodes" if strategy.deploy_type == "pd_cluster" else "--nodes"
            raise K3Error(
                "does-not-fit",
                f"{pool.nodes} x {hw_id} = {mem.text(pool.nodes)} cannot hold the {w.gb:g} GB of weights of {where}",
                f"use {flag} {need} or more (smallest that fits: {need}); KV offload moves KV cache, never weights",
            )
    # The first default given wins: the inventory's, then the variant's, then the recipe's.
    below = "--replicas or the inventory's replicas: override it"
    defaults = [(replicas_default, "the inventory's replicas", "--replicas overrides it"),
                (variant.replicas, f"the recipe's variants.{vname}.replicas", below), (recipe.replicas, "the recipe's replicas", below)]
    replicas, replicas_from = _replicas(sel, strategy, pools, defaults, notices)
    features, modes = options.features(recipe, sel, sname, variant, vname, hw_id, hw, notices)
    kv = options.kv_offload(tree, recipe, sel.kv_offload, strategy, hw_id, hw, notices)
    used = [sname, *(POOL_FLOOR_STRATEGY[p.parallelism] for p in pools if strategy.deploy_type == "pd_cluster" and p.parallelism in POOL_FLOOR_STRATEGY)]
    notices += [Notice("ignored-key", k.notice()) for k in tree.ignored_keys(recipe_id, used)]
    return Resolved(
        recipe_id=recipe_id, recipe=recipe, variant_name=vname, variant=variant, hardware_id=hw_id,
        hardware=hw, strategy=strategy, pools=pools, features=features, kv_offload=kv,
        weights_gb=w.gb, weights_formula=w.formula, checkpoint_gb=w.on_disk_gb, verified=verified, selection=sel, notices=notices, node_memory_gb=mem.gb,
        feature_modes=modes, replicas=replicas, replicas_from=replicas_from,
    )


def _replicas(sel: Selection, strategy: Strategy, pools: list[Pool], defaults: list[tuple[int | None, str, str]],
              notices: list[Notice]) -> tuple[int, str]:
    """``--replicas``: copies of an aggregated engine of any layout, and who asked for them. P/D
    scales each pool by its own instances, and ``multi_node_replicas`` is one copy per node already:
    asked for there, copies are refused; a default (``defaults``: (count, whose, what overrides it),
    the first given wins) is left out with a notice."""
    if sel.replicas is None:
        default, source, over = next(((n, src, o) for n, src, o in defaults if n is not None), (None, "", ""))
        if default is not None and default > 1:
            if strategy.deploy_type == "pd_cluster" or any(p.parallelism == "replicas" for p in pools):
                notices.append(Notice("replicas-default", f"{source}: {default} left out: {strategy.name} is not served as copies"))
                return 1, source
            notices.append(Notice("replicas-default", f"{default} copies of the engine: {source} ({over})"))
            return default, source
    n = sel.replicas or 1
    if n > 1 and strategy.deploy_type == "pd_cluster":
        raise K3Error("replicas", "--replicas does not apply to pd_cluster: its pools are sized with --prefill-nodes/--decode-nodes",
                      "drop --replicas, or serve an aggregated strategy (multi_node_tep, multi_node_dep, ...) as copies")
    if n > 1 and any(p.parallelism == "replicas" for p in pools):
        raise K3Error("replicas", f"{strategy.name} runs one copy per node already: --replicas {n} would copy the copies",
                      f"use --nodes {n} with {strategy.name}, or --replicas {n} with single_node_tp")
    return n, "--replicas"


def _default_strategy(tree: RecipeTree, recipe: Recipe, hw_id: str, hw: HardwareProfile, sel: Selection, fit: int,
                      mem: NodeMemory, weights_gb: float, notices: list[Notice]) -> str:
    """The recipe's recommendation on ``hw`` (:func:`rules.default_strategy`): at two nodes when
    one cannot hold the weights (or ``--nodes`` asks for more)."""
    own = rules.recommend_strategy(recipe, 1)
    multi = (sel.nodes or 1) > 1 or fit > 1
    rec, _ = rules.default_strategy(recipe, tree.strategies, hw_id, hw, fits_one_node=not multi)
    if rec != own:
        if multi and rec.startswith("multi_node_"):
            why = f"{hw_id} x1 holds {mem.text()} < {weights_gb:g} GB of weights" if fit > 1 else f"--nodes {sel.nodes}"
        else:
            why = f"{own} is not offered on {hw_id}"
        notices.append(Notice("strategy-defaulted", f"default strategy {own} replaced by {rec} ({why})"))
    return rec


def _serve_pool(tree: RecipeTree, recipe: Recipe, variant: Variant, vname: str, strategy: Strategy, hw_id: str, hw: HardwareProfile,
                sel: Selection, fit: int, mem: NodeMemory, weights_gb: float, notices: list[Notice]) -> Pool:
    """The one pool of an aggregated (non-P/D) deployment: floors, then capacity, then TP."""
    sname = strategy.name
    multi = is_multi_node(strategy)
    floor, why = floor_nodes(recipe, sname, strategy, hw_id, hw, multi)
    if not multi and sel.nodes is not None and sel.nodes > 1:
        raise K3Error("single-node-strategy", f"{sname} runs on one node (got --nodes {sel.nodes})", f"use {MULTI_NODE_SIBLING.get(sname, 'a multi_node_* strategy')} for several nodes")
    if not multi and not capacity.fits(weights_gb, mem, 1):
        sib = MULTI_NODE_SIBLING.get(sname, "a multi_node_* strategy")
        offered = [s for s in rules.offered_strategies(recipe, tree.strategies, hw_id, hw) if s.startswith("multi_node_")]
        hint = (f"use --strategy {sib if sib in offered else offered[0]} (smallest that fits: {max(fit, 2)} nodes)" if offered
                else f"{recipe.meta.title} offers no multi-node strategy on {hw_id}: choose hardware with more memory per node")
        raise K3Error("does-not-fit", f"1 x {hw_id} = {mem.text()} cannot hold the {weights_gb:g} GB of weights ({sname} runs on one node)",
                      f"{hint}; KV offload moves KV cache, never weights")
    if not multi and floor > 1:
        raise K3Error("single-node-strategy", f"{sname} needs {why.split(' needs ')[-1]}, more than one {hw_id} node ({hw.gpu_count} GPUs)",
                      f"use {MULTI_NODE_SIBLING.get(sname, 'a multi_node_* strategy')}")
    par = parallelism_of(strategy)
    if par == "replicas" and not capacity.fits(weights_gb, mem, 1):
        raise K3Error("does-not-fit", f"1 x {hw_id} = {mem.text()} cannot hold the {weights_gb:g} GB of weights ({sname}: every node holds a whole copy)",
                      f"use a strategy that splits the model over nodes (smallest that fits: {max(fit, 2)} nodes)")
    n = _size(sel.nodes, floor, why, 1 if par == "replicas" or not multi else fit, sname, notices, auto_fit=True)
    gpus = hw.gpu_count
    if sname == "single_node_tp":  # only single_node_tp sizes its TP; TEP/DEP always take the whole node
        gpus, how = rules.single_node_tp(recipe, variant, vname, hw_id, hw)
        if gpus != hw.gpu_count:
            notices.append(Notice("single-node-tp", f"single_node_tp: TP {gpus} on {hw_id} ({hw.gpu_count} GPUs per node): {how}"))
    return Pool("serve", par, n, gpus)


def _pd_pool(tree: RecipeTree, recipe: Recipe, role: EngineRole, asked: str | None, nodes: int | None, hw_id: str, hw: HardwareProfile, fit: int, notices: list[Notice]) -> Pool:
    """One P/D pool: its layout (asked, else the recipe's for the role, else TP; within the
    recipe's pool modes), then nodes (asked; else the recipe's for the role, else the floor, grown
    until the pool holds the weights)."""
    ov = recipe.strategy_overrides.get("pd_cluster")
    role_ov = getattr(ov, role) if ov else None
    modes = rules.pool_modes(recipe)
    default = (role_ov.parallelism if role_ov and role_ov.parallelism else None) or "tp"
    if asked is None and default not in modes:
        notices.append(Notice("pool-mode", f"{role} pool: {default} is not among {recipe.meta.title}'s pool modes ({', '.join(modes)}); {modes[0]}"))
        default = modes[0]
    par = (asked or default).lower()
    par = {"multi_node_tp": "tp", "multi_node_tep": "tep", "multi_node_dep": "dep", "single_node_tp": "tp"}.get(par, par)
    pool_par = next((x for x in POOL_PARALLELISMS if x == par), None)
    if pool_par is None:
        raise _unknown(f"{role}-strategy", par, list(POOL_PARALLELISMS))
    if pool_par not in modes:
        raise K3Error("pool-mode", f"--{role}-strategy {pool_par}: {recipe.meta.title} offers P/D pools as {', '.join(modes)}", f"choose one of: {', '.join(modes)}")
    if nodes is not None and nodes > MAX_POOL_NODES:
        raise K3Error("pool-too-large", f"--{role}-nodes {nodes}: a P/D pool has 1 to {MAX_POOL_NODES} nodes", f"use at most {MAX_POOL_NODES}")
    fs = POOL_FLOOR_STRATEGY[pool_par]
    floor, why = floor_nodes(recipe, fs, tree.strategies.get(fs), hw_id, hw, multi=False)
    label = f"{role} pool ({par})"
    if nodes is not None:
        n = _size(nodes, floor, why, fit, label, notices, auto_fit=False)
    else:
        own = rules.declared(role_ov.nodes, hw_id, hw) if role_ov is not None else None
        n = max(floor, own[0]) if own is not None else floor
        if fit > n:
            notices.append(Notice("nodes-for-capacity", f"{label}: {fit} nodes, the smallest count that holds the weights"))
            n = fit
    if n > MAX_POOL_NODES:
        raise K3Error("pool-too-large", f"the {role} pool needs {n} nodes; a P/D pool has at most {MAX_POOL_NODES}", "choose larger GPUs")
    return Pool(role, pool_par, n, hw.gpu_count)
