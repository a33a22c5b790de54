"""The per-process difference between a running plan and its replacement (k3launch.planning.diff):
what a rollout shows before it acts, and what decides which processes restart."""

from __future__ import annotations

from functools import cache

from k3launch.models.plan import Plan, Process
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.diff import Change, diff_plans, diff_process
from k3launch.planning.recipes import RecipeTree

TREE = RecipeTree()


@cache
def _plan(sets: tuple[str, ...] = (), replicas: int | None = None) -> Plan:
    return build_plan(TREE, Selection(strategy="multi_node_dep", hardware="b300", nodes=2, sets=sets, replicas=replicas))


def _lines(old: Plan, new: Plan) -> dict[str, list[str]]:
    return {d.process: [c.line() for c in d.changes] + (["added"] if d.added else []) + (["removed"] if d.removed else [])
            for d in diff_plans(old, new)}


def test_the_same_plan_changes_nothing() -> None:
    assert not any(d.changed for d in diff_plans(_plan(), _plan()))


def test_a_set_flag_changes_every_engine_and_not_the_router() -> None:
    assert _lines(_plan(), _plan(("max-num-seqs=64",))) == {"serve-0": ["+ --max-num-seqs 64"], "serve-1": ["+ --max-num-seqs 64"],
                                                            "router": []}
    assert _lines(_plan(("max-num-seqs=64",)), _plan(("max-num-seqs=32",)))["serve-0"] == ["~ --max-num-seqs 64 -> 32"]


def _with(p: Process, **kw: object) -> Process:
    return p.model_copy(update=kw)


def test_order_and_boolean_spellings_are_not_changes_but_values_are() -> None:
    head = _plan().processes[0]
    flags = head.argv[3:]
    pairs, i = [], 0
    while i < len(flags):  # (flag, its values) groups, reversed: the same command in another order
        j = i + 1
        while j < len(flags) and not flags[j].startswith("-"):
            j += 1
        pairs.append(flags[i:j])
        i = j
    shuffled = _with(head, argv=head.argv[:3] + [w for g in reversed(pairs) for w in g])
    assert shuffled.argv != head.argv and diff_process(head, shuffled, "0.33.0", "0.33.0").changes == ()
    on = _with(head, argv=[*head.argv, "--enable-prefix-caching"])
    off = _with(head, argv=[*head.argv, "--no-enable-prefix-caching"])
    assert diff_process(on, off, "0.33.0", "0.33.0").changes == (Change("flag", "--enable-prefix-caching", "on", "off"),)
    moved = _with(head, node="node-9", address="10.0.0.9", image="vllm/vllm-openai:v0.34.0", env={**head.env, "NCCL_DEBUG": "INFO"})
    got = [c.line() for c in diff_process(head, moved, "0.33.0", "0.33.0").changes]
    assert got == [f"~ node {head.node} -> node-9", f"~ address {head.address} -> 10.0.0.9",
                   f"~ image {head.image} -> vllm/vllm-openai:v0.34.0", "+ NCCL_DEBUG INFO"], got


def test_a_value_the_schema_cannot_read_still_shows() -> None:
    head = _plan().processes[0]
    odd = _with(head, argv=[*head.argv, "--not-a-vllm-flag"])
    (c,) = diff_process(head, odd, "0.33.0", "0.33.0").changes
    assert c.key == "--not-a-vllm-flag" and c.old is None


def test_more_copies_rename_the_processes_and_change_the_router_urls() -> None:
    got = diff_plans(_plan(), _plan(replicas=2))
    assert {d.process for d in got if d.removed} == {"serve-0", "serve-1"}
    assert {d.process for d in got if d.added} == {"r0-serve-0", "r0-serve-1", "r1-serve-0", "r1-serve-1"}
    (router,) = [d for d in got if d.process == "router"]
    assert [c.key for c in router.changes] == ["--worker-urls"] and router.changes[0].new and router.changes[0].new.count("http://") == 4


def test_rollout_sets_replace_in_place_and_unset_drops() -> None:
    from k3launch.api.rollouts import merged_sets
    from k3launch.errors import K3Error

    given = ["max-num-seqs=64", "--enable-prefix-caching=true", "gpu-memory-utilization=0.9"]
    assert merged_sets(given, ["--max-num-seqs=32", "block-size=16"], ["gpu-memory-utilization"]) == [
        "--max-num-seqs=32", "--enable-prefix-caching=true", "block-size=16"]
    assert merged_sets(given, [], []) == given
    try:
        merged_sets(given, ["max-num-seqs"], [])
    except K3Error as exc:
        assert exc.code == "bad-set" and "FLAG=VALUE" in exc.message
    else:
        raise AssertionError("a --set without = was taken")
