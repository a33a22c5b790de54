"""The rollout's steps against the supervise seam's test double: batches (``--max-unavailable``),
the record's per-unit marks, a failed gate rolled back inside a batch, and the extra gate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from paths import ROOT

from k3launch.api.planning import plan
from k3launch.deploy import rollout as ro
from k3launch.models.control.observation import Observation
from k3launch.models.plan import Plan
from k3launch.models.supervise import units
from k3launch.testing import FakeWatcher
from k3launch.transport.http import Completion

INV = ROOT / "inventories" / "local.yaml"


def _plans(copies: int) -> tuple[Plan, Plan]:
    sel = {"recipe": "k3launch/tiny-llama", "strategy": "single_node_tp", "replicas": copies}
    return plan(INV, selection=sel), plan(INV, selection={**sel, "sets": ["max-num-seqs=4"]})


@pytest.fixture(autouse=True)
def _completions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ro.http, "completion", lambda *a, **k: Completion(True, "200", 8, "ok", 0.01))
    monkeypatch.setattr(ro, "running_requests", lambda url, timeout=3.0: 0.0)


def _healthy(p: Plan) -> Observation:
    return Observation(0, healthy={x.id: True for x in p.processes if x.http_port})


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
    r = ro.Roller(w, old, slow, drain_timeout=1, start_timeout=5, sleep=lambda s: None)
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
