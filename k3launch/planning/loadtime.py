"""How long a plan's engines take to read their weights, from a measured read throughput: pure.

How many bytes a rank reads depends on how it reads, which each engine process's own argv says:
its ``--load-format`` (vLLM's default ``auto``), ``--safetensors-load-strategy`` and
``--model-loader-extra-config`` (vLLM 0.32's ``model_loader/default_loader.py`` and
``weight_utils.py``), and ``--enable-ep-weight-filter``. For a pool (one copy of it) of R ranks,
r of them on the node, weights w (the checkpoint's GB: its index's ``metadata.total_size`` when
the caller read it where the weights are, else the recipe's parameters x bytes/param --
:class:`~k3launch.models.weights.Checkpoint` says which):

* ``lazy``: vLLM's safetensors iterator (formats auto, hf, safetensors, mistral) with the default,
  lazy or torchao strategy: every rank walks every shard file and reads each tensor it keeps
  whole, narrowing it afterwards. Every rank reads a whole copy, and the ranks of one node share
  its page cache, so a node reads one whole copy: w / r per rank, whether the TP group spans one
  node or several -- expert-parallel ranks included: an expert-parallel rank skips the other
  ranks' experts before reading them only with vLLM's EP weight filter (:attr:`Reading.filters_experts`).
  Then with experts parallel (``tep`` across the TP ranks, ``dep`` across every rank of the pool)
  each rank reads its share, w / (tp × pp) or w / (tp × pp × dp) (the dense part every rank reads
  whole is left out: a few percent of a MoE checkpoint).
* ``whole``: the eager strategy (each file read whole, ``f.read()``) and the multi-thread loader
  (``enable_multithread_load``: each file loaded whole) skip no expert before the read: every
  node reads one whole copy, w / r per rank, experts parallel or not.
* ``prefetch``: each rank first reads its slice of the shard files whole into the page cache
  (``sorted_files[rank::world_size]``, the world being the pool's ranks), then reads lazily; the
  node reads its ranks' slice, w × r / R, plus what its lazy read needs from the other files
  (experts assumed spread evenly over the files). Without experts parallel that is one copy.
* ``spread``: fastsafetensors reads the shard files in batches of R, one file per rank, and
  broadcasts the tensors (NCCL, not counted): each file is read once per pool, w / R per rank.
* ``none``: the dummy format reads nothing.

Any other format (runai_streamer, instanttensor, sharded_state, tensorizer, a plugin's, ...) is
not modelled: the prediction says so (``unmodelled``) instead of giving a figure.

Contention: the ranks on one node read the node's disk at once, so the node's bytes (the sum
over its ranks) go at the node's throughput and its ranks finish together; with a shared
filesystem (the inventory's ``weights.shared``), every node's bytes go at one throughput. The
throughput per node is the inventory's ``weights.read_gbps`` when set, else the node's saved
``weights probe``; a node with neither has no prediction (nor does the plan, then).

Staging (the plan's ``stage``): first each engine node copies the whole model from the source
(one copy per node, at the source's throughput; shared: all nodes' copies at its one
throughput), then its engines read the staged copy as above at ``weights.stage_read_gbps``
(without it, no figure). ``up`` skips the copy where it is complete: the figure is for the cold case.

It predicts a cold read: weights already in a node's page cache load faster.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from k3launch.models.phases import Timeline
from k3launch.models.plan import Plan, PoolCapacity
from k3launch.models.weights import Checkpoint, LoadPrediction, RankLoad, estimated

EXPERT_PARALLEL = ("tep", "dep")
READERS = {"auto": "safetensors", "hf": "safetensors", "safetensors": "safetensors", "mistral": "safetensors",
           "fastsafetensors": "spread", "dummy": "none"}  # vLLM's own safetensors iterator, or another way of reading
HOW = {"lazy": "each rank reads the tensors it keeps, a node's ranks sharing one copy (expert-parallel ranks skip the others' experts "
               "only with the EP weight filter)",
       "whole": "each node reads a whole copy (no expert skipped before the read)",
       "prefetch": "each node reads its ranks' slice of the shard files whole, then what its ranks need of the others",
       "spread": "each shard file is read once per pool, by one rank, and broadcast to the others",
       "none": "no weights are read"}


@dataclass(frozen=True)
class Reading:
    """How one engine process reads the checkpoint, from its argv."""

    load_format: str = "auto"
    strategy: str | None = None
    multithread: bool = False
    ep_filter: bool = False  # --enable-ep-weight-filter (vLLM's default: off)
    eplb: bool = False  # --enable-eplb

    @property
    def filters_experts(self) -> bool:
        """Whether an expert-parallel rank skips the other ranks' experts before reading them.

        vLLM's ``model_executor/model_loader/default_loader.py`` (the flag is in the 0.32.0 and
        0.33.0 schemas): the filter is built by
        ``DefaultModelLoader._init_ep_weight_filter`` only with ``--enable-ep-weight-filter``
        (off by default), for a MoE model under expert parallelism, and never with EPLB (its
        redundant expert slots need every expert); ``_get_weights_iterator`` hands it to
        ``safetensors_weights_iterator`` alone, whose per-tensor reads (lazy, prefetch's lazy
        part) skip before reading -- fastsafetensors, the multi-thread loader and the eager
        strategy's whole-file reads never see it. Otherwise every rank reads every expert."""
        return self.ep_filter and not self.eplb and self.mode in ("lazy", "prefetch")

    @property
    def mode(self) -> str | None:
        """``lazy``, ``whole``, ``prefetch``, ``spread``, ``none``; None: not modelled."""
        kind = READERS.get(self.load_format)
        if kind != "safetensors":
            return kind
        if self.multithread or self.strategy == "eager":
            return "whole"
        return "prefetch" if self.strategy == "prefetch" else "lazy"

    @property
    def words(self) -> str:
        strategy = f", {self.strategy}" if self.strategy else ""
        ep = (", EP weight filter" + ("" if self.filters_experts else " (no effect here)")) if self.ep_filter else ""
        return f"--load-format {self.load_format}{strategy}{', multi-thread' if self.multithread else ''}{ep}{', EPLB' if self.eplb else ''}"


def _last(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for i, tok in enumerate(argv):
        name, eq, inline = tok.partition("=")
        if name == flag:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


def _switch(argv: Sequence[str], name: str) -> bool:
    """A boolean flag as vLLM parses it: the last of ``--NAME``, ``--NAME=BOOL``, ``--disable-X``
    (0.33) or ``--no-NAME`` (0.32) wins; off when none is given."""
    off = {"--no-" + name[2:], "--disable-" + name[len("--enable-"):]}
    on = False
    for tok in argv:
        flag, eq, value = tok.partition("=")
        if flag == name:
            on = value.lower() not in ("false", "0", "no", "off") if eq else True
        elif flag in off:
            on = False
    return on


def reading(argv: Sequence[str]) -> Reading:
    """The process's :class:`Reading` (vLLM's defaults where its argv says nothing)."""
    fmt = (_last(argv, "--load-format") or "auto").lower()
    strategy = _last(argv, "--safetensors-load-strategy")
    dotted = _last(argv, "--model-loader-extra-config.enable_multithread_load")
    try:
        extra = json.loads(_last(argv, "--model-loader-extra-config") or "{}")
    except ValueError:
        extra = {}
    multi = (dotted or "").lower() == "true" or (isinstance(extra, dict) and extra.get("enable_multithread_load") is True)
    return Reading(fmt, None if strategy in (None, "None") else strategy, multi,
                   _switch(argv, "--enable-ep-weight-filter"), _switch(argv, "--enable-eplb"))


def shards(pool: PoolCapacity) -> int:
    """How many ways an expert-parallel pool splits its experts between its ranks."""
    ways = max(pool.tp, 1) * max(pool.pp, 1)
    return ways * max(pool.dp, 1) if pool.parallelism == "dep" else ways


def gb_per_rank(plan: Plan, checkpoint: Checkpoint | None = None) -> dict[str, tuple[int, float]]:
    """Engine process id -> (its ranks, GB each of them reads), for the processes whose way of
    reading is modelled (:attr:`Reading.mode`); the checkpoint's size is ``checkpoint`` (the
    recipe's estimate when not given)."""
    w = (checkpoint or estimated(plan)).gb
    pools: dict[str, PoolCapacity] = {p.role: p for p in plan.capacity.pools}
    engines = [p for p in plan.processes if p.role != "router"]
    on_node: dict[tuple[str, str, str], int] = {}  # (pool, copy, node) -> ranks there
    in_pool: dict[tuple[str, str], int] = {}  # (pool, copy) -> its ranks
    for p in engines:
        key = (p.role, str(plan.replica_of(p)), p.node)
        on_node[key] = on_node.get(key, 0) + max(p.gpus, 1)
        in_pool[key[:2]] = in_pool.get(key[:2], 0) + max(p.gpus, 1)
    out: dict[str, tuple[int, float]] = {}
    for p in engines:
        how = reading(p.argv)
        mode = how.mode
        if mode is None:
            continue
        pool = pools.get(p.role)
        r = on_node[(p.role, str(plan.replica_of(p)), p.node)]
        big_r = in_pool[(p.role, str(plan.replica_of(p)))]
        split = pool is not None and pool.parallelism in EXPERT_PARALLEL and how.filters_experts
        lazy_node = r * w / shards(pool) if split and pool is not None else w  # the node's lazy read
        node = {"lazy": lazy_node, "whole": w, "spread": w * r / big_r, "none": 0.0,
                "prefetch": w * r / big_r + lazy_node * (1 - r / big_r)}[mode]
        out[p.id] = (max(p.gpus, 1), node / r)
    return out


def _how(plan: Plan) -> tuple[str, str]:
    """How the engines read, in words (each distinct way with its processes when they differ), and
    why there is no figure ('' when every way is modelled)."""
    by: dict[Reading, list[str]] = {}
    for p in plan.processes:
        if p.role != "router":
            by.setdefault(reading(p.argv), []).append(p.id)
    parts = [f"{r.words}: {HOW[r.mode] if r.mode else 'not modelled'}" + (f" ({', '.join(ids)})" if len(by) > 1 else "")
             for r, ids in by.items()]
    odd = [r for r in by if r.mode is None]
    why = (f"--load-format {', '.join(sorted({r.load_format for r in odd}))} is not modelled (its loader reads the checkpoint its own way): "
           "no figure rather than a wrong one") if odd else ""
    return "; ".join(parts), why


def _notes(plan: Plan, shared: bool) -> tuple[str, ...]:
    modes = {reading(p.argv) for p in plan.processes if p.role != "router"}
    notes = []
    if shared and any(r.mode == "lazy" and r.strategy is None for r in modes):
        notes.append("vLLM's default strategy prefetches on its own when the checkpoint is on NFS or Lustre and fits in 90 % of the "
                     "node's RAM; read here as lazy (set weights.load_strategy to say which)")
    if any(r.mode == "spread" for r in modes):
        notes.append("fastsafetensors then broadcasts every tensor to the pool's ranks over NCCL: not counted")
    if plan.stage is not None:
        notes.append("a node whose staged copy is complete skips the copy")
    ep = {p.role for p in plan.capacity.pools if p.parallelism in EXPERT_PARALLEL}
    ep_reads = {reading(p.argv) for p in plan.processes if p.role in ep}
    if any(r.mode in ("lazy", "prefetch") and not r.ep_filter for r in ep_reads):
        notes.append("expert-parallel ranks read every expert: vLLM's EP weight filter is off (--enable-ep-weight-filter turns it on)")
    if any(r.ep_filter and not r.filters_experts for r in ep_reads):
        notes.append("--enable-ep-weight-filter has no effect here: vLLM turns it off with EPLB, and only its safetensors "
                     "iterator's per-tensor reads use it (not fastsafetensors, the multi-thread loader or the eager strategy)")
    return tuple(notes)


def predict(plan: Plan, node_gbps: Mapping[str, float], *, shared: bool = False, shared_gbps: float | None = None,
            basis: str = "", stage_gbps: Mapping[str, float] | None = None, checkpoint: Checkpoint | None = None) -> LoadPrediction | None:
    """The plan's predicted load, or None when a node that reads weights has no throughput.

    ``node_gbps``: node -> GB/s (10^9 B/s) reading its weight source. ``shared``: one filesystem
    for every node, read at ``shared_gbps`` in total (default: the slowest node's figure — one
    client's measurement, the conservative guess for the filesystem's total). ``stage_gbps``:
    node -> GB/s reading the staged copy (the plan's ``stage``). ``checkpoint``: its size as its
    index says, read where the weights are (this core reads no file); the recipe's estimate when
    not given, and the prediction says which. A way of reading that is not modelled gives a
    prediction without figures that says why (``unmodelled``)."""
    nodes = list(dict.fromkeys(p.node for p in plan.processes if p.role != "router"))
    if not nodes:
        return None
    if shared:
        known = [node_gbps[n] for n in nodes if n in node_gbps]
        total = shared_gbps if shared_gbps is not None else (min(known) if len(known) == len(nodes) else None)
        if not total:
            return None
        rates: dict[str, float] = {"*": total}
    elif any(not node_gbps.get(n) for n in nodes):
        return None
    else:
        rates = {n: node_gbps[n] for n in nodes}
    how, why = _how(plan)
    staged = plan.stage is not None
    if staged and not why and any(not (stage_gbps or {}).get(n) for n in nodes):
        why = "the staged copy's read throughput is unknown: set the inventory's weights.stage_read_gbps"
    notes = _notes(plan, shared)
    ck = checkpoint or estimated(plan)
    if why:
        return LoadPrediction([], rates, basis, shared, how, notes, why, checkpoint=ck)
    per = gb_per_rank(plan, ck)
    node_of = {p.id: p.node for p in plan.processes}
    node_gb = dict.fromkeys(nodes, 0.0)
    for pid, (ranks, gb) in per.items():
        node_gb[node_of[pid]] += ranks * gb
    copy = dict.fromkeys(nodes, 0.0)
    if staged:  # each node copies the whole model first, then reads its copy on its own disk
        copy = {n: len(nodes) * ck.gb / rates["*"] if shared else ck.gb / rates[n] for n in nodes}
        read = {n: node_gb[n] / (stage_gbps or {})[n] for n in nodes}
    elif shared:
        read = dict.fromkeys(nodes, sum(node_gb.values()) / rates["*"])
    else:
        read = {n: node_gb[n] / rates[n] for n in nodes}
    rows = [RankLoad(pid, node_of[pid], r, gb, copy[node_of[pid]] + read[node_of[pid]], copy[node_of[pid]]) for pid, (r, gb) in per.items()]
    return LoadPrediction(rows, rates, basis, shared, how, notes, "", {n: (stage_gbps or {})[n] for n in nodes} if staged else {}, ck)


def against(tl: Timeline, pred: LoadPrediction | None) -> list[dict[str, object]]:
    """Per engine process of a bring-up: the predicted load (None: no throughput known, or not
    modelled) next to vLLM's ``Loading weights took`` of each of its ranks, and actual / predicted
    for its slowest rank; [] when neither is known for any process. With staging the prediction
    set beside vLLM's figure is the engines' read alone (vLLM's clock starts after the copy)."""
    rows: list[dict[str, object]] = []
    for p in tl.processes:
        if p.role == "router":
            continue
        row = next((r for r in pred.ranks if r.process == p.id), None) if pred is not None else None
        predicted = row.seconds - row.copy_s if row is not None else None
        took = max(p.weights_took) if p.weights_took else None
        ratio = round(took / predicted, 3) if took is not None and predicted else None
        rows.append({"process": p.id, "node": p.node, "predicted_s": None if predicted is None else round(predicted, 1),
                     "took_s": p.weights_took, "slowest_took_s": took, "ratio": ratio})
    return rows if any(r["predicted_s"] is not None or r["took_s"] for r in rows) else []
