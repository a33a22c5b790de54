"""``k3launch rollout`` against real processes: two copies of a simulated engine (``--replicas 2``,
``local`` backend) behind the real vllm-router, supervised, under a steady bounded client load.
One deployment serves every assertion: bad input changes nothing; a flag change rolls both copies
one at a time with no failed request; a value the engine refuses at start rolls the first copy
back and stops, the other copy untouched, again with no failed request."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import Cli, Load, local_leftovers, try_complete, up_copies

pytestmark = [pytest.mark.e2e]


FAIL = "K3LAUNCH_SIM_FAIL=exit-during-load"  # the simulated engine dies while it loads: a copy that does not start
DIED = "Engine core initialization failed"  # vLLM's own last line for it, which the rollout's reason quotes


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _running(cli: Cli, name: str) -> dict[str, list[str]]:
    """Each engine's argv as the running process has it."""
    return {i: _cmdline(int(p["handle"])) for i, p in cli.record(name)["processes"].items() if i != "router"}


def _environ(pid: int) -> dict[str, str]:
    pairs = (kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv)
    return {k: v for k, v in pairs}


def _seqs(argv: list[str]) -> str | None:
    return argv[argv.index("--max-num-seqs") + 1] if "--max-num-seqs" in argv else None


def test_rollout_of_two_copies_behind_the_router(state_cli: Cli, local_inventory: Path, tmp_path: Path) -> None:
    cli, name = state_cli, "ro-sim"
    endpoint, _ = up_copies(cli, local_inventory, tmp_path, name, 23540, 2, {"env": {"K3LAUNCH_SIM_LOAD_S": "1"}})
    rec = cli.record(name)
    before = json.dumps([rec["plan"], rec["processes"]], sort_keys=True)
    hook = tmp_path / "hook.jsonl"
    cli.json("supervise", name, "--detach", "--poll", "0.5", "--on-event", f"cat >> {hook}; echo >> {hook}")
    sv0 = cli.record(name)["supervisor"]["pid"]

    # bad input: one line, exit 2, nothing changed
    for args, words in ((["--set", "max-num-seqz=8"], "not a flag of vllm serve"), (["--set", "max-num-seqs=many"], "not a valid int"),
                        (["--set", "max-num-seqs=0"], "(from --set max-num-seqs=0, advanced layer): vLLM 0.33.0 refuses it: "
                                                      "Input should be greater than or equal to 1"),  # vLLM's own bound, at planning
                        (["--unset", "max-num-seqs"], "was not planned with --set"), ([], "nothing to roll out"),
                        (["--set", "max-num-seqs=8", "--name-typo"], "no such option"),
                        (["--set", "max-num-seqs=8", "--max-unavailable", "2"], "stops serving"),
                        (["--env", "HF_TOKEN=hf_abc"], "looks like a secret"), (["--image", "bad image;x"], "not a container image"),
                        (["--continue"], "has no stopped rollout"), (["--continue", "--set", "max-num-seqs=8"], "take no change")):
        bad = cli.run("rollout", name, *args)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, (args, bad.stderr)
    assert cli.run("rollout", "nope", "--set", "max-num-seqs=8").returncode == 2
    after_bad = cli.record(name)
    assert json.dumps([after_bad["plan"], after_bad["processes"]], sort_keys=True) == before  # same plan, same processes
    preview = cli.json("rollout", name, "--set", "max-num-seqs=8", "--dry-run")
    assert preview["units"] == ["r0-serve-0", "r1-serve-0"] and preview["processes"] == [
        {"process": "r0-serve-0", "changes": ["+ --max-num-seqs 8"]}, {"process": "r1-serve-0", "changes": ["+ --max-num-seqs 8"]}]
    assert all(_seqs(a) is None for a in _running(cli, name).values())  # a dry run touches nothing

    with Load(endpoint, rec["plan"]["model"], workers=2, limit=4000, pause=0.02, client="openai") as load:
        t_roll = time.time()
        first = cli.start("rollout", name, "--set", "max-num-seqs=8", "--drain-timeout", "10", "--json")
        spec = cli.state_dir / "supervise" / f"{name}.spec.json"
        deadline = time.monotonic() + 30
        while not (spec.exists() and "max-num-seqs=8" in spec.read_text()) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        second = cli.run("rollout", name, "--set", "max-num-seqs=16")  # while the first one rolls
        ok = json.loads(cli.wait(first, 180, ("rollout",)).stdout)
        # an engine that fails to start (values vLLM refuses never get this far: planning refuses them above)
        refused = cli.run("rollout", name, "--env", FAIL, "--drain-timeout", "10", "--start-timeout", "30", "--json", timeout=180)
        stopped = cli.json("status", name)["rollout"]  # the record holds the stopped rollout until it is finished or undone
        shown = cli.run("status", name).stdout
        busy = cli.run("rollout", name, "--set", "max-num-seqs=16")
        undone = cli.run("rollout", name, "--rollback", "--json", timeout=60)  # nothing rolled: it only drops the rollout
        # an env change the second copy fails to start with: r0 rolls, r1 is rolled back, and the rollout stops between
        fail_env = ["--env", "K3LAUNCH_SIM_FAIL=exit-during-load", "--env", "K3LAUNCH_SIM_FAIL_PROCESS=r1-serve-0"]
        half = cli.run("rollout", name, *fail_env, "--drain-timeout", "10", "--start-timeout", "30", "--json", timeout=180)
        half_rec = cli.record(name)
        half_env = {i: _environ(int(p["handle"])) for i, p in half_rec["processes"].items() if i != "router"}
        again = cli.run("rollout", name, "--continue", "--drain-timeout", "10", "--start-timeout", "30", "--json", timeout=180)
        back = cli.run("rollout", name, "--rollback", "--drain-timeout", "10", "--json", timeout=180)
        # other weights under the same name: health and a completion pass, the canary does not
        wrong = cli.run("rollout", name, "--env", "K3LAUNCH_SIM_FAIL=other-weights", "--drain-timeout", "10", "--json", timeout=180)
        unwrong = cli.run("rollout", name, "--rollback", "--json", timeout=60)
    print(f"\n[rollout of 2 copies: {[(u['unit'], u['seconds']) for u in ok['rolled']]}; failed start: exit {refused.returncode}; "
          f"client {load.ok} ok, {load.failed} failed]")
    assert second.returncode == 2 and "under way" in second.stderr and "Traceback" not in second.stderr, second.stderr
    assert ok["ok"] is True and [u["unit"] for u in ok["rolled"]] == ["r0-serve-0", "r1-serve-0"], ok
    bad_roll: dict[str, Any] = json.loads(refused.stdout)
    assert refused.returncode == 1 and bad_roll["failed"] == "r0-serve-0" and DIED in bad_roll["reason"], bad_roll
    assert bad_roll["logs"] and all(Path(p).is_file() for p in bad_roll["logs"])
    assert {i: _seqs(a) for i, a in _running(cli, name).items()} == {"r0-serve-0": "8", "r1-serve-0": "8"}  # rolled back / untouched
    assert stopped["units"][0]["name"] == "r0-serve-0" and DIED in stopped["units"][0]["failed"], stopped
    assert [u["on"] for u in stopped["units"]] == ["old", "old"] and "r0-serve-0 failed its gate" in stopped["stopped"], stopped
    assert stopped["changes"] == [f"--env {FAIL}"], stopped
    assert f"rollout (--env {FAIL}) stopped: r0-serve-0 failed its gate" in shown and "r1-serve-0 on the old plan" in shown, shown
    assert f"k3launch rollout {name} --continue" in shown, shown
    assert busy.returncode == 2 and "--continue" in busy.stderr and "Traceback" not in busy.stderr, busy.stderr
    assert undone.returncode == 0 and json.loads(undone.stdout)["ok"] is True, undone.stdout + undone.stderr
    assert json.loads(half.stdout)["failed"] == "r1-serve-0" and half.returncode == 1, half.stdout
    ro = half_rec["rollout"]
    assert [(u["name"], u["on"]) for u in ro["units"]] == [("r0-serve-0", "new"), ("r1-serve-0", "old")] and ro["stopped"], ro
    assert {p["id"]: p["env"].get("K3LAUNCH_SIM_FAIL") for p in ro["new"]["processes"] if p["role"] != "router"} == {
        "r0-serve-0": "exit-during-load", "r1-serve-0": "exit-during-load"}  # both plans, whole
    assert not any("K3LAUNCH_SIM_FAIL" in p["env"] for p in ro["old"]["processes"])
    assert half_env["r0-serve-0"].get("K3LAUNCH_SIM_FAIL") == "exit-during-load" and "K3LAUNCH_SIM_FAIL" not in half_env["r1-serve-0"]
    assert again.returncode == 1 and json.loads(again.stdout)["failed"] == "r1-serve-0", again.stdout  # --continue tried r1 again
    assert back.returncode == 0 and [u["unit"] for u in json.loads(back.stdout)["rolled"]] == ["r0-serve-0"], back.stdout
    caught = json.loads(wrong.stdout)
    print(f"[canary gate: {caught['reason'][:300]}]")
    assert wrong.returncode == 1 and caught["failed"] == "r0-serve-0" and "canary:" in caught["reason"], caught
    assert "expected" in caught["reason"] and "got" in caught["reason"], caught  # prompt, expected, got
    assert unwrong.returncode == 0, unwrong.stdout + unwrong.stderr
    listed = cli.run("events", name, "--json").stdout.splitlines()
    mismatch = [e for e in map(json.loads, listed) if e["kind"] == "canary-mismatch"]
    assert mismatch and mismatch[0]["reason"].startswith("rollout gate: r0-serve-0") and "expected" in mismatch[0]["reason"], mismatch
    assert load.failed == 0 and load.ok > 50, (load.ok, load.failures[:5])
    assert cli.run("canary", name).returncode == 0  # every engine answers as recorded at up
    assert "rollout" not in cli.json("status", name) and cli.record(name).get("rollout") is None  # undone: one plan again
    assert not any("K3LAUNCH_SIM_FAIL" in _environ(int(p["handle"])) for i, p in cli.record(name)["processes"].items() if i != "router")
    assert cli.run("rollout", name, "--continue").returncode == 2  # nothing to continue
    snap = cli.json("status", name)
    assert snap["state"] == "ready" and all(p["alive"] and p["healthy"] for p in snap["processes"]), snap
    assert snap["supervisor"] and snap["supervisor"]["pid"] == sv0  # one controller did every rollout: never paused
    assert "max-num-seqs=8" in cli.record(name)["plan"]["origin"]["selection"]["sets"]  # the next rollout starts from here
    # the controller that was started with --on-event did the rollouts: its hook got their events, and it never restarted
    hooked = [e for e in map(json.loads, filter(None, hook.read_text().splitlines())) if e["time"] > t_roll]
    assert not [e for e in hooked if e["kind"] == "watching"] and [e for e in hooked if e["kind"] == "rolled"], hook.read_text()

    d = cli.json("down", name, timeout=120)
    assert d["clean"] is True, d
    assert list((cli.state_dir / "supervise").glob(f"{name}.spec.json")) == []  # nothing of its spec is kept
    assert local_leftovers(rec) == ({}, [])


def test_one_engine_rolls_only_with_allow_downtime_and_reports_it(state_cli: Cli, local_inventory: Path) -> None:
    cli = state_cli
    name = "ro-one"
    r = cli.run("up", "-i", str(local_inventory), "--recipe", "k3launch/tiny-llama", "--strategy", "single_node_tp",
                "--name", name, "--port-base", "23580", "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    refused = cli.run("rollout", name, "--set", "max-num-seqs=8")
    assert refused.returncode == 2 and "--allow-downtime" in refused.stderr and "stops serving" in refused.stderr, refused.stderr
    no_router = cli.run("rollout", name, "--set", "max-num-seqs=8", "--surge")
    assert no_router.returncode == 2 and "has no router" in no_router.stderr, no_router.stderr
    done = cli.json("rollout", name, "--set", "max-num-seqs=8", "--allow-downtime", timeout=120)
    rolled = done["rolled"]
    assert done["ok"] and [u["unit"] for u in rolled] == ["serve-0"] and rolled[0]["downtime_s"] > 0, done
    assert rolled[0]["drained_s"] == 0  # nothing to drain behind: no router
    assert _seqs(_running(cli, name)["serve-0"]) == "8"
    print(f"\n[one engine, --allow-downtime: not serving for {rolled[0]['downtime_s']:.1f}s]")
    assert cli.json("down", name, timeout=60)["clean"] is True


def test_surge_rolls_a_one_unit_dep_onto_spare_nodes_without_a_failed_request(state_cli: Cli, local_inventory: Path,
                                                                                tmp_path: Path) -> None:
    """K3 DEP over two nodes is one recovery unit behind the router: nothing to route around it.
    ``--surge`` starts the new set on the two spare nodes, gates it, switches the router and stops
    the old set; a new set that fails its gate is stopped and the old one never stopped serving."""
    cli = state_cli
    inv = yaml.safe_load(local_inventory.read_text())
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": "1"}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    name = "ro-surge"
    r = cli.run("up", "-i", str(path), "--strategy", "multi_node_dep", "--nodes", "2", "--name", name, "--port-base", "23620",
                "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    endpoint, model = json.loads(r.stdout)["endpoint"], cli.record(name)["plan"]["model"]
    before = cli.record(name)
    old_nodes = sorted({p["node"] for p in before["plan"]["processes"] if p["role"] != "router"})
    refused = cli.run("rollout", name, "--set", "max-num-seqs=8")
    assert refused.returncode == 2 and "--surge" in refused.stderr and "stops serving" in refused.stderr, refused.stderr
    preview = cli.json("rollout", name, "--set", "max-num-seqs=8", "--surge", "--dry-run")
    assert preview["units"] == ["serve-g1"], preview
    with Load(endpoint, model, workers=2, limit=3000, pause=0.02, client="openai") as load:
        bad = cli.run("rollout", name, "--surge", "--env", "K3LAUNCH_SIM_FAIL=exit-during-load", "--start-timeout", "30", "--json",
                      timeout=120)
        kept = cli.record(name)
        done = cli.run("rollout", name, "--surge", "--set", "max-num-seqs=8", "--drain-timeout", "10", "--json", timeout=120)
    print(f"\n[surge of a 2-node DEP: {json.loads(done.stdout).get('rolled')}; failed new set: exit {bad.returncode}; "
          f"client {load.ok} ok, {load.failed} failed]")
    failed = json.loads(bad.stdout)
    assert bad.returncode == 1 and failed["failed"] == "serve-g1" and "not touched" in failed["reason"], failed
    assert kept["processes"] == before["processes"] and kept.get("rollout") is None  # the old set as it was, nothing to continue
    ok = json.loads(done.stdout)
    assert done.returncode == 0 and ok["ok"] and [u["unit"] for u in ok["rolled"]] == ["serve-g1"], ok
    after = cli.record(name)
    engines = {i: p for i, p in after["processes"].items() if i != "router"}
    assert sorted(engines) == ["serve-0-g1", "serve-1-g1"] and after["processes"]["router"] == before["processes"]["router"]
    assert not {p["node"] for p in engines.values()} & set(old_nodes)  # on the spares
    assert all(_seqs(_cmdline(int(p["handle"]))) == "8" for p in engines.values())
    assert not any(Path(f"/proc/{p['handle']}").exists() for i, p in before["processes"].items() if i != "router")  # old set stopped
    assert load.failed == 0 and load.ok > 50, (load.ok, load.failures[:5])
    snap = cli.json("status", name)
    assert snap["state"] == "ready" and all(p["alive"] and p["healthy"] for p in snap["processes"]) and "rollout" not in snap, snap
    rec = cli.record(name)
    d = cli.json("down", name, timeout=120)
    assert d["clean"] is True, d
    assert local_leftovers(rec) == ({}, [])


def test_pd_rolls_in_place_only_with_allow_downtime_and_the_router_keeps_every_instance(state_cli: Cli, local_inventory: Path,
                                                                                        tmp_path: Path) -> None:
    """vllm-router's P/D mode cannot add an instance back over HTTP: a P/D rollout is refused
    unless --allow-downtime, then restarts each instance in place (never removed from the router's
    lists), and the router still pairs with every instance afterwards; the failed requests (those
    paired with an instance while it restarted) are counted, not hidden."""
    cli = state_cli
    inv = yaml.safe_load(local_inventory.read_text())
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": "0.5"}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    name = "ro-pd"
    r = cli.run("up", "-i", str(path), "--strategy", "pd_cluster", "--decode-strategy", "tp", "--decode-nodes", "1", "--name", name,
                "--port-base", "23660", "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    endpoint, model = json.loads(r.stdout)["endpoint"], cli.record(name)["plan"]["model"]
    refused = cli.run("rollout", name, "--set", "max-num-seqs=8")
    assert refused.returncode == 2 and "P/D" in refused.stderr and "--allow-downtime" in refused.stderr, refused.stderr
    surge = cli.run("rollout", name, "--set", "max-num-seqs=8", "--surge")
    assert surge.returncode == 2 and "cannot add instances" in surge.stderr, surge.stderr
    with Load(endpoint, model, workers=2, limit=3000, pause=0.02, client="openai") as load:
        done = cli.json("rollout", name, "--set", "max-num-seqs=8", "--allow-downtime", "--drain-timeout", "5", timeout=180)
        time.sleep(2)
    print(f"\n[P/D rollout in place: {[(u['unit'], u['seconds']) for u in done['rolled']]}; client {load.ok} ok, {load.failed} failed]")
    assert done["ok"] and sorted(u["unit"] for u in done["rolled"]) == ["decode-0", "prefill-0"], done["reason"]
    assert all(_seqs(a) == "8" for a in _running(cli, name).values())
    with urllib.request.urlopen(endpoint + "/workers", timeout=10) as resp:
        stats = json.loads(resp.read())["stats"]
    assert stats["prefill_count"] == 1 and stats["decode_count"] == 1, stats  # both still in the router's lists
    assert cli.run("canary", name).returncode == 0  # and the pairing answers as recorded at up
    # one prefill and one decode: each restart is an outage of the whole P/D path (what --allow-downtime
    # accepts), and the router serves every request again once the rollout is done
    assert load.ok > 20 and [try_complete(endpoint, model) for _ in range(5)] == [None] * 5, (load.ok, load.failures[:3])
    rec = cli.record(name)
    assert cli.json("down", name, timeout=120)["clean"] is True
    assert local_leftovers(rec) == ({}, [])
