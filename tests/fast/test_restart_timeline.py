"""A supervisor's restart records its bring-up timeline, phase by phase, as ``up`` does: the watcher
tracks the restarting unit's processes (:class:`k3launch.deploy.progress.Restarts`, reading their
logs only), the ``restarted`` event carries the timeline, ``k3launch timeline NAME --restart``
shows it and ``--restart --compare NAME`` compares it with the ``up``.

The end-to-end case (a killed simulated engine under ``k3launch supervise``) is
test_restart_timeline_e2e.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from inventory_helpers import CliResult, run_cli

from k3launch import api
from k3launch.deploy import eventlog
from k3launch.deploy.control import loop
from k3launch.deploy.logtail import LogCursor
from k3launch.deploy.progress import Restarts
from k3launch.deploy.ssh.observe import _log_reads
from k3launch.deploy.state import StateStore
from k3launch.models.bringups import in_brief, narrow, restarts
from k3launch.models.control.observation import Observation
from k3launch.models.phases import LogDelta, Phase, PhaseSpan, ProcessTimeline, Timeline
from k3launch.models.plan import Plan
from k3launch.models.record import ProcessRecord, SshRecord
from k3launch.models.supervise import Event, RestartPolicy
from k3launch.testing import FakeOps, FakeWatcher

P = Phase


def _proc(pid: str, t0: float, *phases: tuple[Phase, float], role: str = "serve") -> ProcessTimeline:
    spans, t = [], t0
    for ph, s in phases:
        spans.append(PhaseSpan(phase=ph, start=t, end=t + s))
        t += s
    return ProcessTimeline(id=pid, node="n-1", role=role, phases=spans)


def _up_timeline() -> Timeline:
    """A whole deployment's `up`: two engines and a router."""
    a = _proc("serve-0", 100, (P.STARTING, 1), (P.LOADING_WEIGHTS, 20), (P.COMPILING, 30), (P.API_SERVER, 2), (P.HEALTHY, 7))
    b = _proc("serve-1", 100, (P.STARTING, 1), (P.LOADING_WEIGHTS, 40), (P.COMPILING, 30), (P.API_SERVER, 2), (P.HEALTHY, 1))
    r = _proc("router", 100, (P.STARTING, 1), (P.HEALTHY, 73), role="router")
    return Timeline(started=100, ended=174, ready=True, processes=[a, b, r])


def _restart_timeline() -> Timeline:
    """serve-0 restarted warm: the compile mostly cached."""
    a = _proc("serve-0", 1000, (P.STARTING, 1), (P.LOADING_WEIGHTS, 20), (P.COMPILING, 5), (P.API_SERVER, 2), (P.HEALTHY, 0.5))
    return Timeline(started=1000, ended=1028.5, ready=True, processes=[a])


# ---------------------------------------------------------------------- the pure parts
def test_restarts_are_the_events_with_a_timeline_the_last_first() -> None:
    tl = _restart_timeline()
    log = [Event(time=1, kind="restarted", deployment="d", unit="serve-0"),  # an older supervisor's: no timeline
           Event(time=2, kind="restarted", deployment="d", unit="serve-0", timeline=tl),
           Event(time=3, kind="detected", deployment="d", unit="serve-1"),
           Event(time=4, kind="restart-failed", deployment="d", unit="serve-1", timeline=tl.model_copy(update={"ready": False}))]
    got = restarts(log)
    assert [(e.time, e.kind) for e in got] == [(4, "restart-failed"), (2, "restarted")]
    assert restarts(log[:1]) == []


def test_narrow_keeps_the_restarted_processes_and_ends_when_the_last_of_them_was_done() -> None:
    up = _up_timeline()
    cut = narrow(up, {"serve-0"})
    assert [p.id for p in cut.processes] == ["serve-0"]
    assert (cut.started, cut.ended) == (100, 153)  # serve-0 was healthy 53 s in; the whole `up` took 74 s
    failed = up.model_copy(update={"ready": False})
    assert narrow(failed, {"serve-0"}).ended == 174  # a failed bring-up keeps its end: it did not serve
    assert narrow(up, {"nothing"}).processes == []


def test_in_brief_gives_the_slowest_process_s_phase_seconds_in_order() -> None:
    assert in_brief(_restart_timeline()) == "serve-0: starting 1.0s, loading weights 20.0s, compiling / CUDA graphs 5.0s, API server up 2.0s"
    assert in_brief(Timeline(started=0, ended=1, ready=False)) == ""


def test_the_event_keeps_its_timeline_through_the_event_log(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    e = Event(time=5, kind="restarted", deployment="d", unit="serve-0", seconds=30.0, timeline=_restart_timeline())
    eventlog.append(store, e)
    eventlog.append(store, Event(time=6, kind="detected", deployment="d", unit="serve-0"))
    back = eventlog.read(store, "d")
    assert back[0] == e and back[1].timeline is None
    assert "timeline" not in store.events_path("d").read_text().splitlines()[1]  # absent unless there is one


def test_the_tracker_follows_only_the_restarting_unit_from_its_start() -> None:
    plan = api.plan(None, recipe="k3launch/tiny-llama", strategy="multi_node_replicas", name="rt-track")
    r = Restarts()
    r.cursor.offsets["serve-0"] = 5000  # read up to here before the restart: the new log starts at 0
    assert r.reading() == set()
    r.start("serve-0", plan, ("serve-0",), now=10.0)
    assert r.reading() == {"serve-0"} and "serve-0" not in r.cursor.offsets
    logs = {"serve-0": LogDelta("INFO Starting to load model x...\n"), "serve-1": LogDelta("INFO Starting to load model x...\n")}
    r.update(logs, [], now=12.0)
    r.update({"serve-0": LogDelta("INFO Loading weights took 3.00 seconds\n")}, ["serve-0", "serve-1"], now=20.0)
    tl = r.timeline("serve-0", True, now=21.0)
    assert tl is not None and tl.ready and (tl.started, tl.ended) == (10.0, 21.0)
    assert [p.id for p in tl.processes] == ["serve-0"]  # serve-1's log and health are not this restart's
    assert [(s.phase, s.start, s.end) for s in tl.processes[0].phases] == [
        (P.STARTING, 10.0, 12.0), (P.LOADING_WEIGHTS, 12.0, 20.0), (P.HEALTHY, 20.0, 21.0)]
    assert tl.processes[0].weights_took == [3.0]
    assert r.timeline("serve-0", True) is None and r.reading() == set()  # once: the tracking ended
    r.start("serve-1", plan, ("serve-1",))
    r.drop(["serve-1"])  # stopped for good
    assert r.reading() == set()


def test_a_poll_reads_the_logs_of_the_processes_it_is_asked_for_only() -> None:
    prs = [ProcessRecord(id=i, node="n", runtime="bare", handle="1", log=f"/tmp/{i}.log", started=True) for i in ("a", "b")]
    cur = LogCursor()
    assert len(_log_reads(prs, cur, None)) == 2
    only = _log_reads(prs, cur, {"b"})
    assert len(only) == 1 and "/tmp/b.log" in only[0] and "/tmp/a.log" not in only[0]
    assert _log_reads(prs, cur, set()) == []


def _running(store: StateStore, strategy: str, name: str) -> Plan:
    """A ready deployment's record (no process is started: the watcher is a fake)."""
    plan = api.plan(None, recipe="k3launch/tiny-llama", strategy=strategy, name=name)
    store.save(SshRecord(name=plan.name, state="ready", created=time.time(), updated=time.time(), backend="local", endpoint=plan.endpoint,
                         plan=plan, processes={p.id: ProcessRecord(id=p.id, node=p.node, runtime="bare", handle="1", started=True)
                                               for p in plan.processes}))
    return plan


def test_the_supervisor_attaches_the_watcher_s_timeline_to_restarted(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    plan = _running(store, "multi_node_replicas", "rt-loop")
    ok = {"serve-0": True, "serve-1": True, "router": True}
    stop = threading.Event()
    w = FakeWatcher([Observation(0, healthy=ok), Observation(0, dead={"serve-1": "exited with code 137"}, healthy=ok),
                     Observation(0, healthy=ok)], stop=stop)
    w.timelines["serve-1"] = _restart_timeline()
    seen: list[Event] = []
    loop.supervise(plan.name, store, FakeOps(w), RestartPolicy(poll=0.1, backoff=0), on_event=seen.append, stop=stop)
    done = next(e for e in seen if e.kind == "restarted")
    assert done.timeline is not None and done.timeline.ready and done.timeline.processes[0].id == "serve-0"
    assert all(e.timeline is None for e in seen if e.kind != "restarted")
    logged = next(e for e in eventlog.read(store, plan.name) if e.kind == "restarted")
    assert logged.timeline == done.timeline


def test_a_failed_start_attaches_what_it_reached(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    plan = _running(store, "single_node_tp", "rt-fail")
    stop = threading.Event()
    w = FakeWatcher([Observation(0, dead={"serve-0": "exited with code 1"})], stop=stop, start_fails={"serve-0": 5})
    w.timelines["serve-0"] = _restart_timeline()
    seen: list[Event] = []
    loop.supervise(plan.name, store, FakeOps(w), RestartPolicy(poll=0.1, backoff=0, max_restarts=1), on_event=seen.append, stop=stop)
    failed = [e for e in seen if e.kind == "restart-failed"]
    assert failed and failed[0].timeline is not None and failed[0].timeline.ready is False


# ---------------------------------------------------------------------- the command, over a written event log
def _store(tmp: Path, *evs: Event) -> None:
    store = StateStore(tmp / "state")
    plan = api.plan(api.bundled_inventory("local"), name="dep")
    store.save(SshRecord(name="dep", state="ready", created=1.0, updated=1.0, endpoint=plan.endpoint, plan=plan, backend="local",
                         timeline=_up_timeline()))
    for e in evs:
        eventlog.append(store, e)


def _cli(tmp: Path, *args: str) -> CliResult:
    return run_cli([*args, "--state-dir", str(tmp / "state")], tmp / "home", env={"COLUMNS": "200"})


def test_timeline_restart_shows_the_last_restart_and_compares_it_with_the_up(tmp_path: Path) -> None:
    older = _restart_timeline().model_copy(update={"started": 900.0})
    _store(tmp_path, Event(time=950, kind="restarted", deployment="dep", unit="serve-0", attempt=1, timeline=older),
           Event(time=1030, kind="restarted", deployment="dep", unit="serve-0", attempt=2, seconds=31.0, timeline=_restart_timeline()))
    r = _cli(tmp_path, "timeline", "dep", "--restart")
    assert r.code == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[0] == "dep restart of serve-0 (attempt 2): bring-up ready in 28.5s"
    assert "from the failure's detection to serving: 31.0s" in r.stdout
    data = _cli(tmp_path, "timeline", "dep", "--restart", "--json").json()
    assert data["restart"] == {"unit": "serve-0", "kind": "restarted", "attempt": 2, "time": 1030, "detected_to_serving_s": 31.0}
    assert data["started"] == 1000 and [p["id"] for p in data["processes"]] == ["serve-0"]
    cmp = _cli(tmp_path, "timeline", "dep", "--restart", "--compare", "dep", "--json").json()
    assert cmp["name"] == "dep restart of serve-0 (attempt 2)" and cmp["other_deployment"] == "dep"
    assert [p["id"] for p in cmp["processes"]] == ["serve-0"] and cmp["only_other"] == []  # the up's other processes left out
    compiling = next(ph for ph in cmp["processes"][0]["phases"] if ph["phase"] == "compiling")
    assert compiling == {"phase": "compiling", "name_s": 5.0, "other_s": 30.0, "diff_s": -25.0, "ratio": 0.167}
    assert cmp["total"]["name_s"] == 28.5 and cmp["total"]["other_s"] == 53.0
    text = _cli(tmp_path, "timeline", "dep", "--restart", "--compare", "dep")
    assert text.code == 0 and text.stdout.startswith("dep restart of serve-0 (attempt 2): bring-up ready in 28.5s; dep: ready in 53.0s")
    # the saved JSON of a restart compares as any saved bring-up
    (tmp_path / "warm.json").write_text(_cli(tmp_path, "timeline", "dep", "--restart", "--json").stdout)
    back = _cli(tmp_path, "timeline", "dep", "--compare", str(tmp_path / "warm.json"), "--json").json()
    assert back["total"]["other_s"] == 28.5
    ev = _cli(tmp_path, "events", "dep")
    assert "[serve-0: starting 1.0s, loading weights 20.0s, compiling / CUDA graphs 5.0s, API server up 2.0s]" in ev.stdout, ev.stdout


@pytest.mark.parametrize(("evs", "name", "compare", "code"), [
    ((), "dep", None, "no-restart-timeline"),  # no restart yet
    ((Event(time=5, kind="restarted", deployment="dep", unit="serve-0"),), "dep", None, "no-restart-timeline"),  # one without a timeline
    ((), "gone", None, "no-restart-timeline"),
    ((Event(time=5, kind="restarted", deployment="dep", unit="serve-0", timeline=_restart_timeline()),), "dep", "nothing", "unknown-deployment"),
])
def test_timeline_restart_refuses_bad_input_in_one_line_and_exit_2(tmp_path: Path, evs: tuple[Event, ...], name: str, compare: str | None,
                                                                   code: str) -> None:
    _store(tmp_path, *evs)
    args = ["timeline", name, "--restart", *(["--compare", compare] if compare else [])]
    err = _cli(tmp_path, *args, "--json").error()
    assert err["code"] == code and err["hint"], err
    r = _cli(tmp_path, *args)
    assert r.code == 2 and r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), r.stderr
