"""``k3launch supervise`` against real processes: the simulated engine on this machine (``local``
backend), the real ``vllm-router`` in front of replicas (of ``multi_node_replicas``, and copies of
multi-node TP: ``--replicas``). Failures are caused for real (``kill -9``,
``SIGSTOP``, an engine that crashes after every start) under a bounded client load, and what the
client saw is counted.

Each scenario is one deployment checked for several things; the figures (seconds from the kill to
detected, to restarted; failed requests) are printed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import Cli, Load, events, local_leftovers, try_complete, wait_event
from paths import ROOT

pytestmark = [pytest.mark.e2e]

RECIPE = "k3launch/tiny-llama"
POLL_S = 0.5


@pytest.fixture
def cli(state_cli: Cli) -> Cli:
    return state_cli


def _inventory(tmp_path: Path, env: dict[str, str], restart: dict[str, Any] | None = None) -> Path:
    inv = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": "1", **env}
    if restart is not None:
        inv["restart"] = restart
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def _up(cli: Cli, inv: Path, name: str, port_base: int, *args: str) -> dict[str, Any]:
    r = cli.run("up", "-i", str(inv), "--recipe", RECIPE, "--name", name, "--port-base", str(port_base), *args, "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _pid(cli: Cli, name: str, process: str) -> int:
    return int(cli.record(name)["processes"][process]["handle"])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _gone(cli: Cli, name: str, rec: dict[str, Any], supervisor_pid: int) -> None:
    """`down` left nothing: no process, port, lock, record or supervisor."""
    d = cli.json("down", name, timeout=120)
    assert d["clean"] is True, d
    assert d["supervisor"] and str(supervisor_pid) in d["supervisor"], d
    procs, ports = local_leftovers(rec)
    assert procs == {} and ports == [], (procs, ports)
    assert not _alive(supervisor_pid)
    assert list((cli.state_dir / "supervise").glob("*.lock")) == []
    assert cli.records() == {}


# ------------------------------------------------------------------ replicas behind the real router
def test_replicas_a_killed_and_a_hung_engine_are_restarted_under_load_and_down_stops_the_supervisor(cli: Cli, tmp_path: Path) -> None:
    inv = _inventory(tmp_path, {}, restart={"poll": POLL_S, "unhealthy_after": 3, "backoff": 1})
    name = "sv-replicas"
    out = _up(cli, inv, name, 23400, "--strategy", "multi_node_replicas", "--supervise")
    sv_pid = out["supervisor"]["pid"]
    rec = cli.record(name)
    assert rec["supervisor"]["pid"] == sv_pid and rec["supervisor"]["detached"] is True
    assert rec["supervisor"]["policy"]["unhealthy_after"] == 3  # the inventory's restart: section

    second = cli.run("supervise", name, "--poll", "1")
    assert second.returncode == 2 and f"already watched by the supervisor (pid {sv_pid}" in second.stderr, second.stderr

    with Load(out["endpoint"], rec["plan"]["model"]) as load:
        time.sleep(2)
        before = _pid(cli, name, "serve-1")
        t_kill = time.time()
        os.kill(before, signal.SIGKILL)
        detected = wait_event(cli, name, "detected", "serve-1", after=t_kill - 1)
        restarted = wait_event(cli, name, "restarted", "serve-1", after=t_kill)
        time.sleep(2)
        hung = _pid(cli, name, "serve-0")
        t_stop = time.time()
        os.kill(hung, signal.SIGSTOP)
        stuck = wait_event(cli, name, "detected", "serve-0", after=t_stop)
        back = wait_event(cli, name, "restarted", "serve-0", after=t_stop)
        time.sleep(2)
    assert _pid(cli, name, "serve-1") != before and _pid(cli, name, "serve-0") != hung
    assert not _alive(before) and not _alive(hung)  # the stopped engine was killed, not left behind
    assert "exited with code 137" in detected["reason"] and detected["node"] == "local-2"
    assert "hung" in stuck["reason"]
    detect_s = detected["time"] - t_kill
    assert detect_s <= 2 * POLL_S + 1.0, detect_s  # within two polls (plus a poll's own cost)

    snap = cli.json("status", name)
    assert snap["state"] == "ready" and snap["supervisor"]["pid"] == sv_pid and snap["supervisor"]["restarts"] == 2, snap
    print(f"\n[replicas: kill -9 -> detected {detect_s:.2f}s, serving {restarted['time'] - t_kill:.2f}s; "
          f"SIGSTOP -> detected {stuck['time'] - t_stop:.2f}s, serving {back['time'] - t_stop:.2f}s; "
          f"client: {load.ok} ok, {load.failed} failed]")
    for t, why in load.failures[:5]:
        print(f"  failed {t - t_kill:+.2f}s after the kill: {why}")
    assert load.ok > 50 and load.failed == 0, load.failures[:5]  # the router retried what the dead engine dropped
    tl = cli.json("timeline", name)
    assert [e["kind"] for e in tl["events"]].count("restarted") == 2, tl["events"]
    shown = cli.run("timeline", name).stdout
    assert "since it served" in shown and "restarted" in shown, shown
    _gone(cli, name, rec, sv_pid)
    kinds = [e["kind"] for e in events(cli, name)]  # kept after down
    assert kinds[0] == "watching" and kinds[-1] == "stopped-watching" and kinds.count("restarted") == 2, kinds


# ------------------------------------------------------------------ a coupled group
def test_one_dead_rank_of_multi_node_tp_restarts_the_group_and_ctrl_c_leaves_it_serving(cli: Cli, tmp_path: Path) -> None:
    inv = _inventory(tmp_path, {})
    name = "sv-group"
    out = _up(cli, inv, name, 23420, "--strategy", "multi_node_tp", "--nodes", "2")
    rec = cli.record(name)
    head, rank = _pid(cli, name, "serve-0"), _pid(cli, name, "serve-1")
    sup = cli.start("supervise", name, "--poll", str(POLL_S))
    wait_event(cli, name, "watching")
    t_kill = time.time()
    os.kill(rank, signal.SIGKILL)
    ev = wait_event(cli, name, "restarting", "serve", after=t_kill)
    done = wait_event(cli, name, "restarted", "serve", after=t_kill)
    assert "serve-1" in ev["reason"]
    assert _pid(cli, name, "serve-0") != head and _pid(cli, name, "serve-1") != rank  # every rank, not the dead one only
    assert not _alive(head)
    assert try_complete(out["endpoint"], rec["plan"]["model"]) is None
    os.killpg(sup.pid, signal.SIGINT)  # Ctrl-C: stop watching
    r = Cli.wait(sup, 30)
    assert r.returncode == 0, r.stdout + r.stderr
    snap = cli.json("status", name)
    assert snap["state"] == "ready" and snap["supervisor"] is None and all(p["alive"] for p in snap["processes"]), snap
    print(f"\n[multi-node TP: rank killed -> group serving again in {done['time'] - t_kill:.2f}s]")
    d = cli.json("down", name, timeout=120)
    assert d["clean"] is True and d["supervisor"] is None, d
    assert local_leftovers(rec) == ({}, [])


# ------------------------------------------------------------------ a crash loop
def test_an_engine_that_crashes_after_every_start_is_given_up_with_nothing_left(cli: Cli, tmp_path: Path) -> None:
    inv = _inventory(tmp_path, {"K3LAUNCH_SIM_FAIL": "crash-after-ready", "K3LAUNCH_SIM_FAIL_AFTER_S": "3"})
    name = "sv-loop"
    _up(cli, inv, name, 23440, "--strategy", "single_node_tp")
    rec = cli.record(name)
    r = cli.run("supervise", name, "--poll", str(POLL_S), "--max-restarts", "2", "--backoff", "0.5", "--on-event",
                f"cat >> {tmp_path / 'hook.jsonl'}; echo >> {tmp_path / 'hook.jsonl'}", timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    kinds = [e["kind"] for e in events(cli, name)]
    assert kinds.count("restarting") == 2 and kinds[-3:] == ["gave-up", "failed", "stopped-watching"], kinds
    after = cli.record(name)
    assert after["state"] == "failed" and "supervisor gave up" in after["error"] and "2 restarts within" in after["error"], after["error"]
    kept = cli.state_dir / "logs" / name / "serve-0.log"
    assert "EngineDeadError" in kept.read_text()
    assert local_leftovers(rec) == ({}, [])  # nothing left running
    hooked = [json.loads(ln) for ln in (tmp_path / "hook.jsonl").read_text().splitlines() if ln.strip()]
    assert [e["kind"] for e in hooked] == kinds[: len(hooked)] and "gave-up" in [e["kind"] for e in hooked]
    d = cli.json("down", name, timeout=60)
    assert d["clean"] is True and cli.records() == {}, d


# ------------------------------------------------------------------ down wins over a restart
def test_down_during_a_restart_wins(cli: Cli, tmp_path: Path) -> None:
    """A restart takes as long as a bring-up (here the engines load for 6 s): a `down` meanwhile
    stops the supervisor first, then everything, the restarted engine included."""
    inv = _inventory(tmp_path, {"K3LAUNCH_SIM_LOAD_S": "6"})
    name = "sv-race"
    _up(cli, inv, name, 23460, "--strategy", "multi_node_replicas")
    rec = cli.record(name)
    sv = cli.json("supervise", name, "--detach", "--poll", str(POLL_S))
    sv_pid = sv["supervisor"]["pid"]
    t_kill = time.time()
    os.kill(_pid(cli, name, "serve-0"), signal.SIGKILL)
    wait_event(cli, name, "restarting", "serve-0", after=t_kill)
    _gone(cli, name, rec, sv_pid)
    assert "restarted" not in [e["kind"] for e in events(cli, name) if e["time"] >= t_kill]


def test_a_restarted_engine_that_uses_no_cpu_is_hung_after_stall_after_and_started_again(cli: Cli, tmp_path: Path) -> None:
    """A restarted engine stopped while it loads (SIGSTOP: no CPU time at all, as a process stuck
    in the kernel) is failed after ``--stall-after`` instead of the start timeout (here the plan's
    ready timeout, minutes), SIGKILLed and started again; the next start, whose 6 s load works the
    CPU as a real one does, is not taken for a stall although it is longer than ``--stall-after``."""
    inv = _inventory(tmp_path, {"K3LAUNCH_SIM_LOAD_S": "6"})
    name = "sv-stall"
    _up(cli, inv, name, 23480, "--strategy", "multi_node_replicas")
    rec = cli.record(name)
    sv = cli.json("supervise", name, "--detach", "--poll", str(POLL_S), "--stall-after", "2.5", "--backoff", "0")
    old = _pid(cli, name, "serve-0")
    t_kill = time.time()
    os.kill(old, signal.SIGKILL)
    wait_event(cli, name, "restarting", "serve-0", after=t_kill)
    deadline = time.monotonic() + 60
    new = old
    while new == old or not _alive(new):  # the record has no serve-0 between the stop and the start
        assert time.monotonic() < deadline, "the restarted serve-0 never showed up in the record"
        time.sleep(0.05)
        got = cli.record(name)["processes"].get("serve-0")
        new = int(got["handle"]) if got else old
    os.kill(new, signal.SIGSTOP)
    t_stop = time.time()
    failed = wait_event(cli, name, "restart-failed", "serve-0", after=t_stop, within=30)
    assert failed["reason"].startswith("serve-0 hung: no CPU time used for ") and "state T" in failed["reason"], failed
    back = wait_event(cli, name, "restarted", "serve-0", after=failed["time"], within=60)
    print(f"\n[stall: SIGSTOP while starting -> restart-failed {failed['time'] - t_stop:.1f}s (stall-after 2.5, poll {POLL_S}), "
          f"serving again {back['time'] - t_stop:.1f}s]")
    assert failed["time"] - t_stop < 2.5 + 10  # the stall clock, not the start timeout
    assert not _alive(new)  # the stopped process was killed, not left behind
    kinds = [e["kind"] for e in events(cli, name) if e["time"] >= t_kill]
    assert kinds.count("restart-failed") == 1, kinds  # the second, longer load was not taken for a stall
    _gone(cli, name, rec, sv["supervisor"]["pid"])


def test_two_copies_of_multi_node_tp_serve_behind_one_router_and_restart_one_copy_at_a_time(cli: Cli, tmp_path: Path) -> None:
    inv = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": "1"}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    name = "rep-tp"
    r = cli.run("up", "-i", str(path), "--recipe", RECIPE, "--strategy", "multi_node_tp", "--nodes", "2", "--replicas", "2",
                "--name", name, "--port-base", "23520", "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    rec = cli.record(name)
    procs = {p["id"]: p for p in rec["plan"]["processes"]}
    assert sorted(procs) == ["r0-serve-0", "r0-serve-1", "r1-serve-0", "r1-serve-1", "router"]
    assert len({procs[i]["node"] for i in procs if i != "router"}) == 4
    snap = cli.json("status", name)
    assert snap["state"] == "ready" and all(p["alive"] for p in snap["processes"]), snap
    pids = {i: int(rec["processes"][i]["handle"]) for i in procs}

    sv = cli.json("supervise", name, "--detach", "--poll", "0.5")
    with Load(out["endpoint"], rec["plan"]["model"], workers=2, limit=3000, pause=0.02) as load:
        time.sleep(1.5)
        t_kill = time.time()
        os.kill(pids["r1-serve-1"], signal.SIGKILL)
        restarting = wait_event(cli, name, "restarting", "r1-serve", after=t_kill - 1, within=30)
        back = wait_event(cli, name, "restarted", "r1-serve", after=t_kill, within=60)
        time.sleep(1.5)
    after = {i: int(p["handle"]) for i, p in cli.record(name)["processes"].items()}
    print(f"\n[replicas x2 of TP over 2 nodes: r1-serve-1 killed -> copy r1 restarting {restarting['time'] - t_kill:.1f}s, "
          f"serving {back['time'] - t_kill:.1f}s; client {load.ok} ok, {load.failed} failed]")
    kinds = {(e["kind"], e.get("unit")) for e in events(cli, name) if e["time"] >= t_kill - 1}
    assert not any(unit == "r0-serve" for _, unit in kinds), kinds  # the other copy was never touched ...
    assert after["r0-serve-0"] == pids["r0-serve-0"] and after["r0-serve-1"] == pids["r0-serve-1"] and after["router"] == pids["router"]
    assert after["r1-serve-0"] != pids["r1-serve-0"] and after["r1-serve-1"] != pids["r1-serve-1"]  # ... the killed one restarted whole
    assert load.failed == 0 and load.ok > 50, (load.ok, load.failures[:5])  # the router sent everything to r0 meanwhile

    d = cli.json("down", name, timeout=120)
    assert d["clean"] is True and str(sv["supervisor"]["pid"]) in d["supervisor"], d
    assert local_leftovers(rec) == ({}, [])
