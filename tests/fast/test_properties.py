"""Property tests over the whole selection space of the bundled Kimi K3 recipe.

Every selection either composes a plan that satisfies :func:`plan_checks.check_plan` (schema-clean,
no duplicate/contradictory flags, a layout that uses exactly the GPUs of its nodes, consistent
ranks and rendezvous addresses, disjoint P/D pools, weights that fit, complete provenance), or is
refused with a :class:`K3Error` that says why. Regressions of bugs found here keep their own tests
tests at the bottom instead of being left in the random domain.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from plan_checks import check_plan, engine_processes, flags, lint_errors

from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.schema import load_schema

HARDWARE = ("h100", "h200", "b200", "gb200", "b300", "gb300", "mi300x", "mi325x", "mi355x")
STRATEGIES = (None, "single_node_tp", "multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster")
POOL_STRATEGIES = (None, None, "tp", "tep", "dep", "tp", "tep", "dep", "multi_node_dep", "bogus")
FEATURES = ("tool_calling", "reasoning", "spec_decoding", "text_only")
KV = ("off", "simple", "lmcache", "mooncake")
KV_WEIGHTED = ("off", "off", "off", *KV[1:])  # refusals are cheap to find; spend most draws on plans
ADVANCED = ("max-num-batched-tokens", "max-num-seqs", "gpu-memory-utilization", "max-model-len")
VALID_SETS = (
    "max-num-seqs=64",
    "max-model-len=131072",
    "gpu-memory-utilization=0.9",
    "kv-cache-dtype=fp8",
    "enable-prefix-caching",
    "disable-prefix-caching",
    "no-enable-prefix-caching",  # legacy spelling: normalised with a notice
    "attention-config.use_prefill_query_quantization=false",
    "compilation-config.max_cudagraph_capture_size=256",  # folds into P/D decode's whole JSON
    "moe-backend=flashinfer_trtllm",  # locked on Hopper and AMD
)
INVALID_SETS = (
    "max-num-seqs",
    "=5",
    "tensor-parallel-size=4",
    "port=9000",
    "moe-backend=nonsense",
    "no-such-flag=1",
    "max-num-seqs=lots",
    "gpu-memory-utilization=1.5",  # out of vLLM's range (value-out-of-range)
)
# Every refusal the selection space above can legitimately produce.
REFUSALS = {
    "does-not-fit", "single-node-strategy", "pd-options", "pd-nodes", "pool-too-large", "bad-nodes",
    "unknown-prefill-strategy", "unknown-decode-strategy", "feature-strategy",
    "kv-offload-pd", "kv-offload-strategy", "kv-offload-unsupported",
    "bad-set", "feature-conflict", "reserved-flag", "locked-by-hardware", "bad-choice", "bad-value", "unknown-flag", "missing-value",
    "value-out-of-range", "values-conflict",  # max-num-seqs=64 above PD decode's --max-num-batched-tokens 32: vLLM refuses it
}

TREE = RecipeTree()
SCHEMA = load_schema()


def _subset(items: tuple[str, ...]) -> st.SearchStrategy[tuple[str, ...]]:
    return st.lists(st.sampled_from(items), unique=True, max_size=len(items)).map(tuple)


@st.composite
def selections(draw: st.DrawFn) -> Selection:
    strategy = draw(st.sampled_from((*STRATEGIES, "pd_cluster", "pd_cluster")))
    pd = strategy == "pd_cluster" or (strategy is None and draw(st.booleans()))
    sets = draw(st.lists(st.sampled_from(VALID_SETS), max_size=2))
    if draw(st.integers(0, 4)) == 0:
        sets.append(draw(st.sampled_from(INVALID_SETS)))
    return Selection(
        hardware=draw(st.sampled_from(HARDWARE)),
        strategy=strategy,
        nodes=draw(st.one_of(st.none(), st.integers(1, 6))) if not pd or draw(st.integers(0, 9)) == 0 else None,
        prefill_strategy=draw(st.sampled_from(POOL_STRATEGIES)) if pd else None,
        prefill_nodes=draw(st.sampled_from((None, 1, 2, 3, 4, None, 1, 2, 3, 4, 17))) if pd else None,
        decode_strategy=draw(st.sampled_from(POOL_STRATEGIES)) if pd else None,
        decode_nodes=draw(st.one_of(st.none(), st.integers(1, 4))) if pd else None,
        features=draw(_subset(FEATURES)),
        no_features=draw(_subset(FEATURES)),
        kv_offload=draw(st.sampled_from(KV_WEIGHTED)) if not pd or draw(st.integers(0, 9)) == 0 else "off",
        sets=tuple(sets),
        advanced=draw(_subset(ADVANCED)),
    )


def _plan_or_refusal(sel: Selection) -> Plan | None:
    try:
        return build_plan(TREE, sel)
    except K3Error as err:
        event(f"refused {err.code}")
        assert err.code and err.message.strip(), err.as_dict()
        assert (err.hint or err.message).strip()
        assert "\n" not in err.message, "refusals are one line"
        assert err.code in REFUSALS, f"unexpected refusal {err.code}: {err.message}"
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(selections())
def test_every_selection_composes_a_sound_plan_or_is_refused(sel: Selection) -> None:
    plan = _plan_or_refusal(sel)
    event("refused" if plan is None else f"plan {plan.strategy} x{plan.nodes}")
    if plan is None:
        return
    check_plan(SCHEMA, plan)
    assert build_plan(TREE, sel).to_json() == plan.to_json(), "composition is deterministic"
    assert plan.hardware == sel.hardware
    assert plan.verified == (sel.hardware in ("h200", "b300", "gb300", "mi355x"))
    assert any(n.code == "unverified-hardware" for n in plan.notices) != plan.verified
    if sel.strategy is not None:
        assert plan.strategy == sel.strategy
    for s in sel.sets:
        if s.startswith("no-enable-"):
            assert any(n.code == "normalized-flag" for n in plan.notices)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(selections())
def test_lint_finds_no_error_in_any_composed_command(sel: Selection) -> None:
    plan = _plan_or_refusal(sel)
    if plan is not None:
        assert lint_errors(SCHEMA, plan) == []


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(HARDWARE), st.sampled_from(STRATEGIES[1:]), st.integers(1, 6))
def test_explicit_node_count_is_honoured_or_raised_with_a_notice(hw: str, strategy: str, nodes: int) -> None:
    sel = Selection(hardware=hw, strategy=strategy, nodes=None if strategy == "pd_cluster" else nodes)
    plan = _plan_or_refusal(sel)
    if plan is None or strategy == "pd_cluster":
        return
    if plan.nodes != nodes:
        assert plan.nodes > nodes and any(n.code == "floor-raised" for n in plan.notices)


# --------------------------------------------------------------------------- known bugs
def _args(plan: Plan, proc_id: str) -> dict[str, object]:
    proc = next(p for p in plan.processes if p.id == proc_id)
    return {k: (a.polarity if a.polarity is not None else a.value) for k, a in flags(SCHEMA, proc).items()}


@pytest.mark.parametrize("role,par", [("prefill", "tep"), ("decode", "dep"), ("prefill", "dep"), ("decode", "tep")])
def test_pd_expert_parallel_pools_enable_expert_parallel(role: str, par: str) -> None:
    kw = {f"{role}_strategy": par}
    plan = build_plan(TREE, Selection(hardware="b300", strategy="pd_cluster", **kw))
    for p in engine_processes(plan):
        if p.role == role:
            assert _args(plan, p.id).get("--enable-expert-parallel") is True, f"{p.id} runs {par} without expert parallelism"


@pytest.mark.parametrize("hw", ["gb300"])
def test_single_node_strategy_never_spans_nodes(hw: str) -> None:
    try:
        plan = build_plan(TREE, Selection(hardware=hw, strategy="single_node_tp"))
    except K3Error as err:
        assert err.code in REFUSALS
        return
    assert plan.nodes == 1, f"{plan.strategy} planned on {plan.nodes} nodes"


@pytest.mark.parametrize("strategy,dotted", [
    (None, "attention-config.mla_prefill_backend=TRTLLM_RAGGED"),
    ("pd_cluster", "compilation-config.cudagraph_mode=FULL"),
])
def test_dotted_set_with_bare_string_value_is_folded(strategy: str | None, dotted: str) -> None:
    plan = build_plan(TREE, Selection(hardware="b300", strategy=strategy, sets=(dotted,)))
    check_plan(SCHEMA, plan)
    assert lint_errors(SCHEMA, plan) == []


def test_setting_a_locked_value_to_its_own_value_is_allowed() -> None:
    plan = build_plan(TREE, Selection(hardware="b300", sets=('attention-config.mla_prefill_backend="TRTLLM_RAGGED"',)))
    check_plan(SCHEMA, plan)


@pytest.mark.parametrize("text", ["enforce-eager", "enforce-eager=true"])
def test_set_can_enable_a_plain_boolean(text: str) -> None:
    plan = build_plan(TREE, Selection(sets=(text,)))
    assert _args(plan, "serve-0").get("--enforce-eager") is True


def test_feature_both_enabled_and_disabled_is_not_silent() -> None:
    try:
        plan = build_plan(TREE, Selection(features=("text_only",), no_features=("text_only",)))
    except K3Error:
        return
    assert any("text_only" in n.message for n in plan.notices)
