"""What the user asked for (``Selection``) and what k3launch decided from it (``Resolved``).

Resolution is where floors, defaults and capacity are applied, in the documented order:
defaults first, then strategy floors (raised with a notice), then capacity on the result (a
refusal naming the smallest node count that would fit). Everything changed automatically is a
notice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3launch.models.recipe import HardwareProfile, Recipe, Strategy, Variant
from k3launch.planning.compose import Notice
from k3launch.planning.schema import DEFAULT_VLLM_VERSION

DEFAULT_RECIPE = "moonshotai/Kimi-K3"
KV_OFFLOAD_OFF = "off"
MAX_POOL_NODES = 16

# How a strategy lays processes out; upstream strategies name it in ``parallelism`` or imply it.
PARALLELISMS = ("tp", "tep", "dep", "tp_pp", "tp_dp")
POOL_PARALLELISMS = ("tp", "tep", "dep")
# The multi-node sibling of each single-node strategy (used when a node cannot hold the weights).
MULTI_NODE_SIBLING = {
    "single_node_tp": "multi_node_tp",
    "single_node_tep": "multi_node_tep",
    "single_node_dep": "multi_node_dep",
}
# The strategy whose floor applies to a P/D pool of a given parallelism.
POOL_FLOOR_STRATEGY = {"tp": "multi_node_tp", "tep": "multi_node_tep", "dep": "multi_node_dep"}


@dataclass(frozen=True)
class Selection:
    """The user's choices; ``None`` means "the recipe's default"."""

    recipe: str | None = None
    variant: str | None = None
    hardware: str | None = None
    strategy: str | None = None
    nodes: int | None = None
    prefill_strategy: str | None = None
    prefill_nodes: int | None = None
    decode_strategy: str | None = None
    decode_nodes: int | None = None
    features: tuple[str, ...] = ()
    no_features: tuple[str, ...] = ()
    kv_offload: str = KV_OFFLOAD_OFF
    sets: tuple[str, ...] = ()  # "FLAG=VALUE" as typed
    advanced: tuple[str, ...] = ()
    vllm_version: str = DEFAULT_VLLM_VERSION


@dataclass(frozen=True)
class Pool:
    """One group of nodes running one engine: the whole deployment, or a P/D role."""

    role: str  # serve | prefill | decode
    parallelism: str  # tp | tep | dep | tp_pp | tp_dp
    nodes: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Resolved:
    recipe_id: str
    recipe: Recipe
    variant_name: str
    variant: Variant
    hardware_id: str
    hardware: HardwareProfile
    strategy: Strategy
    pools: list[Pool]
    features: list[str]
    kv_offload: str
    weights_gb: float
    weights_formula: str
    verified: bool
    selection: Selection
    notices: list[Notice] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return sum(p.nodes for p in self.pools)

    @property
    def is_pd(self) -> bool:
        return self.strategy.deploy_type == "pd_cluster" or self.strategy.name == "pd_cluster"


def parallelism_of(strategy: Strategy) -> str:
    """The layout a strategy implies: explicit ``parallelism`` or its upstream name."""
    if strategy.parallelism in PARALLELISMS:
        return strategy.parallelism
    name = strategy.name
    for par in ("tp_pp", "tp_dp", "dep", "tep"):
        if name.endswith(par):
            return par
    return "tp"


def is_multi_node(strategy: Strategy) -> bool:
    return strategy.deploy_type == "multi_node" or strategy.hardware_match.multi_node
