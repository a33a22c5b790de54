"""Pydantic models of a recipes tree's ``kv_store/*.yaml`` files (the KV stores a P/D recipe may
name; k3launch refuses Mooncake for the bundled recipes and carries these files validated).

Apart from :mod:`k3launch.models.recipe` because a plan reads them only when a recipe asks for a
KV store (:attr:`k3launch.planning.recipes.RecipeTree.kv_stores`): `plan` does not define them.
"""

# No ``from __future__ import annotations`` here, as in models.recipe (pydantic reads annotation
# objects as they are).
from pydantic import Field, JsonValue

from k3launch.models.recipe import Env, Strict


class ArgsBlock(Strict):
    args: list[str] = []


class KvStoreRouter(Strict):
    policy: str = ""
    install: str = ""
    port: int | None = None


class KvStoreVllm(Strict):
    vllm_args: list[str] = []
    env: Env = {}
    install: dict[str, str] = {}
    port: int | None = None


class KvStore(Strict):
    name: str
    deploy_type: str = ""
    display_name: str = ""
    label: str = ""
    order: int = 0
    description: str = ""
    router: KvStoreRouter | None = None
    vllm: KvStoreVllm = Field(default_factory=KvStoreVllm)  # a factory: an instance would build the model at import
    pd: dict[str, ArgsBlock] = {}
    # Service set-up the upstream page renders as extra tabs; k3launch refuses Mooncake for
    # the bundled recipes, so these are carried, validated as JSON, and not interpreted.
    mooncake_master: dict[str, JsonValue] | None = None
    mooncake_store_config: dict[str, JsonValue] | None = None
    mooncake_vllm_config: dict[str, JsonValue] | None = None
    min_vllm_version: str | None = None
    default_instances: int | None = None
