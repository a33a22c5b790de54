"""A restart's timeline end to end: the simulated engine of a local deployment killed under
``k3launch supervise``; its restart records the phases the sim logged (its own port base, 23900,
and state dir). The watcher and the commands: test_restart_timeline.py.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from e2e_helpers import Cli, events, local_leftovers, wait_event
from paths import ROOT

from k3launch.models.phases import Phase

# ---------------------------------------------------------------------- end to end: the simulated engine restarted
LOAD_S = 4.0


def _pid(cli: Cli, name: str, process: str) -> int:
    return int(cli.record(name)["processes"][process]["handle"])


@pytest.mark.e2e
def test_a_killed_engine_s_restart_records_the_phases_the_sim_logged(state_cli: Cli, tmp_path: Path) -> None:
    cli, name = state_cli, "rt-e2e"
    inv = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": str(LOAD_S)}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    r = cli.run("up", "-i", str(path), "--recipe", "k3launch/tiny-llama", "--name", name, "--port-base", "23900", "--strategy",
                "single_node_tp", "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = cli.record(name)
    none = cli.run("timeline", name, "--restart")
    assert none.returncode == 2 and "no recorded restart timeline" in none.stderr and "hint: " in none.stderr, none.stderr
    sup = cli.start("supervise", name, "--poll", "0.5")
    try:
        wait_event(cli, name, "watching")
        old = _pid(cli, name, "serve-0")
        t_kill = time.time()
        os.kill(old, signal.SIGKILL)
        back = wait_event(cli, name, "restarted", "serve-0", after=t_kill, within=90)
    finally:
        os.killpg(sup.pid, signal.SIGINT)
        Cli.wait(sup, 30)
    tl = back.get("timeline")
    assert tl is not None and tl["ready"] is True, back
    assert tl["started"] >= t_kill and tl["ended"] <= back["time"] + 1e-6
    assert [p["id"] for p in tl["processes"]] == ["serve-0"]
    spans = tl["processes"][0]["phases"]
    seen = [s["phase"] for s in spans]
    assert seen[0] == "starting" and seen[-1] == "healthy", seen
    assert {"loading_weights", "compiling", "kv_cache", "api_server"} <= set(seen), seen
    order = [ph.value for ph in Phase]
    ranks = [order.index(p) for p in seen]
    assert ranks == sorted(ranks) or "kv_cache" in seen, seen  # compiling and the KV cache may alternate
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans)), spans
    loading = sum(s["end"] - s["start"] for s in spans if s["phase"] == "loading_weights")
    assert loading >= 0.4 * LOAD_S, spans  # the sim spends most of its load on the weights
    assert tl["processes"][0].get("weights_took"), tl  # vLLM's "Loading weights took", read from the new log

    shown = cli.run("timeline", name, "--restart")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"{name} restart of serve-0 (attempt 1): bring-up ready in"), shown.stdout
    assert "loading weights" in shown.stdout and "healthy" in shown.stdout
    as_json = cli.json("timeline", name, "--restart")
    assert as_json["started"] == tl["started"] and as_json["restart"]["unit"] == "serve-0"
    cmp = cli.json("timeline", name, "--restart", "--compare", name)
    assert [p["id"] for p in cmp["processes"]] == ["serve-0"] and cmp["ready"] and cmp["other_ready"]
    both = {ph["phase"]: ph for ph in cmp["processes"][0]["phases"]}
    assert both["loading_weights"]["name_s"] and both["loading_weights"]["other_s"], both  # in the restart and in the `up`
    ev = cli.run("events", name)
    line = next(ln for ln in ev.stdout.splitlines() if " restarted " in ln)
    assert "loading weights" in line, ev.stdout
    print(f"\n{shown.stdout}\n{line}")
    kinds = [e["kind"] for e in events(cli, name)]
    assert kinds.count("restarted") == 1, kinds
    d = cli.json("down", name, timeout=120)
    assert d["clean"] is True, d
    assert local_leftovers(rec) == ({}, [])
