"""``--replicas N``: independent copies of any aggregated strategy's engine, each on nodes of its
own behind one vllm-router (planning; tests/test_supervise_sim.py runs two copies and restarts one)."""

from __future__ import annotations

import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from k3launch import api
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.selection import Selection
from k3launch.models.supervise import units, worker_urls
from k3launch.planning.build import build_plan
from k3launch.planning.recipes import RecipeTree

TREE = RecipeTree()


@cache
def _plan(strategy: str, hardware: str, nodes: int | None, replicas: int) -> Plan:
    return build_plan(TREE, Selection(strategy=strategy, hardware=hardware, nodes=nodes, replicas=replicas))


def _arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.parametrize(("strategy", "hardware", "nodes", "addr_flag"), [
    ("multi_node_tp", "h200", 2, "--master-addr"),
    ("multi_node_tep", "gb300", 2, "--master-addr"),
    ("multi_node_dep", "b300", 2, "--data-parallel-address"),
])
def test_each_copy_of_a_multi_node_engine_is_the_one_copy_plan_on_nodes_of_its_own(strategy: str, hardware: str, nodes: int,
                                                                                     addr_flag: str) -> None:
    """Copy k is the single-copy plan with its ids prefixed r<k>- and its own head's address: the
    same flags otherwise, no node shared, and one recovery unit per copy behind one router."""
    one, two = _plan(strategy, hardware, nodes, 1), _plan(strategy, hardware, nodes, 2)
    engines = [p for p in two.processes if p.role != "router"]
    assert two.nodes == 2 * one.nodes == len({p.node for p in engines}) and two.replicas == 2 and one.replicas == 1
    assert [p.id for p in engines] == [f"r{k}-{p.id}" for k in range(2) for p in one.processes if p.role != "router"]
    for k in range(2):
        copy = [p for p in engines if p.id.startswith(f"r{k}-")]
        assert {p.pool for p in copy} == {f"r{k}-serve"}
        head = next(p for p in copy if p.head)
        assert {_arg(p.argv, addr_flag) for p in copy} == {head.address}  # a copy's ranks meet at their own head
        alone = [p for p in one.processes if p.role != "router"]
        for mine, orig in zip(copy, alone, strict=True):  # the same command but for the addresses
            assert [a for a in mine.argv if a not in (mine.address, head.address)] == [a for a in orig.argv if a not in (orig.address, alone[0].address)]
    (router,) = [p for p in two.processes if p.role == "router"]
    assert worker_urls(router) == [f"http://{p.address}:{p.http_port}" for p in engines if p.http_port is not None]
    assert [(u.name, u.kind) for u in units(two)] == [("r0-serve", "group"), ("r1-serve", "group"), ("router", "router")]
    assert any(n.code == "router-added" and "--replicas" in n.message for n in two.notices)
    assert "x2" in two.name and "replicas" not in one.model_dump(mode="json") and two.model_dump(mode="json")["replicas"] == 2


def test_copies_of_a_single_node_engine_restart_alone_and_a_lone_engine_gets_a_router() -> None:
    p = _plan("single_node_tp", "b300", None, 3)
    assert [(u.name, u.kind, u.processes) for u in units(p)] == [
        ("r0-serve-0", "engine", ("r0-serve-0",)), ("r1-serve-0", "engine", ("r1-serve-0",)), ("r2-serve-0", "engine", ("r2-serve-0",)),
        ("router", "router", ("router",))]
    assert len({q.node for q in p.processes if q.role != "router"}) == 3 and p.endpoint.endswith(str(next(q.http_port for q in p.processes if q.role == "router")))


@pytest.mark.parametrize(("sel", "words"), [
    (Selection(strategy="pd_cluster", replicas=2), "--replicas does not apply to pd_cluster"),
    (Selection(strategy="multi_node_dep", hardware="b300", nodes=2, replicas=2, fault_tolerance=True), "fault tolerance is not supported yet"),
])
def test_what_replicas_cannot_copy_is_refused_with_a_hint(sel: Selection, words: str) -> None:
    with pytest.raises(K3Error) as exc:
        build_plan(TREE, sel)
    assert exc.value.code == "replicas" and words in exc.value.message and exc.value.hint


LOCAL = Path(__file__).resolve().parents[1] / "inventories" / "local.yaml"  # 4 nodes


def test_replicas_of_independent_replicas_are_refused() -> None:
    with pytest.raises(K3Error) as exc:
        api.plan(str(LOCAL), recipe="k3launch/tiny-llama", strategy="multi_node_replicas", nodes=2, replicas=2)
    assert exc.value.code == "replicas" and "one copy per node already" in exc.value.message and "--nodes 2" in exc.value.hint


@pytest.mark.parametrize("bad", ["0", "257", "two"])
def test_a_bad_replica_count_is_one_line_and_exit_2(bad: str) -> None:
    r = subprocess.run([sys.executable, "-m", "k3launch", "plan", "--replicas", bad], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--replicas" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_inventory_too_small_for_the_copies_says_how_many_nodes() -> None:
    with pytest.raises(K3Error) as exc:
        api.plan(str(LOCAL), recipe="k3launch/tiny-llama", strategy="multi_node_tp", nodes=2, replicas=3)
    assert "6" in exc.value.message, exc.value.message


def test_an_inventory_default_of_copies_is_taken_unless_replicas_says_otherwise(tmp_path: Path) -> None:
    import yaml

    inv = yaml.safe_load(LOCAL.read_text())
    inv["replicas"] = 2
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    two = api.plan(str(path), recipe="k3launch/tiny-llama", strategy="single_node_tp")
    assert two.replicas == 2 and [p.id for p in two.processes] == ["r0-serve-0", "r1-serve-0", "router"]
    assert any(n.code == "replicas-default" for n in two.notices)
    assert api.plan(str(path), recipe="k3launch/tiny-llama", strategy="single_node_tp", replicas=1).replicas == 1
    # a default, not an order: a layout that is not served as copies plans one, and says so
    one = api.plan(str(path), recipe="k3launch/tiny-llama", strategy="multi_node_replicas", nodes=2)
    assert one.replicas == 1 and any(n.code == "replicas-default" and "left out" in n.message for n in one.notices)
    inv["replicas"] = 0
    path.write_text(yaml.safe_dump(inv))
    with pytest.raises(K3Error) as exc:
        api.plan(str(path), recipe="k3launch/tiny-llama", strategy="single_node_tp")
    assert "replicas" in exc.value.message
