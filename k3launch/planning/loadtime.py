"""How long a plan's engines take to read their weights, from a measured read throughput: pure.

The bytes each rank reads follow vLLM's own loader (``safetensors_weights_iterator`` in vLLM
0.32's ``model_loader/weight_utils.py``): every rank walks every shard file of the checkpoint
and reads each tensor it keeps whole, narrowing it to its part only afterwards; with expert
parallelism it skips the experts that are not its own. So:

* with experts parallel (``tep`` across the TP ranks, ``dep`` across every rank of the pool)
  the experts — nearly all of a MoE model's bytes — are split ``tp × pp`` (tep) or
  ``tp × pp × dp`` (dep) ways, and each rank reads its share (the dense part every rank reads
  whole is left out: a few percent of a MoE checkpoint);
* without (``tp``, ``tp_pp``, ``tp_dp``, ``replicas``) every rank reads a whole copy, and the
  ranks of one node share its page cache, so a node reads one whole copy: each of its ranks is
  counted for its part of that copy, whether the TP group spans one node or several.

Contention: the ranks on one node read the node's disk at once, so the node's bytes (the sum
over its ranks) go at the node's throughput and its ranks finish together; with a shared
filesystem (the inventory's ``weights.shared``), every node's bytes go at one throughput. The
throughput per node is the inventory's ``weights.read_gbps`` when set, else the node's saved
``weights probe``; a node with neither has no prediction (nor does the plan, then).

It predicts a cold read: weights already in a node's page cache load faster.
"""

from __future__ import annotations

from collections.abc import Mapping

from k3launch.models.phases import Timeline
from k3launch.models.plan import Plan, PoolCapacity
from k3launch.models.weights import LoadPrediction, RankLoad


def shards(pool: PoolCapacity) -> int:
    """How many ways an expert-parallel pool splits its experts between its ranks."""
    ways = max(pool.tp, 1) * max(pool.pp, 1)
    return ways * max(pool.dp, 1) if pool.parallelism == "dep" else ways


EXPERT_PARALLEL = ("tep", "dep")


def gb_per_rank(plan: Plan) -> dict[str, tuple[int, float]]:
    """Engine process id -> (its ranks, GB each of them reads)."""
    pools: dict[str, PoolCapacity] = {p.role: p for p in plan.capacity.pools}
    engines = [p for p in plan.processes if p.role != "router"]
    on_node: dict[tuple[str, str, str], int] = {}  # (pool, copy, node) -> ranks there
    for p in engines:
        key = (p.role, str(plan.replica_of(p)), p.node)
        on_node[key] = on_node.get(key, 0) + max(p.gpus, 1)
    out: dict[str, tuple[int, float]] = {}
    for p in engines:
        pool = pools.get(p.role)
        if pool is None:
            gb = plan.capacity.weights_gb
        elif pool.parallelism in EXPERT_PARALLEL:
            gb = pool.weights_gb / shards(pool)
        else:  # every rank reads a whole copy; the node's ranks share one read of it
            gb = pool.weights_gb / on_node[(p.role, str(plan.replica_of(p)), p.node)]
        out[p.id] = (max(p.gpus, 1), gb)
    return out


def predict(plan: Plan, node_gbps: Mapping[str, float], *, shared: bool = False, shared_gbps: float | None = None,
            basis: str = "") -> LoadPrediction | None:
    """The plan's predicted load, or None when a node that reads weights has no throughput.

    ``node_gbps``: node -> GB/s (10^9 B/s) reading its weight source. ``shared``: one filesystem
    for every node, read at ``shared_gbps`` in total (default: the slowest node's figure — one
    client's measurement, the conservative guess for the filesystem's total)."""
    per = gb_per_rank(plan)
    if not per:
        return None
    node_of = {p.id: p.node for p in plan.processes}
    node_gb: dict[str, float] = {}
    for pid, (ranks, gb) in per.items():
        node_gb[node_of[pid]] = node_gb.get(node_of[pid], 0.0) + ranks * gb
    if shared:
        known = [node_gbps[n] for n in node_gb if n in node_gbps]
        total = shared_gbps if shared_gbps is not None else (min(known) if len(known) == len(node_gb) else None)
        if not total:
            return None
        t = sum(node_gb.values()) / total
        rows = [RankLoad(pid, node_of[pid], r, gb, t) for pid, (r, gb) in per.items()]
        return LoadPrediction(rows, {"*": total}, basis, True)
    if any(not node_gbps.get(n) for n in node_gb):
        return None
    rows = [RankLoad(pid, node_of[pid], r, gb, node_gb[node_of[pid]] / node_gbps[node_of[pid]]) for pid, (r, gb) in per.items()]
    return LoadPrediction(rows, {n: node_gbps[n] for n in node_gb}, basis, False)


def against(tl: Timeline, pred: LoadPrediction | None) -> list[dict[str, object]]:
    """Per engine process of a bring-up: the predicted load (None: no throughput known) next to
    vLLM's ``Loading weights took`` of each of its ranks, and actual / predicted for its slowest
    rank; [] when neither is known for any process."""
    rows: list[dict[str, object]] = []
    for p in tl.processes:
        if p.role == "router":
            continue
        predicted = pred.seconds_of(p.id) if pred is not None else None
        took = max(p.weights_took) if p.weights_took else None
        ratio = round(took / predicted, 3) if took is not None and predicted else None
        rows.append({"process": p.id, "node": p.node, "predicted_s": None if predicted is None else round(predicted, 1),
                     "took_s": p.weights_took, "slowest_took_s": took, "ratio": ratio})
    return rows if any(r["predicted_s"] is not None or r["took_s"] for r in rows) else []
