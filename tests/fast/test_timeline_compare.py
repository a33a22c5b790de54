"""Two bring-ups side by side: ``k3launch timeline NAME --compare OTHER`` (OTHER: another deployment
of the state directory, or a file ``timeline NAME --json`` wrote), and the pure comparison under it
(:mod:`k3launch.models.bringups`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from inventory_helpers import CliResult, run_cli

from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.bringups import compare, phase_seconds, read_saved
from k3launch.models.phases import Phase, PhaseSpan, ProcessTimeline, Timeline


def _proc(pid: str, node: str, role: str, t0: float, *phases: tuple[Phase, float]) -> ProcessTimeline:
    """A process whose phases follow each other from ``t0``, each lasting the seconds given."""
    spans, t = [], t0
    for ph, s in phases:
        spans.append(PhaseSpan(phase=ph, start=t, end=t + s))
        t += s
    return ProcessTimeline(id=pid, node=node, role=role, phases=spans)


P = Phase


def _cold() -> Timeline:
    """A first bring-up: a long compile (twice, around the KV cache), a router, and a rank only it had."""
    head = _proc("serve-0", "n-1", "serve", 100, (P.STARTING, 1), (P.WAITING_FOR_PEERS, 4), (P.LOADING_WEIGHTS, 20),
                 (P.COMPILING, 30), (P.KV_CACHE, 2), (P.COMPILING, 10), (P.API_SERVER, 3), (P.HEALTHY, 2))
    rank = _proc("serve-2", "n-3", "serve", 100, (P.STARTING, 2), (P.WAITING_FOR_PEERS, 3), (P.LOADING_WEIGHTS, 20))
    router = _proc("router", "login", "router", 100, (P.STARTING, 1), (P.HEALTHY, 71))
    return Timeline(started=100, ended=172, ready=True, processes=[rank, router, head])


def _warm() -> Timeline:
    """The restart: the compile mostly cached, no wait for peers, a rank on another node, one the cold one lacked."""
    head = _proc("serve-0", "n-1", "serve", 500, (P.STARTING, 1), (P.LOADING_WEIGHTS, 20), (P.COMPILING, 8),
                 (P.KV_CACHE, 2), (P.COMPILING, 2), (P.API_SERVER, 3), (P.HEALTHY, 1))
    router = _proc("router", "login-2", "router", 500, (P.STARTING, 2), (P.HEALTHY, 35))
    extra = _proc("serve-1", "n-2", "serve", 500, (P.STARTING, 1), (P.LOADING_WEIGHTS, 25))
    return Timeline(started=500, ended=537, ready=True, processes=[head, extra, router])


# ---------------------------------------------------------------------- the pure comparison
def test_a_phase_entered_twice_counts_its_spans_together() -> None:
    head = next(p for p in _cold().processes if p.id == "serve-0")
    assert phase_seconds(head)[P.COMPILING] == 40.0 and phase_seconds(head)[P.KV_CACHE] == 2.0


def test_processes_match_by_id_phases_come_in_phase_order_with_difference_and_ratio() -> None:
    c = compare(_warm(), _cold(), "warm", "cold.json")
    assert [p.id for p in c.processes] == ["serve-0", "router"]  # NAME's order; matched by id, not by position
    head = c.processes[0]
    got = {ph.phase: (ph.delta.name_s, ph.delta.other_s, ph.delta.diff_s, ph.delta.ratio) for ph in head.phases}
    assert [ph.phase for ph in head.phases] == [P.STARTING, P.WAITING_FOR_PEERS, P.LOADING_WEIGHTS, P.COMPILING, P.KV_CACHE, P.API_SERVER]
    assert got[P.COMPILING] == (10.0, 40.0, -30.0, 0.25)  # 8 + 2 against 30 + 10
    assert got[P.LOADING_WEIGHTS] == (20.0, 20.0, 0.0, 1.0)
    assert got[P.WAITING_FOR_PEERS] == (None, 4.0, None, None)  # a phase one side never entered: no difference invented
    assert (head.done.name_s, head.done.other_s, head.done.diff_s) == (36.0, 70.0, -34.0)
    router = c.processes[1]
    assert (router.node, router.other_node, router.role) == ("login-2", "login", "router")
    assert [ph.phase for ph in router.phases] == [P.STARTING]  # healthy is the `done` row, not a phase that costs time
    assert (router.done.name_s, router.done.other_s) == (2.0, 1.0)
    assert [(a.id, a.done_s) for a in c.only_name] == [("serve-1", 1.0)]  # a rank without HTTP: done where its last phase began
    assert [(a.id, a.node) for a in c.only_other] == [("serve-2", "n-3")]
    assert (c.total.name_s, c.total.other_s, c.total.diff_s) == (37.0, 72.0, -35.0)
    assert c.total.ratio == pytest.approx(37 / 72)


def test_the_comparison_as_json_rounds_and_says_what_is_missing() -> None:
    failed = _cold().model_copy(update={"ready": False})
    data: dict[str, Any] = compare(_warm(), failed, "warm", "cold.json", "k3-demo").as_dict()
    assert (data["name"], data["other"], data["other_deployment"], data["ready"], data["other_ready"]) == (
        "warm", "cold.json", "k3-demo", True, False)
    assert data["total"] == {"name_s": 37.0, "other_s": 72.0, "diff_s": -35.0, "ratio": 0.514}
    head = data["processes"][0]
    assert head["phases"][1] == {"phase": "waiting_for_peers", "name_s": None, "other_s": 4.0, "diff_s": None, "ratio": None}
    assert [a["id"] for a in data["only_name"]] == ["serve-1"] and [a["id"] for a in data["only_other"]] == ["serve-2"]
    json.dumps(data)  # all of it serialisable


def test_a_bring_up_against_itself_differs_by_nothing() -> None:
    c = compare(_cold(), _cold())
    assert not c.only_name and not c.only_other and c.total.diff_s == 0.0
    assert all(ph.delta.diff_s == 0.0 and ph.delta.ratio == 1.0 for p in c.processes for ph in p.phases)


def test_a_difference_too_small_to_show_is_plus_zero_not_minus_zero() -> None:
    from k3launch.cli.show_progress import _diff
    from k3launch.models.bringups import Delta

    assert _diff(Delta(1.0, 1.002)) == ("+0.0", "1.00")
    assert _diff(Delta(16.0, 35.5)) == ("-19.5", "0.45") and _diff(Delta(None, 3.0)) == ("", "")


# ---------------------------------------------------------------------- a saved bring-up read back
def test_what_timeline_json_printed_reads_back_as_the_same_timeline() -> None:
    printed = {"name": "k3-demo", **_cold().as_dict(), "weights_load": {"predicted_total_s": 1.0}, "events": []}
    saved = read_saved(json.dumps(printed), "cold.json")
    assert saved.timeline == _cold() and saved.deployment == "k3-demo"
    bare = read_saved(_cold().model_dump_json(), "t.json")  # the model's own dump too
    assert bare.timeline == _cold() and bare.deployment is None


@pytest.mark.parametrize(
    ("text", "code", "said"),
    [
        ("", "not-a-timeline", "x.json is not JSON"),
        ("{\"started\": 1,", "not-a-timeline", "is not JSON"),
        ("[1, 2]", "not-a-timeline", "not a bring-up timeline (a list)"),
        ('{"name": "dep", "state": "ready"}', "not-a-timeline", "no started, ended, ready, processes"),
        ('{"error": {"code": "unknown-deployment", "message": "no deployment named \'x\'"}}', "not-a-timeline",
         "holds a k3launch error, not a timeline: no deployment named 'x'"),
        ('{"started": 1, "ended": 2, "ready": true, "processes": [{"id": "a", "node": "n", "phases": [{"phase": "nap", "start": 1, "end": 2}]}]}',
         "not-a-timeline", "processes.0.phases.0.phase"),
        ('{"started": 1, "ended": 2, "ready": true, "processes": {"a": 1}}', "not-a-timeline", "processes"),
        ('{"name": "dep", "state": "failed", "plan": {}, "timeline": null}', "no-timeline", "x.json (dep) has no bring-up timeline (failed)"),
    ],
)
def test_what_is_not_a_saved_bring_up_is_refused_with_a_reason(text: str, code: str, said: str) -> None:
    with pytest.raises(K3Error) as err:
        read_saved(text, "x.json")
    assert err.value.code == code and said in err.value.message, err.value.message
    assert err.value.hint


# ---------------------------------------------------------------------- the command
def _store(tmp: Path, **timelines: Timeline | None) -> Path:
    from k3launch import api
    from k3launch.models.record import SshRecord

    store = StateStore(tmp / "state")
    for name, tl in timelines.items():
        plan = api.plan(api.bundled_inventory("local"), name=name)
        store.save(SshRecord(name=name, state="ready", created=1.0, updated=1.0, endpoint=plan.endpoint, plan=plan, backend="local",
                             timeline=tl))
    return store.root


def _cli(tmp: Path, *args: str) -> CliResult:
    return run_cli(["timeline", *args, "--state-dir", str(tmp / "state")], tmp / "home", env={"COLUMNS": "200"})


def test_compare_with_another_deployment_prints_a_table_and_json(tmp_path: Path) -> None:
    _store(tmp_path, warm=_warm(), cold=_cold())
    r = _cli(tmp_path, "warm", "--compare", "cold")
    assert r.code == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "warm: bring-up ready in 37.0s; cold: ready in 72.0s; difference -35.0s, ratio 0.51"
    row = next(ln for ln in lines if "compiling / CUDA graphs" in ln)
    assert row.split("│")[3:8] == [" compiling / CUDA graphs ", " 10.0 ", " 40.0 ", " -30.0 ", "  0.25 "], row
    assert any("waiting for peers" in ln and "—" in ln for ln in lines)
    assert "only in warm: serve-1 (serve) on n-2, done after 1.0s" in r.stdout
    assert "only in cold: serve-2 (serve) on n-3, done after 5.0s" in r.stdout
    j = _cli(tmp_path, "warm", "--compare", "cold", "--json")
    data = j.json()
    assert (data["name"], data["other"], data["other_deployment"]) == ("warm", "cold", "cold")
    assert data["processes"][0]["done"] == {"name_s": 36.0, "other_s": 70.0, "diff_s": -34.0, "ratio": 0.514}


def test_a_bring_up_saved_before_down_compares_after_the_next_up(tmp_path: Path) -> None:
    """The warm-restart workflow: save the first bring-up's JSON, `down` (the record goes), `up`, compare."""
    root = _store(tmp_path, dep=_cold())
    saved = _cli(tmp_path, "dep", "--json")
    assert saved.code == 0, saved.stderr
    (tmp_path / "cold.json").write_text(saved.stdout)
    StateStore(root).delete("dep")  # what a clean `down` does
    _store(tmp_path, dep=_warm())
    data = _cli(tmp_path, "dep", "--compare", str(tmp_path / "cold.json"), "--json").json()
    assert data["other"] == str(tmp_path / "cold.json") and data["other_deployment"] == "dep"
    compiling = next(ph for ph in data["processes"][0]["phases"] if ph["phase"] == "compiling")
    assert compiling == {"phase": "compiling", "name_s": 10.0, "other_s": 40.0, "diff_s": -30.0, "ratio": 0.25}
    text = _cli(tmp_path, "dep", "--compare", str(tmp_path / "cold.json"))
    assert text.code == 0 and f"{tmp_path / 'cold.json'} (dep): ready in 72.0s" in text.stdout


def test_two_saved_bring_ups_compare_with_no_deployment_left(tmp_path: Path) -> None:
    """NAME may be a saved file too, with --compare: both deployments long gone."""
    root = _store(tmp_path, warm=_warm(), cold=_cold())
    for name in ("warm", "cold"):
        (tmp_path / f"{name}.json").write_text(_cli(tmp_path, name, "--json").stdout)
        StateStore(root).delete(name)
    data = _cli(tmp_path, str(tmp_path / "warm.json"), "--compare", str(tmp_path / "cold.json"), "--json").json()
    assert data["other_deployment"] == "cold" and data["total"]["ratio"] == pytest.approx(37 / 72, abs=1e-3)
    assert _cli(tmp_path, str(tmp_path / "warm.json"), "--json").error()["code"] == "bad-name"  # without --compare: a deployment


def test_a_deployment_name_wins_over_a_file_of_that_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _store(tmp_path, warm=_warm(), cold=_cold())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cold").write_text("not json")
    assert _cli(tmp_path, "warm", "--compare", "cold", "--json").json()["other_deployment"] == "cold"
    assert _cli(tmp_path, "warm", "--compare", "./cold", "--json").error()["code"] == "not-a-timeline"


@pytest.mark.parametrize(
    ("name", "other", "code"),
    [
        ("warm", "gone", "unknown-deployment"),  # neither a deployment nor a file
        ("warm", "gone.json", "timeline-file"),
        ("warm", "garbage.json", "not-a-timeline"),
        ("warm", "error.json", "not-a-timeline"),
        ("warm", "old", "no-timeline"),  # a deployment whose record has none
        ("warm", ".", "timeline-file"),  # a directory
        ("gone", "cold", "unknown-deployment"),
        ("old", "cold", "no-timeline"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, other: str, code: str) -> None:
    _store(tmp_path, warm=_warm(), cold=_cold(), old=None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "garbage.json").write_text("{\"started\": ")
    (tmp_path / "error.json").write_text(json.dumps({"error": {"code": "x", "message": "no deployment named 'y'", "hint": ""}}))
    err = _cli(tmp_path, name, "--compare", other, "--json").error()
    assert err["code"] == code and err["hint"], err
    r = _cli(tmp_path, name, "--compare", other)
    assert r.code == 2 and r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), r.stderr
