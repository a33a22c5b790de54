"""The typed outputs: records (two variants, old files still readable), Status and its published schema, stages."""

from __future__ import annotations

import json

import pytest
from paths import ROOT

from k3launch import api
from k3launch.models.record import (
    ProcessStatus,
    SlurmJob,
    SlurmRecord,
    SshRecord,
    Stage,
    Status,
    parse_record,
    status_schema,
)


def _plan():  # type: ignore[no-untyped-def]
    return api.plan(None, strategy="single_node_tp", name="m-a")


def test_the_published_status_schema_is_the_models() -> None:
    # docs/status.schema.json is what `status --json` promises; regenerate it when Status changes:
    #   python -c "import json; from k3launch.models.record import status_schema; print(json.dumps(status_schema(), indent=2, sort_keys=True))"
    published = json.loads((ROOT / "docs" / "status.schema.json").read_text())
    assert published == status_schema()
    assert set(published["required"]) == {"name", "state", "endpoint", "processes"}


def test_status_json_has_a_job_only_on_slurm() -> None:
    proc = ProcessStatus(id="serve-0", node="n", role="serve", alive=True, healthy=None)
    ssh = Status(name="a", state="ready", endpoint="http://x:1", processes=[proc])
    assert "job" not in json.loads(ssh.to_json()) and json.loads(ssh.to_json())["processes"][0]["healthy"] is None
    assert Status.model_validate_json(ssh.to_json()) == ssh and ssh.healthy
    sick = ssh.model_copy(update={"processes": [proc.model_copy(update={"healthy": False})]})
    assert not sick.healthy


def test_records_are_typed_variants_and_old_files_still_read() -> None:
    plan = _plan()
    ssh = SshRecord(name="m-a", state="ready", created=0, updated=0, endpoint=plan.endpoint, plan=plan, backend="local")
    slurm = SlurmRecord(name="m-a", state="ready", created=0, updated=0, endpoint=plan.endpoint, plan=plan,
                        slurm=SlurmJob(job_id="7", log_dir="/l", script="/l/job.sbatch", hosts={"local-1": "k3n2"}))
    assert isinstance(parse_record(ssh.to_json()), SshRecord) and isinstance(parse_record(slurm.to_json()), SlurmRecord)
    assert ssh.job is None and ssh.holds_nodes and slurm.job is not None and slurm.job.job_id == "7" and not slurm.holds_nodes
    assert slurm.machines() == ["k3n2"] and ssh.machines() == sorted({p.node for p in plan.processes})
    # records written before `backend` existed: `slurm: null` for ssh/local ones, a job for Slurm ones
    old_ssh = json.loads(ssh.to_json())
    del old_ssh["backend"]
    old_ssh["slurm"] = None
    old_slurm = json.loads(slurm.to_json())
    del old_slurm["backend"]
    got = parse_record(json.dumps(old_ssh))
    assert isinstance(got, SshRecord) and got.backend == "local"  # the plan's backend
    assert isinstance(parse_record(json.dumps(old_slurm)), SlurmRecord)
    with pytest.raises(ValueError):
        parse_record(json.dumps({**old_ssh, "surprise": 1}))


def test_stages_print_as_their_names() -> None:
    assert f"{Stage.HEALTH}" == "health" and f"{Stage.COMPLETION:<10}|" == "completion|" and Stage("queued") is Stage.QUEUED


def test_placed_nodes_derive_from_the_inventory_node_model() -> None:
    # a setting added to the inventory's node model reaches placement and the plan's hosts by its name
    import dataclasses

    from k3launch.models.plan import Host
    from k3launch.planning.inventory import NodeSettings
    from k3launch.planning.placement import SETTING_NAMES, NodeSpec

    spec_fields = {f.name for f in dataclasses.fields(NodeSpec)}
    assert {SETTING_NAMES.get(f, f) for f in NodeSettings.model_fields} <= spec_fields
    assert set(Host.model_fields) - {"role", "gpus"} <= spec_fields
    inv = api.load(ROOT / "inventories" / "h200-pair.yaml")[0]
    plan = api.plan(inv, strategy="multi_node_tp", name="m-h")
    node = next(n for n in inv.nodes if n.name == plan.hosts[0].name)
    assert plan.hosts[0].ssh_port == (node.port or inv.defaults.port) and plan.hosts[0].runtime == (node.runtime or inv.defaults.runtime or "docker")


def test_a_ready_deployment_with_an_unhealthy_endpoint_is_degraded() -> None:
    from k3launch.models.record import observed_state

    up = ProcessStatus(id="serve-0", node="n", role="serve", alive=True, healthy=True)
    headless = ProcessStatus(id="serve-1", node="m", role="serve", alive=True, healthy=None)
    assert observed_state("ready", [up, headless]) == "ready"
    # vLLM whose EngineCore died: the API server still runs, /health answers 503
    assert observed_state("ready", [up.model_copy(update={"healthy": False}), headless]) == "degraded"
    assert observed_state("ready", [up, headless.model_copy(update={"alive": False})]) == "degraded"
    assert observed_state("starting", [up.model_copy(update={"healthy": False})]) == "starting"


def test_docker_and_podman_are_the_container_runtimes() -> None:
    from typing import get_args

    from k3launch.models.plan import CONTAINER_RUNTIMES, Runtime, is_container
    from k3launch.planning import inventory

    assert inventory.Runtime is Runtime  # inventories and plans name runtimes the same way
    assert {r: is_container(r) for r in get_args(Runtime)} == {"docker": True, "podman": True, "apptainer": False, "bare": False}
    assert CONTAINER_RUNTIMES == ("docker", "podman")
