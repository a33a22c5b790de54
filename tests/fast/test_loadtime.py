"""The predicted weight load (k3launch.planning.loadtime): bytes per rank by layout, contention on
a node's disk and on a shared filesystem; where the throughput comes from (inventory, saved
probe) (``plan``, ``doctor`` and ``timeline`` showing it: test_loadtime_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from paths import TESTS

from k3launch import api
from k3launch.deploy.state import StateStore, write_atomic
from k3launch.models.plan import Plan, WeightStage
from k3launch.models.weights import Checkpoint, Probe, index_total, probes_json
from k3launch.planning.loadtime import Reading, gb_per_rank, predict, reading

GOLDEN = TESTS / "golden"


def golden(name: str) -> Plan:
    return Plan.model_validate_json((GOLDEN / f"{name}.json").read_text())


def reading_as(plan: Plan, load_format: str, strategy: str | None = None, extra: str | None = None, *more: str) -> Plan:
    """``plan`` with every engine's --load-format (and strategy, loader config) replaced, ``more`` flags added."""
    procs = []
    for p in plan.processes:
        argv = list(p.argv)
        if p.role != "router":
            for flag, value in (("--load-format", load_format), ("--safetensors-load-strategy", strategy), ("--model-loader-extra-config", extra)):
                if flag in argv:
                    del argv[argv.index(flag):argv.index(flag) + 2]
                argv += [flag, value] if value is not None else []
            argv += more
        procs.append(p.model_copy(update={"argv": argv}))
    return plan.model_copy(update={"processes": procs})


FILTER = "--enable-ep-weight-filter"


def test_bytes_per_rank_follow_the_layout() -> None:
    """vLLM's own safetensors iterator (lazy): what each rank keeps; a node's ranks share one copy.
    Expert-parallel ranks skip the others' experts only with the EP weight filter."""
    tp3 = gb_per_rank(reading_as(golden("h100_multi_node_tp_3"), "auto"))  # TP 24 over 3 nodes of 8: each node reads a whole copy
    assert tp3 == {f"serve-{i}": (8, pytest.approx(1400 / 8)) for i in range(3)}  # the checkpoint: 2.8T x 0.5 byte
    dep = gb_per_rank(reading_as(golden("b300_multi_node_dep_2"), "safetensors", None, None, FILTER))  # DEP 16: the experts split 16 ways
    assert dep == {"serve-0": (8, 87.5), "serve-1": (8, 87.5)}
    tep = gb_per_rank(reading_as(golden("gb300_multi_node_tep_2"), "auto", "lazy", None, FILTER))  # TEP 8 over 2 nodes of 4
    assert tep == {"serve-0": (4, 175.0), "serve-1": (4, 175.0)}
    pd = gb_per_rank(reading_as(golden("pd_cluster_h200_prefill_tp2_decode_dep2"), "auto", None, None, FILTER))  # TP prefill: a whole copy per node; DEP decode: shares
    assert pd == {"prefill-0": (8, 175.0), "prefill-1": (8, 175.0), "decode-0": (8, 87.5), "decode-1": (8, 87.5)}
    copies = gb_per_rank(reading_as(golden("b300_multi_node_dep_2_replicas_2"), "auto", None, None, FILTER))  # two copies: each reads its own
    assert set(copies) == {"r0-serve-0", "r0-serve-1", "r1-serve-0", "r1-serve-1"} and {g for _, g in copies.values()} == {87.5}


def test_expert_parallel_ranks_read_every_expert_without_the_filter() -> None:
    """vLLM's default (the filter off): every rank of a DEP or TEP pool reads every expert, a node's
    ranks sharing one copy -- as TP does; the prediction says so in a note."""
    dep = reading_as(golden("b300_multi_node_dep_2"), "safetensors")
    assert gb_per_rank(dep) == {"serve-0": (8, 175.0), "serve-1": (8, 175.0)}  # 1400 GB per node, not 700
    assert gb_per_rank(reading_as(golden("gb300_multi_node_tep_2"), "auto", "lazy")) == {"serve-0": (4, 350.0), "serve-1": (4, 350.0)}
    pd = gb_per_rank(reading_as(golden("pd_cluster_h200_prefill_tp2_decode_dep2"), "auto"))
    assert {g for _, g in pd.values()} == {175.0}
    pred = predict(dep, {"node-0": 2.0, "node-1": 2.0})
    assert pred is not None and pred.total_s == pytest.approx(700.0)  # 1400 GB per node at 2 GB/s
    assert any("read every expert" in n and FILTER in n for n in pred.notes), pred.notes
    assert "only with the EP weight filter" in pred.reading


def test_only_vllms_per_tensor_reads_without_eplb_use_the_filter() -> None:
    """The filter as vLLM applies it: never with EPLB, never by fastsafetensors, the multi-thread
    loader or the eager strategy; the last of --enable/--disable (0.33) or --no-enable (0.32) wins."""
    dep = golden("b300_multi_node_dep_2")

    def per_rank(*args: str | None) -> float:
        return gb_per_rank(reading_as(dep, *args))["serve-0"][1]  # type: ignore[arg-type]

    assert per_rank("auto", None, None, FILTER) == 87.5
    assert per_rank("auto", "prefetch", None, FILTER) == pytest.approx((1400 * 8 / 16 + 8 * 87.5 * (1 - 8 / 16)) / 8)
    assert per_rank("auto", "prefetch") == pytest.approx(175.0)
    assert per_rank("auto", None, None, FILTER, "--enable-eplb") == 175.0  # EPLB: the loader sees every expert
    assert per_rank("auto", None, None, "--enable-eplb", FILTER, "--disable-eplb") == 87.5
    assert per_rank("auto", None, '{"enable_multithread_load": true}', FILTER) == 175.0  # the multi-thread loader drops it
    assert per_rank("auto", "eager", None, FILTER) == 175.0  # eager reads each file whole first
    assert per_rank("auto", None, None, FILTER, "--disable-ep-weight-filter") == 175.0
    assert per_rank("auto", None, None, FILTER, "--no-enable-ep-weight-filter") == 175.0  # vLLM 0.32's spelling
    assert per_rank("auto", None, None, "--enable-ep-weight-filter=false") == 175.0
    assert per_rank("fastsafetensors", None, None, FILTER) == per_rank("fastsafetensors") == 87.5  # each file once per pool, filter or not
    fast = predict(reading_as(dep, "fastsafetensors", None, None, FILTER), {"node-0": 2.0, "node-1": 2.0})
    assert fast is not None and any(f"{FILTER} has no effect here" in n for n in fast.notes), fast.notes
    assert "EP weight filter (no effect here)" in fast.reading
    assert reading(["vllm", "serve", "m", FILTER]) == Reading("auto", None, False, True, False)


def test_each_way_of_reading_reads_its_own_bytes() -> None:
    """The plan's load format and strategy decide the bytes: DEP 16 on 2 nodes of 8 (no EP weight
    filter: only fastsafetensors splits the reads) and TP 24 on 3 nodes of 8, a 1400 GB checkpoint."""
    dep, tp3 = golden("b300_multi_node_dep_2"), golden("h100_multi_node_tp_3")
    per = {k: gb_per_rank(reading_as(dep, *args))["serve-0"][1] for k, args in {
        "lazy": ("auto",), "torchao": ("auto", "torchao"), "eager": ("safetensors", "eager"), "prefetch": ("auto", "prefetch"),
        "multithread": ("auto", None, '{"enable_multithread_load": true}'), "fast": ("fastsafetensors",), "dummy": ("dummy",)}.items()}
    assert per == {"lazy": 175.0, "torchao": 175.0, "eager": 175.0, "multithread": 175.0, "fast": 87.5, "dummy": 0.0,
                   "prefetch": pytest.approx(175.0)}  # without the EP weight filter every DEP rank reads every expert
    flat = {k: gb_per_rank(reading_as(tp3, *args))["serve-2"][1] for k, args in {
        "lazy": ("hf",), "eager": ("auto", "eager"), "prefetch": ("auto", "prefetch"), "fast": ("fastsafetensors",)}.items()}
    assert flat == {"lazy": 175.0, "eager": 175.0, "prefetch": pytest.approx(175.0), "fast": pytest.approx(1400 / 24)}  # fastsafetensors: each file once per pool
    assert gb_per_rank(tp3) == gb_per_rank(reading_as(tp3, "fastsafetensors"))  # the recipe's own: the goldens read through fastsafetensors
    assert gb_per_rank(reading_as(dep, "runai_streamer")) == {}  # not modelled: no bytes guessed
    assert reading(["vllm", "serve", "m", "--load-format=SafeTensors", "--safetensors-load-strategy", "None"]) == Reading("safetensors")
    assert reading(["vllm", "serve", "m", "--model-loader-extra-config.enable_multithread_load=true"]).mode == "whole"


def test_a_way_of_reading_that_is_not_modelled_gets_no_figure() -> None:
    plan = reading_as(golden("pd_cluster_h200_prefill_tp2_decode_dep2"), "auto")
    procs = [p.model_copy(update={"argv": [*p.argv, "--load-format", "runai_streamer"]}) if p.role == "decode" else p for p in plan.processes]
    pred = predict(plan.model_copy(update={"processes": procs}), {}, shared=True, shared_gbps=10.0, basis="test")
    assert pred is not None and pred.ranks == [] and "runai_streamer is not modelled" in pred.unmodelled
    assert "not modelled (decode-0, decode-1)" in pred.reading and "(prefill-0, prefill-1)" in pred.reading
    row = pred.rows()
    assert row["total_s"] is None and row["unmodelled"] == pred.unmodelled and row["processes"] == []
    assert predict(plan.model_copy(update={"processes": procs}), {}) is None  # no throughput at all: nothing to say


def test_staging_is_the_copy_then_the_read_of_the_copy() -> None:
    plan = reading_as(golden("b300_multi_node_dep_2"), "auto", "lazy").model_copy(update={"stage": WeightStage(source="/lustre", dir="/nvme")})
    pred = predict(plan, {}, shared=True, shared_gbps=20.0, stage_gbps={"node-0": 6.0, "node-1": 3.0})
    assert pred is not None and not pred.unmodelled
    copy = 2 * 1400 / 20.0  # both nodes copy the whole model from one filesystem
    assert [r.copy_s for r in pred.ranks] == [copy, copy]
    assert pred.seconds_of("serve-0") == pytest.approx(copy + 1400 / 6.0) and pred.total_s == pytest.approx(copy + 1400 / 3.0)
    row = pred.rows()
    assert row["stage_gbps"] == {"node-0": 6.0, "node-1": 3.0} and row["processes"][0]["copy_s"] == 140.0  # type: ignore[index]
    own = predict(plan, {"node-0": 2.0, "node-1": 4.0}, stage_gbps={"node-0": 6.0, "node-1": 6.0})  # each node copies from its own source
    assert own is not None and [r.copy_s for r in own.ranks] == [700.0, 350.0]
    blind = predict(plan, {}, shared=True, shared_gbps=20.0)
    assert blind is not None and blind.ranks == [] and "stage_read_gbps" in blind.unmodelled
    unstaged = predict(reading_as(golden("b300_multi_node_dep_2"), "auto", "lazy"), {"node-0": 2.0, "node-1": 2.0})
    assert unstaged is not None and "copy_s" not in unstaged.rows()["processes"][0]  # type: ignore[index]
    from k3launch.deploy.progress import Tracker
    from k3launch.models.phases import LogDelta
    from k3launch.planning.loadtime import against

    t = Tracker(plan, started=0.0)  # vLLM's clock starts once the copy is done: set beside the read alone
    t.update({"serve-0": LogDelta("(Worker_DP0) Loading weights took 280.00 seconds\n")}, (), "alive", 1.0)
    rows = {r["process"]: r for r in against(t.timeline(ready=True, now=2.0), pred)}
    assert rows["serve-0"]["predicted_s"] == 233.3 and rows["serve-0"]["ratio"] == 1.2  # 280 s against 1400 GB / 6 GB/s


def test_the_default_strategy_on_a_shared_filesystem_says_vllm_may_prefetch() -> None:
    plan = reading_as(golden("b300_multi_node_dep_2"), "auto")
    told = predict(plan, {}, shared=True, shared_gbps=10.0)
    assert told is not None and any("prefetches on its own" in n for n in told.notes)
    chosen = predict(reading_as(plan, "auto", "lazy"), {}, shared=True, shared_gbps=10.0)
    assert chosen is not None and not any("prefetches" in n for n in chosen.notes)
    fast = predict(golden("b300_multi_node_dep_2"), {}, shared=True, shared_gbps=10.0)
    assert fast is not None and any("NCCL" in n for n in fast.notes) and "fastsafetensors" in fast.reading


def test_ranks_on_a_node_contend_for_its_disk_and_a_shared_filesystem_for_one_throughput() -> None:
    plan = golden("b300_multi_node_dep_2")
    pred = predict(plan, {"node-0": 2.0, "node-1": 1.0}, basis="test")
    assert pred is not None and not pred.shared
    assert pred.seconds_of("serve-0") == pytest.approx(8 * 87.5 / 2.0) and pred.seconds_of("serve-1") == pytest.approx(8 * 87.5 / 1.0)
    assert pred.total_s == pytest.approx(700.0)  # the slow node decides
    shared = predict(plan, {"node-0": 2.0, "node-1": 1.0}, shared=True)  # one client's figure taken as the total: the slowest
    assert shared is not None and shared.gbps == {"*": 1.0} and shared.total_s == pytest.approx(1400.0)
    assert [round(r.seconds) for r in shared.ranks] == [1400, 1400]
    told = predict(plan, {}, shared=True, shared_gbps=10.0)
    assert told is not None and told.total_s == pytest.approx(140.0)
    assert predict(plan, {"node-0": 2.0}) is None  # a node without a figure: no prediction
    row = pred.rows()
    assert row["total_s"] == 700.0 and row["processes"][0]["gb_per_rank"] == 87.5  # type: ignore[index]


def _inventory(tmp: Path, weights: str = "") -> Path:
    p = tmp / "inv.yaml"
    p.write_text(
        "name: lt-inv\nbackend: ssh\nhardware: b300\ndefaults: {runtime: bare}\n"
        "nodes:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2}\n" + weights
    )
    return p


def test_the_throughput_comes_from_the_inventory_else_a_saved_probe(tmp_path: Path) -> None:
    state = tmp_path / "state"
    inv = _inventory(tmp_path)
    plan = api.plan(inv, strategy="multi_node_dep", nodes=2, state_dir=state)
    assert api.load_prediction(plan, inv, state) is None  # nothing known
    target = StateStore(state).probe_path("lt-inv")
    target.parent.mkdir(parents=True)
    write_atomic(target, probes_json("lt-inv", [Probe("a", "/w", "o_direct", 2_000_000_000, 1.0), Probe("b", "/w", "fadvise", 1_000_000_000, 1.0)], 0))
    pred = api.load_prediction(plan, inv, state)
    assert pred is not None and pred.gbps == {"a": 2.0, "b": 1.0} and "fadvise, o_direct" in pred.basis
    assert pred.total_s == pytest.approx(700.0)  # 1400 GB on disk (2.8T x 0.5 byte): the 1.2 headroom of 1680 is GPU memory's
    write_atomic(target, probes_json("lt-inv", [Probe("a", "/w", "cached", 9_000_000_000, 1.0), Probe("b", "/w", "cached", 9_000_000_000, 1.0)], 0))
    pred = api.load_prediction(plan, inv, state)
    assert pred is not None and "NOT the disk" in pred.basis
    shared = _inventory(tmp_path, "weights: {shared: true, read_gbps: 4}\n")
    pred = api.load_prediction(api.plan(shared, strategy="multi_node_dep", nodes=2, state_dir=state), shared, state)
    assert pred is not None and pred.shared and pred.total_s == pytest.approx(350.0) and "read_gbps 4 GB/s (shared)" in pred.basis
    with pytest.raises(Exception, match="read_gbps"):
        api.load(_inventory(tmp_path, "weights: {read_gbps: -1}\n"))
    assert api.load_prediction(api.plan(None, placeholders=True)) is None


def test_k3_offers_the_filter_on_its_expert_parallel_strategies_off_by_default() -> None:
    """docs/planning.md ("Expert weights at load"): an opt-in feature, where it pays on AMD (whose
    --load-format auto reads per tensor) and is inert on NVIDIA (fastsafetensors)."""
    from k3launch.errors import K3Error
    from k3launch.models.selection import Selection
    from k3launch.planning.build import build_plan
    from k3launch.planning.recipes import RecipeTree

    tree = RecipeTree()

    def plan(hw: str, strategy: str, *features: str) -> Plan:
        return build_plan(tree, Selection(hardware=hw, strategy=strategy, nodes=2, features=features))

    off, on = plan("mi355x", "multi_node_tep"), plan("mi355x", "multi_node_tep", "ep_weight_filter")
    assert not any(FILTER in p.argv for p in off.processes) and all(FILTER in p.argv for p in on.processes if p.role != "router")
    assert gb_per_rank(off)["serve-0"] == (8, 175.0) and gb_per_rank(on)["serve-0"] == (8, 87.5)  # TEP 16: half a copy per node
    nvidia = plan("b300", "multi_node_dep", "ep_weight_filter")
    assert gb_per_rank(nvidia) == gb_per_rank(plan("b300", "multi_node_dep"))  # fastsafetensors reads each file once per pool anyway
    with pytest.raises(K3Error, match="does not apply to multi_node_tp"):
        plan("mi355x", "multi_node_tp", "ep_weight_filter")


def test_the_checkpoints_own_size_replaces_the_recipes_estimate() -> None:
    """A size measured from the checkpoint's index is what a load reads; without one, the recipe's
    parameters x bytes/param -- and the prediction says which it used."""
    plan = reading_as(golden("b300_multi_node_dep_2"), "auto")
    est = predict(plan, {"node-0": 2.0, "node-1": 2.0})
    assert est is not None and est.checkpoint is not None and not est.checkpoint.measured and est.checkpoint.gb == 1400.0
    assert est.rows()["checkpoint_gb"] == 1400.0 and "the recipe's parameters x bytes/param" in str(est.rows()["checkpoint"])
    k3 = Checkpoint(1561.0, "model.safetensors.index.json metadata.total_size, on node-0", True)  # K3's card: about 1.56 TB
    pred = predict(plan, {"node-0": 2.0, "node-1": 2.0}, checkpoint=k3)
    assert pred is not None and pred.total_s == pytest.approx(1561.0 / 2.0) and pred.ranks[0].gb_per_rank == pytest.approx(1561.0 / 8)
    assert pred.rows()["checkpoint_gb"] == 1561.0 and pred.rows()["checkpoint"] == k3.source
    staged = predict(plan.model_copy(update={"stage": WeightStage(source="/lustre", dir="/nvme")}), {"node-0": 10.0, "node-1": 10.0},
                     stage_gbps={"node-0": 10.0, "node-1": 10.0}, checkpoint=k3)
    assert staged is not None and staged.ranks[0].copy_s == pytest.approx(156.1)  # the copy is the checkpoint's bytes too
    assert index_total('{"metadata": {"total_size": 1561000000000}, "weight_map": {}}') == 1_561_000_000_000
    assert index_total('{"metadata": {"total_size": 0}}') is None and index_total("{}") is None and index_total("not json") is None


def test_the_index_where_this_machine_sees_the_model_gives_the_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan -i` reads no node: the index of the model in a hub cache here (the local backend's
    nodes are this machine) is the checkpoint's size; without one, the recipe's estimate."""
    import standin

    state = tmp_path / "state"
    inv = _inventory(tmp_path, "weights: {read_gbps: 2}\n")
    plan = api.plan(inv, strategy="multi_node_dep", nodes=2, state_dir=state)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    pred = api.load_prediction(plan, inv, state)
    assert pred is not None and pred.checkpoint is not None and not pred.checkpoint.measured and pred.total_s == pytest.approx(350.0)
    snap = standin.hf_cache(tmp_path / "hf" / "hub")  # Kimi K3 at main, in this process's HF_HOME
    (snap / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1_561_000_000_000}, "weight_map": {}}))
    pred = api.load_prediction(plan, inv, state)
    assert pred is not None and pred.checkpoint is not None and pred.checkpoint.measured and pred.checkpoint.gb == 1561.0
    assert str(snap) in pred.checkpoint.source and pred.total_s == pytest.approx(1561.0 / 2 / 2)  # fastsafetensors: half a copy per node
    given = Checkpoint(1500.0, "on a", True)  # a node's own index (the doctor's) wins over this machine's
    assert api.load_prediction(plan, inv, state, checkpoint=given).checkpoint == given  # type: ignore[union-attr]


# ---------------------------------------------------------------------- predicted next to actual (timeline)
def test_vllms_loading_weights_took_is_read_per_rank_once_and_shown_beside_the_prediction() -> None:
    from k3launch.deploy.progress import Tracker
    from k3launch.models.phases import LogDelta, weights_took
    from k3launch.planning.loadtime import against

    assert weights_took("(Worker_TP3 pid=88) INFO 05-02 10:00:01 [default_loader.py:267] Loading weights took 132.57 seconds") == 132.57
    assert weights_took("INFO [gpu_model_runner.py] Model loading took 92.1 GiB memory and 140.2 seconds") is None
    assert weights_took("Loading safetensors checkpoint shards:  45% Completed | 45/100") is None
    plan = golden("b300_multi_node_dep_2")
    t = Tracker(plan, started=0.0)
    t.update({"serve-0": LogDelta("(Worker_DP0) Loading weights took 10.00 seconds\n", "(Worker_DP1) Loading weights took 1")}, (), "alive", 1.0)
    t.update({"serve-0": LogDelta("(Worker_DP1) Loading weights took 12.50 seconds\n")}, (), "alive", 2.0)  # the partial line, whole now
    tl = t.timeline(ready=True, now=3.0)
    took = {p.id: p.weights_took for p in tl.processes}
    assert took == {"serve-0": [10.0, 12.5], "serve-1": [], "router": []}
    procs = tl.as_dict()["processes"]
    assert [p.get("weights_took") for p in procs] == [[10.0, 12.5], None, None]  # type: ignore[union-attr]
    pred = predict(plan, {"node-0": 70.0, "node-1": 70.0})  # 700 GB per node: 10 s
    rows = {r["process"]: r for r in against(tl, pred)}
    assert rows["serve-0"]["predicted_s"] == 10.0 and rows["serve-0"]["slowest_took_s"] == 12.5 and rows["serve-0"]["ratio"] == 1.25
    assert rows["serve-1"]["took_s"] == [] and rows["serve-1"]["ratio"] is None and "router" not in rows
    assert against(t.timeline(ready=True, now=3.0).model_copy(update={"processes": []}), None) == []
    real = Tracker(plan, started=0.0)  # vLLM 0.32.0's own log (CPU build): its one worker's figure
    real.update({"serve-0": LogDelta((GOLDEN.parent / "data" / "vllm-0.32-cpu-serve.log").read_text())}, (), "alive", 1.0)
    assert next(p for p in real.timeline(ready=True).processes if p.id == "serve-0").weights_took == [0.01]


def test_plan_shows_the_staged_copy_and_says_when_a_way_of_reading_is_not_modelled(tmp_path: Path) -> None:
    from inventory_helpers import ROOT, run_cli

    env = {"K3LAUNCH_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "250", "NO_COLOR": "1"}
    staged = tmp_path / "staged.yaml"  # the example: Lustre shared, NVMe, safetensors lazy; 20 GB/s for Lustre, 6 for one NVMe disk
    staged.write_text((ROOT / "inventories" / "h200-staged.yaml").read_text().replace("  shared: true\n", "  shared: true\n  read_gbps: 20\n")
                      .replace("  stage: /local/nvme/hf", "  stage_read_gbps: 6\n  stage: /local/nvme/hf"))
    out = run_cli(["plan", "--json", "-i", str(staged)], tmp_path, env).json()["weights_load"]
    assert out["stage_gbps"] == {"h200-c": 6.0, "h200-d": 6.0} and out["reading"].startswith("--load-format safetensors, lazy")
    assert [(p["copy_s"], p["seconds"]) for p in out["processes"]] == [(140.0, 373.3), (140.0, 373.3)]  # 2 x 1400 GB / 20, + 1400 / 6
    assert out["checkpoint_gb"] == 1400.0 and out["checkpoint"].startswith("the recipe's parameters x bytes/param")
    text = run_cli(["plan", "-i", str(staged)], tmp_path, env).stdout
    assert "373 s until the last rank has its weights (the staged copy first, then its read at 6.00 GB/s)" in text
    assert "serve-0 on h200-c: 8 rank(s) x 175.0 GB, 373 s after a 140 s copy" in text
    assert "checkpoint 1,400 GB: the recipe's parameters x bytes/param" in text
    pair = tmp_path / "pair.yaml"
    pair.write_text((ROOT / "inventories" / "h200-pair.yaml").read_text() + "weights: {read_gbps: 2}\n")
    res = run_cli(["plan", "--json", "-i", str(pair), "--set", "load-format=runai_streamer"], tmp_path, env)
    load = res.json()["weights_load"]
    assert load["total_s"] is None and "runai_streamer is not modelled" in load["unmodelled"] and load["processes"] == []
    text = run_cli(["plan", "-i", str(pair), "--set", "load-format=runai_streamer"], tmp_path, env).stdout
    assert "weights load: not predicted: --load-format runai_streamer is not modelled" in text
    assert "weights load  not predicted" in text  # the summary says so too, no figure
