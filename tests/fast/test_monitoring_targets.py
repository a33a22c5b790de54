"""Prometheus targets from a deployment's record (k3launch.render.monitoring), and the state
store keeping one file per ready deployment (written with the record, removed with it)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import yaml
from paths import ROOT

from k3launch import api
from k3launch.deploy.state import StateStore
from k3launch.models.control.memory import ControlMemory
from k3launch.models.plan import Plan
from k3launch.models.record import SlurmJob, SlurmRecord, SshRecord
from k3launch.models.rollout import RolloutState, RolloutUnit
from k3launch.render.monitoring import revision, targets

H200 = str(ROOT / "inventories" / "h200-pair.yaml")


def _record(plan: Plan, **kw: object) -> SshRecord:
    return SshRecord(name=plan.name, state="ready", created=0, updated=0, endpoint=plan.endpoint, plan=plan, **kw)  # type: ignore[arg-type]


def _by_process(groups: list[dict[str, object]]) -> dict[str, dict[str, str]]:
    out = {}
    for g in groups:
        labels = g["labels"]
        assert isinstance(labels, dict) and isinstance(g["targets"], list) and len(g["targets"]) == 1
        out[labels["process"]] = {**labels, "target": g["targets"][0]}
    return out


def test_a_multi_node_dep_plan_scrapes_every_http_server_and_the_routers_metrics_port() -> None:
    plan = api.plan(H200, strategy="multi_node_dep", nodes=2, name="k3-dep")
    rec = _record(plan, deployment_id="0123abcd-ef0123")
    got = _by_process(targets(rec))
    http = [p for p in plan.processes if p.http_port and p.role != "router"]
    router = next(p for p in plan.processes if p.role == "router")
    assert sorted(got) == sorted([p.id for p in http] + ["router"])
    for p in http:
        t = got[p.id]
        assert t["target"] == f"{p.address}:{p.http_port}" and t["job"] == "k3launch-vllm" and t["role"] == p.role
        assert t["deployment"] == "k3-dep" and t["k3launch_id"] == "0123abcd-ef0123" and t["node"] == p.node
        assert t["dp_rank"] == str(p.dp_start_rank) and t["revision"] == revision(plan) and "copy" not in t
    metrics_port = router.argv[router.argv.index("--prometheus-port") + 1]
    assert got["router"]["target"] == f"{router.address}:{metrics_port}" and got["router"]["job"] == "k3launch-vllm-router"
    # the router's metrics listen on its node's address, not vllm-router's default 127.0.0.1
    assert router.argv[router.argv.index("--prometheus-host") + 1] == router.address


def test_a_headless_rank_is_no_target_and_copies_say_which_copy_and_standby() -> None:
    plan = api.plan(H200, strategy="multi_node_tp", nodes=2, name="k3-tp")
    got = _by_process(targets(_record(plan)))
    headless = [p.id for p in plan.processes if p.role != "router" and not p.http_port]
    assert headless and not set(headless) & set(got)
    assert got["serve-0"]["rank"] == "0"

    local = str(ROOT / "inventories" / "local.yaml")
    copies = api.plan(local, strategy="single_node_tp", replicas=3, name="k3-copies")
    got = _by_process(targets(_record(copies, control=ControlMemory(standby=["r2"]))))
    engines = {k: v for k, v in got.items() if k != "router"}
    assert {v["copy"] for v in engines.values()} == {"r0", "r1", "r2"}
    assert {v["copy"]: v["standby"] for v in engines.values()} == {"r0": "false", "r1": "false", "r2": "true"}


def test_during_a_rollout_a_rolled_unit_is_labelled_with_the_new_plans_revision() -> None:
    local = str(ROOT / "inventories" / "local.yaml")
    old = api.plan(local, strategy="single_node_tp", replicas=2, name="k3-roll")
    new = api.plan(local, strategy="single_node_tp", replicas=2, name="k3-roll", sets=["max-num-seqs=8"])
    assert revision(old) != revision(new)
    ids = sorted(p.id for p in old.processes if p.role != "router")
    units = [RolloutUnit(name=ids[0], processes=[ids[0]], on="new"), RolloutUnit(name=ids[1], processes=[ids[1]], on="old")]
    rec = _record(old, rollout=RolloutState(old=old, new=new, changes=["--set max-num-seqs=8"], units=units, started=0, updated=0))
    got = _by_process(targets(rec))
    assert got[ids[0]]["revision"] == revision(new) and got[ids[1]]["revision"] == revision(old)
    assert sorted(got) == sorted(p.id for p in old.processes)  # each process once


def test_on_slurm_the_targets_are_the_allocated_nodes() -> None:
    plan = api.plan(H200, strategy="multi_node_dep", nodes=2, name="k3-slurm")
    nodes = sorted({p.node for p in plan.processes})
    job = SlurmJob(job_id="7", log_dir="/l", script="/l/job.sbatch", hosts={n: f"gpu{i:03d}" for i, n in enumerate(nodes)},
                   addresses={n: f"10.9.0.{i + 1}" for i, n in enumerate(nodes)})
    rec = SlurmRecord(name=plan.name, state="ready", created=0, updated=0, endpoint=plan.endpoint, plan=plan, slurm=job)
    got = _by_process(targets(rec))
    for p in plan.processes:
        if p.id in got:
            assert got[p.id]["node"] == job.hosts[p.node] and got[p.id]["target"].split(":")[0] == job.addresses[p.node]


def test_the_store_keeps_a_target_file_for_ready_deployments_only(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    plan = api.plan(H200, strategy="multi_node_dep", nodes=2, name="k3-dep")
    path = store.targets_dir() / "k3-dep.json"
    rec = _record(plan)
    rec.state = "starting"
    store.save(rec)
    assert not path.exists()  # a bring-up is not engines down
    rec.state = "ready"
    store.save(rec)
    assert json.loads(path.read_text()) == targets(rec)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # a Prometheus running as another user reads it
    assert [p.name for p in store.targets_dir().iterdir()] == ["k3-dep.json"]  # no temporary file left
    rec.state = "stopping"
    store.save(rec)
    assert not path.exists()
    rec.state = "ready"
    store.save(rec)
    store.delete("k3-dep")
    assert not path.exists()


def test_the_printed_scrape_config_reads_that_directory(tmp_path: Path) -> None:
    conf = yaml.safe_load(api.prometheus_config(tmp_path, 5))
    (job,) = conf["scrape_configs"]
    assert job["scrape_interval"] == "5s"
    assert job["file_sd_configs"] == [{"files": [f"{tmp_path.resolve()}/monitoring/targets/*.json"], "refresh_interval": "30s"}]
