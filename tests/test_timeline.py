"""The bring-up timeline: per process, each phase's start and end, kept in the deployment's record;
``k3launch timeline NAME`` (table, ``--json``) shows it with the slowest rank and what it waited for.

The end-to-end case runs ``up`` of a simulated deployment with a 25 s load, not on a terminal (as
in CI, nohup or a Slurm job's output), on its own loopback addresses (127.0.80.x) and state dir.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import CLI, local_leftovers
from inventory_helpers import run_cli
from paths import ROOT

from k3launch.deploy.progress import Tracker
from k3launch.deploy.state import StateStore
from k3launch.models.phases import LogDelta, Phase, PhaseSpan, ProcessTimeline, Timeline
from k3launch.models.record import parse_record


def _span(phase: Phase, start: float, end: float) -> PhaseSpan:
    return PhaseSpan(phase=phase, start=start, end=end)


def _timeline() -> Timeline:
    head = ProcessTimeline(
        id="serve-0",
        node="n-1",
        role="serve",
        phases=[
            _span(Phase.STARTING, 100, 101),
            _span(Phase.WAITING_FOR_PEERS, 101, 112),
            _span(Phase.LOADING_WEIGHTS, 112, 150),
            _span(Phase.API_SERVER, 150, 152),
            _span(Phase.HEALTHY, 152, 158),
        ],
    )
    rank = ProcessTimeline(
        id="serve-1",
        node="n-2",
        role="serve",
        phases=[  # a headless rank: done where its last phase began
            _span(Phase.STARTING, 100, 111),
            _span(Phase.WAITING_FOR_PEERS, 111, 112),
            _span(Phase.LOADING_WEIGHTS, 112, 140),
            _span(Phase.COMPILING, 140, 155),
            _span(Phase.KV_CACHE, 155, 158),
        ],
    )
    return Timeline(started=100, ended=158, ready=True, processes=[head, rank])


def test_the_slowest_rank_is_the_last_one_done_and_it_waited_longest_for_its_longest_phase() -> None:
    slow = _timeline().slowest()
    assert slow is not None
    assert (slow.process, slow.node, slow.seconds, slow.waited_for, slow.waited_s) == ("serve-1", "n-2", 55.0, Phase.LOADING_WEIGHTS, 28.0)
    data = _timeline().as_dict()
    assert data["slowest"]["process"] == "serve-1" and data["seconds"] == 58.0  # type: ignore[index]
    first = data["processes"][0]["phases"][1]  # type: ignore[index]
    assert first == {"phase": "waiting_for_peers", "start": 101.0, "end": 112.0, "start_s": 1.0, "end_s": 12.0, "seconds": 11.0}


def test_the_tracker_builds_a_timeline_that_ends_where_the_next_phase_begins() -> None:
    from k3launch import api

    plan = api.plan(api.bundled_inventory("local"), name="tl", strategy="multi_node_tp", nodes=2)
    head, rank = (p.id for p in plan.processes)
    t = Tracker(plan, started=10.0)
    t.update(
        {
            head: LogDelta("world_size=16 rank=0 local_rank=0 distributed_init_method=tcp://a:1 backend=nccl\n"),
            rank: LogDelta("world_size=16 rank=8 local_rank=0 distributed_init_method=tcp://a:1 backend=nccl\n"),
        },
        (),
        "alive",
        11.0,
    )
    t.update({head: LogDelta("Starting to load model m...\n"), rank: LogDelta("Starting to load model m...\n")}, (), "alive", 20.0)
    t.update({head: LogDelta("Starting vLLM server on http://a:8000\n")}, (), "alive", 30.0)
    t.update({}, {head}, "health", 31.0)
    tl = t.timeline(ready=True, now=32.0)
    got = {p.id: [(s.phase, s.start, s.end) for s in p.phases] for p in tl.processes}
    assert got[head] == [
        (Phase.STARTING, 10.0, 11.0),
        (Phase.WAITING_FOR_PEERS, 11.0, 20.0),
        (Phase.LOADING_WEIGHTS, 20.0, 30.0),
        (Phase.API_SERVER, 30.0, 31.0),
        (Phase.HEALTHY, 31.0, 32.0),
    ]
    assert got[rank][-1] == (Phase.LOADING_WEIGHTS, 20.0, 32.0)
    assert (tl.started, tl.ended, tl.ready) == (10.0, 32.0, True)


def _store_with(tmp: Path, timeline: Timeline | None) -> StateStore:
    from k3launch import api
    from k3launch.models.record import SshRecord

    plan = api.plan(api.bundled_inventory("local"), name="dep")
    store = StateStore(tmp / "state")
    store.save(
        SshRecord(
            name="dep", state="ready", created=1.0, updated=1.0, endpoint=plan.endpoint, plan=plan, backend="local", timeline=timeline
        )
    )
    return store


def test_records_keep_the_timeline_and_old_records_without_one_still_load(tmp_path: Path) -> None:
    store = _store_with(tmp_path, _timeline())
    assert store.load("dep").timeline == _timeline()
    data = json.loads(store.path("dep").read_text())
    del data["timeline"]  # a record written before timelines existed
    assert parse_record(json.dumps(data)).timeline is None


def test_timeline_command_prints_json_and_a_table(tmp_path: Path) -> None:
    _store_with(tmp_path, _timeline())
    state = str(tmp_path / "state")
    r = run_cli(["timeline", "dep", "--state-dir", state, "--json"], tmp_path / "home")
    assert r.code == 0, r.stdout + r.stderr
    data = r.json()
    assert data["name"] == "dep" and data["ready"] is True and data["slowest"]["process"] == "serve-1"
    assert [p["id"] for p in data["processes"]] == ["serve-0", "serve-1"]
    t = run_cli(["timeline", "dep", "--state-dir", state], tmp_path / "home", env={"COLUMNS": "200"})
    assert t.code == 0 and "loading weights" in t.stdout and "bring-up ready in 58.0s" in t.stdout
    assert "slowest: serve-1 on n-2, done 55.0s after the start; it waited longest for loading weights (28.0s)" in t.stdout


def test_timeline_of_a_record_without_one_is_refused_with_a_hint(tmp_path: Path) -> None:
    _store_with(tmp_path, None)
    err = run_cli(["timeline", "dep", "--state-dir", str(tmp_path / "state"), "--json"], tmp_path / "home").error()
    assert err["code"] == "no-timeline" and "up" in err["hint"]
    err = run_cli(["timeline", "nope", "--state-dir", str(tmp_path / "state"), "--json"], tmp_path / "home").error()
    assert err["code"] == "unknown-deployment"


# ---------------------------------------------------------------------- end to end (simulated engine)
LOAD_S = 25.0
STAMP = re.compile(r"^\s*(\d+\.\d)s (\S+)")


def _inventory(tmp: Path) -> Path:
    """The bundled local inventory on this test's own loopback addresses, with a 25 s load."""
    inv = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    inv["nodes"] = [{"name": f"tl-{i}", "address": f"127.0.80.{i}"} for i in (1, 2)]
    inv["router"] = {"node": "login", "address": "127.0.80.10"}
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": str(LOAD_S), "K3LAUNCH_SIM_TTFT_MS": "1", "K3LAUNCH_SIM_ITL_MS": "1"}
    path = tmp / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def _cli(state: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(state), "NO_COLOR": "1"}
    env.pop("COLUMNS", None)  # not a terminal: rich would assume 80 columns
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.e2e
def test_up_not_on_a_terminal_shows_progress_and_records_the_timeline(tmp_path: Path) -> None:
    inv, state, name = _inventory(tmp_path), tmp_path / "state", "tl-e2e"
    rec: dict[str, Any] = {}
    t0 = time.monotonic()
    r = _cli(state, "up", "-i", str(inv), "--name", name, "--port-base", "23800", "--strategy", "multi_node_tp", "--nodes", "2")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert time.monotonic() - t0 >= LOAD_S  # the load really took its 25 s
        lines = r.stdout.splitlines()
        stamped = [(float(m.group(1)), m.group(2), ln) for ln in lines if (m := STAMP.match(ln))]
        progress = [(t, ln) for t, kind, ln in stamped if kind == "progress"]
        assert progress, r.stdout
        # during the load: a line at least every 10 s (a phase change or the summary)
        t_alive = next(t for t, kind, _ in stamped if kind == "alive")
        t_ready = next(t for t, kind, _ in stamped if kind == "ready")
        times = [t_alive] + [t for t, _ in progress if t_alive <= t <= t_ready] + [t_ready]
        assert max(b - a for a, b in itertools.pairwise(times)) <= 10.0 + 1.0, progress  # one poll of slack
        text = r.stdout
        # the phases that last (a phase shorter than a poll is in the timeline below, not always on screen)
        for label in ("loading weights", "compiling / CUDA graphs", "healthy"):
            assert label in text, (label, text)
        assert re.search(r"loading weights \d+% \| Loading safetensors checkpoint shards:", text), text
        assert any(len(ln) > 80 for _, ln in progress)  # a line with the last log line is not cut or wrapped at 80 columns

        tl = _cli(state, "timeline", name, "--json")
        assert tl.returncode == 0, tl.stdout + tl.stderr
        data: dict[str, Any] = json.loads(tl.stdout)
        assert data["ready"] is True and data["slowest"] is not None
        procs = {p["id"]: p for p in data["processes"]}
        rec = json.loads((state / "deployments" / f"{name}.json").read_text())
        assert set(procs) == {p["id"] for p in rec["plan"]["processes"]}
        order = [ph.value for ph in Phase]
        for p in procs.values():
            spans = p["phases"]
            assert spans and spans[0]["phase"] == "starting", p
            assert all(s["start"] <= s["end"] for s in spans), p
            assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans)), p
            ranks = [order.index(s["phase"]) for s in spans]
            assert ranks == sorted(ranks) or "kv_cache" in [s["phase"] for s in spans], p  # compiling / KV cache may alternate
        engines = [p for p in procs.values() if p["role"] != "router"]
        for p in engines:
            seen = [s["phase"] for s in p["phases"]]
            assert {"waiting_for_peers", "loading_weights", "compiling", "kv_cache"} <= set(seen), seen
        loads = [s["seconds"] for p in engines for s in p["phases"] if s["phase"] == "loading_weights"]
        assert max(loads) >= 0.5 * LOAD_S  # most of the simulated load is the weights
        assert data["slowest"]["process"] in procs and data["slowest"]["waited_for"] in order

        # bench: requests done of total, elapsed and ETA on stderr, read from the client's own bar
        b = _cli(
            state,
            "bench",
            name,
            "--num-prompts",
            "40",
            "--max-concurrency",
            "2",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--out",
            str(tmp_path / "bench"),
        )
        assert b.returncode == 0, b.stdout + b.stderr
        said = [ln for ln in b.stderr.splitlines() if ln.startswith("bench ")]
        done = re.fullmatch(r"bench (bench-tl-e2e-\S+): 40/40 requests, \d+s elapsed, done", said[-1]) if said else None
        assert done, b.stderr
        assert "40/40 [" in (tmp_path / "bench" / f"{done.group(1)}.log").read_text()  # the client's bar, in its log
    finally:
        down = _cli(state, "down", name)
    assert down.returncode == 0, down.stdout + down.stderr
    if rec:
        assert local_leftovers({"name": name, "plan": rec["plan"]}) == ({}, [])
