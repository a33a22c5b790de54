"""Turn a resolved selection into the ordered :class:`Source` list of one pool's engine processes.

This is where the recipe schema's blocks are mapped onto the seven layers, following the
upstream generator (see docs/planning.md ("Composition")), with these choices made explicit:

* hardware blocks of the recipe, the variant and a strategy override are looked up by
  generation (``hopper``/``blackwell``/``amd``), falling back on NVIDIA to ``nvidia``; a
  strategy's (or P/D role's) block for the generation *replaces* the recipe's and the variant's
  generation blocks; blocks keyed by an exact hardware id (``gb300``) are applied after, additively;
* a feature's (or its mode's) ``hardware_overrides`` entry for the hardware id, generation,
  brand or ``default`` replaces its ``args``; a modal feature runs its one resolved mode;
* placement flags (TP/DP sizes, ranks, addresses, ports) are written by k3launch at the end of
  the strategy layer and are reserved: ``--set`` cannot change them. A ``strategy_overrides``
  list that sets a layout flag itself comes after them, as upstream's order has it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from k3launch.defaults import PROBE_PATHS
from k3launch.errors import K3Error
from k3launch.models.recipe import AdvancedPreset, Env, HardwareProfile, Recipe, RoleOverride, Strategy, StrategyOverride
from k3launch.models.selection import Pool, Resolved
from k3launch.planning import rules
from k3launch.planning.compose import Locked, Source
from k3launch.planning.schema import FlagSchema

# The seed's four Advanced knobs, used when neither the taxonomy nor the recipe defines its own.
DEFAULT_ADVANCED: dict[str, AdvancedPreset] = {
    "max-num-batched-tokens": AdvancedPreset(description="one generic batch budget", args=["--max-num-batched-tokens", "8192"]),
    "max-num-seqs": AdvancedPreset(description="one generic concurrency cap", args=["--max-num-seqs", "256"]),
    "gpu-memory-utilization": AdvancedPreset(description="GPU memory fraction", args=["--gpu-memory-utilization", "0.95"]),
    "max-model-len": AdvancedPreset(description="let vLLM size the context from free KV cache", args=["--max-model-len", "auto"]),
}

# Flag keys placement owns, with the reason shown when a user tries to --set them.
RESERVED: dict[str, str] = {
    "--tensor-parallel-size": "TP size follows the strategy and node count",
    "--pipeline-parallel-size": "PP size follows the strategy and node count",
    "--data-parallel-size": "DP size follows the strategy and node count",
    "--data-parallel-size-local": "DP ranks per node follow the GPUs per node",
    "--data-parallel-start-rank": "each node's first DP rank is planned",
    "--data-parallel-address": "the DP coordinator is the pool head",
    "--data-parallel-rpc-port": "ports are planned",
    "--data-parallel-hybrid-lb": "load balancing follows the strategy",
    "--data-parallel-external-lb": "load balancing follows the strategy",
    "--data-parallel-rank": "each DP rank's process is planned (--fault-tolerance)",
    "--enable-fault-tolerance": "fault tolerance needs one API server per DP rank: ask for it with --fault-tolerance",
    "--nnodes": "node count is planned",
    "--node-rank": "node ranks are planned",
    "--master-addr": "the TP master is the pool head",
    "--master-port": "ports are planned",
    "--headless": "head/headless follows the node rank",
    "--port": "ports are planned",
    "--host": "each engine binds its node's planned address",
    "--enable-expert-parallel": "expert parallelism is what distinguishes TP from TEP/DEP; pick the strategy",
}


def _env(env: Env) -> tuple[tuple[str, str], ...]:
    return tuple((k, str(v)) for k, v in env.items())


# Flags k3launch's placement writes for the layout (its ports and bind address are planned apart).
LAYOUT_FLAGS = frozenset({"--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size", "--data-parallel-size-local",
                          "--data-parallel-start-rank", "--data-parallel-address", "--data-parallel-rpc-port", "--nnodes",
                          "--node-rank", "--master-addr", "--master-port", "--headless"})


def _writes_layout(schema: FlagSchema, src: Source) -> bool:
    """Whether a recipe source sets a flag placement writes (``--data-parallel-size 4`` to run DP 4
    on an 8-GPU node): upstream applies ``strategy_overrides`` after its parallel flags, so such a
    recipe value wins there, and k3launch applies that source after its placement flags to match."""
    args, _ = schema.parse(list(src.args))  # placeholders are not resolved yet: only flag names matter here
    return any(a.spec.canonical in LAYOUT_FLAGS for a in args)


class PoolSources(NamedTuple):
    """A pool's sources, split where k3launch's placement flags go (after ``pre``, before ``layout``)."""

    pre: list[Source]  # base, variant, strategy file, strategy_overrides
    layout: list[Source]  # strategy_overrides that set placement flags: after placement, so they win
    post: list[Source]  # hardware, advanced presets
    tail: list[Source]  # --set, features, kv_offload
    quiet: tuple[Source, ...] = ()  # after placement, on a process that serves HTTP: no access log of probes


# The flag that keeps the polls of PROBE_PATHS out of an engine's access log (vLLM's uvicorn filter;
# the simulated engine's the same), where the plan's vLLM has it.
QUIET_FLAG = "--disable-access-log-for-endpoints"


def quiet_probes(schema: FlagSchema) -> tuple[Source, ...]:
    """The source asking a serving engine not to log its probes' requests; none for a vLLM without the flag."""
    if schema.lookup(QUIET_FLAG) is None:
        return ()
    return (Source("strategy", "k3launch probes (health and metrics polls)", (QUIET_FLAG, ",".join(PROBE_PATHS))),)


def advanced_presets(recipe: Recipe, taxonomy_presets: Mapping[str, AdvancedPreset]) -> dict[str, AdvancedPreset]:
    return dict(recipe.advanced or taxonomy_presets or DEFAULT_ADVANCED)


def pool_sources(r: Resolved, pool: Pool, rf: str, strategy_file: str, taxonomy_presets: Mapping[str, AdvancedPreset],
                 kv_args: tuple[list[str], Env] | None, schema: FlagSchema,
                 pool_strategies: Mapping[str, Strategy] | None = None) -> PoolSources:
    """Sources before placement (base, variant, strategy), and after (hardware..kv_offload).

    Placement flags are inserted at the end of the strategy layer, before the recipe's
    ``strategy_overrides`` that set placement flags themselves; the ``--set`` sources are applied
    inside the advanced layer. ``pool_strategies`` maps a P/D pool's layout (``tep``) to the strategy
    whose args it takes.
    """
    ov, role_ov = _overrides(r, pool.role)
    pre = [*_model_sources(r, rf), _strategy_source(r, pool, strategy_file), *_pool_layout_source(r, pool, pool_strategies or {})]
    layout: list[Source] = []
    for src in _override_sources(r, pool.role, rf, ov, role_ov):
        (layout if _writes_layout(schema, src) else pre).append(src)
    post = [*_hardware_sources(r, pool.role, rf, ov, role_ov), *_preset_sources(r, taxonomy_presets)]
    tail = [*_user_sources(r, schema), *_feature_sources(r, rf)]
    if kv_args is not None:
        tail.append(Source("kv_offload", f"taxonomy.yaml kv_offload.{r.kv_offload}", tuple(kv_args[0]), _env(kv_args[1])))
    return PoolSources(pre, layout, post, tail, quiet_probes(schema))


def _overrides(r: Resolved, role: str) -> tuple[StrategyOverride | None, RoleOverride | None]:
    """The recipe's ``strategy_overrides`` block of the strategy, and of the P/D role within it."""
    ov = r.recipe.strategy_overrides.get(r.strategy.name)
    role_ov = getattr(ov, role, None) if ov is not None and role in ("prefill", "decode") else None
    return ov, role_ov


def _model_sources(r: Resolved, rf: str) -> list[Source]:
    """The base layer (the recipe's model) and the variant's, with its block for this exact hardware id."""
    rec, v, hid = r.recipe, r.variant, r.hardware_id
    out = [Source("base", f"{rf} model.base_args", tuple(rec.model.base_args), _env(rec.model.base_env)),
           Source("variant", f"{rf} variants.{r.variant_name}", tuple(v.extra_args), _env(v.extra_env))]
    if hid in v.hardware_overrides:
        vb = v.hardware_overrides[hid]
        out.append(Source("variant", f"{rf} variants.{r.variant_name}.hardware_overrides.{hid}", tuple(vb.extra_args), _env(vb.extra_env)))
    return out


def _strategy_source(r: Resolved, pool: Pool, strategy_file: str) -> Source:
    """The strategy file's args: its P/D role's for a P/D pool."""
    role_args = getattr(r.strategy, pool.role, None) if pool.role in ("prefill", "decode") else None
    if role_args is None:
        return Source("strategy", strategy_file, tuple(r.strategy.vllm_args), _env(r.strategy.env))
    return Source("strategy", f"{strategy_file} {pool.role}", tuple(role_args.vllm_args), _env(role_args.env))


def _pool_layout_source(r: Resolved, pool: Pool, pool_strategies: Mapping[str, Strategy]) -> list[Source]:
    """A P/D pool laid out as TEP or DEP takes that strategy's args (expert parallelism, hybrid load
    balancing); its env (NIC names) comes from placement."""
    if pool.role not in ("prefill", "decode") or getattr(r.strategy, pool.role, None) is None:
        return []
    ps = pool_strategies.get(pool.parallelism)
    if ps is not None:
        return [Source("strategy", f"strategies/{ps.name}.yaml ({pool.role} pool)", tuple(ps.vllm_args))]
    if pool.parallelism in ("tep", "dep"):
        return [Source("strategy", f"k3launch placement ({pool.role} pool is {pool.parallelism})", ("--enable-expert-parallel",))]
    return []


def _override_sources(r: Resolved, role: str, rf: str, ov: StrategyOverride | None, role_ov: RoleOverride | None) -> list[Source]:
    """The recipe's ``strategy_overrides`` of the strategy, then of the P/D role."""
    sname = r.strategy.name
    out: list[Source] = []
    if ov is not None:
        # extra_env is the non-P/D env of a strategy override: a P/D role takes env only.
        env = ov.env if role in ("prefill", "decode") else {**ov.env, **ov.extra_env}
        out.append(Source("strategy", f"{rf} strategy_overrides.{sname}", tuple(ov.extra_args + ov.vllm_args), _env(env)))
    if role_ov is not None:
        out.append(Source("strategy", f"{rf} strategy_overrides.{sname}.{role}", tuple(role_ov.vllm_args), _env(role_ov.env)))
    return out


def _hardware_sources(r: Resolved, role: str, rf: str, ov: StrategyOverride | None, role_ov: RoleOverride | None) -> list[Source]:
    """The hardware layer: the generation block (a strategy- or role-level one replaces the recipe's
    and the variant's), then the blocks keyed by this exact hardware id."""
    rec, hw, hid, sname = r.recipe, r.hardware, r.hardware_id, r.strategy.name
    out: list[Source] = []
    replacing = None
    for blocks, where in ((role_ov.hardware_overrides if role_ov else {}, f"strategy_overrides.{sname}.{role}"),
                          (ov.hardware_overrides if ov else {}, f"strategy_overrides.{sname}")):
        found = rules.generation_block(blocks, hw)
        if found is not None and replacing is None:
            replacing = (f"{where}.hardware_overrides.{found[0]}", found[1])
    if replacing is not None:
        out.append(Source("hardware", f"{rf} {replacing[0]}", tuple(replacing[1].extra_args), _env(replacing[1].extra_env)))
    else:
        found = rules.generation_block(rec.hardware_overrides, hw)
        if found is not None:
            out.append(Source("hardware", f"{rf} hardware_overrides.{found[0]}", tuple(found[1].extra_args), _env(found[1].extra_env)))
        vfound = rules.generation_block(r.variant.hardware_overrides, hw)
        if vfound is not None:
            vkey, vblock = vfound
            out.append(Source("hardware", f"{rf} variants.{r.variant_name}.hardware_overrides.{vkey}", tuple(vblock.extra_args), _env(vblock.extra_env)))
    for blocks, where in ((rec.hardware_overrides, "hardware_overrides"),
                          (ov.hardware_overrides if ov else {}, f"strategy_overrides.{sname}.hardware_overrides"),
                          (role_ov.hardware_overrides if role_ov else {}, f"strategy_overrides.{sname}.{role}.hardware_overrides")):
        if hid in blocks and hid not in (hw.generation, hw.brand.lower()):
            out.append(Source("hardware", f"{rf} {where}.{hid}", tuple(blocks[hid].extra_args), _env(blocks[hid].extra_env)))
    return out


def _preset_sources(r: Resolved, taxonomy_presets: Mapping[str, AdvancedPreset]) -> list[Source]:
    """The Advanced presets asked for (``--advanced``)."""
    presets = advanced_presets(r.recipe, taxonomy_presets)
    out = []
    for name in r.selection.advanced:
        if name not in presets:
            raise K3Error("unknown-advanced", f"unknown Advanced preset {name!r}", "choose one of: " + ", ".join(presets))
        out.append(Source("advanced", f"advanced preset {name}", tuple(presets[name].args)))
    return out


def _user_sources(r: Resolved, schema: FlagSchema) -> list[Source]:
    """The user's ``--set`` and ``--env``, in the advanced layer."""
    user = [Source("advanced", f"--set {s}", set_tokens(s, schema), user=True) for s in r.selection.sets]
    return user + [Source("advanced", f"--env {name}", (), ((name, value),), user=True)
                   for name, _, value in (e.partition("=") for e in r.selection.env)]


def _feature_sources(r: Resolved, rf: str) -> list[Source]:
    """Each feature that runs: its args, its one resolved mode's for a modal feature, replaced by a
    hardware entry for this hardware id, generation, brand or ``default``."""
    out = []
    for name in r.features:
        feat = r.recipe.features[name]
        base = f"features.{name}"
        args, fblocks = feat.args, feat.hardware_overrides
        mode = r.feature_modes.get(name)
        if mode is not None:  # a modal feature runs its one mode's args
            base, args, fblocks = f"{base}.modes.{mode}", feat.modes[mode].args, feat.modes[mode].hardware_overrides
        where = base
        hit = rules.hw_keyed(fblocks, r.hardware_id, r.hardware)  # a hardware entry replaces the args
        if hit is not None:
            args, where = hit[1].args, f"{base}.hardware_overrides.{hit[0]}"
        out.append(Source("features", f"{rf} {where}", tuple(args)))
    return out


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def set_tokens(text: str, schema: FlagSchema) -> tuple[str, ...]:
    """``FLAG=VALUE`` as typed after ``--set``; booleans as ``FLAG``, ``no-FLAG`` or ``FLAG=true|false``."""
    name, eq, value = text.partition("=")
    name = name.strip()
    if not name:
        raise K3Error("bad-set", f"--set {text!r}: no flag name", "write --set FLAG=VALUE, e.g. --set max-num-seqs=64")
    flag = name if name.startswith("-") else "--" + name
    found = schema.lookup(flag.partition(".")[0])
    if found is None:
        raise K3Error("unknown-flag", f"--set {text!r}: {flag} is not a flag of vllm serve {schema.version}", schema.suggest(flag))
    spec, polarity, _ = found
    if spec.kind in ("bool", "store_true"):
        if not eq:
            return (flag,)
        if value.lower() in _TRUE + _FALSE:
            want = (value.lower() in _TRUE) == bool(polarity)
            return (spec.bool_form(want),)
        raise K3Error("bad-set", f"--set {text!r}: {spec.canonical} is a boolean", f"write --set {name} or --set {name}=false")
    if not eq:
        raise K3Error("bad-set", f"--set {text!r} has no '='", f"write --set {name}=VALUE")
    return (flag, value)


def locks_for(recipe: Recipe, hw_id: str, hw: HardwareProfile) -> list[Locked]:
    out: list[Locked] = []
    for key in (hw_id, hw.generation, hw.brand.lower()):
        for lk in recipe.locked.get(key, []):
            if lk.flag:
                out.append(Locked(lk.flag, lk.reason))
            if lk.env:
                out.append(Locked("env:" + lk.env, lk.reason))
    return out
