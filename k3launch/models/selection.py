"""What the user asked for (:class:`Selection`) and what k3launch decided from it (:class:`Resolved`).

:class:`Selection` is the one model of a user's choices: the CLI's selection options
(``k3launch plan --help``), a campaign file's ``base`` and ``deployments`` axes and
``api.plan(...)`` are all derived from its fields, and it owns their defaults (``None``: the
recipe's default) and the ``--advanced all`` expansion. Each field's ``cli`` extra names its
command-line flag (``features`` is ``--feature``, repeatable).

Resolution is where floors, defaults and capacity are applied, in the documented order:
defaults first, then strategy floors (raised with a notice), then capacity on the result (a
refusal naming the smallest node count that would fit). Everything changed automatically is a
notice.
"""

# No ``from __future__ import annotations`` here (as in models.recipe and models.plan): pydantic takes annotation
# objects as they are, while it compiles and evaluates every string one at each start. So a model
# is defined before the models that use it.
import re
from dataclasses import dataclass, field
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from k3launch.defaults import ADVANCED_ALL, DEFAULT_RECIPE, DEFAULT_VLLM_VERSION
from k3launch.models.plan import EngineRole, Parallelism
from k3launch.models.recipe import HardwareProfile, Recipe, Strategy, Variant
from k3launch.util.bounds import NODES, REPLICAS, Bound
from k3launch.util.records import record

KV_OFFLOAD_OFF = "off"
MAX_POOL_NODES = 16

# How a strategy lays processes out; upstream strategies name it in ``parallelism`` or imply it.
PARALLELISMS: tuple[Parallelism, ...] = get_args(Parallelism)
POOL_PARALLELISMS: tuple[Parallelism, ...] = ("tp", "tep", "dep")
# The multi-node sibling of each single-node strategy (used when a node cannot hold the weights).
MULTI_NODE_SIBLING = {
    "single_node_tp": "multi_node_tp",
    "single_node_tep": "multi_node_tep",
    "single_node_dep": "multi_node_dep",
}
# The strategy whose floor applies to a P/D pool of a given parallelism.
IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECRET_NAMES = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "VLLM_API_KEY", "OPENAI_API_KEY"})
NOT_SECRETS = frozenset({"TOKENIZERS_PARALLELISM"})
PLACEMENT_ENV = frozenset(
    {
        "VLLM_HOST_IP",
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "K3LAUNCH_DEPLOYMENT",
        "K3LAUNCH_PROCESS",
        "K3LAUNCH_ID",
    }
)


def check_image(v: str | None) -> str | None:
    """An image reference as a validator takes it: it becomes a word of a remote `docker run`, so a
    reference's own characters only."""
    if v is not None and not IMAGE_REF.fullmatch(v):
        raise ValueError(f"image {v!r} is not a container image reference")
    return v


def env_refusal(name: str, where: str) -> str | None:
    """Why ``name`` may not be set in ``where`` (an inventory, ``--env``): a credential (plans are
    written to records, scripts and logs), or a variable placement sets per process; None: fine."""
    up = name.upper()
    if up in SECRET_NAMES or (
        any(w in up for w in ("TOKEN", "SECRET", "PASSWORD", "API_KEY", "ACCESS_KEY", "PRIVATE_KEY"))
        and up not in NOT_SECRETS
        and not up.endswith(("_PATH", "_FILE", "_DIR"))
    ):
        return f"env {name} looks like a secret; secrets never go into inventories or plans (use hf_token_file)"
    if up in PLACEMENT_ENV:
        return f"env {name} is set by k3launch's placement for each process; it cannot be set in {where}"
    return None
POOL_FLOOR_STRATEGY = {"tp": "multi_node_tp", "tep": "multi_node_tep", "dep": "multi_node_dep"}


@record
class Notice:
    """Something k3launch changed or decided on its own (every automatic change is one)."""

    code: str
    message: str


# The documented range of each numeric field. The CLI parses its options with it and a campaign's
# axes take it (`--nodes 0`, `nodes: [0]` are refused at once, with the option or the line); the
# model itself refuses values above it (the API: no plan of a million nodes), while counts below 1
# stay planning's refusal (`bad-nodes`, a K3Error next to the strategy floors it belongs with).
FIELD_BOUNDS: dict[str, Bound] = {"nodes": NODES, "prefill_nodes": NODES, "decode_nodes": NODES, "replicas": REPLICAS}


def _opt(cli: str, help: str, bound: Bound | None = None, **kw: Any) -> Any:
    limits: dict[str, Any] = {"le": int(bound.hi)} if bound else {}
    return Field(description=help, json_schema_extra={"cli": cli}, **limits, **kw)


class Selection(BaseModel):
    """The user's choices; ``None`` means "the recipe's default"."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    recipe: str | None = _opt("--recipe", f"Recipe id (org/Model), slug or model id. Default: {DEFAULT_RECIPE}.", default=None)
    variant: str | None = _opt("--variant", "Recipe variant (default: the recipe's first).", default=None)
    hardware: str | None = _opt("--hardware", "Hardware id (default: the inventory's, else the recipe's default_hardware).", default=None)
    strategy: str | None = _opt(
        "--strategy", "single_node_tp, multi_node_tp, multi_node_tep, multi_node_dep, pd_cluster, ...", default=None
    )
    nodes: int | None = _opt("--nodes", "Node count (raised to the strategy floor with a notice).", NODES, default=None)
    replicas: int | None = _opt(
        "--replicas", "Independent copies of the engine, each on nodes of its own (--nodes is per copy), behind one vllm-router "
        "(default 1; not with pd_cluster or multi_node_replicas).", REPLICAS, default=None,
    )
    prefill_strategy: str | None = _opt(
        "--prefill-strategy", "P/D prefill pool: tp, tep or dep (default: the recipe's, else tp).", default=None
    )
    prefill_nodes: int | None = _opt("--prefill-nodes", "P/D prefill pool nodes (1-16).", NODES, default=None)
    decode_strategy: str | None = _opt(
        "--decode-strategy", "P/D decode pool: tp, tep or dep (default: the recipe's, else tp).", default=None
    )
    decode_nodes: int | None = _opt("--decode-nodes", "P/D decode pool nodes (1-16).", NODES, default=None)
    features: tuple[str, ...] = _opt(
        "--feature",
        "Enable a feature (repeatable): tool_calling, reasoning, spec_decoding, text_only; NAME=MODE picks a modal feature's mode.",
        default=(),
    )
    no_features: tuple[str, ...] = _opt("--no-feature", "Disable a feature the recipe enables by default (repeatable).", default=())
    kv_offload: str = _opt("--kv-offload", "off, simple, lmcache or mooncake.", default=KV_OFFLOAD_OFF)
    sets: tuple[str, ...] = _opt("--set", "FLAG=VALUE applied at the Advanced layer (repeatable).", default=())  # as typed
    advanced: tuple[str, ...] = _opt(
        "--advanced",
        "Advanced preset (repeatable): max-num-batched-tokens, max-num-seqs, gpu-memory-utilization, max-model-len, or all.",
        default=(),
    )
    fault_tolerance: bool | None = _opt(
        "--fault-tolerance",
        "DEP pools with vLLM's engine fault tolerance: one API server per DP rank, --enable-fault-tolerance, an FT-capable "
        "all-to-all (default: the inventory's restart.fault_tolerance, else off).",
        default=None,
    )
    image: str | None = _opt(
        "--image", "Container image for every engine (over the inventory's and the recipe's; a bare runtime ignores it).", default=None,
    )
    env: tuple[str, ...] = _opt(
        "--env", "NAME=VALUE in every engine's environment, over the recipe's (repeatable; never a secret: tokens come from "
        "the inventory's hf_token_file).", default=(),
    )
    vllm_version: str | None = _opt(
        "--vllm-version",
        "vLLM version the plan is written for and checked against (its flag schema): "
        f"default the inventory's vllm_version, else {DEFAULT_VLLM_VERSION}.",
        default=None,
    )

    @field_validator("features", "no_features", "sets", "advanced", "env", mode="before")
    @classmethod
    def _seq(cls, v: Any) -> Any:
        """A bare string is one value, None none; lists become tuples (the model is frozen and hashable)."""
        return () if v is None else (v,) if isinstance(v, str) else tuple(v) if isinstance(v, list) else v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        return check_image(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for item in v:
            name, eq, _ = item.partition("=")
            if not eq or not ENV_NAME.fullmatch(name):
                raise ValueError(f"env {item!r}: use NAME=VALUE with NAME of letters, digits and _")
            why = env_refusal(name, "--env")
            if why:
                raise ValueError(why)
        return v

    @field_validator("advanced")
    @classmethod
    def _all(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return ADVANCED_ALL if "all" in v else v

    @field_validator("kv_offload", mode="before")
    @classmethod
    def _default_for_none(cls, v: Any) -> Any:
        """``null`` (a campaign axis, an unset CLI option) is the default, like the other fields."""
        return KV_OFFLOAD_OFF if v is None else v

    def engine_version(self, inventory_version: str | None = None) -> str:
        """The vLLM version a plan is for: this selection's, else the inventory's, else the default."""
        return self.vllm_version or inventory_version or DEFAULT_VLLM_VERSION

    @classmethod
    def cli_fields(cls) -> list[tuple[str, str, str, Any]]:
        """``(field, flag, help, annotation)`` of each field, in order: what the CLI options are built from."""
        out = []
        for name, f in cls.model_fields.items():
            extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
            out.append((name, str(extra.get("cli", "--" + name.replace("_", "-"))), f.description or "", f.annotation))
        return out

    @classmethod
    def bound(cls, name: str) -> Bound | None:
        """The range of numeric field ``name`` (None: not a number, or unbounded)."""
        return FIELD_BOUNDS.get(name)

    @classmethod
    def list_fields(cls) -> tuple[str, ...]:
        """Fields that take several values (repeatable options, list axes)."""
        return tuple(n for n, f in cls.model_fields.items() if getattr(f.annotation, "__origin__", None) is tuple)


def copy_nodes(parallelism: Parallelism, nodes: int) -> int:
    """The nodes of a pool that hold one copy of the weights: each node of independent replicas
    holds a whole copy; every other layout splits one copy over all of its nodes."""
    return 1 if parallelism == "replicas" else nodes


@record
class Pool:
    """One group of nodes running one engine: the whole deployment, or a P/D role."""

    role: EngineRole
    parallelism: Parallelism
    nodes: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def copy_nodes(self) -> int:
        return copy_nodes(self.parallelism, self.nodes)


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
    node_memory_gb: float = 0.0  # what one node holds weights in: GPU memory, or host memory on a CPU profile
    feature_modes: dict[str, str] = field(default_factory=dict)  # modal feature -> the mode that runs
    replicas: int = 1  # independent copies of the pools, each on nodes of its own
    checkpoint_gb: float | None = None  # the checkpoint's GB (parameters x bytes/param, no headroom): what loading reads; None when unknown
    replicas_from: str = "--replicas"  # who asked for them: --replicas, or the default that was taken (its words in notices)

    @property
    def nodes(self) -> int:
        return self.replicas * sum(p.nodes for p in self.pools)

    @property
    def is_pd(self) -> bool:
        return self.strategy.deploy_type == "pd_cluster" or self.strategy.name == "pd_cluster"


def parallelism_of(strategy: Strategy) -> Parallelism:
    """The layout a strategy implies: explicit ``parallelism`` or its upstream name."""
    for par in PARALLELISMS:
        if strategy.parallelism == par:
            return par
    name = strategy.name
    for par in ("tp_pp", "tp_dp", "dep", "tep"):
        if name.endswith(par):
            return par
    return "tp"


def is_multi_node(strategy: Strategy) -> bool:
    return strategy.deploy_type == "multi_node" or strategy.hardware_match.multi_node
