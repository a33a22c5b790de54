"""The one controller against real processes: three copies of the simulated engine (``--replicas
3``, ``local`` backend) behind the real vllm-router, under a steady bounded client load. One
deployment serves three scenarios of a rollout that others interfere with:

1. ``kill -9`` of one copy while another is being rolled: the same controller restarts it, and
   the rollout completes on every copy;
2. SIGINT to the ``rollout`` command midway: a detached controller takes over from the saved
   memory and the rollout converges; the router lists every copy at the end;
3. ``kill -9`` of that controller midway, then ``supervise --detach`` again: the new one adopts
   the memory (the restart count is unchanged) and finishes the rollout.

No client request fails in any of them."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import Cli, Load, local_leftovers, up_copies, wait_for_record

pytestmark = [pytest.mark.e2e]


def _seqs(pid: int) -> str | None:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--max-num-seqs") + 1] if "--max-num-seqs" in argv else None


def _rolling(rec: dict[str, Any]) -> bool:
    ro = rec.get("rollout")
    return bool(ro) and any(u["on"] == "rolling" for u in ro["units"])


def _listed(endpoint: str) -> list[str]:
    with urllib.request.urlopen(endpoint + "/list_workers", timeout=5) as r:
        return sorted(json.loads(r.read())["urls"])


def _all_listed(endpoint: str, every: list[str], within: float = 10.0) -> list[str]:
    """What the router lists once it lists every copy (or after ``within`` s): a rolled copy
    rejoins in the look that gated it, the record says the rollout is done in the same look."""
    deadline = time.monotonic() + within
    while (got := _listed(endpoint)) != every and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def _urls(cli: Cli, name: str, by_id: bool = False) -> Any:
    """The engines' URLs as the router lists them (sorted), or (id, URL) pairs."""
    pairs = [(p["id"], f"http://{p['address']}:{p['http_port']}") for p in cli.record(name)["plan"]["processes"] if p["role"] != "router"]
    return pairs if by_id else sorted(u for _, u in pairs)


def _targets(cli: Cli, name: str) -> list[str]:
    """The processes of the deployment's Prometheus target file (docs/monitoring.md)."""
    groups = json.loads((cli.state_dir / "monitoring" / "targets" / f"{name}.json").read_text())
    return sorted(g["labels"]["process"] for g in groups)


def _engines(cli: Cli, name: str) -> dict[str, int]:
    return {i: int(p["handle"]) for i, p in cli.record(name)["processes"].items() if i != "router"}


def test_one_controller_rolls_while_copies_die_commands_are_interrupted_and_controllers_are_killed(
        state_cli: Cli, local_inventory: Path, tmp_path: Path) -> None:
    cli, name = state_cli, "ctl-sim"
    # each start takes a while: there is a "midway"
    endpoint, model = up_copies(cli, local_inventory, tmp_path, name, 23740, 3, {"env": {"K3LAUNCH_SIM_LOAD_S": "2"}})
    every = _listed(endpoint)
    assert len(every) == 3
    with Load(endpoint, model, workers=2, limit=6000, pause=0.02, client="openai") as load:
        # 1. a copy killed while another rolls (no supervisor: the command runs the controller)
        t0 = time.monotonic()
        first = cli.start("rollout", name, "--set", "max-num-seqs=8", "--drain-timeout", "10", "--json")
        wait_for_record(cli, name, lambda rec: _rolling(rec) and rec["rollout"]["units"][0]["on"] == "rolling", 60, first)
        mid = cli.json("status", name)  # never "ready" while a unit rolls
        victim = _engines(cli, name)["r2-serve-0"]
        os.kill(victim, signal.SIGKILL)
        one = cli.wait(first, 240, ("rollout",))
        took_1 = time.monotonic() - t0
        after_1 = cli.record(name)
        restarts_1 = after_1["control"]["restarts"]
        seqs_1 = {i: _seqs(pid) for i, pid in _engines(cli, name).items()}
        listed_1 = _listed(endpoint)
        # a serving copy out of its router (as an interrupted command used to leave one): degraded, and repaired
        out = every[0]
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/remove_worker?url={out}", data=b"", method="POST"), timeout=10).read()
        outside = cli.json("status", name)

        # 2. SIGINT to the command midway: a detached controller goes on from the saved memory
        second = cli.start("rollout", name, "--set", "max-num-seqs=16", "--drain-timeout", "10")
        wait_for_record(cli, name, _rolling, 60, second)
        os.killpg(second.pid, signal.SIGINT)
        two = cli.wait(second, 120, ("rollout",))
        _, done_2 = wait_for_record(cli, name, lambda rec: rec.get("rollout") is None, 240)
        seqs_2 = {i: _seqs(pid) for i, pid in _engines(cli, name).items()}
        listed_2 = _all_listed(endpoint, every)
        sv = done_2["supervisor"]

        # 3. that controller killed midway, then a new one: it adopts the memory and finishes
        third = cli.start("rollout", name, "--set", "max-num-seqs=32", "--drain-timeout", "10", "--json")
        wait_for_record(cli, name, _rolling, 60, third)
        os.kill(sv["pid"], signal.SIGKILL)
        time.sleep(1.0)
        again = cli.json("supervise", name, "--detach")
        three = cli.wait(third, 240, ("rollout",))
        _, done_3 = wait_for_record(cli, name, lambda rec: rec.get("rollout") is None and rec.get("supervisor"), 120)
        seqs_3 = {i: _seqs(pid) for i, pid in _engines(cli, name).items()}
        listed_3 = _all_listed(endpoint, every)
    print(f"\n[controller: rollout with a kill {took_1:.1f}s; restarts {restarts_1}; client {load.ok} ok, {load.failed} failed]")
    ok = json.loads(one.stdout)
    assert one.returncode == 0 and ok["ok"] and sorted(u["unit"] for u in ok["rolled"]) == ["r0-serve-0", "r1-serve-0", "r2-serve-0"], ok
    assert restarts_1 >= 1 and seqs_1 == {"r0-serve-0": "8", "r1-serve-0": "8", "r2-serve-0": "8"}, (restarts_1, seqs_1)
    assert listed_1 == every
    assert mid["state"] == "rolling" and mid["reason"].startswith("rolling: --set max-num-seqs=8"), mid
    assert outside["state"] == "degraded" and "the router does not list it" in outside["reason"], outside
    assert [u["in_router"] for u in outside["units"] if u["name"] != "router"].count(False) == 1, outside["units"]
    assert "goes on under a detached supervisor" in two.stdout + two.stderr, two.stdout + two.stderr
    assert seqs_2 == {"r0-serve-0": "16", "r1-serve-0": "16", "r2-serve-0": "16"} and listed_2 == every, (seqs_2, listed_2)
    assert again["supervisor"]["pid"] != sv["pid"]
    assert three.returncode == 0 and json.loads(three.stdout)["ok"], three.stdout + three.stderr
    assert seqs_3 == {"r0-serve-0": "32", "r1-serve-0": "32", "r2-serve-0": "32"} and listed_3 == every, (seqs_3, listed_3)
    assert done_3["control"]["restarts"] >= restarts_1  # the memory went on: no count started over
    assert load.failed == 0 and load.ok > 50, (load.ok, load.failures[:5])
    end = cli.json("status", name)
    assert end["state"] == "ready" and all(u["in_router"] for u in end["units"] if u["name"] != "router"), end
    rec = cli.record(name)
    d = cli.json("down", name, timeout=120)
    assert d["clean"] is True, d
    assert local_leftovers(rec) == ({}, [])


def test_scale_out_and_in_then_a_standby_takes_a_killed_copys_place(state_cli: Cli, local_inventory: Path, tmp_path: Path) -> None:
    """Two copies, supervised: ``scale --replicas 4`` then ``--replicas 2`` under load (the router
    lists exactly the serving copies, freed nodes hold nothing); then ``--standby 1`` and a
    ``kill -9`` of a serving copy: the standby is in the router in the look that saw the kill."""
    from e2e_helpers import events

    cli, name = state_cli, "ctl-scale"
    endpoint, model = up_copies(cli, local_inventory, tmp_path, name, 23780, 2, {"env": {"K3LAUNCH_SIM_LOAD_S": "1"}})
    cli.json("supervise", name, "--detach", "--poll", "0.5")
    with Load(endpoint, model, workers=2, limit=6000, pause=0.02, client="openai") as load:
        t0 = time.monotonic()
        out = cli.json("scale", name, "--replicas", "4", timeout=180)
        t_out = time.monotonic() - t0
        four = _all_listed(endpoint, _urls(cli, name))
        targets_four = _targets(cli, name)
        leaving = [pid for i, pid in _engines(cli, name).items() if i.startswith(("r2-", "r3-"))]
        t0 = time.monotonic()
        back = cli.json("scale", name, "--replicas", "2", timeout=180)
        t_in = time.monotonic() - t0
        two_rec = cli.record(name)
        targets_two = _targets(cli, name)
        two = _listed(endpoint)
        urls = _urls(cli, name)
        sb = cli.json("scale", name, "--standby", "1", timeout=180)
        listed_sb = _all_listed(endpoint, urls)
        r2 = next(u for i, u in _urls(cli, name, by_id=True) if i == "r2-serve-0")
        victim = _engines(cli, name)["r0-serve-0"]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        _, healed = wait_for_record(cli, name, lambda rec: rec.get("control", {}).get("standby") == ["r0"]
                                    and rec["control"]["units"]["r0-serve-0"]["state"] == "serving", 60)
        after_kill = _listed(endpoint)
    log = [e for e in events(cli, name) if e["time"] >= t_kill]
    detected = next(e for e in log if e["kind"] == "detected" and e.get("unit") == "r0-serve-0")
    added = next(e for e in log if e["kind"] == "rerouted" and f"added {r2}" in e["reason"])
    print(f"\n[scale 2->4 {t_out:.1f}s, 4->2 {t_in:.1f}s; standby promoted {added['time'] - detected['time']:.2f}s after detection "
          f"({detected['time'] - t_kill:.1f}s after the kill); client {load.ok} ok, {load.failed} failed]")
    assert out["copies"] == 4 and back["copies"] == 2 and sb == {"name": name, "copies": 3, "standby": ["r2"], "seconds": sb["seconds"]}, sb
    assert len(four) == 4, four
    assert two == urls and len(two) == 2, two
    assert sorted(two_rec["processes"]) == ["r0-serve-0", "r1-serve-0", "router"]
    # the Prometheus targets follow the copies: exactly the serving processes, and the controller
    assert targets_four == ["controller", "r0-serve-0", "r1-serve-0", "r2-serve-0", "r3-serve-0", "router"], targets_four
    assert targets_two == ["controller", "r0-serve-0", "r1-serve-0", "router"], targets_two
    assert len(leaving) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in leaving)  # the freed nodes hold nothing
    assert listed_sb == urls, listed_sb  # the standby r2 serves, out of the router
    assert added["time"] - detected["time"] < 2.0, (detected, added)
    assert after_kill == sorted([urls[1], r2]), after_kill  # r0 came back as the standby
    assert healed["control"]["restarts"] >= 1
    assert load.failed == 0 and load.ok > 50, (load.ok, load.failures[:5])
    rec = cli.record(name)
    d = cli.json("down", name, timeout=120)
    assert d["clean"] is True, d
    assert local_leftovers(rec) == ({}, [])


def test_up_with_a_standby_serves_it_out_of_the_router(state_cli: Cli, local_inventory: Path) -> None:
    """``up --replicas 1 --standby 1``: two copies, the second kept out of the router by the
    supervisor ``up`` starts; status says so, and is ready."""
    cli, name = state_cli, "ctl-standby"
    r = cli.run("up", "-i", str(local_inventory), "--recipe", "k3launch/tiny-llama", "--strategy", "single_node_tp", "--replicas", "1",
                "--standby", "1", "--name", name, "--port-base", "23820", "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    endpoint = json.loads(r.stdout)["endpoint"]
    urls = dict(_urls(cli, name, by_id=True))
    snap = cli.json("status", name)
    listed = _listed(endpoint)
    rec = cli.record(name)
    d = cli.json("down", name, timeout=120)
    assert sorted(urls) == ["r0-serve-0", "r1-serve-0"] and listed == [urls["r0-serve-0"]], (urls, listed)
    assert snap["state"] == "ready" and snap["supervisor"], snap
    assert [(u["name"], u["standby"], u["in_router"]) for u in snap["units"] if u["name"] != "router"] == [
        ("r0-serve-0", False, True), ("r1-serve-0", True, False)], snap["units"]
    assert d["clean"] is True and local_leftovers(rec) == ({}, [])
