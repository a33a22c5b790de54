"""Capacity arithmetic: do the chosen nodes hold the weights, and what does KV offload pin?

``weights = parameters × bytes/param × 1.2 headroom`` (the recipe page's estimate: 2.8T × 0.5 ×
1.2 = 1680 GB for Kimi K3 MXFP4). Weights stay resident in GPU memory whatever KV offload does,
so a pool fits only if the GPU memory of its own nodes holds a full copy: for P/D, each pool.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from k3launch.errors import K3Error
from k3launch.models.recipe import HardwareProfile, Recipe, Variant

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


@dataclass(frozen=True)
class Weights:
    gb: float
    formula: str


def weights(recipe: Recipe, variant: Variant) -> Weights:
    """Weight footprint in GB (10^9 bytes), with the formula that produced it."""
    params = parse_parameter_count(recipe.model.parameter_count or "")
    bpp = BYTES_PER_PARAM.get(variant.precision.lower())
    if params is not None and bpp is not None:
        gb = params * bpp * HEADROOM / 1e9
        formula = f"{recipe.model.parameter_count} x {bpp:g} byte/param ({variant.precision}) x {HEADROOM:g} headroom"
        if variant.vram_minimum_gb is not None and variant.vram_minimum_gb > gb:
            return Weights(variant.vram_minimum_gb, f"recipe vram_minimum_gb (estimate {formula} = {gb:.0f} GB)")
        return Weights(round(gb, 3), formula)
    if variant.vram_minimum_gb is not None:
        return Weights(variant.vram_minimum_gb, "recipe vram_minimum_gb")
    raise K3Error(
        "no-weights-estimate",
        f"recipe {recipe.meta.title} gives neither parameter_count x precision nor vram_minimum_gb",
        "add model.parameter_count and the variant's precision (or vram_minimum_gb) to the recipe",
    )


def nodes_to_fit(weights_gb: float, hw: HardwareProfile) -> int:
    return max(1, math.ceil(weights_gb / hw.vram_gb - 1e-9))


def fits(weights_gb: float, hw: HardwareProfile, nodes: int) -> bool:
    return nodes * hw.vram_gb + 1e-9 >= weights_gb
