"""The one controller with the REAL vLLM (CPU build) behind the real vllm-router: hot standbys
and a rollout that a kill interrupts (the engine tier; tests/e2e/local/test_control_sim.py proves the same
with the simulated engine).

Two sshd test hosts (a core each: ``Hosts.own_cores``), ``up --replicas 1 --standby 1``: one copy
serves in the router, the other serves out of it as the hot standby. One deployment, under a
steady bounded client load through the router (clients pause 0.25 s between requests: this
machine has 2 cores):

1. ``rollout --set max-num-seqs=8``: the copy in the router hands its place to the standby
   (``promoted``) before it leaves, and rolls as the standby;
2. once it has rolled, ``kill -9`` of the other copy, the one in the router: the rolled standby
   takes its place in the look that saw the kill (the router lists it within 2 s of the
   detection), the killed copy restarts as the standby on the plan it had, then rolls;
3. the rollout ends with both copies on the new flag, and no client request failed.

Prints the detection, promotion, restart and per-unit rollout times.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from e2e_helpers import Cli, Load, events, wait_event
from enginepair import UP_TIMEOUT_S, Pair, argv_of, up

if TYPE_CHECKING:
    from enginecpu import VllmCpu

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.ssh]

POLL_S = 0.5


def _listed(endpoint: str) -> list[str]:
    with urllib.request.urlopen(endpoint + "/list_workers", timeout=5) as r:
        return sorted(json.loads(r.read())["urls"])


def _seqs(rec: dict[str, Any]) -> dict[str, str]:
    """Each engine's --max-num-seqs, read from its running process (absent: vLLM's default)."""
    out = {}
    for i, p in rec["processes"].items():
        if i != "router":
            argv = argv_of(int(p["handle"]))
            out[i] = argv[argv.index("--max-num-seqs") + 1] if "--max-num-seqs" in argv else "default"
    return out


def _soon(cli: Cli, name: str, kind: str, unit: str, after: float, within: float) -> dict[str, Any]:
    """The first ``kind`` event of ``unit`` since ``after``, read every 20 ms. A look that gated a
    unit took longer than ``poll``, so the next one follows at once and starts the next unit's
    roll: the kill after ``rolled`` must come before it."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got = next((e for e in events(cli, name) if e["kind"] == kind and e.get("unit") == unit and e["time"] >= after), None)
        if got is not None:
            return got
        time.sleep(0.02)
    raise AssertionError(f"no {kind} event for {unit} within {within:g}s: {events(cli, name)[-5:]}")


def _rss_gb(name: str) -> float:
    """Resident memory of every process of the deployment (engines, their engine cores, the router), GB."""
    from e2e_helpers import processes

    total = 0
    for pid in processes(name):
        try:
            total += int(next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS:")).split()[1])
        except (OSError, StopIteration):
            pass
    return total / 2**20


def test_a_standby_takes_a_killed_copys_place_during_a_rollout_of_real_engines(pair: Pair, vllm_cpu: VllmCpu, tmp_path: Path) -> None:
    name = f"eng-ctl-{pair.suffix}"
    cli = pair.cli
    inv = yaml.safe_load(pair.inv.read_text())
    inv["restart"] = {"poll": POLL_S, "unhealthy_after": 10, "stall_after": 60, "start_timeout": 300}
    pair.inv = tmp_path / "inv-ctl.yaml"
    pair.inv.write_text(yaml.safe_dump(inv))
    t0 = time.monotonic()
    r = up(pair, name, 22500, "--strategy", "single_node_tp", "--replicas", "1", "--standby", "1", json_out=True)
    took_up = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    endpoint = json.loads(r.stdout)["endpoint"]
    rec = cli.record(name)
    urls = {p["id"]: f"http://{p['address']}:{p['http_port']}" for p in rec["plan"]["processes"] if p["role"] != "router"}
    assert sorted(urls) == ["r0-serve-0", "r1-serve-0"], urls
    assert rec["control"]["standby"] == ["r1"] and _listed(endpoint) == [urls["r0-serve-0"]], (rec["control"], _listed(endpoint))
    rss = _rss_gb(name)

    with Load(endpoint, pair.model, workers=2, limit=6000, pause=0.25) as load:
        time.sleep(2)
        t_roll = time.time()
        roll = cli.start("rollout", name, "--set", "max-num-seqs=8", "--drain-timeout", "30", "--start-timeout", "300", "--json")
        first = _soon(cli, name, "rolled", "r0-serve-0", after=t_roll, within=UP_TIMEOUT_S)
        victim = int(cli.record(name)["processes"]["r1-serve-0"]["handle"])
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        seen = []  # (time, what the router lists) until it lists the rolled standby alone
        while time.time() - t_kill < 30 and (not seen or seen[-1][1] != [urls["r0-serve-0"]]):
            seen.append((time.time(), _listed(endpoint)))
            time.sleep(0.05)
        detected = wait_event(cli, name, "detected", "r1-serve-0", after=t_kill - 1, within=30)
        back = wait_event(cli, name, "restarted", "r1-serve-0", after=t_kill, within=UP_TIMEOUT_S)
        done = cli.wait(roll, 2 * UP_TIMEOUT_S, ("rollout",))
        took_roll = time.time() - t_roll
        listed_end = _listed(endpoint)
        time.sleep(2)
    log = [e for e in events(cli, name) if e["time"] >= t_roll - 1]
    for e in log:
        print(f"  event +{e['time'] - t_roll:7.1f}s {e['kind']:<16} {e.get('unit') or ''} {e.get('reason', '')[:140]}")
    out = json.loads(done.stdout)
    promoted = [e for e in log if e["kind"] == "promoted"]
    t_listed = seen[-1][0]
    print(f"\n[real engines, 1 serving + 1 standby (up {took_up:.0f}s, {rss:.1f} GB resident): kill -9 -> detected "
          f"{detected['time'] - t_kill:.2f}s, standby listed by the router {t_listed - detected['time']:.2f}s after the detection; "
          f"killed copy serving again (as the standby) {back['time'] - t_kill:.1f}s; rollout {took_roll:.1f}s "
          f"{[(u['unit'], u['seconds'], u['drained_s']) for u in out['rolled']]}; client {load.ok} ok, {load.failed} failed]")
    for t, why in load.failures[:5]:
        print(f"  failed {t - t_kill:+.1f}s after the kill: {why}")
    assert done.returncode == 0 and out["ok"] and [u["unit"] for u in out["rolled"]] == ["r0-serve-0", "r1-serve-0"], out
    # the copy in the router handed its place to the standby before it rolled; then the kill promoted it back
    assert [e["reason"] for e in promoted[:2]] == [
        "standby r1 joins the router in place of r0, which rolls as the standby",
        "standby r0 joins the router in place of r1, which restarts as the standby"], [e["reason"] for e in promoted]
    assert promoted[0]["time"] < first["time"] < t_kill < promoted[1]["time"], (promoted, first, t_kill)
    assert detected["reason"].startswith("r1-serve-0 exited"), detected  # "with code 137" once its wrapper has written the code
    assert seen[-1][1] == [urls["r0-serve-0"]] and t_listed - detected["time"] < 2.0, seen[-3:]
    assert _seqs(cli.record(name)) == {"r0-serve-0": "8", "r1-serve-0": "8"}
    assert listed_end == [urls["r0-serve-0"]] and cli.record(name)["control"]["standby"] == ["r1"]  # r1 rolled as the standby
    assert load.failed == 0 and load.ok > 100, (load.ok, load.failures[:5])
    snap = cli.json("status", name)
    assert snap["state"] == "ready" and "rollout" not in snap, snap
    d = cli.json("down", name, timeout=180)
    assert d["clean"] is True and d["leftovers"] == {}, d
