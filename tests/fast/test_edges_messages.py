"""What refusals and reports say: the error code on the text line, k3launch's words rather than the
validation library's, a hint aimed at the user's own --set, a rollout --dry-run that says the
real run would be refused (and suggests only what could run), a --rollback that rolled nothing,
a restart timeline listing each phase once, and a `down` that tells an exited engine from a
stopped one and says that a rollout under way was abandoned.

The deployments here are records only (no engine runs: their processes have exited), on the
bundled local inventory, so these stay in the fast tier."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
from inventory_helpers import INVENTORIES, CliResult, run_cli, write_yaml
from rich.console import Console

from k3launch import api
from k3launch.cli import show_progress
from k3launch.deploy.rollout import RolloutResult
from k3launch.deploy.state import StateStore
from k3launch.models.phases import Phase, PhaseSpan, ProcessTimeline, Timeline
from k3launch.models.plan import Plan
from k3launch.models.record import ProcessRecord, SshRecord
from k3launch.models.rollout import RolloutState, RolloutUnit

LOCAL = str(INVENTORIES / "local.yaml")


def _record(state: Path, name: str, port_base: int, **sel: object) -> tuple[StateStore, SshRecord]:
    """A ready deployment's record whose engines have exited (nothing of it runs: no handle to signal)."""
    plan = api.plan(LOCAL, name=name, port_base=port_base, **sel)  # type: ignore[arg-type]
    st = StateStore(state)
    now = time.time()
    rec = SshRecord(name=name, state="ready", created=now, updated=now, backend="local", endpoint=plan.endpoint, plan=plan, inventory=LOCAL,
                    processes={p.id: ProcessRecord(id=p.id, node=p.node, runtime="bare", handle="", started=True) for p in plan.processes})
    st.save(rec)
    return st, rec


def _cli(tmp: Path, state: Path, *args: str) -> CliResult:
    return run_cli([*args, "--state-dir", str(state)], tmp)


def test_a_text_refusal_shows_its_code(tmp_path: Path) -> None:
    res = run_cli(["plan", "--name", "labA"], tmp_path)
    lines = res.stderr.splitlines()
    assert res.code == 2 and lines[0].startswith("error: --name 'labA': ") and lines[0].endswith(" [bad-name]"), res.stderr
    assert lines[1].startswith("hint: ")


def test_validation_wording_does_not_leak(tmp_path: Path) -> None:
    bad = write_yaml(tmp_path, "name: t\nbackend: k8s\nnodes:\n  - {name: n1}\n")
    err = run_cli(["plan", "--json", "-i", str(bad)], tmp_path).error()
    assert "backend 'k8s' is not one of" in err["message"] and "Value error" not in err["message"], err


def test_a_bad_set_value_is_the_users_to_correct(tmp_path: Path) -> None:
    err = run_cli(["plan", "--json", "--set", "max-num-seqs=abc"], tmp_path).error()
    assert err["message"].startswith("--set max-num-seqs=abc: ") and "recipe" not in err["hint"] and "--set" in err["hint"], err
    _, rec = _record(tmp_path / "s", "ro-set", 24500)
    err = _cli(tmp_path, tmp_path / "s", "rollout", rec.name, "--set", "max-num-seqs=abc", "--json").error()
    assert err["code"] == "bad-value" and "recipe" not in err["hint"] and "--set" in err["hint"], err


def test_a_dry_run_says_the_real_run_would_be_refused_and_offers_only_what_could_run(tmp_path: Path) -> None:
    _, rec = _record(tmp_path / "s", "ro-dry", 24500)  # one engine, no router
    res = _cli(tmp_path, tmp_path / "s", "rollout", rec.name, "--set", "max-num-seqs=128", "--dry-run")
    assert res.code == 2 and "+ --max-num-seqs 128" in res.stdout, res.stdout + res.stderr
    err, hint = res.stderr.splitlines()[:2]
    assert err.startswith("error: the rollout would be refused: ") and err.endswith("[rollout-downtime]"), err
    assert "--surge" not in hint and "--allow-downtime" in hint, hint  # no router: a surge is refused too
    js = _cli(tmp_path, tmp_path / "s", "rollout", rec.name, "--set", "max-num-seqs=128", "--dry-run", "--json").error()
    assert js["code"] == "rollout-downtime"
    ok = _cli(tmp_path, tmp_path / "s", "rollout", rec.name, "--set", "max-num-seqs=128", "--dry-run", "--allow-downtime")
    assert ok.code == 0, ok.stderr


def test_a_dry_run_with_a_router_still_offers_surge(tmp_path: Path) -> None:
    _, rec = _record(tmp_path / "s", "ro-dep", 24500, strategy="multi_node_dep", nodes=2)
    assert any(p.role == "router" for p in rec.plan.processes)
    res = _cli(tmp_path, tmp_path / "s", "rollout", rec.name, "--set", "max-num-seqs=128", "--dry-run")
    assert res.code == 2 and "--surge" in res.stderr.splitlines()[1], res.stderr


def test_a_rollback_that_rolled_nothing_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from k3launch.api import rollouts

    plan = api.plan(LOCAL, name="ro-back", port_base=24500)

    def nothing(name: str, **kw: object) -> RolloutResult:
        assert kw["rollback"] is True
        return RolloutResult(plan)

    monkeypatch.setattr(rollouts, "rollout_continue", nothing)
    res = run_cli(["rollout", "ro-back", "--rollback"], tmp_path)
    assert res.code == 0 and "rolled: 0 unit(s)" not in res.stdout and "none was rolled back" in res.stdout, res.stdout


def test_a_restart_timeline_lists_each_phase_once() -> None:
    t, spans = 1000.0, []
    for ph, s in ((Phase.STARTING, 1), (Phase.COMPILING, 3), (Phase.KV_CACHE, 2), (Phase.COMPILING, 4), (Phase.API_SERVER, 1)):
        spans.append(PhaseSpan(phase=ph, start=t, end=t + s))
        t += s
    tl = Timeline(started=1000, ended=t, ready=True, processes=[ProcessTimeline(id="serve-0", node="n", role="serve", phases=spans)])
    out = io.StringIO()
    show_progress.timeline(Console(file=out, width=120), "d restart of serve-0", tl)
    rows = [line for line in out.getvalue().splitlines() if "compiling" in line and "│" in line]
    assert len(rows) == 1 and rows[0].split("│")[-2].strip() == "7.0", out.getvalue()  # 3 s + 4 s
    assert "waited longest for compiling / CUDA graphs (7.0s)" in out.getvalue()


def test_down_tells_an_exited_engine_from_a_stopped_one_and_abandons_a_rollout(tmp_path: Path) -> None:
    st, rec = _record(tmp_path / "s", "ro-down", 24500)
    plan: Plan = rec.plan
    rec.rollout = RolloutState(old=plan, new=plan, changes=["--set", "max-num-seqs=128"], started=1.0, updated=1.0,
                               units=[RolloutUnit(name="serve-0", processes=["serve-0"])])
    st.save(rec)
    res = _cli(tmp_path, tmp_path / "s", "down", rec.name)
    assert res.code == 0, res.stdout + res.stderr
    assert "a rollout was under way (--set max-num-seqs=128): abandoned" in res.stdout, res.stdout
    assert "process(es) stopped" not in res.stdout and "1 had exited already (serve-0)" in res.stdout, res.stdout


@pytest.mark.parametrize(("args", "code"), [
    (["status", "nope"], "unknown-deployment"),
    (["timeline", "nope"], "unknown-deployment"),
    (["events", "nope"], "unknown-deployment"),
    (["rollout", "nope", "--set", "max-num-seqs=8"], "unknown-deployment"),
    (["supervise", "nope"], "unknown-deployment"),
    (["cordon", "-i", LOCAL, "--reason", "disk"], "bad-usage"),
])
def test_a_refusal_inside_a_command_is_one_error_line_a_hint_and_exit_2_in_text_and_json(tmp_path: Path, args: list[str], code: str) -> None:
    """A K3Error a command's body raises ends in the CLI's one shape, whichever command: on stderr
    ``error: <message> [<code>]`` then ``hint: ...`` and nothing on stdout; with ``--json`` the same
    refusal as the one JSON object on stdout and nothing on stderr; exit 2 both ways."""
    text = _cli(tmp_path, tmp_path / "s", *args)
    lines = text.stderr.splitlines()
    assert (text.code, text.stdout, len(lines)) == (2, "", 2), (text.code, text.stdout, text.stderr)
    assert lines[0].startswith("error: ") and lines[0].endswith(f" [{code}]") and lines[1].startswith("hint: "), lines
    js = _cli(tmp_path, tmp_path / "s", *args, "--json")
    err = js.error()  # exit 2, one {"error": {code, message, hint}}, no traceback
    assert js.stderr == "" and len(js.stdout.splitlines()) == 1, js.stdout + js.stderr
    assert (f"error: {err['message']} [{err['code']}]", f"hint: {err['hint']}") == (lines[0], lines[1])
