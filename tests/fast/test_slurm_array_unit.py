"""Job arrays without a cluster: ``submit_array`` / ``wait_array`` against a fake
:class:`~k3launch.deploy.slurm.client.SlurmClient` (:class:`k3launch.testing.FakeSlurm`) whose
``squeue`` answers are scripted poll by poll.

What ``wait_array`` must get right: a task Slurm forgot (``MinJobAge``) has ended, a failed
``squeue`` says nothing, "Invalid job id" means every task ended, only a final result (``ended``)
counts, and a resubmission never reads the results of an earlier array with the same name."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from k3launch.deploy.slurm import array as slurm_array
from k3launch.deploy.slurm.array import submit_array, wait_array
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.reports import ArrayJob
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import Inventory
from k3launch.planning.recipes import RecipeTree
from k3launch.testing import BUSY, INVALID_JOB_ID, Fails, FakeSlurm, TaskPoll

TREE = RecipeTree()


def inventory() -> Inventory:
    return Inventory.model_validate({"name": "u", "backend": "slurm", "hardware": "b300", "engine": "sim",
                                     "defaults": {"runtime": "bare"}, "slurm": {"container": "bare", "partition": "gpu"}})


def plans(*names: str) -> list[Plan]:
    return [build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inventory(), name=n) for n in names]


def poll(answer: Mapping[int, str] | Fails, before: Callable[[], None] | None = None) -> TaskPoll:
    """One scripted ``squeue -r`` answer and what happens on the "cluster" just before it."""
    if before is None:
        return answer

    def then() -> Mapping[int, str] | Fails:
        before()
        return answer

    return then


def squeue(before: Callable[[], None] | None = None, **states: str) -> TaskPoll:
    """Task states, e.g. ``squeue(t0="RUNNING")`` (printed as ``<job>_0|RUNNING``)."""
    assert all(re.fullmatch(r"t\d+", t) for t in states), states
    return poll({int(t[1:]): s for t, s in states.items()}, before)


def polls(fake: FakeSlurm) -> int:
    """How many times squeue was asked; wait_array asks nothing else (and only ``squeue -r``)."""
    assert all(c[0] == "squeue" and "-r" in c for c in fake.calls), fake.calls
    return len(fake.calls)


def job_of(n: int, tmp: Path, job_id: str = "7") -> ArrayJob:
    (tmp / "results").mkdir(parents=True, exist_ok=True)
    return ArrayJob(job_id, str(tmp), [f"dep-{i}" for i in range(n)], str(tmp / "array.sbatch"))


def out_file(job: ArrayJob, t: int) -> Path:
    """The task's output, as the array script's ``--output=<dir>/slurm-%A_%a.out`` names it."""
    return Path(job.log_dir) / f"slurm-{job.job_id}_{t}.out"


def provisional(job: ArrayJob, t: int) -> None:
    """What slurm_task writes as soon as it starts."""
    job.result_path(t).write_text(json.dumps({"task": str(t), "deployment": job.deployments[t], "ok": False,
                                              "error": "waiting for the deployment"}))


def final(job: ArrayJob, t: int, ok: bool = True) -> None:
    job.result_path(t).write_text(json.dumps({"task": str(t), "deployment": job.deployments[t], "ok": ok,
                                              "error": None if ok else "work exited with code 2", "ended": 1.0}))


def test_a_task_slurm_forgot_without_a_result_ended_and_its_output_says_why(tmp_path: Path) -> None:
    job = job_of(2, tmp_path)
    out_file(job, 0).write_text("k3launch: node 0 = k3n1 10.0.0.1\n"
                                  "k3launch: doctor failed on k3n1: 0 of 8 GPUs visible\n")
    fake = FakeSlurm(tasks=[
        squeue(t0="RUNNING", t1="RUNNING", before=lambda: provisional(job, 1)),
        squeue(t0="FAILED", t1="RUNNING"),
        squeue(t1="RUNNING"),  # MinJobAge: task 0's record purged, the array lives on
        squeue(t1="RUNNING"),
        squeue(t1="COMPLETED", before=lambda: final(job, 1)),
    ])
    res = wait_array(job, timeout=5, client=fake, poll_s=0)
    assert polls(fake) == 5  # not before task 1 ended, not a poll later
    assert res.results[1]["ok"] is True and res.results[1]["ended"] == 1.0
    r0 = res.results[0]
    assert r0["ok"] is False and r0["deployment"] == "dep-0"
    assert r0["error"] == "doctor refused k3n1 (0 of 8 GPUs visible)"
    assert res.states == {1: "COMPLETED"}  # task 0: forgotten


def test_a_task_that_ended_early_after_slurm_task_started_is_not_reported_by_its_provisional_result(tmp_path: Path) -> None:
    job = job_of(1, tmp_path)
    provisional(job, 0)
    out_file(job, 0).write_text("k3launch: started serve-0 on node 0 (k3n2)\n"
                                  "k3launch: serve-0 on node 0 (k3n2) exited with code 137; stopping the deployment\n")
    res = wait_array(job, timeout=5, client=FakeSlurm(tasks=[squeue(t0="FAILED")]), poll_s=0)
    assert res.results[0]["ok"] is False and res.results[0]["error"] == "serve-0 on k3n2 exited with code 137"
    bare = job_of(1, tmp_path / "b")  # no output either: the state and where to look
    res = wait_array(bare, timeout=5, client=FakeSlurm(tasks=[INVALID_JOB_ID]), poll_s=0)
    assert re.fullmatch(r"task ended GONE without a result; see \S+slurm-7_0\.out", str(res.results[0]["error"]))


def test_a_failed_squeue_does_not_end_the_wait_while_tasks_run(tmp_path: Path) -> None:
    job = job_of(2, tmp_path)
    provisional(job, 0)
    provisional(job, 1)  # both started: result files exist, none final

    def both_end() -> None:
        final(job, 0)
        final(job, 1, ok=False)

    fake = FakeSlurm(tasks=[
        squeue(t0="RUNNING", t1="RUNNING"),
        BUSY,
        BUSY,
        squeue(t0="RUNNING", t1="RUNNING"),
        squeue(t0="COMPLETED", t1="COMPLETED", before=both_end),
    ])
    res = wait_array(job, timeout=5, client=fake, poll_s=0)
    assert polls(fake) == 5
    assert res.results[0]["ok"] is True and res.results[1]["ok"] is False and res.results[1]["error"] == "work exited with code 2"
    assert res.states == {0: "COMPLETED", 1: "COMPLETED"}


def test_invalid_job_id_means_slurm_forgot_the_whole_array(tmp_path: Path) -> None:
    job = job_of(2, tmp_path)
    out_file(job, 1).write_text("k3launch: doctor failed on k3n3: nvidia-smi not found\n")  # task 1: no result file at all
    fake = FakeSlurm(tasks=[squeue(t0="RUNNING", t1="PENDING"), squeue(t0="RUNNING", t1="RUNNING"),
                            poll(INVALID_JOB_ID, before=lambda: final(job, 0))])
    res = wait_array(job, timeout=5, client=fake, poll_s=0)
    assert polls(fake) == 3 and res.states == {}
    assert res.results[0]["ok"] is True
    assert res.results[1] == {"task": "1", "deployment": "dep-1", "ok": False, "error": "doctor refused k3n3 (nvidia-smi not found)"}


def test_squeue_failing_for_good_raises_slurm_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_array, "SQUEUE_FAILURE_S", 0.05)
    job = job_of(1, tmp_path)
    provisional(job, 0)
    fake = FakeSlurm(tasks=[squeue(t0="RUNNING"), BUSY])
    with pytest.raises(K3Error) as exc:
        wait_array(job, timeout=5, client=fake, poll_s=0.01)
    assert exc.value.code == "slurm-unavailable" and "7" in exc.value.message and polls(fake) > 2
    # one success in between restarts the count: the wait goes on until the task ends
    flaky = FakeSlurm(tasks=[BUSY, BUSY, BUSY, squeue(t0="RUNNING"), BUSY, BUSY,
                             BUSY, squeue(t0="COMPLETED", before=lambda: final(job, 0))])
    monkeypatch.setattr(slurm_array, "SQUEUE_FAILURE_S", 1.0)  # 3 failures: ~0.1 s
    assert wait_array(job, timeout=5, client=flaky, poll_s=0.05).results[0]["ok"] is True


def test_the_timeout_counts_the_tasks_still_running(tmp_path: Path) -> None:
    job = job_of(3, tmp_path)
    fake = FakeSlurm(tasks=[squeue(t0="COMPLETED", t2="RUNNING")])  # task 1 forgot, task 2 runs forever
    with pytest.raises(K3Error) as exc:
        wait_array(job, timeout=0.05, client=fake, poll_s=0.01)
    assert exc.value.code == "array-timeout" and "1 task(s) still running" in exc.value.message


def test_two_submissions_with_the_same_name_do_not_share_results(tmp_path: Path) -> None:
    fake = FakeSlurm(first_id=101)
    first = submit_array(plans("a-0", "a-1"), inventory(), tmp_path, name="k3c-x", client=fake)
    second = submit_array(plans("b-0"), inventory(), tmp_path, name="k3c-x", client=fake)
    (j1,), (j2,) = first, second
    assert j1.job_id == "101" and j2.job_id == "102" and j1.log_dir != j2.log_dir
    assert [Path(s).parent for s, _ in fake.submitted] == [Path(c) for _, c in fake.submitted] == [Path(j1.log_dir), Path(j2.log_dir)]
    for j in (j1, j2):
        d = Path(j.log_dir)
        assert d.parent == tmp_path.resolve() and re.fullmatch(r"k3c-x-\d{8}T\d{6}Z-[0-9a-f]{6}", d.name), d
        assert (d / "array.sbatch").is_file() and (d / "results").is_dir() and (d / "task-0" / "plan.json").is_file()
        assert str(d / "results" / "task-0.json") in (d / "array.sbatch").read_text()
    final(j1, 0)  # the first array's task 0 succeeded ...
    out_file(j2, 0).write_text("k3launch: allocation has 0 nodes, the plan needs 1\n")  # ... the second's failed before slurm_task
    res = wait_array(j2, timeout=5, client=FakeSlurm(tasks=[squeue(t0="FAILED")]), poll_s=0)
    assert res.results[0]["ok"] is False and res.results[0]["deployment"] == "b-0"
    assert "allocation has 0 nodes, the plan needs 1" in str(res.results[0]["error"])
