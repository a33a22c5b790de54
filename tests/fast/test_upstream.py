"""k3launch against the reference copies of the vLLM recipes project (../shared/upstream-recipes).

The loader must accept upstream trees unchanged and compose every model they hold; refusals are
allowed only for the reasons a real selection can hit (weights do not fit, the recipe does not
offer that strategy on that GPU) or a value vLLM 0.33.0 itself would refuse (a config field its
dataclass no longer has, named with the recipe block that wrote it). Legacy boolean spellings in upstream files are normalised to
vLLM 0.33.0's spelling with a ``normalized-flag`` notice and never reach a command.
"""

from __future__ import annotations

import pytest
from paths import ROOT
from plan_checks import check_plan, engine_processes, flags, lint_errors

from k3launch.errors import K3Error
from k3launch.models.plan import Plan, Process
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.schema import load_schema

UPSTREAM = ROOT.parent / "shared" / "upstream-recipes"
if not UPSTREAM.is_dir():
    pytest.skip(f"{UPSTREAM} is absent", allow_module_level=True)

pytestmark = pytest.mark.upstream

ERAS = ("seed-era", "latest")
EXPECTED_REFUSALS = {"does-not-fit", "incompatible-strategy", "single-node-strategy", "unknown-field"}
SCHEMA = load_schema()


@pytest.fixture(scope="module", params=ERAS)
def tree(request: pytest.FixtureRequest) -> RecipeTree:
    return RecipeTree(UPSTREAM / request.param)


def _combos(tree: RecipeTree, rid: str) -> list[tuple[str, str, str]]:
    """(variant, hardware, strategy) for every hardware a model lists and every strategy it offers."""
    rec = tree.model(rid)
    profiles = tree.taxonomy.hardware_profiles
    hardware = list(rec.meta.hardware) or ([rec.meta.default_hardware] if rec.meta.default_hardware else
                                           [h for h, p in profiles.items() if not p.restricted])
    strategies = [s for s in (rec.compatible_strategies or sorted(tree.strategies)) if s in tree.strategies]
    out = []
    for vname, variant in rec.variants.items():
        for hw in hardware:
            if variant.supported_hardware is not None and hw not in variant.supported_hardware:
                continue
            out.extend((vname, hw, s) for s in strategies)
    return out


def test_tree_loads_unchanged(tree: RecipeTree) -> None:
    tax = tree.taxonomy
    assert {"h100", "h200", "b200", "gb200", "b300", "gb300", "mi300x", "mi325x", "mi355x"} <= set(tax.hardware_profiles)
    files = sorted((tree.root / "strategies").glob("*.yaml"))
    assert len(tree.strategies) == len(files) >= 8
    assert {"single_node_tp", "multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster"} <= set(tree.strategies)
    assert len(tree.kv_stores) == len(list((tree.root / "kv_store").glob("*.yaml"))) >= 2
    ids = tree.model_ids()
    assert len(ids) == len(list((tree.root / "models").glob("*/*.yaml"))) >= 10
    for rid in ids:
        rec = tree.model(rid)
        assert rec.model.model_id and rec.meta.title
        assert tree.resolve(rid.split("/")[-1]) == rid


def test_every_model_composes_or_is_refused_for_a_reason(tree: RecipeTree) -> None:
    plans = refusals = 0
    for rid in tree.model_ids():
        for variant, hw, strategy in _combos(tree, rid):
            where = f"{tree.root.name} {rid} {variant} {hw} {strategy}"
            try:
                plan = build_plan(tree, Selection(recipe=rid, variant=variant, hardware=hw, strategy=strategy))
            except K3Error as err:
                assert err.code in EXPECTED_REFUSALS, f"{where}: {err.code}: {err.message}"
                assert err.message and err.hint
                assert err.code != "unknown-field" or f"models/{rid}.yaml" in err.message, err.message
                refusals += 1
                continue
            try:
                check_plan(SCHEMA, plan)
                assert lint_errors(SCHEMA, plan) == []
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from exc
            plans += 1
    assert plans > 10 * refusals  # most of the upstream space is launchable


# ----------------------------------------------------------------- the seed's K3 commands
@pytest.fixture(scope="module")
def seed_tree() -> RecipeTree:
    return RecipeTree(UPSTREAM / "seed-era")


def _k3(tree: RecipeTree, **kw: object) -> Plan:
    return build_plan(tree, Selection(recipe="moonshotai/Kimi-K3", **kw))  # type: ignore[arg-type]


def _vals(proc: Process) -> dict[str, object]:
    return {k: (a.polarity if a.polarity is not None else a.value) for k, a in flags(SCHEMA, proc).items()}


def test_seed_b300_single_node_tp8(seed_tree: RecipeTree) -> None:
    plan = _k3(seed_tree, hardware="b300")
    assert (plan.strategy, plan.nodes, plan.verified) == ("single_node_tp", 1, True)
    (proc,) = plan.processes
    v = _vals(proc)
    assert v["--tensor-parallel-size"] == "8"
    assert v["--max-model-len"] == "1000000" and v["--max-num-batched-tokens"] == "32768"
    assert v["--kv-cache-dtype"] == "fp8" and v["--enable-prefix-caching"] is True
    assert v["--load-format"] == "fastsafetensors" and v["--gpu-memory-utilization"] == "0.95"
    assert "TRTLLM_RAGGED" in str(v["--attention-config"])
    assert proc.env["VLLM_ENGINE_READY_TIMEOUT_S"] == "3600"
    assert proc.image == "vllm/vllm-openai:kimi-k3"


def test_seed_h200_multi_node_tp_two_nodes(seed_tree: RecipeTree) -> None:
    plan = _k3(seed_tree, hardware="h200", strategy="multi_node_tp", nodes=2)
    assert plan.nodes == 2
    head, worker = plan.processes
    for i, proc in enumerate((head, worker)):
        v = _vals(proc)
        assert v["--tensor-parallel-size"] == "16" and v["--nnodes"] == "2" and v["--node-rank"] == str(i)
        assert v["--master-addr"] == head.address
        assert v["--moe-backend"] == "marlin" and v["--disable-custom-all-reduce"] is True
        assert v["--enable-flashinfer-autotune"] is False  # upstream --no-enable-flashinfer-autotune
        assert proc.env["GLOO_SOCKET_IFNAME"] == proc.env["NCCL_SOCKET_IFNAME"] != "$IFACE_NAME"
    assert "--headless" not in head.argv and "--headless" in worker.argv
    assert head.http_port == 8000 and worker.http_port is None


def test_seed_pd_cluster(seed_tree: RecipeTree) -> None:
    plan = _k3(seed_tree, hardware="b300", strategy="pd_cluster")
    pools = {p.role: p for p in plan.capacity.pools}
    assert (pools["prefill"].parallelism, pools["decode"].parallelism) == ("tep", "dep")
    assert pools["decode"].nodes == 2  # DEP floor: 16 GPUs
    prefill = [p for p in engine_processes(plan) if p.role == "prefill"]
    decode = [p for p in engine_processes(plan) if p.role == "decode"]
    for p in prefill:
        v = _vals(p)
        assert p.http_port == 8001 and p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5557"
        assert "kv_producer" in str(v["--kv-transfer-config"]) and v["--max-num-batched-tokens"] == "16384"
        assert v["--enforce-eager"] is True
    for p in decode:
        v = _vals(p)
        assert p.http_port == 8002 and p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5558"
        assert "kv_consumer" in str(v["--kv-transfer-config"])
        assert v["--max-num-seqs"] == "32" and v["--max-num-batched-tokens"] == "32"
        assert v["--moe-backend"] == "deep_gemm_mega_moe" and v["--enable-prefix-caching"] is False
        assert v["--data-parallel-size"] == "16" and v["--data-parallel-size-local"] == "8"
    router = plan.processes[-1]
    assert router.role == "router" and router.argv[:2] == ["vllm-router", "--vllm-pd-disaggregation"]


# ---------------------------------------------------------------- legacy spellings
@pytest.mark.parametrize("legacy,modern,sel", [
    ("--no-enable-prefix-caching", "--disable-prefix-caching", {"hardware": "b300", "strategy": "pd_cluster"}),
    ("--no-enable-flashinfer-autotune", "--disable-flashinfer-autotune", {"hardware": "h200"}),
    ("--no-enable-flashinfer-autotune", "--disable-flashinfer-autotune", {"hardware": "b300", "strategy": "pd_cluster"}),
    ("--no-disable-hybrid-kv-cache-manager", "--enable-hybrid-kv-cache-manager", {"hardware": "gb300", "strategy": "pd_cluster"}),
])
def test_legacy_spellings_are_normalised_with_a_notice(seed_tree: RecipeTree, legacy: str, modern: str, sel: dict[str, str]) -> None:
    plan = _k3(seed_tree, **sel)
    argvs = [p.argv for p in engine_processes(plan)]
    assert all(legacy not in argv for argv in argvs)
    assert any(modern in argv for argv in argvs)
    notes = [n.message for n in plan.notices if n.code == "normalized-flag"]
    assert any(legacy in m and modern in m for m in notes), notes


def test_no_legacy_spelling_reaches_any_upstream_command(tree: RecipeTree) -> None:
    legacy = ("--no-enable-prefix-caching", "--no-enable-flashinfer-autotune", "--no-disable-hybrid-kv-cache-manager")
    normalised = 0
    for rid in tree.model_ids():
        text = tree.model_path(rid).read_text()
        if not any(f'"{s}"' in text for s in legacy):
            continue
        for variant, hw, strategy in _combos(tree, rid):
            try:
                plan = build_plan(tree, Selection(recipe=rid, variant=variant, hardware=hw, strategy=strategy))
            except K3Error:
                continue
            for p in engine_processes(plan):
                assert not set(legacy) & set(p.argv), f"{rid} {hw} {strategy} {p.id}"
            normalised += any(n.code == "normalized-flag" for n in plan.notices)
    assert normalised > 0
