"""What a Prometheus needs to watch a deployment, from its record (docs/monitoring.md): pure.

``targets(rec)`` is the deployment's ``file_sd`` target file: one target group per process that
serves HTTP (each engine's API server, ``/metrics`` beside it; the router's metrics port), with
the labels an operator filters and groups by. A headless rank serves no HTTP: its health shows in
its head's. Written by :mod:`k3launch.deploy.state` whenever the record is saved, removed when it
is deleted, so the file follows every restart elsewhere, re-placement, scale and promotion.

While a controller (``supervise``) watches the deployment, its own metrics are a target too
(:mod:`k3launch.render.controller_metrics`). ``scrape_config(dir)`` is the ``scrape_configs``
entry that reads those files.
"""

from __future__ import annotations

import json
from typing import Any

from k3launch.models.plan import Plan, Process
from k3launch.models.record import DeploymentRecord
from k3launch.planning.porttable import flag_value
from k3launch.util.digest import sha256

JOB_ENGINES = "k3launch-vllm"
JOB_ROUTERS = "k3launch-vllm-router"
JOB_CONTROLLERS = "k3launch-controller"
# file_sd files are named <deployment>.json in one directory per state directory
TARGETS_GLOB = "*.json"


def revision(plan: Plan) -> str:
    """A short name of the plan a process runs: 12 hex digits of its processes' commands and
    environments, so a rollout's old and new processes carry different ones."""
    body = json.dumps([[p.id, p.argv, p.env, p.image] for p in plan.processes], sort_keys=True)
    return sha256(body.encode()).hexdigest()[:12]


def _running(rec: DeploymentRecord) -> list[tuple[Process, Plan]]:
    """Each process of the deployment with the plan it runs: during a rollout, a unit that serves
    the new plan runs the new plan's processes (the same ids in place; a surge's own new set)."""
    ro = rec.rollout
    if ro is None:
        return [(p, rec.plan) for p in rec.plan.processes]
    rolled = {pid for u in ro.units if u.on == "new" for pid in u.processes}
    kept = [(p, rec.plan) for p in rec.plan.processes if p.id not in rolled]
    return kept + [(p, ro.new) for p in ro.new.processes if p.id in rolled]


def _address(rec: DeploymentRecord, p: Process) -> tuple[str, str]:
    """(host name, address) the process runs on: on Slurm the allocated node's, else the plan's."""
    job = rec.job
    if job is not None and p.node in job.addresses:
        return job.hosts.get(p.node, p.node), job.addresses[p.node]
    return p.node, p.address


def targets(rec: DeploymentRecord) -> list[dict[str, Any]]:
    """The deployment's ``file_sd`` target groups (a JSON list), one per scraped process."""
    standby = set(rec.control.standby) if rec.control else set()
    groups: list[dict[str, Any]] = []
    for p, plan in _running(rec):
        host, address = _address(rec, p)
        if p.role == "router":
            port = flag_value(p.argv, "--prometheus-port")
            job = JOB_ROUTERS
        else:
            port = str(p.http_port) if p.http_port else None
            job = JOB_ENGINES
        if port is None:
            continue
        k = plan.replica_of(p)
        labels = {
            "job": job,
            "deployment": rec.name,
            "inventory": plan.inventory or "",
            "k3launch_id": rec.deployment_id,
            "process": p.id,
            "role": p.role,
            "pool": p.pool or "",
            "copy": f"r{k}" if k is not None else "",
            "standby": "true" if k is not None and f"r{k}" in standby else "false",
            "node": host,
            "rank": "" if p.node_rank is None else str(p.node_rank),
            "dp_rank": "" if p.dp_start_rank is None else str(p.dp_start_rank),
            "revision": revision(plan),
        }
        groups.append({"targets": [f"{address}:{port}"], "labels": {k_: v for k_, v in labels.items() if v != ""}})
    sup = rec.supervisor
    if sup is not None and sup.metrics:  # its controller, while one watches (and after one died: then it is down)
        labels = {"job": JOB_CONTROLLERS, "deployment": rec.name, "inventory": rec.plan.inventory or "", "k3launch_id": rec.deployment_id,
                  "process": "controller", "node": sup.host}
        groups.append({"targets": [sup.metrics], "labels": {k_: v for k_, v in labels.items() if v != ""}})
    return groups


def targets_json(rec: DeploymentRecord) -> str:
    return json.dumps(targets(rec), indent=2) + "\n"


def scrape_config(targets_dir: str, interval_s: int = 15) -> str:
    """The ``scrape_configs`` entries (YAML) that read every deployment's target file in
    ``targets_dir``: the engines and routers are two jobs (the file's ``job`` label picks one:
    a target's own ``job`` label overrides the job name, so one file list serves both)."""
    return (
        "scrape_configs:\n"
        f"  - job_name: k3launch\n"
        f"    scrape_interval: {interval_s}s\n"
        "    file_sd_configs:\n"
        f"      - files: [{json.dumps(targets_dir.rstrip('/') + '/' + TARGETS_GLOB)}]\n"
        "        refresh_interval: 30s\n"
    )
