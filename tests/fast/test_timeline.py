"""The bring-up timeline: per process, each phase's start and end, kept in the deployment's record;
``k3launch timeline NAME`` (table, ``--json``) shows it with the slowest rank and what it waited for.

The end-to-end case (``up`` not on a terminal, recording the timeline) is test_timeline_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from inventory_helpers import run_cli

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
