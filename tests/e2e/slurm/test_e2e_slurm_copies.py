"""Two copies of an engine (``up --replicas 2``) in one Slurm job, end to end on the local Slurm cluster.

One deployment serves every check, so the test stays quick: K3 DEP on 2 nodes, twice, on the
cluster's 4 nodes (the simulated engine, bare; the real vllm-router on node 0 of the allocation).
Each copy's ranks meet at their own head; requests through the router reach both copies (each
copy's engines count them on /metrics); ``status`` shows both copies; ``rollout`` of a job brought
up without ``--supervise`` is refused (no controller runs in it: docs/rollout.md, "On Slurm") and
changes nothing (tests/e2e/slurm/test_e2e_slurm_control.py rolls a supervised one); ``down`` leaves no job, step or process.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from e2e_helpers import processes
from slurmdeploy import ENGINES, argv_of, assert_nothing_left, chat, jobs_named, k3, record, refuses, step_ids, workers, write_inventory

from k3launch.models.record import Status

if TYPE_CHECKING:
    from slurmcluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

REQUESTS = 8


def served(url: str) -> float:
    """Requests an engine's API server finished, from its /metrics (every local DP rank summed)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_two_copies_in_one_job_serve_through_the_router_show_in_status_refuse_a_rollout_and_go_down(
        cluster: Cluster, state: Path, tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, cluster)
    name = f"k3e-copies-{uuid.uuid4().hex[:4]}"
    t0 = time.monotonic()
    up = k3(cluster, state, "up", "-i", str(inv), "--strategy", "multi_node_dep", "--nodes", "2", "--replicas", "2", "--name", name,
            "--ready-timeout", "60")
    up_s = time.monotonic() - t0
    assert up.returncode == 0, up.stdout + up.stderr
    rec = record(state, name)
    job, hosts, addrs, plan = rec["slurm"]["job_id"], rec["slurm"]["hosts"], rec["slurm"]["addresses"], rec["plan"]
    procs = {p["id"]: p for p in plan["processes"]}
    assert plan["replicas"] == 2 and list(procs) == [*ENGINES, "router"]
    assert jobs_named(cluster, name) == {job: "RUNNING"}  # every copy in the one job
    assert sorted(hosts[procs[e]["node"]] for e in ENGINES) == sorted(cluster.nodes)  # each copy on nodes of its own

    # Each copy's ranks meet at their own head, bound to its node's address; the router fronts all four servers.
    head = {k: addrs[procs[f"r{k}-serve-0"]["node"]] for k in (0, 1)}
    assert head[0] != head[1]
    running = argv_of(name)
    assert sorted(running) == ENGINES, running
    for e in ENGINES:
        own = addrs[procs[e]["node"]]
        assert _arg(running[e], "--data-parallel-address") == head[int(e[1])], e
        assert _arg(running[e], "--host") == own, e
    urls = {e: f"http://{addrs[procs[e]['node']]}:{procs[e]['http_port']}" for e in ENGINES}
    assert rec["endpoint"] == f"http://{addrs[procs['router']['node']]}:{procs['router']['http_port']}"
    assert sorted(workers(rec["endpoint"])) == sorted(urls.values())

    # Requests through the router reach both copies.
    before = {e: served(u) for e, u in urls.items()}
    for _ in range(REQUESTS):
        assert chat(rec["endpoint"])["usage"]["completion_tokens"] > 0
    got = {e: served(u) - before[e] for e, u in urls.items()}
    per_copy = [got[f"r{k}-serve-0"] + got[f"r{k}-serve-1"] for k in (0, 1)]
    assert sum(got.values()) == REQUESTS and min(per_copy) >= 1, got

    # status: both copies, serving; the JSON is the published shape
    st = k3(cluster, state, "status", name, "--json")
    assert st.returncode == 0, st.stderr
    snap = json.loads(st.stdout)
    assert Status.model_validate(snap).as_dict() == snap and snap["state"] == "ready" and snap["job"]["id"] == job
    assert snap["replicas"] == [{"replica": k, "state": "serving", "processes": [f"r{k}-serve-0", f"r{k}-serve-1"]} for k in (0, 1)]
    assert {p["id"]: p.get("replica") for p in snap["processes"]} == {**{e: int(e[1]) for e in ENGINES}, "router": None}
    human = k3(cluster, state, "status", name)
    assert "copy r0: serving (2 process(es))" in human.stdout and "copy r1: serving (2 process(es))" in human.stdout, human.stdout
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in human.stdout.splitlines() if ln.startswith("│")}
    assert {e: rows[e] for e in ENGINES} == {e: e[:2] for e in ENGINES} and rows["router"] == "-", human.stdout

    # rollout: planned (a dry run shows one unit per copy), then refused before anything is touched
    dry = k3(cluster, state, "rollout", name, "--set", "max-num-seqs=8", "--dry-run")
    assert dry.returncode == 0 and "units to roll, in order: r0-serve, r1-serve" in dry.stdout, dry.stdout + dry.stderr
    pids, steps = processes(name), step_ids(cluster, job)
    assert sorted(steps) == sorted(procs)
    t1 = time.monotonic()
    ro = k3(cluster, state, "rollout", name, "--set", "max-num-seqs=8")
    refuse_s = time.monotonic() - t1
    assert ro.returncode == 2, ro.stdout + ro.stderr
    lines = ro.stderr.splitlines()
    assert lines[0] == f"error: {name}'s job {job} runs no controller: it fails fast, and nothing in it can roll a copy while the others serve [rollout-needs-controller]" \
        and len(lines) == 2, ro.stderr
    assert "--supervise" in lines[1] and f"k3launch down {name}" in lines[1], ro.stderr
    assert lines[1].startswith("hint: ") and "Traceback" not in ro.stderr
    after = record(state, name)
    assert after["plan"] == plan and after["state"] == "ready" and after["slurm"] == rec["slurm"]
    assert processes(name) == pids and step_ids(cluster, job) == steps and jobs_named(cluster, name) == {job: "RUNNING"}
    assert argv_of(name) == running  # the same processes, on the same command lines
    assert chat(rec["endpoint"])["usage"]["completion_tokens"] > 0  # still serving

    t2 = time.monotonic()
    down = k3(cluster, state, "down", name, "--json")
    down_s = time.monotonic() - t2
    assert down.returncode == 0 and json.loads(down.stdout)["clean"] is True, down.stdout + down.stderr
    assert jobs_named(cluster, name) in ({job: "COMPLETED"}, {}), jobs_named(cluster, name)
    assert not (state / "deployments" / f"{name}.json").exists()
    assert_nothing_left(cluster, name)
    assert refuses(rec["endpoint"])
    print(f"copies on Slurm: up {up_s:.1f}s, rollout refused in {refuse_s:.1f}s, down {down_s:.1f}s")
