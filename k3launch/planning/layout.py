"""How a pool's engines are laid out: k3launch's placement flags, and the recipe's say in them.

Placement flags (docs/planning.md ("Layout of processes")): one node runs TP over the GPUs the
pool uses (all of them, or a single-node TP's declared or auto-fit size); multi-node TP/TEP gets
``--nnodes/--node-rank/--master-addr/--master-port`` and ``--headless`` off the head; DEP gets
``--data-parallel-size g·N --data-parallel-size-local g`` and ``--data-parallel-start-rank i·g``.

A recipe may size a one-node layout itself, after the placement flags (``strategy_overrides``
``--data-parallel-size 4``, a hardware block's ``--tensor-parallel-size 2``): upstream's command
keeps the recipe's value, so the plan does too and its placement follows (:func:`recipe_layout`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from k3launch.errors import K3Error
from k3launch.models.recipe import HardwareProfile, Strategy
from k3launch.models.selection import Notice, Pool, Resolved
from k3launch.planning.compose import Composed, ProvEntry, Source, last_writes
from k3launch.planning.placement import NodeSpec, Ports
from k3launch.planning.rules import NVL4_HARDWARE, NVL4_ONLY_ENV
from k3launch.planning.schema import FlagSchema

_LB_KEYS = ("--data-parallel-hybrid-lb", "--data-parallel-external-lb")
_SIZES = ("--tensor-parallel-size", "--data-parallel-size", "--pipeline-parallel-size")


def placement_flags(pool: Pool, i: int, head: NodeSpec, hybrid: bool, ports: Ports) -> tuple[list[str], bool, int | None, int | None]:
    """Placement flags of node ``i`` of ``pool``: (tokens, serves_http, node_rank, dp_start_rank)."""
    g, n, par = pool.gpus_per_node, pool.nodes, pool.parallelism
    if par == "replicas":  # independent engines: a whole copy per node, each serving HTTP (a router fronts them)
        return ["--tensor-parallel-size", str(g)], True, None, None
    if par in ("tp", "tep", "tp_pp"):
        toks = ["--tensor-parallel-size", str(g if par == "tp_pp" else g * n)]
        if par == "tp_pp":
            toks += ["--pipeline-parallel-size", str(n)]
        if n == 1:
            return toks, True, None, None
        toks += ["--nnodes", str(n), "--node-rank", str(i), "--master-addr", head.address, "--master-port", str(ports.master)]
        if i > 0:
            toks.append("--headless")
        return toks, i == 0, i, None
    local = g if par == "dep" else 1
    toks = ["--tensor-parallel-size", str(1 if par == "dep" else g), "--data-parallel-size", str(local * n), "--data-parallel-size-local", str(local)]
    if n == 1:
        return toks, True, None, 0
    toks += ["--data-parallel-address", head.address, "--data-parallel-rpc-port", str(ports.dp_rpc)]
    if i > 0:
        toks += ["--data-parallel-start-rank", str(i * local)]
        if not hybrid:
            toks.append("--headless")
    return toks, i == 0 or hybrid, None, i * local


def sizes(pool: Pool) -> tuple[int, int, int]:
    """(TP, DP, PP) of a pool as its placement flags lay it out."""
    return {"tp": (pool.gpus, 1, 1), "tep": (pool.gpus, 1, 1), "dep": (1, pool.gpus, 1),
            "tp_pp": (pool.gpus_per_node, 1, pool.nodes), "tp_dp": (pool.gpus_per_node, pool.nodes, 1),
            "replicas": (pool.gpus_per_node, pool.nodes, 1)}[pool.parallelism]


def lb_modes(schema: FlagSchema, sources: Sequence[Source]) -> dict[str, bool]:
    """Which of hybrid and external load balancing the pool's own sources leave on (either: every
    DEP node serves HTTP; a fault-tolerant pool turns hybrid off), judged as
    compose judges them: the last writer wins, so a recipe's ``strategy_overrides``
    ``--no-data-parallel-hybrid-lb`` turns the strategy's flag off."""
    on = dict.fromkeys(_LB_KEYS, False)
    for src in sources:
        args, _ = schema.parse(list(src.args))  # placeholders are not resolved yet: only booleans matter here
        for a in args:
            if a.key in on:
                on[a.key] = bool(a.polarity)
    return on


def pool_strategies(strategies: Mapping[str, Strategy], pool: Pool) -> dict[str, Strategy]:
    """The strategy whose args a P/D pool laid out as TEP or DEP takes: for a one-node pool the
    tree's single-node one when it has it (a multi-node strategy may carry cross-node tuning such
    as ``-cc.pass_config.fuse_allreduce_rms=False``, which a one-node pool must not get), else
    the multi-node one."""
    out: dict[str, Strategy] = {}
    for par in ("tep", "dep"):
        names = ([f"single_node_{par}"] if pool.nodes == 1 else []) + [f"multi_node_{par}"]
        found = next((strategies[s] for s in names if s in strategies), None)
        if found is not None:
            out[par] = found
    return out


def recipe_layout(schema: FlagSchema, sources: Sequence[Source], placement: Sequence[str], reserved: Mapping[str, str],
                  pool: Pool, hw_id: str, hw: HardwareProfile) -> Pool | None:
    """The pool a recipe's own size flags describe, when the sizes the head node's ``sources`` (the
    ``placement`` flags' source among them) would compose to differ from the ``placement`` flags'
    (``None``: they agree). Read before composing, so each pool is composed once, at its final size.
    Only a one-node pool can follow a recipe: a multi-node layout is k3launch's."""
    last = last_writes(schema, sources, _SIZES, reserved)
    want = tuple(int(placement[placement.index(k) + 1]) if k in placement else 1 for k in _SIZES)
    got = tuple(int(last[k].value or 1) if k in last else 1 for k in _SIZES)
    if got == want:
        return None
    tp, dp, pp = got
    who = ", ".join(f"{k} {last[k].value} ({last[k].origin})" for k in _SIZES if k in last)
    if pool.nodes > 1:
        raise K3Error("recipe-layout", f"the recipe sets {who}, which contradicts the {pool.nodes}-node {pool.parallelism} layout "
                      f"(TP {want[0]} x DP {want[1]} x PP {want[2]})", "choose another strategy or hardware for this recipe")
    if pool.parallelism in ("tp", "tep") and dp == pp == 1:
        used = tp
    elif pool.parallelism == "dep" and tp == pp == 1:
        used = dp
    else:
        raise K3Error("recipe-layout", f"the recipe sets {who}: not a one-node {pool.parallelism} layout k3launch can place",
                      "choose another strategy for this recipe")
    if used > hw.gpu_count and not hw.is_cpu:
        raise K3Error("recipe-layout", f"the recipe sets {who}: {used} GPUs, more than one {hw_id} node has ({hw.gpu_count})",
                      "choose hardware with more GPUs per node, or a multi-node strategy")
    return replace(pool, gpus_per_node=used)


def strip_nvl4_env(r: Resolved, c: Composed) -> list[Notice]:
    """P/D only: remove the environment GB200/GB300 NVL4 trays want (NCCL symmetric memory,
    cross-node NVLink, UCX devices) on other GPUs, where it is inert or harmful, whichever layer set
    it. Each removal is recorded in the provenance and is an ``overridden`` notice."""
    if not r.is_pd or r.hardware_id in NVL4_HARDWARE:
        return []
    out = []
    for k in NVL4_ONLY_ENV:
        if k in c.env:
            last = c.provenance[k][-1]
            del c.env[k]
            c.provenance[k].append(ProvEntry(last.layer, "(removed)", f"k3launch P/D: for GB200/GB300 NVL4 trays only, removed on {r.hardware_id}"))
            out.append(Notice("overridden", f"env {k}: {last.value} ({last.layer}) removed: P/D environment for GB200/GB300 NVL4 trays only, "
                                            f"inert or harmful on {r.hardware_id}"))
    return out
