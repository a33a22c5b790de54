"""The shipped test doubles (:mod:`k3launch.testing`): FakeRunner's script and checks, and FakeSlurm
driving the real :class:`~k3launch.deploy.slurm.client.SlurmClient` (its parsers included)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3launch.deploy.slurm.array import task_states
from k3launch.deploy.slurm.client import JobInfo
from k3launch.errors import K3Error
from k3launch.testing import BUSY, INVALID_JOB_ID, Fails, FakeRunner, FakeSlurm
from k3launch.transport.runners import SshRunner, Target, Unreachable, run_many

N1, N2 = Target("n1", "10.0.0.1", local=False), Target("n2", "10.0.0.2", local=False)


# ------------------------------------------------------------------ FakeRunner
def test_the_first_matching_rule_answers_and_everything_is_recorded() -> None:
    r = FakeRunner(respond=[(r"^cat /proc/loadavg", (0, "0.1\n", "")), (r"^kill ", lambda t, c: (1, "", f"{t.name}: {c.split()[-1]}: no such process")),
                            (r"kill", (0, "never", ""))], default=(3, "", "what?"))
    assert r.run(N1, "cat /proc/loadavg").stdout == "0.1\n"
    res = r.run(N2, "kill -s TERM 42", timeout=5, env={"A": "1"})
    assert (res.exit_code, res.stderr, res.target, res.command) == (1, "n2: 42: no such process", "n2", "kill -s TERM 42")
    assert r.run(N1, "uptime").exit_code == 3  # no rule: the default
    assert [(c.node, c.command, c.timeout, c.env) for c in r.calls] == [
        ("n1", "cat /proc/loadavg", 60.0, None), ("n2", "kill -s TERM 42", 5, {"A": "1"}), ("n1", "uptime", 60.0, None)]
    assert r.commands("n1") == ["cat /proc/loadavg", "uptime"] and r.commands() == ["cat /proc/loadavg", "kill -s TERM 42", "uptime"]
    r.close()
    assert r.closed


def test_a_handler_alone_answers_everything_and_a_dict_of_rules_works_too() -> None:
    r = FakeRunner(lambda t, c: (0, f"{t.name}:{c}", ""))
    assert r.run(N1, "hostname").stdout == "n1:hostname"
    assert FakeRunner(respond={"a": (0, "A", "")}).run(N1, "say a").stdout == "A"
    assert FakeRunner().run(N1, "anything").ok


def test_fail_on_a_node_or_a_pattern_raises_unreachable_and_run_many_reports_it() -> None:
    r = FakeRunner(fail_on=["n2", r"systemctl"])
    assert r.run(N1, "true").ok
    with pytest.raises(Unreachable) as down:
        r.run(N2, "true")
    assert down.value.code == "unreachable" and down.value.target == "n2" and "no answer" in down.value.message
    with pytest.raises(Unreachable):
        r.run(N1, "systemctl status")
    assert r.commands() == ["true", "true", "systemctl status"]  # failed calls are recorded too
    out = run_many(r, [(N1, "echo hi"), (N2, "echo hi")])
    assert out["n1"].ok and isinstance(out["n2"], Unreachable)  # type: ignore[union-attr]


def test_assert_ran_counts_and_fails_with_what_did_run() -> None:
    r = FakeRunner()
    r.run(N1, "kill -s TERM 1")
    r.run(N2, "kill -s TERM 2")
    assert r.assert_ran(r"kill -s TERM", times=2) == ["kill -s TERM 1", "kill -s TERM 2"]
    r.assert_ran(r"TERM 2", node="n2", times=1)
    r.assert_not_ran(r"KILL")
    r.assert_not_ran(r"TERM 2", node="n1")
    with pytest.raises(AssertionError) as nothing:
        r.assert_ran(r"kill -s KILL")
    msg = str(nothing.value)
    assert "'kill -s KILL'" in msg and "matched 0" in msg and "n1: kill -s TERM 1" in msg and "n2: kill -s TERM 2" in msg
    with pytest.raises(AssertionError, match=r"1 time\(s\), matched 2"):
        r.assert_ran(r"kill", times=1)
    with pytest.raises(AssertionError, match=r"on n3.*nothing ran on n3"):
        r.assert_ran(r"kill", node="n3")
    with pytest.raises(AssertionError, match=r"expected no command matching 'TERM 1'.*matched 1"):
        r.assert_not_ran(r"TERM 1")


def test_ssh_never_sends_an_environment() -> None:
    with pytest.raises(K3Error) as exc:
        SshRunner().run(N1, "true", env={"X": "1"})  # refused before any connection is tried
    assert exc.value.code == "ssh-env" and not isinstance(exc.value, ValueError)


# ------------------------------------------------------------------ FakeSlurm
def test_job_states_go_through_squeue_and_sacct_parsers_and_the_last_repeats() -> None:
    seen: list[str] = []
    slurm = FakeSlurm([JobInfo("7", "PENDING", [], "Resources"), lambda: (seen.append("poll 2"), JobInfo("7", "RUNNING", ["g1", "g2", "g3"]))[1],
                       BUSY, JobInfo("7", "FAILED", ["g2"], "", "1:0"), INVALID_JOB_ID])
    assert slurm.job("7") == JobInfo("7", "PENDING", [], "Resources")
    assert slurm.job("7") == JobInfo("7", "RUNNING", ["g1", "g2", "g3"]) and seen == ["poll 2"]
    with pytest.raises(K3Error) as busy:
        slurm.job("7")
    assert busy.value.code == "slurm-unavailable" and "Socket timed out" in busy.value.message
    assert slurm.job("7") == JobInfo("7", "FAILED", ["g2"], "", "1:0")  # from sacct
    assert slurm.job("7").state == "GONE" and slurm.job("7").state == "GONE"  # the last one repeats
    assert ["squeue", "-h", "-j", "7", "-t", "all", "-o", "%T|%N|%r"] in slurm.calls
    assert slurm.calls_to("sacct")[0] == ["sacct", "-X", "-n", "-P", "-j", "7", "-o", "State,ExitCode,NodeList"]
    raw = FakeSlurm([JobInfo("7", "RUNNING", ["g1", "g2", "g3"])]).fake_runner.run(N1, "squeue -h -j 7 -o %T|%N|%r")
    assert raw.stdout == "RUNNING|g[1-3]|None\n"  # Slurm's own format
    assert FakeSlurm().job("9").state == "GONE"


def test_sbatch_steps_and_cancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "secret")
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n")
    slurm = FakeSlurm([JobInfo("42", "RUNNING", ["n1"])], steps={"serve-0": "n1", "router": "n1"}, output="k3launch: node 0 = n1 10.0.0.1\n")
    assert slurm.sbatch(str(script), str(tmp_path), job_name="k3-x") == "42"
    assert slurm.sbatch(str(script), str(tmp_path)) == "43"
    assert (tmp_path / "slurm-42.out").read_text() == "k3launch: node 0 = n1 10.0.0.1\n" and (tmp_path / "slurm-43.out").exists()
    assert slurm.submitted == [(str(script), str(tmp_path))] * 2
    env = slurm.fake_runner.calls[0].env
    assert env is not None and "HF_TOKEN" not in env and env.get("PATH") == os.environ["PATH"]  # submit_env, not a command line
    assert slurm.steps("42") == {"serve-0": "n1", "router": "n1"}  # the batch step is left out by the parser
    slurm.cancel("42", signal="TERM")
    assert slurm.calls_to("scancel") == [["scancel", "--batch", "--signal=TERM", "42"]]
    assert slurm.job("42").state == "CANCELLED" and slurm.steps("42") == {}
    with pytest.raises(K3Error, match="Unable to open file"):
        slurm.sbatch(str(tmp_path / "missing.sbatch"), str(tmp_path))
    with pytest.raises(K3Error, match="Slurm refused the job: sbatch: error: Batch job submission failed: no nodes") as refused:
        FakeSlurm(refuse="no nodes").sbatch(str(script), str(tmp_path))
    assert refused.value.code == "sbatch-refused"


def test_a_stuck_job_ignores_cancel() -> None:
    slurm = FakeSlurm([JobInfo("5", "RUNNING", ["n1"])], steps={"serve-0": "n1"}, stuck=True)
    slurm.cancel("5")
    assert slurm.job("5").state == "RUNNING" and slurm.steps("5") == {"serve-0": "n1"} and slurm.calls_to("scancel") == [["scancel", "5"]]


def test_array_tasks_partitions_and_nodes() -> None:
    slurm = FakeSlurm(tasks=[{0: "RUNNING", 1: "PENDING"}, BUSY, Fails("slurm_load_jobs error: Invalid job id specified")],
                      nodes=["a1", "a2", "b1"], partition_size=3)
    assert task_states("7", slurm) == {0: "RUNNING", 1: "PENDING"}
    assert task_states("7", slurm) is None  # squeue failed: nothing known
    assert task_states("7", slurm) == {}  # Slurm forgot the whole array
    assert slurm.partition_nodes("gpu") == 3 and slurm.partition_nodes(None) == 3 and FakeSlurm().partition_nodes(None) is None
    assert slurm.outside("gpu", "a[1-2]") == ["b1"]
    assert slurm.calls_to("sinfo") == [["sinfo", "-h", "-N", "-o", "%N", "-p", "gpu"]]


def test_an_array_squeue_cannot_tell_about_counts_as_still_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a busy controller (squeue failed) must not make a campaign submit a group again that still runs
    import json as _json

    from k3launch.campaign import slurm as campaign_slurm
    from k3launch.deploy.slurm.backend import SlurmBackend

    slurm = FakeSlurm(tasks=[BUSY, {0: "COMPLETED", 1: "RUNNING"}])
    backend = SlurmBackend(client=slurm)
    assert backend.active_tasks(["7"]) == {"7_*"}
    assert backend.active_tasks(["7"]) == {"7_1"}
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "arrays.json").write_text(_json.dumps({"h0": "7_0", "h1": "7_1"}))
    slurm2 = FakeSlurm(tasks=[BUSY])
    monkeypatch.setattr(campaign_slurm.api, "active_array_tasks", lambda ids, backend="slurm": SlurmBackend(client=slurm2).active_tasks(ids))
    assert campaign_slurm.in_flight(tmp_path) == {"h0": "7_0", "h1": "7_1"}  # both taken as running: neither submitted again
