"""The recipe rules of the vLLM recipes project's generator that pick a default selection.

Pure functions of a recipe, a variant and hardware profiles (docs/planning.md ("Defaults and the
order of checks")): which hardware a recipe lands on, which strategies it offers there, which one
is recommended at one or two nodes, the TP of a single-node TP deployment, the mode of a modal
feature, the layouts of P/D pools and the container image. Resolution (:mod:`.resolve`) applies them and layers
k3launch's own checks (floors, capacity) on top; where k3launch departs from them it says so in
a notice and docs/planning.md lists the decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from k3launch.models.recipe import Feature, HardwareProfile, HwKeyedInt, PrecisionHardware, Recipe, Strategy, Variant
from k3launch.planning.capacity import holds

T = TypeVar("T")

MAX_NODES = 16  # the largest node count a multi-node strategy is offered at
# Checkpoint precisions that need NVIDIA Blackwell unless the variant says otherwise (precision_hardware).
PRECISION_HARDWARE = {"nvfp4": PrecisionHardware(brand="NVIDIA", generation="blackwell"),
                      "fp4": PrecisionHardware(brand="NVIDIA", generation="blackwell")}
# Environment only GB200/GB300 NVL4 trays want in a P/D deployment (NCCL symmetric memory,
# cross-node NVLink, UCX device selection): inert or harmful on HGX nodes, so removed there.
NVL4_ONLY_ENV = ("VLLM_USE_NCCL_SYMM_MEM", "NCCL_CUMEM_ENABLE", "NCCL_MNNVL_ENABLE", "NCCL_NVLS_ENABLE", "UCX_NET_DEVICES")
NVL4_HARDWARE = ("gb200", "gb300")
OMNI_TASK = "omni"  # meta.tasks of recipes served by vLLM-Omni (`vllm serve --omni`)


def hw_keys(hw_id: str, hw: HardwareProfile) -> tuple[str, ...]:
    """Lookup order of a hardware-keyed map: exact id, generation, lowercase brand, ``default``."""
    return (hw_id, hw.generation, hw.brand.lower(), "default")


def hw_keyed(blocks: Mapping[str, T], hw_id: str, hw: HardwareProfile) -> tuple[str, T] | None:
    """``(key, value)`` of the first key of :func:`hw_keys` that ``blocks`` has."""
    for key in hw_keys(hw_id, hw):
        if key in blocks:
            return key, blocks[key]
    return None


def generation_block(blocks: Mapping[str, T], hw: HardwareProfile) -> tuple[str, T] | None:
    """The block of a recipe's (or variant's, or strategy override's) ``hardware_overrides`` that
    applies to ``hw``: its generation's, else -- NVIDIA only -- the brand-wide ``nvidia`` one. A
    generation block wins whole over ``nvidia``; the two are never merged."""
    if hw.generation in blocks:
        return hw.generation, blocks[hw.generation]
    if hw.brand.upper() == "NVIDIA" and "nvidia" in blocks:
        return "nvidia", blocks["nvidia"]
    return None


def declared(value: HwKeyedInt | None, hw_id: str, hw: HardwareProfile) -> tuple[int, str] | None:
    """A number, or a hardware-keyed map of numbers, for ``hw``: ``(n, key)`` (key "" for a plain number)."""
    if isinstance(value, int):
        return value, ""
    if isinstance(value, Mapping):
        found = hw_keyed(value, hw_id, hw)
        if found is not None:
            return found[1], found[0]
    return None


def single_node_tp(recipe: Recipe, variant: Variant, variant_name: str, hw_id: str, hw: HardwareProfile) -> tuple[int, str]:
    """TP of ``single_node_tp`` on one ``hw`` node and why: the variant's ``tp``, else
    ``strategy_overrides.single_node_tp.tp`` (either may be keyed by hardware), clamped to the
    node's GPUs (not on a CPU profile, whose ranks are not devices); else auto-fit: 1 when the
    variant's ``vram_minimum_gb`` fits one GPU, else the whole node (never 2 or 4: those come only
    from a declaration)."""
    g = hw.gpu_count
    so = recipe.strategy_overrides.get("single_node_tp")
    for value, where in ((variant.tp, f"variants.{variant_name}.tp"), (so.tp if so else None, "strategy_overrides.single_node_tp.tp")):
        found = declared(value, hw_id, hw)
        if found is not None and found[0] > 0:
            tp = found[0] if hw.is_cpu else min(found[0], g)
            key = f".{found[1]}" if found[1] else ""
            clamped = f", clamped to the node's {g} GPUs" if tp < found[0] else ""
            return tp, f"{where}{key} = {found[0]}{clamped}"
    need = variant.vram_minimum_gb or 0
    if need > 0 and holds(hw.gpu_memory_gb, need):
        return 1, f"auto-fit: vram_minimum_gb {need:g} GB fits one {hw.gpu_memory_gb:g} GB GPU"
    return g, "the whole node"


def precision_constraint(variant: Variant) -> PrecisionHardware | None:
    return variant.precision_hardware or PRECISION_HARDWARE.get(variant.precision.lower())


def precision_matches(hw: HardwareProfile, c: PrecisionHardware | None) -> bool:
    return c is None or (hw.brand == c.brand and (c.generation is None or hw.generation == c.generation))


def hardware_offered(recipe: Recipe, variant: Variant, hw_id: str, hw: HardwareProfile) -> bool:
    """Whether the recipe page offers ``hw`` for ``variant``: the precision runs there, the recipe
    does not mark it unsupported, the variant's allowlist has it, and a restricted profile is
    listed by the recipe."""
    return (precision_matches(hw, precision_constraint(variant)) and recipe.meta.hardware.get(hw_id) != "unsupported"
            and (variant.supported_hardware is None or not variant.supported_hardware or hw_id in variant.supported_hardware)
            and (not hw.restricted or hw_id in recipe.meta.hardware))


def default_hardware(profiles: Mapping[str, HardwareProfile], recipe: Recipe, variant: Variant) -> tuple[str, str] | None:
    """``(hardware id, rule)`` the recipe lands on: the author's ``meta.default_hardware`` when it
    is offered, else B200 (then GB200) for a Blackwell-only precision, else H200, else the first
    offered profile, NVIDIA first, then AMD, then by id. ``None``: nothing is offered."""
    offered = [h for h, p in profiles.items() if hardware_offered(recipe, variant, h, p)]
    authored = recipe.meta.default_hardware
    if authored and authored in offered:
        return authored, "the recipe's meta.default_hardware"
    c = precision_constraint(variant)
    if c is not None and c.generation == "blackwell":
        for h in ("b200", "gb200"):
            if h in offered:
                return h, f"{variant.precision} needs Blackwell"
    if "h200" in offered:
        return "h200", "the recipes project's canonical GPU"
    brand_order = {"NVIDIA": 0, "AMD": 1}
    offered.sort(key=lambda h: (brand_order.get(profiles[h].brand, 9), h))
    return (offered[0], "the first offered profile") if offered else None


def compatible_strategies(recipe: Recipe) -> list[str]:
    """The recipe's strategies plus those ``strategy_hardware`` grants as ``supported`` somewhere."""
    listed = list(recipe.compatible_strategies)
    granted = [s for s, m in recipe.strategy_hardware.items() if s not in listed and "supported" in m.values()]
    return listed + granted


def strategy_offered(recipe: Recipe, name: str, hw_id: str, hw: HardwareProfile) -> bool:
    """``strategy_hardware.<s>`` keyed by hardware decides when it has an entry for ``hw``; else
    the recipe's list (a recipe listing none offers every strategy of the tree)."""
    gate = hw_keyed(recipe.strategy_hardware.get(name, {}), hw_id, hw)
    if gate is not None:
        return gate[1] != "unsupported"
    return not recipe.compatible_strategies or name in recipe.compatible_strategies


def min_gpus(recipe: Recipe, key: str, hw_id: str) -> int:
    """``strategy_min_gpus`` of a strategy (or pool layout ``tp``/``tep``/``dep``, found as
    ``multi_node_<k>``), raised by a minimum keyed by the hardware id."""
    table = recipe.strategy_min_gpus
    own = next((table[k] for k in (key, f"multi_node_{key}", f"single_node_{key}") if k in table), 0)
    return max(own, table.get(hw_id, 0))


def offered_strategies(recipe: Recipe, strategies: Mapping[str, Strategy], hw_id: str, hw: HardwareProfile) -> list[str]:
    """Strategies the recipe offers on ``hw``, in the recipe's order: allowed there, reachable
    (their GPU floor within 16 nodes, or one node for a single-node strategy), and multi-node
    ones only on hardware that scales out."""
    out = []
    for s in compatible_strategies(recipe):
        st = strategies.get(s)
        if st is None or not strategy_offered(recipe, s, hw_id, hw):
            continue
        scales = st.deploy_type in ("multi_node", "pd_cluster")
        if (MAX_NODES if scales else 1) * hw.gpu_count < min_gpus(recipe, s, hw_id):
            continue
        if hw.scalable or not (s.startswith("multi_node_") or s == "pd_cluster"):
            out.append(s)
    return out


def recommend_strategy(recipe: Recipe, node_count: int) -> str:
    """The recommended strategy at ``node_count`` nodes: ``default_strategy`` (at several nodes
    its ``multi_node_`` sibling, if listed), else TP: ``multi_node_tp`` (then DEP, then TEP) at
    several nodes, ``single_node_tp`` at one, else the recipe's first strategy."""
    comp = compatible_strategies(recipe)
    own = recipe.default_strategy
    if own and own in comp:
        if node_count <= 1 or not own.startswith("single_node_"):
            return own
        sibling = "multi_node_" + own.removeprefix("single_node_")
        if sibling in comp:
            return sibling
    if node_count > 1:
        for s in ("multi_node_tp", "multi_node_dep", "multi_node_tep"):
            if s in comp:
                return s
    if "single_node_tp" in comp:
        return "single_node_tp"
    return comp[0] if comp else "single_node_tp"


def default_strategy(recipe: Recipe, strategies: Mapping[str, Strategy], hw_id: str, hw: HardwareProfile,
                     fits_one_node: bool) -> tuple[str, int]:
    """``(strategy, base node count)``: two nodes when the weights do not fit one and the recipe
    offers a multi-node strategy on ``hw``; the recommendation there, or -- when it is not offered
    on ``hw`` -- the first offered strategy that is not P/D."""
    offered = offered_strategies(recipe, strategies, hw_id, hw)
    multi = hw.scalable and any(s.startswith("multi_node_") for s in offered)
    base = 2 if not fits_one_node and multi else 1
    rec = recommend_strategy(recipe, base)
    if rec not in offered:
        rec = next((s for s in offered if s != "pd_cluster"), None) or next(iter(offered), rec)
    return rec, base


def offered_modes(feature: Feature, variant_name: str, hw_id: str, hw: HardwareProfile) -> list[str]:
    """Modes of a modal feature offered with this variant on this hardware, in the recipe's order."""
    out = []
    for name, mode in feature.modes.items():
        if mode.variants and variant_name not in mode.variants:
            continue
        if "unsupported" in (mode.hardware.get(hw.generation), mode.hardware.get(hw_id)):
            continue
        out.append(name)
    return out


def feature_mode(feature: Feature, name: str, variant: Variant, variant_name: str, hw_id: str, hw: HardwareProfile,
                 asked: str | None = None) -> str | None:
    """The mode a modal feature runs: the one asked for, else the variant's ``default_modes``, else
    the feature's ``default_mode``, else its first offered mode (``None``: none is offered)."""
    offered = offered_modes(feature, variant_name, hw_id, hw)
    for pick in (asked, variant.default_modes.get(name), feature.default_mode):
        if pick and pick in offered:
            return pick
    return offered[0] if offered else None


def pool_modes(recipe: Recipe) -> list[str]:
    """Layouts a P/D pool may take: those of the recipe's strategies (``*_tp``, ``*_tp_pp``,
    ``*_tp_dp`` give tp; ``*_tep`` tep; ``*_dep`` dep), narrowed by
    ``strategy_overrides.pd_cluster.pool_modes``."""
    modes: set[str] = set()
    for s in compatible_strategies(recipe):
        if s == "pd_cluster":
            continue
        if s == "dep" or s.endswith("_dep"):
            modes.add("dep")
        elif s == "tep" or s.endswith("_tep"):
            modes.add("tep")
        elif s.endswith(("_tp", "_tp_pp", "_tp_dp")) or s == "tp":
            modes.add("tp")
    ordered: list[str] = [m for m in ("tp", "tep", "dep") if m in (modes or {"tp"})]
    ov = recipe.strategy_overrides.get("pd_cluster")
    allowed: list[str] = list(ov.pool_modes or []) if ov is not None else []
    narrowed = [m for m in ordered if m in allowed]
    return narrowed or ordered


def docker_image(recipe: Recipe, variant: Variant, hw_id: str, hw: HardwareProfile) -> str | None:
    """The container image the recipe names for ``hw``: the variant's block for the hardware id,
    the variant's own, then the model's (a string is an NVIDIA pin; a map is keyed by brand, an
    NVIDIA value or a map of CUDA keys alone being a CUDA map, CUDA 13.0 first)."""
    vb = variant.hardware_overrides.get(hw_id)
    if vb is not None and vb.docker_image:
        return vb.docker_image
    brand = _image_brand(hw)
    if variant.docker_image and brand == "nvidia":
        return variant.docker_image
    img = recipe.model.docker_image
    if isinstance(img, str):
        return img if brand == "nvidia" and img else None
    if not any(k in img for k in ("nvidia", "amd", "tpu", "intel")):
        cuda = {k: v for k, v in img.items() if isinstance(v, str)}
        return _cuda(cuda) if brand == "nvidia" else None
    value = img.get(brand) if brand else None
    return _cuda(value) if isinstance(value, Mapping) else value


def _image_brand(hw: HardwareProfile) -> str | None:
    if hw.generation == "tpu":
        return "tpu"
    if hw.brand.upper() == "AMD":
        return "amd"
    if hw.generation in ("cpu", "xpu") or hw.brand.lower() == "intel":
        return "intel"
    return "nvidia" if hw.brand.upper() == "NVIDIA" else None


def _cuda(images: Mapping[str, str]) -> str | None:
    return images.get("cu130") or images.get("cu129") or next(iter(images.values()), None)
