"""The predicted weight load (k3launch.planning.loadtime): bytes per rank by layout, contention on
a node's disk and on a shared filesystem; where the throughput comes from (inventory, saved
probe) (``plan``, ``doctor`` and ``timeline`` showing it: test_loadtime_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from paths import TESTS

from k3launch import api
from k3launch.deploy.state import StateStore, write_atomic
from k3launch.models.plan import Plan
from k3launch.models.weights import Probe, probes_json
from k3launch.planning.loadtime import Reading, gb_per_rank, predict, reading

GOLDEN = TESTS / "golden"


def golden(name: str) -> Plan:
    return Plan.model_validate_json((GOLDEN / f"{name}.json").read_text())


def reading_as(plan: Plan, load_format: str, strategy: str | None = None, extra: str | None = None) -> Plan:
    """``plan`` with every engine's --load-format (and strategy, loader config) replaced."""
    procs = []
    for p in plan.processes:
        argv = list(p.argv)
        if p.role != "router":
            for flag, value in (("--load-format", load_format), ("--safetensors-load-strategy", strategy), ("--model-loader-extra-config", extra)):
                if flag in argv:
                    del argv[argv.index(flag):argv.index(flag) + 2]
                argv += [flag, value] if value is not None else []
        procs.append(p.model_copy(update={"argv": argv}))
    return plan.model_copy(update={"processes": procs})


def test_bytes_per_rank_follow_the_layout() -> None:
    """vLLM's own safetensors iterator (lazy): what each rank keeps; a node's ranks share one copy."""
    tp3 = gb_per_rank(reading_as(golden("h100_multi_node_tp_3"), "auto"))  # TP 24 over 3 nodes of 8: each node reads a whole copy
    assert tp3 == {f"serve-{i}": (8, pytest.approx(1400 / 8)) for i in range(3)}  # the checkpoint: 2.8T x 0.5 byte
    dep = gb_per_rank(reading_as(golden("b300_multi_node_dep_2"), "safetensors"))  # DEP 16: the experts split 16 ways
    assert dep == {"serve-0": (8, 87.5), "serve-1": (8, 87.5)}
    tep = gb_per_rank(reading_as(golden("gb300_multi_node_tep_2"), "auto", "lazy"))  # TEP 8 over 2 nodes of 4
    assert tep == {"serve-0": (4, 175.0), "serve-1": (4, 175.0)}
    pd = gb_per_rank(reading_as(golden("pd_cluster_h200_prefill_tp2_decode_dep2"), "auto"))  # TP prefill: each node a whole copy; DEP decode: shares
    assert pd == {"prefill-0": (8, 175.0), "prefill-1": (8, 175.0), "decode-0": (8, 87.5), "decode-1": (8, 87.5)}
    copies = gb_per_rank(reading_as(golden("b300_multi_node_dep_2_replicas_2"), "auto"))  # two copies: each reads its own
    assert set(copies) == {"r0-serve-0", "r0-serve-1", "r1-serve-0", "r1-serve-1"} and {g for _, g in copies.values()} == {87.5}


def test_each_way_of_reading_reads_its_own_bytes() -> None:
    """The plan's load format and strategy decide the bytes: DEP 16 on 2 nodes of 8 (experts split
    16 ways) and TP 24 on 3 nodes of 8 (no expert skipped), a 1400 GB checkpoint."""
    dep, tp3 = golden("b300_multi_node_dep_2"), golden("h100_multi_node_tp_3")
    per = {k: gb_per_rank(reading_as(dep, *args))["serve-0"][1] for k, args in {
        "lazy": ("auto",), "torchao": ("auto", "torchao"), "eager": ("safetensors", "eager"), "prefetch": ("auto", "prefetch"),
        "multithread": ("auto", None, '{"enable_multithread_load": true}'), "fast": ("fastsafetensors",), "dummy": ("dummy",)}.items()}
    assert per == {"lazy": 87.5, "torchao": 87.5, "eager": 175.0, "multithread": 175.0, "fast": 87.5, "dummy": 0.0,
                   "prefetch": pytest.approx((1400 * 8 / 16 + 8 * 87.5 * (1 - 8 / 16)) / 8)}  # its slice whole + the rest it needs
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
    from k3launch.models.plan import WeightStage

    plan = reading_as(golden("b300_multi_node_dep_2"), "auto", "lazy").model_copy(update={"stage": WeightStage(source="/lustre", dir="/nvme")})
    pred = predict(plan, {}, shared=True, shared_gbps=20.0, stage_gbps={"node-0": 6.0, "node-1": 3.0})
    assert pred is not None and not pred.unmodelled
    copy = 2 * 1400 / 20.0  # both nodes copy the whole model from one filesystem
    assert [r.copy_s for r in pred.ranks] == [copy, copy]
    assert pred.seconds_of("serve-0") == pytest.approx(copy + 700 / 6.0) and pred.total_s == pytest.approx(copy + 700 / 3.0)
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
    assert rows["serve-0"]["predicted_s"] == 116.7 and rows["serve-0"]["ratio"] == 2.4  # 280 s against 700 GB / 6 GB/s


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
    text = run_cli(["plan", "-i", str(staged)], tmp_path, env).stdout
    assert "373 s until the last rank has its weights (the staged copy first, then its read at 6.00 GB/s)" in text
    assert "serve-0 on h200-c: 8 rank(s) x 175.0 GB, 373 s after a 140 s copy" in text
    pair = tmp_path / "pair.yaml"
    pair.write_text((ROOT / "inventories" / "h200-pair.yaml").read_text() + "weights: {read_gbps: 2}\n")
    res = run_cli(["plan", "--json", "-i", str(pair), "--set", "load-format=runai_streamer"], tmp_path, env)
    load = res.json()["weights_load"]
    assert load["total_s"] is None and "runai_streamer is not modelled" in load["unmodelled"] and load["processes"] == []
    text = run_cli(["plan", "-i", str(pair), "--set", "load-format=runai_streamer"], tmp_path, env).stdout
    assert "weights load: not predicted: --load-format runai_streamer is not modelled" in text
    assert "weights load  not predicted" in text  # the summary says so too, no figure
