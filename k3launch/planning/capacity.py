"""Capacity arithmetic: do the chosen nodes hold the weights, and what does KV offload pin?

``weights = parameters × bytes/param × 1.2 headroom`` (the recipe page's estimate: 2.8T × 0.5 ×
1.2 = 1680 GB for Kimi K3 MXFP4). Weights stay resident in GPU memory whatever KV offload does,
so a pool fits only if the GPU memory of its own nodes holds a full copy: for P/D, each pool.

On a CPU profile (vLLM's CPU backend) the weights live in host memory: the check uses each
node's ``cpu_memory_gb`` from the inventory when it is known, else the profile's nominal memory
(its ``vram_gb``), and the smallest of the usable nodes counts (:func:`node_memory`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import field

from k3launch.errors import K3Error
from k3launch.models.plan import Capacity, KvOffloadCapacity, PoolCapacity
from k3launch.models.recipe import HardwareProfile, Recipe, Variant
from k3launch.models.selection import Pool
from k3launch.util.records import record

HEADROOM = 1.2
GIB = 1024**3

# Bytes per parameter by checkpoint precision (weights only).
BYTES_PER_PARAM: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "mxfp8": 1.0,
    "int8": 1.0,
    "w8a8": 1.0,
    "mxfp4": 0.5,
    "nvfp4": 0.5,
    "int4": 0.5,
    "w4a16": 0.5,
    "awq": 0.5,
    "gptq": 0.5,
    "int2": 0.25,
    "2bit": 0.25,
}

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def parse_parameter_count(text: str) -> float | None:
    """``"2.8T"`` → 2.8e12; ``"235B"`` → 2.35e11; ``None`` when the text is not a count."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMBT]?)\s*", text.upper())
    if not m:
        return None
    return float(m.group(1)) * _SUFFIX[m.group(2)]


@record
class Weights:
    gb: float
    formula: str
    on_disk_gb: float | None = None  # parameters x bytes/param: the checkpoint a load reads (the headroom is GPU memory's)


AGREE = 0.01  # an estimate within 1% of the recipe's figure explains it


def weights(recipe: Recipe, variant: Variant) -> Weights:
    """Weight footprint in GB (10^9 bytes), with the formula that produced it.

    The variant's ``vram_minimum_gb`` is the recipe author's figure (and what the recipes project
    checks a node against), so it wins when given; the estimate parameters x bytes/param x 1.2 is
    its explanation when the two agree, and the figure when the recipe gives none. (A precision
    label does not always tell the bytes: a "fp8" checkpoint may keep its experts in FP4.)"""
    params = parse_parameter_count(recipe.model.parameter_count or "")
    bpp = BYTES_PER_PARAM.get(variant.precision.lower())
    if params is not None and bpp is not None:
        gb = params * bpp * HEADROOM / 1e9
        formula = f"{recipe.model.parameter_count} x {bpp:g} byte/param ({variant.precision}) x {HEADROOM:g} headroom"
        disk = round(params * bpp / 1e9, 3)
        vmin = variant.vram_minimum_gb
        if vmin is not None and abs(vmin - gb) > AGREE * vmin:
            return Weights(vmin, f"recipe vram_minimum_gb (estimate {formula} = {gb:.0f} GB)", disk)
        return Weights(round(gb, 3), formula, disk)
    if variant.vram_minimum_gb is not None:
        return Weights(variant.vram_minimum_gb, "recipe vram_minimum_gb")
    raise K3Error(
        "no-weights-estimate",
        f"recipe {recipe.meta.title} gives neither parameter_count x precision nor vram_minimum_gb",
        "add model.parameter_count and the variant's precision (or vram_minimum_gb) to the recipe",
    )


def gb_text(gb: float) -> str:
    """``2144`` for whole numbers (as the GPU figures always are), else ``%g``."""
    return str(int(gb)) if float(gb).is_integer() else f"{gb:g}"


@record
class HostMemory:
    """An inventory's ``cpu_memory_gb`` of each usable node, per hardware id (``None``: not set;
    the key ``""`` holds nodes that name no hardware, usable as any)."""

    inventory: str
    nodes: Mapping[str, Sequence[float | None]] = field(default_factory=dict)

    def of(self, hw_id: str) -> list[float | None]:
        return [*self.nodes.get(hw_id, ()), *self.nodes.get("", ())]


@record
class NodeMemory:
    """What one node holds weights in: GPU memory, or on a CPU profile host memory (``source`` says whose figure)."""

    gb: float
    host: bool = False
    source: str = ""

    def text(self, nodes: int = 1) -> str:
        """``2144 GB`` (GPU memory) or ``16 GB of host memory``, for ``nodes`` nodes."""
        return f"{gb_text(nodes * self.gb)} GB" + (" of host memory" if self.host else "")


def node_memory(hw_id: str, hw: HardwareProfile, host: HostMemory | None = None) -> NodeMemory:
    """GPU memory per node; on a CPU profile the host memory: the smallest usable node's
    ``cpu_memory_gb``, a node that does not set it counting as the profile's nominal ``vram_gb``."""
    if not hw.is_cpu:
        return NodeMemory(hw.vram_gb)
    values = host.of(hw_id) if host is not None else []
    known = [v for v in values if v is not None]
    nominal = f"{hw_id}'s nominal {hw.vram_gb} GB"
    if not known:
        return NodeMemory(hw.vram_gb, True, f"{nominal}; set cpu_memory_gb in the inventory for the real figure")
    assert host is not None
    where = f"cpu_memory_gb of inventory {host.inventory}"
    if len(known) < len(values):
        return NodeMemory(min(*known, hw.vram_gb), True, f"{where}, {nominal} for nodes that do not set it")
    return NodeMemory(min(known), True, where)


SLACK_GB = 1e-9  # float noise: 8 x 268 GB holds 2144 GB even when the product rounds a hair under


def holds(have_gb: float, need_gb: float) -> bool:
    """The fit rule, the one every capacity question of planning asks: memory holds a need when it
    is at least as large. Weights against the GPUs of a pool's copy (:func:`pool_fit`) or of one
    node (:func:`fits`), a variant's ``vram_minimum_gb`` against one GPU (single_node_tp's auto-fit),
    the host RAM KV offload pins against a node's, the smallest node count (:func:`nodes_to_fit`)."""
    return have_gb + SLACK_GB >= need_gb


def fits(weights_gb: float, mem: NodeMemory, nodes: int) -> bool:
    """Whether ``nodes`` nodes of ``mem`` hold the weights (the :func:`holds` rule)."""
    return holds(nodes * mem.gb, weights_gb)


def nodes_to_fit(weights_gb: float, mem: NodeMemory) -> int:
    """The smallest node count that holds the weights (the :func:`holds` rule, counted up from the
    floor of the ratio: at most one step)."""
    n = max(1, math.floor(weights_gb / mem.gb))
    while not fits(weights_gb, mem, n):
        n += 1
    return n


@record
class PoolFit:
    """Whether one copy of a pool holds the weights: what each of its nodes holds them in, how many
    nodes hold a copy, and the :func:`holds` verdict."""

    node: NodeMemory
    nodes: int
    weights_gb: float

    @property
    def gb(self) -> float:
        return self.nodes * self.node.gb

    @property
    def fits(self) -> bool:
        return holds(self.gb, self.weights_gb)


def pool_fit(weights_gb: float, mem: NodeMemory, pool: Pool, hw: HardwareProfile) -> PoolFit:
    """One copy of ``pool`` against the weights: its nodes (:attr:`Pool.copy_nodes`), each holding
    what the GPUs its engine uses hold (:func:`pool_node_memory`)."""
    return PoolFit(pool_node_memory(mem, pool, hw), pool.copy_nodes, weights_gb)


def pool_capacity(fit: PoolFit, pool: Pool, sizes: tuple[int, int, int]) -> PoolCapacity:
    """The plan's capacity row of a pool, at the size it runs (``sizes``: its TP, DP, PP)."""
    tp, dp, pp = sizes
    return PoolCapacity(role=pool.role, parallelism=pool.parallelism, nodes=pool.nodes, gpus=pool.gpus, gpu_memory_gb=fit.gb,
                        weights_gb=fit.weights_gb, fits=fit.fits, tp=tp, dp=dp, pp=pp)


def plan_capacity(w: Weights, pools: Sequence[PoolCapacity], kv: KvOffloadCapacity | None) -> Capacity:
    """The plan's capacity: the weights, the smallest pool's memory, and whether every pool holds them."""
    return Capacity(weights_gb=w.gb, formula=w.formula, checkpoint_gb=w.on_disk_gb, gpu_memory_gb=min(p.gpu_memory_gb for p in pools),
                    fits=all(p.fits for p in pools), pools=list(pools), kv_offload=kv)


def pool_node_memory(mem: NodeMemory, pool: Pool, hw: HardwareProfile) -> NodeMemory:
    """What one node of ``pool`` holds weights in: the memory of the GPUs its engine uses -- all of
    them, unless a one-node TP (declared by the recipe or sized by it) leaves GPUs idle; a CPU
    profile's ranks share the node's host memory whatever their count."""
    if hw.is_cpu or pool.gpus_per_node >= hw.gpu_count:
        return mem
    return NodeMemory(mem.gb * pool.gpus_per_node / hw.gpu_count, mem.host, mem.source)
