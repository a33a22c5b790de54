"""The rollout's steps against the supervise seam's test double: batches (``--max-unavailable``),
the record's per-unit marks, a failed gate rolled back inside a batch, and the extra gate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from k3launch.api.planning import plan
from k3launch.deploy import rollout as ro
from k3launch.models.plan import Plan, Process
from k3launch.models.supervise import units
from k3launch.models.supervision import Observation
from k3launch.testing import FakeWatcher
from k3launch.transport.http import Completion

INV = Path(__file__).resolve().parents[1] / "inventories" / "local.yaml"


def _plans(copies: int) -> tuple[Plan, Plan]:
    sel = {"recipe": "k3launch/tiny-llama", "strategy": "single_node_tp", "replicas": copies}
    return plan(INV, selection=sel), plan(INV, selection={**sel, "sets": ["max-num-seqs=4"]})


@pytest.fixture(autouse=True)
def _completions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ro.http, "completion", lambda *a, **k: Completion(True, "200", 8, "ok", 0.01))
    monkeypatch.setattr(ro, "running_requests", lambda url, timeout=3.0: 0.0)


def _healthy(p: Plan) -> Observation:
    return Observation(0, healthy={x.id: True for x in p.processes if x.http_port})


def _roller(w: FakeWatcher, old: Plan, new: Plan, marks: list[tuple[str, str, str]], **kw: object) -> ro.Roller:
    return ro.Roller(w, old, new, drain_timeout=1, start_timeout=5, sleep=lambda s: None,
                     mark=lambda u, on, why: marks.append((u, on, why)), **kw)  # type: ignore[arg-type]


def test_batches_take_units_out_together_and_mark_each() -> None:
    old, new = _plans(3)
    w = FakeWatcher([_healthy(new)] * 20)
    marks: list[tuple[str, str, str]] = []
    todo = [u for u in units(new) if u.kind != "router"]
    result = _roller(w, old, new, marks).run(todo, batch=2)
    assert result.ok and [r.unit for r in result.rolled] == ["r0-serve-0", "r1-serve-0", "r2-serve-0"]
    reroutes = [c for c in w.calls if c[0] == "reroute"]
    # two out together, back together; then the third alone
    assert [len(c) - 1 for c in reroutes] == [2, 2, 1, 1] and all(x.startswith("-") for x in reroutes[0][1:]), reroutes
    restarts = [c[1] for c in w.calls if c[0] == "restart"]
    assert restarts == ["r0-serve-0", "r1-serve-0", "r2-serve-0"]
    assert [(u, on) for u, on, _ in marks] == [("r0-serve-0", "rolling"), ("r1-serve-0", "rolling"), ("r0-serve-0", "new"),
                                              ("r1-serve-0", "new"), ("r2-serve-0", "rolling"), ("r2-serve-0", "new")]
    assert result.plan.processes == new.processes and result.plan.origin == old.origin  # processes rolled; the caller adopts the rest


def test_a_failed_gate_in_a_batch_rolls_back_that_unit_only() -> None:
    old, new = _plans(2)
    w = FakeWatcher([_healthy(new)] * 20, start_fails={"r1-serve-0": 1})
    marks: list[tuple[str, str, str]] = []
    todo = [u for u in units(new) if u.kind != "router"]
    result = _roller(w, old, new, marks).run(todo, batch=2)
    assert result.failed == "r1-serve-0" and "start command exited 1" in result.reason
    runs = {p.id: p for p in result.plan.processes}
    assert runs["r0-serve-0"] == next(p for p in new.processes if p.id == "r0-serve-0")
    assert runs["r1-serve-0"] == next(p for p in old.processes if p.id == "r1-serve-0")
    assert marks[-2:] == [("r0-serve-0", "new", ""), ("r1-serve-0", "old", marks[-1][2])] and "exited 1" in marks[-1][2]
    assert [c[1] for c in w.calls if c[0] == "restart"] == ["r0-serve-0", "r1-serve-0", "r1-serve-0"]  # r1 again, on the old plan
    assert w.plan is not None and {p.id: p for p in w.plan.processes}["r1-serve-0"] == runs["r1-serve-0"]
    assert w.calls[-1][0] == "reroute" and len(w.calls[-1]) == 3  # both back in the router: r0 new, r1 as it was


def test_the_extra_gate_fails_a_unit_with_its_words() -> None:
    old, new = _plans(2)
    w = FakeWatcher([_healthy(new)] * 20)
    seen: list[Sequence[str]] = []

    def gate(p: Plan, engines: Sequence[Process]) -> str:
        seen.append([e.id for e in engines])
        return "canary: 'The capital' expected [1, 2] got [1, 3]" if engines[0].id == "r0-serve-0" and len(seen) == 1 else ""

    result = _roller(w, old, new, [], gate=gate).run([u for u in units(new) if u.kind != "router"])
    assert result.failed == "r0-serve-0" and "expected [1, 2] got [1, 3]" in result.reason
    assert seen == [["r0-serve-0"], ["r0-serve-0"]]  # the roll-back is gated too; r1 never rolled


def test_surge_plans_rename_engines_into_the_next_generation_and_keep_the_router() -> None:
    from k3launch.planning.surge import beside, generation, renamed

    old = plan(INV, selection={"strategy": "multi_node_dep", "nodes": 2})
    assert generation(old) == 0
    g1 = renamed(old, 1)
    assert [p.id for p in g1.processes] == ["serve-0-g1", "serve-1-g1", "router"] and generation(g1) == 1
    assert {p.pool for p in g1.processes if p.role != "router"} == {"serve-g1"}
    assert {u.process for u in g1.ports} == {"serve-0-g1", "serve-1-g1", "router"}
    g2 = renamed(g1, 2)
    assert [p.id for p in g2.processes][:2] == ["serve-0-g2", "serve-1-g2"]  # replaced, not nested
    both = beside(old, g1)
    assert [p.id for p in both.processes] == ["serve-0", "serve-1", "router", "serve-0-g1", "serve-1-g1"]
    assert [u.name for u in units(both)] == ["serve", "serve-g1", "router"]  # each set its own recovery unit
    assert units(renamed(plan(INV, selection={"recipe": "k3launch/tiny-llama", "strategy": "single_node_tp", "replicas": 2}), 1))[0].name \
        == "r0-serve-0-g1"


def test_surge_preview_refusals() -> None:
    from k3launch.api.rollouts import _surge_preview
    from k3launch.errors import K3Error

    lone = plan(INV, selection={"recipe": "k3launch/tiny-llama", "strategy": "single_node_tp"})
    with pytest.raises(K3Error) as e:
        _surge_preview(lone, lambda busy: lone, ())
    assert e.value.code == "surge-no-router" and "--allow-downtime" in e.value.hint
    dep = plan(INV, selection={"strategy": "multi_node_dep", "nodes": 3})
    seen: list[Sequence[str]] = []

    def replan(busy: Sequence[str]) -> Plan:
        seen.append(busy)
        return plan(INV, selection={"strategy": "multi_node_dep", "nodes": 3}, exclude=list(busy))

    with pytest.raises(K3Error) as e:
        _surge_preview(dep, replan, ())
    assert e.value.code == "surge-no-spares" and "local-1, local-2, local-3" in e.value.message, e.value.message
    assert seen == [["local-1", "local-2", "local-3"]]
    two = plan(INV, selection={"strategy": "multi_node_dep", "nodes": 2})
    p = _surge_preview(two, lambda busy: plan(INV, selection={"strategy": "multi_node_dep", "nodes": 2}, exclude=list(busy)), ("--surge",))
    assert p.surge and [u.name for u in p.units] == ["serve-g1"]
    assert {x.node for x in p.new.processes if x.role != "router"} == {"local-3", "local-4"}


def test_no_api_submodule_shadows_an_api_function() -> None:
    # importing k3launch.api.X sets attribute X on the package: a module named like one of the
    # functions the package exports would replace that function for every later caller
    import importlib
    import pkgutil
    import types

    from k3launch import api

    for mod in pkgutil.iter_modules(api.__path__):
        importlib.import_module(f"k3launch.api.{mod.name}")
    shadowed = [n for n in api.__all__ if isinstance(getattr(api, n), types.ModuleType)]
    assert shadowed == []


def test_the_stop_waits_out_vllms_own_shutdown_timeout() -> None:
    old, _ = _plans(2)
    slow = plan(INV, selection={"recipe": "k3launch/tiny-llama", "strategy": "single_node_tp", "replicas": 2,
                                "sets": ["shutdown-timeout=90"]})
    w = FakeWatcher([_healthy(slow)] * 5)
    r = _roller(w, old, slow, [])
    unit = units(slow)[0]
    assert ro.shutdown_timeout(next(p for p in slow.processes if p.id == unit.processes[0])) == 90
    assert r._grace(slow, unit) == 90 + ro.SHUTDOWN_MARGIN_S  # SIGKILL only after vLLM's own drain on SIGTERM
    assert r._grace(old, units(old)[0]) == ro.GRACE_S


@pytest.mark.parametrize("state", ["starting", "failed", "interrupted", "stopping"])
def test_a_deployment_that_is_not_ready_is_not_rolled_and_nothing_changes(tmp_path: Path, state: str) -> None:
    import time

    from k3launch.api.rollouts import rollout, rollout_continue
    from k3launch.deploy.state import StateStore
    from k3launch.errors import K3Error
    from k3launch.models.record import ProcessRecord, SshRecord

    p = _plans(2)[0]
    store = StateStore(tmp_path)
    rec = SshRecord(name=p.name, state=state, created=time.time(), updated=time.time(), backend="local", endpoint=p.endpoint, plan=p,
                    inventory=str(INV), processes={x.id: ProcessRecord(id=x.id, node=x.node, runtime="bare", handle="1") for x in p.processes})
    store.save(rec)
    before = store.path(p.name).read_text()
    with pytest.raises(K3Error) as e:
        rollout(p.name, sets=["max-num-seqs=8"], state_dir=tmp_path)
    assert e.value.code == "not-ready" and f"{p.name} is {state}" in e.value.message and "status" in e.value.hint
    with pytest.raises(K3Error) as e:
        rollout_continue(p.name, state_dir=tmp_path)
    assert e.value.code == "nothing-to-continue"
    assert store.path(p.name).read_text() == before
