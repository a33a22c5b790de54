"""Pydantic models of the vLLM recipes schema (recipes.vllm.ai), plus k3launch's additive keys.

The schema is the one of the vLLM recipes project: ``models/<org>/<Model>.yaml``,
``strategies/*.yaml``, ``kv_store/*.yaml`` and ``taxonomy.yaml``. Every model forbids unknown
keys, so a typo in a recipe is an error that names the file and line instead of a setting that
silently does nothing. Keys k3launch adds are marked "k3launch extension" and are optional, so
upstream trees load unchanged.
"""

# No ``from __future__ import annotations`` here: pydantic takes annotation objects as they are,
# while it compiles and evaluates every string one (~1 ms of each start for these ~30 models).
# So a model is defined before the models that use it.
import datetime as dt
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    # defer_build: validators are built on first use, not at import. A command that never loads
    # a recipe (``--help``, ``status``) skips them, and ``plan`` builds only the trees it
    # validates (taxonomy, strategies, one recipe; the inventory models only with --inventory).
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


Env = dict[str, str | int]


# ---------------------------------------------------------------------------- taxonomy
class HardwareProfile(Strict):
    brand: str
    generation: str
    display_name: str = ""
    description: str = ""
    gpu_count: int = Field(ge=1)  # a CPU profile: engine ranks per node
    vram_gb: int = Field(ge=1)  # per node; a CPU profile: nominal host memory (an inventory's cpu_memory_gb wins)
    multi_node: bool = False
    scalable: bool = True
    restricted: bool = False
    # k3launch extensions
    platform: Literal["cuda", "rocm", "cpu", "other"] | None = None
    image: str | None = None  # default container image when the model names none

    @property
    def gpu_memory_gb(self) -> float:
        return self.vram_gb / self.gpu_count

    @property
    def vendor_platform(self) -> str:
        """``cuda``, ``rocm``, ``cpu`` (vLLM's CPU backend: upstream's ``generation: cpu`` profiles) or ``other``."""
        if self.platform:
            return self.platform
        if self.generation.lower() == "cpu":
            return "cpu"
        return {"nvidia": "cuda", "amd": "rocm"}.get(self.brand.lower(), "other")

    @property
    def is_cpu(self) -> bool:
        """A CPU profile: one engine rank per "GPU", and ``vram_gb`` is the node's nominal host memory."""
        return self.vendor_platform == "cpu"


class Task(Strict):
    id: str
    display_name: str = ""
    description: str = ""


class Companion(Strict):
    label: str
    description: str = ""
    command: str


class KvOffloadOption(Strict):
    display_name: str = ""
    label: str = ""
    order: int = 0
    description: str = ""
    args: list[str] = []
    env: Env = {}
    strategies: list[str] | None = None
    brands: list[str] | None = None
    group: str | None = None
    requires_opt_in: bool = False
    install: str | None = None
    docs_url: str | None = None
    companion: Companion | None = None
    # k3launch extension: host RAM each GPU rank pins (Simple: ~220 GiB)
    host_memory_gib_per_rank: float | None = None


class KvOffloadGroup(Strict):
    display_name: str = ""
    label: str = ""
    order: int = 0
    sub_row_label: str = ""
    docs_url: str = ""
    tooltip: str = ""
    description: str = ""


class AdvancedPreset(Strict):
    """k3launch extension: one Advanced knob (the recipe page's Advanced row)."""

    description: str = ""
    args: list[str]


class Taxonomy(Strict):
    hardware_profiles: dict[str, HardwareProfile]
    # k3launch extension: keys no model of this tree knows are errors (k3launch's own trees, where
    # a typo must not pass as a setting). Without it (an upstream checkout) they are kept and each
    # is a plan notice with its file and line (planning.recipe_keys).
    strict_keys: bool = False
    tasks: list[Task] = []
    strategies: list[str] = []
    kv_offload: dict[str, KvOffloadOption] = {}
    kv_offload_groups: dict[str, KvOffloadGroup] = {}
    advanced: dict[str, AdvancedPreset] = {}  # k3launch extension


# -------------------------------------------------------------------------- strategies
class HardwareMatch(Strict):
    min_gpus: int = 1
    max_gpus: int | None = None
    multi_node: bool = False
    architecture: str | None = None


class RoleArgs(Strict):
    vllm_args: list[str] = []
    env: Env = {}


class RouterPolicy(Strict):
    policy: str = "round_robin"


class Strategy(Strict):
    name: str
    deploy_type: str
    display_name: str = ""
    orientation: str | None = None
    description: str = ""
    # default factories, not instances: an instance here would build the model's validator at import
    hardware_match: HardwareMatch = Field(default_factory=HardwareMatch)
    parallelism: str | None = None
    vllm_args: list[str] = []
    parallel_flag: str = "--tensor-parallel-size"
    env: Env = {}
    prefill: RoleArgs | None = None
    decode: RoleArgs | None = None
    router: RouterPolicy | None = None


# ------------------------------------------------------------------------------ models
class Meta(Strict):
    title: str
    slug: str = ""
    provider: str = ""
    description: str = ""
    date_added: dt.date | str | None = None
    date_updated: dt.date | str | None = None
    difficulty: str = ""
    tasks: list[str] = []
    performance_headline: str = ""
    related_recipes: list[str] = []
    default_hardware: str | None = None
    hardware: dict[str, str] = {}  # hardware id -> "verified"


class InstallNote(Strict):
    note: str = ""


# A value keyed by hardware: an exact id (``h200``), a generation (``hopper``), a lowercase brand
# (``nvidia``) or ``default`` -- looked up in that order (planning.rules.hw_keyed).
HwKeyedInt = int | dict[str, int]


class ModelSpec(Strict):
    model_id: str
    min_vllm_version: str | None = None
    # A string pins the NVIDIA image; a map is keyed by brand (nvidia/amd/tpu/intel), where the
    # nvidia value may itself be a CUDA map ({cu129, cu130}); a map of CUDA keys alone is NVIDIA's.
    docker_image: str | dict[str, str | dict[str, str]] = {}
    nightly_required: bool = False
    install: dict[str, InstallNote | bool | None] = {}  # per install tab: false/null omit it or take the default
    architecture: str = "dense"
    parameter_count: str | None = None
    active_parameters: str | None = None
    context_length: int | None = None
    base_args: list[str] = []
    base_env: Env = {}
    supports_dcp: bool = False


class FeatureHardware(Strict):
    args: list[str] = []


class FeatureMode(Strict):
    """One mode of a single-select feature: exactly one mode's args run when the feature is on."""

    description: str = ""
    args: list[str] = []
    hardware_overrides: dict[str, FeatureHardware] = {}  # replaces args (exact id > generation > brand > default)
    hardware: dict[str, str] = {}  # generation or hardware id -> "unsupported": the mode is not offered there
    variants: list[str] | None = None  # offered only with these variants


class Feature(Strict):
    description: str = ""
    args: list[str] = []
    hardware_overrides: dict[str, FeatureHardware] = {}
    strategies: list[str] | None = None
    modes: dict[str, FeatureMode] = {}
    default_mode: str | None = None


class VariantHardware(Strict):
    extra_args: list[str] = []
    extra_env: Env = {}
    docker_image: str | None = None


class PrecisionHardware(Strict):
    """The hardware a variant's precision runs on (default: nvfp4/fp4 need NVIDIA Blackwell)."""

    brand: str
    generation: str | None = None


class Variant(Strict):
    precision: str = ""
    vram_minimum_gb: float | None = None
    description: str = ""
    extra_args: list[str] = []
    extra_env: Env = {}
    hardware_overrides: dict[str, VariantHardware] = {}
    model_id: str | None = None
    supported_hardware: list[str] | None = None
    precision_hardware: PrecisionHardware | None = None
    tp: HwKeyedInt | None = None  # single_node_tp's TP for this variant (clamped to the node's GPUs)
    default_modes: dict[str, str] = {}  # feature -> mode; turns the feature on by default
    docker_image: str | None = None
    # k3launch extension: copies of the engine this variant serves by default (wins over the recipe's)
    replicas: int | None = Field(default=None, ge=1, le=256)


class HardwareOverride(Strict):
    extra_args: list[str] = []
    extra_env: Env = {}


class RoleOverride(Strict):
    parallelism: Literal["tp", "tep", "dep"] | None = None
    tp: int | None = None
    nodes: HwKeyedInt | None = None  # the pool's default node count (a map: by hardware id, else "default")
    vllm_args: list[str] = []
    env: Env = {}
    hardware_overrides: dict[str, HardwareOverride] = {}


class StrategyOverride(Strict):
    extra_args: list[str] = []
    vllm_args: list[str] = []
    env: Env = {}
    extra_env: Env = {}
    hardware_overrides: dict[str, HardwareOverride] = {}
    prefill: RoleOverride | None = None
    decode: RoleOverride | None = None
    router: dict[str, int] = {}
    tp: HwKeyedInt | None = None  # single_node_tp only: TP on one node (clamped to its GPUs)
    pool_modes: list[Literal["tp", "tep", "dep"]] | None = None  # pd_cluster: the layouts a pool may take


class Dependency(Strict):
    command: str
    note: str = ""
    optional: bool = False


class Lock(Strict):
    """k3launch extension: a hardware-mandated value ``--set`` may not change.

    ``flag`` is a flag (``--moe-backend``) or a JSON sub-key of one
    (``--attention-config.mla_prefill_backend``); ``env`` an environment variable.
    """

    flag: str | None = None
    env: str | None = None
    reason: str


class Recipe(Strict):
    meta: Meta
    model: ModelSpec
    features: dict[str, Feature] = {}
    opt_in_features: list[str] = []
    hardware_opt_in_features: dict[str, list[str]] = {}
    variants: dict[str, Variant] = Field(default_factory=lambda: {"default": Variant()})  # a factory: see Strategy.hardware_match
    compatible_strategies: list[str] = []
    default_strategy: str | None = None
    strategy_min_gpus: dict[str, int] = {}
    kv_cache_strategy_hardware: dict[str, dict[str, str]] = {}
    strategy_hardware: dict[str, dict[str, str]] = {}
    hardware_overrides: dict[str, HardwareOverride] = {}
    strategy_overrides: dict[str, StrategyOverride] = {}
    kv_offload_support: dict[str, str] = {}
    dependencies: list[Dependency] = []
    guide: str = ""
    # k3launch extensions
    locked: dict[str, list[Lock]] = {}
    advanced: dict[str, AdvancedPreset] = {}
    # copies of the engine (--replicas) a plan serves when neither --replicas nor the inventory says
    replicas: int | None = Field(default=None, ge=1, le=256)
