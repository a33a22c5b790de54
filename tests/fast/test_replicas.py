"""``--replicas N``: independent copies of any aggregated strategy's engine, each on nodes of its
own behind one vllm-router (planning; tests/e2e/local/test_supervise_sim.py runs two copies and restarts one)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Collection
from functools import cache
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from paths import ROOT

from k3launch import api
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import ProcessStatus, Status, observed_state, with_replicas
from k3launch.models.selection import Selection
from k3launch.models.supervise import units, worker_urls
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import Inventory
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


LOCAL = ROOT / "inventories" / "local.yaml"  # 4 nodes


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


# ------------------------------------------------------------------ status, per copy
def _snap(plan: Plan, dead: Collection[str] = (), sick: Collection[str] = ()) -> Status:
    procs = [ProcessStatus(id=p.id, node=p.node, role=p.role, alive=p.id not in dead,
                           healthy=None if p.http_port is None or p.id in dead else p.id not in sick) for p in plan.processes]
    return Status(name=plan.name, state=observed_state("ready", procs), endpoint=plan.endpoint, processes=procs)


def test_status_of_copies_names_each_processs_copy_and_each_copys_state() -> None:
    plan = _plan("multi_node_dep", "b300", 2, 2)
    ok = with_replicas(_snap(plan), plan)
    assert [(p.id, p.replica) for p in ok.processes] == [("r0-serve-0", 0), ("r0-serve-1", 0), ("r1-serve-0", 1), ("r1-serve-1", 1),
                                                         ("router", None)]
    assert [(r.replica, r.state, r.processes) for r in ok.replicas] == [(0, "serving", ["r0-serve-0", "r0-serve-1"]),
                                                                        (1, "serving", ["r1-serve-0", "r1-serve-1"])]
    # one rank of copy 1 answers /health with an error: that copy is degraded, the other still serves
    sick = with_replicas(_snap(plan, sick={"r1-serve-1"}), plan)
    assert [r.state for r in sick.replicas] == ["serving", "degraded"] and sick.state == "degraded"
    # every process of copy 0 gone: down; one of copy 1 gone: degraded
    gone = with_replicas(_snap(plan, dead={"r0-serve-0", "r0-serve-1", "r1-serve-0"}), plan)
    assert [r.state for r in gone.replicas] == ["down", "degraded"]
    data = gone.as_dict()
    assert [p.get("replica") for p in data["processes"]] == [0, 0, 1, 1, None] and "replica" not in data["processes"][-1]
    assert data["replicas"][0] == {"replica": 0, "state": "down", "processes": ["r0-serve-0", "r0-serve-1"]}
    assert Status.model_validate(data).as_dict() == data  # the published shape, read back as written


def test_status_of_one_copy_is_as_it_was() -> None:
    plan = _plan("multi_node_dep", "b300", 2, 1)
    snap = _snap(plan, dead={"serve-1"})
    assert with_replicas(snap, plan) is snap
    data = snap.as_dict()
    assert set(data) == {"name", "state", "endpoint", "processes", "unreachable", "supervisor"}
    assert all(set(p) == {"id", "node", "role", "alive", "healthy"} for p in data["processes"])


class _Health(BaseHTTPRequestHandler):
    code = 200

    def do_GET(self) -> None:
        self.send_response(self.code if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        return None


def test_k3launch_status_groups_a_slurm_deployments_processes_per_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two single-node copies in one Slurm job (squeue answered by FakeSlurm; each process's /health
    by a small server on its bound address): the table has a copy column and a line per copy, and
    --json carries the same, first with copy 1's step gone, then with it running but unhealthy."""
    import random
    import threading
    from http.server import ThreadingHTTPServer

    from typer.testing import CliRunner

    import k3launch.deploy.slurm.ops as ops
    from k3launch.cli import app
    from k3launch.deploy.slurm.client import JobInfo
    from k3launch.deploy.state import StateStore
    from k3launch.models.record import SlurmJob, SlurmRecord
    from k3launch.planning.inventory import Inventory
    from k3launch.testing import FakeSlurm

    inv = Inventory.model_validate({"name": "u", "backend": "slurm", "hardware": "b300", "engine": "sim", "slurm": {"container": "bare"}})
    plan = build_plan(TREE, Selection(strategy="single_node_tp", replicas=2), inventory=inv, name="u-copies",
                      port_base=random.randrange(30000, 40000, 100))
    addr = {"slurm-node-0": "127.0.77.161", "slurm-node-1": "127.0.77.162"}
    hosts = {"slurm-node-0": "k3n1", "slurm-node-1": "k3n2"}
    store = StateStore(tmp_path / "state")
    store.save(SlurmRecord(name=plan.name, state="ready", created=1.0, updated=1.0, endpoint=plan.endpoint, plan=plan,
                           slurm=SlurmJob(job_id="42", log_dir=str(tmp_path), script="", hosts=hosts, addresses=addr)))
    sick = type("Sick", (_Health,), {"code": 503})
    servers = [ThreadingHTTPServer((addr[p.node], p.http_port or 0), sick if p.id == "r1-serve-0" else _Health) for p in plan.processes]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        steps = {"r0-serve-0": "k3n1", "router": "k3n1"}
        fake = FakeSlurm([JobInfo("42", "RUNNING", ["k3n1", "k3n2"])], steps=steps)
        monkeypatch.setattr(ops, "SlurmClient", lambda: fake)

        def status(*args: str) -> str:
            res = CliRunner().invoke(app, ["status", plan.name, "--state-dir", str(store.root), *args], catch_exceptions=False)
            assert res.exit_code == 0, res.stdout + res.stderr
            return res.stdout

        text = status()
        cells = [[c.strip() for c in re.split("[│┃]", ln)[1:-1]] for ln in text.splitlines() if ln[:1] in "│┃"]
        rows = {c[0]: c[1:] for c in cells}
        assert rows["process"][0] == "copy" and rows["r0-serve-0"][:2] == ["r0", "k3n1"] and rows["r1-serve-0"][:2] == ["r1", "k3n2"]
        assert rows["router"][0] == "-" and rows["r1-serve-0"][3] == "no"  # not alive
        assert "copy r0: serving (1 process(es))" in text and "copy r1: down: no process alive" in text
        assert "state degraded" in text
        snap = json.loads(status("--json"))
        assert [(r["replica"], r["state"]) for r in snap["replicas"]] == [(0, "serving"), (1, "down")]
        assert {p["id"]: p.get("replica") for p in snap["processes"]} == {"r0-serve-0": 0, "r1-serve-0": 1, "router": None}

        fake.running_steps["r1-serve-0"] = "k3n2"  # the step runs, but its engine answers /health 503
        text = status()
        assert "copy r1: degraded: r1-serve-0 not healthy" in text and "copy r0: serving" in text
        assert [r["state"] for r in json.loads(status("--json"))["replicas"]] == ["serving", "degraded"]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


# ------------------------------------------------------------------ a recipe's default
K3_FILE = Path("models/moonshotai/Kimi-K3.yaml")
TINY_FILE = Path("models/k3launch/tiny-llama.yaml")


def _tree(tmp_path: Path, recipe: str = "", variant: str = "", rel: Path = K3_FILE) -> Path:
    """The bundled tree with ``recipe`` appended to one recipe's top level and ``variant`` to its default variant."""
    import shutil

    from k3launch.planning.recipes import default_recipes_dir

    root = tmp_path / "recipes"
    if not root.exists():
        shutil.copytree(default_recipes_dir(), root)
    path = root / rel
    text = path.read_text()
    if variant:
        anchor = "variants:\n  default:\n"
        assert anchor in text
        text = text.replace(anchor, f"{anchor}    {variant}\n", 1)
    path.write_text(text + (f"\n{recipe}\n" if recipe else ""))
    return root


def _slurm_inventory(replicas: int | None = None) -> Inventory:  # no nodelist: as many b300 nodes as a plan needs
    return Inventory.model_validate({"name": "s", "backend": "slurm", "hardware": "b300", "slurm": {"container": "pyxis"},
                                     **({"replicas": replicas} if replicas is not None else {})})


def _default_notices(plan: Plan) -> list[str]:
    return [n.message for n in plan.notices if n.code == "replicas-default"]


def test_a_recipes_default_of_copies_comes_after_the_flag_and_the_inventory(tmp_path: Path) -> None:
    tree = RecipeTree(_tree(tmp_path, recipe="replicas: 2"))
    dep = Selection(strategy="multi_node_dep", hardware="b300")
    two = build_plan(tree, dep)
    assert two.replicas == 2 and [p.id for p in two.processes][:2] == ["r0-serve-0", "r0-serve-1"] and two.nodes == 4
    assert _default_notices(two) == ["2 copies of the engine: the recipe's replicas (--replicas or the inventory's replicas: override it)"]
    # --replicas first, then the inventory's replicas: (even 1), then the recipe's
    assert build_plan(tree, dep.model_copy(update={"replicas": 1})).replicas == 1
    assert build_plan(tree, dep.model_copy(update={"replicas": 3})).replicas == 3
    three = build_plan(tree, dep, inventory=_slurm_inventory(3))
    assert three.replicas == 3 and _default_notices(three) == ["3 copies of the engine: the inventory's replicas (--replicas overrides it)"]
    one = build_plan(tree, dep, inventory=_slurm_inventory(1))
    assert one.replicas == 1 and not _default_notices(one)
    assert build_plan(tree, dep, inventory=_slurm_inventory()).replicas == 2  # an inventory that says nothing
    # without the recipe's default: one copy, no notice (the bundled tree)
    assert _plan("multi_node_dep", "b300", None, 1).replicas == 1 and not _default_notices(build_plan(TREE, dep))


def test_a_variants_default_of_copies_wins_over_its_recipes(tmp_path: Path) -> None:
    tree = RecipeTree(_tree(tmp_path, recipe="replicas: 2", variant="replicas: 3"))
    plan = build_plan(tree, Selection(strategy="single_node_tp", hardware="b300"))
    assert plan.replicas == 3 and [p.id for p in plan.processes] == ["r0-serve-0", "r1-serve-0", "r2-serve-0", "router"]
    assert _default_notices(plan) == ["3 copies of the engine: the recipe's variants.default.replicas "
                                      "(--replicas or the inventory's replicas: override it)"]


def test_a_recipes_default_is_left_out_where_copies_do_not_apply_as_the_inventorys_is(tmp_path: Path) -> None:
    root = _tree(tmp_path, recipe="replicas: 2")
    _tree(tmp_path, recipe="replicas: 2", rel=TINY_FILE)
    tree = RecipeTree(root)
    pd = build_plan(tree, Selection(strategy="pd_cluster", hardware="b300"))
    assert pd.replicas == 1 and _default_notices(pd) == ["the recipe's replicas: 2 left out: pd_cluster is not served as copies"]
    rep = api.plan(str(LOCAL), recipe="k3launch/tiny-llama", strategy="multi_node_replicas", nodes=2, recipes_dir=str(root))
    assert rep.replicas == 1 and _default_notices(rep) == ["the recipe's replicas: 2 left out: multi_node_replicas is not served as copies"]
    # asked for with the flag, the same plans are refused, as ever
    with pytest.raises(K3Error, match="does not apply to pd_cluster"):
        build_plan(tree, Selection(strategy="pd_cluster", hardware="b300", replicas=2))
    # fault tolerance cannot run copies yet: the refusal names the recipe's default, and the hint how to ask for one copy
    with pytest.raises(K3Error) as exc:
        build_plan(tree, Selection(strategy="multi_node_dep", hardware="b300", fault_tolerance=True))
    assert exc.value.code == "replicas" and exc.value.message.startswith("2 copies (the recipe's replicas) with vLLM's fault tolerance")
    assert exc.value.hint.startswith("--replicas 1")
    assert build_plan(tree, Selection(strategy="multi_node_dep", hardware="b300", fault_tolerance=True, replicas=1)).fault_tolerance


@pytest.mark.parametrize(("recipe", "variant", "words"), [
    ("replicas: 0", "", "replicas"), ("replicas: 257", "", "replicas"), ("replicas: two", "", "replicas"),
    ("", "replicas: 0", "variants.default.replicas"), ("replica: 2", "", "replica"),  # a typo: k3launch's own tree refuses unknown keys
])
def test_a_bad_recipe_replicas_is_refused_with_its_file_and_line(recipe: str, variant: str, words: str, tmp_path: Path) -> None:
    root = _tree(tmp_path, recipe=recipe, variant=variant)
    with pytest.raises(K3Error) as exc:
        build_plan(RecipeTree(root), Selection())
    line = next(i for i, ln in enumerate((root / K3_FILE).read_text().splitlines(), 1) if ln.strip() == (recipe or variant))
    assert exc.value.code == "bad-recipe" and f"{root / K3_FILE}:{line}:" in exc.value.message and words in exc.value.message, exc.value.message
    assert "\n" not in exc.value.message and exc.value.hint
