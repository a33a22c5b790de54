"""A fault-tolerant DEP plan brought up on the simulated engine: it serves, and every rank answers
its fault-tolerance status (the plans and refusals: test_ft_plan.py).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from inventory_helpers import example, write_yaml


# ------------------------------------------------------------------ end to end, simulated engine
def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:  # bounded: every wait of the test is
        return r.status, r.read()


def _statuses(procs: dict[str, Any], ft: dict[str, Any]) -> list[str]:
    urls = [f"http://{procs[pid]['address']}:{procs[pid]['http_port']}{ft['status']}" for pid in ft["processes"]]
    return [json.loads(_get(u)[1])["engines"][0]["status"] for u in urls]


def _wait_all(procs: dict[str, Any], ft: dict[str, Any], want: str, within: float) -> None:
    deadline = time.monotonic() + within
    while (seen := _statuses(procs, ft)) != [want] * len(ft["processes"]):
        assert time.monotonic() < deadline, f"not all {want} within {within}s: {seen}"
        time.sleep(0.2)


@pytest.mark.e2e
def test_up_of_a_fault_tolerant_dep_plan_serves_and_every_rank_answers_status(tmp_path: Path) -> None:
    """``up`` of K3 DEP over two local "nodes" with the opt-in: 16 rank processes behind the router.
    Then what the plan tells a supervisor is enough to recover a stalled collective: DP rank 3's
    all-to-all stops 20 s after it serves, every rank turns unhealthy, a retry to every rank's
    ``apply`` heals the group, and the router serves again."""
    from e2e_helpers import Cli, cleanup, events, local_leftovers, try_complete, wait_event

    inv = yaml.safe_load(example("local").read_text())
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": "0.5", "K3LAUNCH_SIM_RENDEZVOUS_TIMEOUT_S": "60",
                              "K3LAUNCH_SIM_FAIL": "collective-timeout", "K3LAUNCH_SIM_FAIL_PROCESS": "serve-dp3",
                              "K3LAUNCH_SIM_FAIL_AFTER_S": "20", "K3LAUNCH_SIM_FT_DETECT_S": "0.3", "K3LAUNCH_SIM_FT_RETRY_S": "0.2"}
    path = write_yaml(tmp_path, yaml.safe_dump(inv))
    cli, name = Cli(tmp_path / "state"), "ft-dep"
    try:
        r = cli.run("up", "-i", str(path), "--strategy", "multi_node_dep", "--fault-tolerance", "--name", name,
                    "--port-base", "24400", "--json", timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        out = json.loads(r.stdout)
        rec = cli.record(name)
        plan = rec["plan"]
        (ft,) = plan["fault_tolerance"]
        procs = {p["id"]: p for p in plan["processes"]}
        assert len(ft["processes"]) == 16
        for rank, pid in enumerate(ft["processes"]):
            p = procs[pid]
            code, raw = _get(f"http://{p['address']}:{p['http_port']}{ft['status']}")
            body = json.loads(raw)
            assert code == 200 and body["engines"] == [{"id": rank, "status": "healthy"}], (pid, body)
            assert _get(f"http://{p['address']}:{p['http_port']}/health")[0] == 200
        assert try_complete(out["endpoint"], plan["model"], timeout=30) is None  # served through the router
        # the supervisor drives vLLM's fault tolerance: the stall reaches every rank (/health stays
        # 200), it sends retry to every rank's apply, and the group recovers without a restart
        sv = cli.json("supervise", name, "--detach", "--poll", "0.5")
        handles = {pid: pr["handle"] for pid, pr in rec["processes"].items()}
        seen = wait_event(cli, name, "detected", "serve", within=60)
        assert "unhealthy" in seen["reason"] and "/health stays 200" in seen["reason"], seen
        sent = wait_event(cli, name, "ft-retry", "serve", within=60)
        back = wait_event(cli, name, "recovered", "serve", within=60)
        _wait_all(procs, ft, "healthy", within=30)
        assert try_complete(out["endpoint"], plan["model"], timeout=30) is None
        assert "restarting" not in [e["kind"] for e in events(cli, name)]
        assert {pid: pr["handle"] for pid, pr in cli.record(name)["processes"].items()} == handles  # no process restarted
        print(f"\n[fault tolerance: stall detected -> retry {sent['time'] - seen['time']:.1f}s -> recovered {back['time'] - seen['time']:.1f}s]")
        d = cli.json("down", name, timeout=120)
        assert d["clean"] is True and f"pid {sv['supervisor']['pid']}" in d["supervisor"], d
        assert local_leftovers(rec) == ({}, [])
    finally:
        cleanup(cli, [name])
