"""A Slurm job that supervises itself (``up --supervise``): the watch library ``slurm/k3launch-watch.sh``.

* goldens: a supervised K3 DEP, a P/D and a two-copy DEP job script in ``tests/golden/slurm/supervised/``
  (``K3LAUNCH_UPDATE_GOLDEN=1`` rewrites them); the unsupervised goldens stay as they are
  (tests/test_slurm_render.py).
* parity: the bash decisions (``k3_rs_*``) and :class:`k3launch.models.supervise.Supervision` are fed
  the same sequences of looks (steps that ended, restarted units answering or not, on a fake
  clock): the events they write must be the same, field by field.
* the whole script under fakes (srun, scontrol, scancel, squeue, curl): a step that exits is started
  again with exactly its first arguments, a crash loop ends the job naming the reason.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from test_slurm_render import FAKE_ADDRS, FAKE_HOSTS, FAKE_SCONTROL, FAKE_SLEEP, LOG_DIR, bash_n, case_plan, hostile_inventory

from k3launch import api
from k3launch.deploy import eventlog
from k3launch.deploy.slurm.client import JobInfo
from k3launch.deploy.slurm.launch import SlurmLaunch
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import SlurmJob, SlurmRecord
from k3launch.models.selection import Selection
from k3launch.models.supervise import Event, RestartPolicy, units
from k3launch.models.supervision import Observation, Restart, StopAll, Supervision, UnitState
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import Inventory
from k3launch.planning.recipes import RecipeTree
from k3launch.render.sbatch import WATCH_LIBRARY, job_library, make_sbatch_string
from k3launch.testing import FakeSlurm
from k3launch.util.resources import bundled

GOLDEN = Path(__file__).parent / "golden" / "slurm" / "supervised"
UPDATE = os.environ.get("K3LAUNCH_UPDATE_GOLDEN") == "1"
POLICY = RestartPolicy(max_restarts=3, window=1800, backoff=5, backoff_max=60, poll=1, start_timeout=900)
SUPERVISED = ("multi_node_dep_4", "pd_cluster", "multi_node_dep_2_replicas_2")  # copies: one unit each, restarted inside the one job


def watch_library() -> str:
    path = bundled("slurm", WATCH_LIBRARY)
    assert path is not None
    return path.read_text()


def supervised_script(case: str, log_dir: str = LOG_DIR, policy: RestartPolicy = POLICY) -> str:
    plan, slurm, c = case_plan(case)
    return make_sbatch_string(plan, slurm, log_dir, c.extra_sbatch, c.exclude, supervise=policy)


# ------------------------------------------------------------------ goldens and structure
@pytest.mark.parametrize("case", SUPERVISED)
def test_golden_supervised_sbatch(case: str) -> None:
    path = GOLDEN / f"{case}.sbatch"
    got = supervised_script(case)
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(got, encoding="utf-8")
        return
    want = path.read_text(encoding="utf-8")
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), f"golden/slurm/supervised/{case}.sbatch", "now"))
        pytest.fail(f"{case} differs from its golden (K3LAUNCH_UPDATE_GOLDEN=1 to accept):\n{diff}")


def test_no_stale_supervised_goldens() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.sbatch")) == sorted(SUPERVISED)


@pytest.mark.parametrize("case", SUPERVISED)
def test_a_supervised_script_starts_every_step_and_watches_each_recovery_unit(case: str, tmp_path: Path) -> None:
    plan, _, _ = case_plan(case)
    text = supervised_script(case)
    (tmp_path / "job.sbatch").write_text(text)
    bash_n(tmp_path / "job.sbatch")
    watch = bundled("slurm", WATCH_LIBRARY)
    assert watch is not None and job_library(True) == job_library() + watch.read_text() and job_library(True) in text
    body = text.split("# ---- end of the k3launch watch library ----\n", 1)[1]
    calls = [ln.split()[0] for ln in body.splitlines() if ln.startswith("k3_")]
    us = units(plan)
    dirs = calls.count("k3_dir")  # what the steps need on their nodes, made first (tests/test_slurm_render.py checks them)
    assert calls == ["k3_bind", "k3_doctor", *["k3_dir"] * dirs, "k3_prepare", *["k3_start"] * len(plan.processes), *["k3_unit"] * len(us),
                     "k3_watch"] and dirs > 0
    assert f"K3_DEPLOYMENT={plan.name}\n" in body
    assert "K3_RS_POLICY=on-failure K3_RS_MAX=3 K3_RS_WINDOW_MS=1800000 K3_RS_BACKOFF_MS=5000 K3_RS_BACKOFF_MAX_MS=60000\n" in body
    assert "K3_RS_START_TIMEOUT_MS=900000 K3_RS_POLL_MS=1000\n" in body
    # one k3_unit per recovery unit: its processes in start order, each HTTP one with its /health URL on its bound address
    # (a router's /liveness: its /health is 503 while a worker restarts)
    got = [shlex.split(ln) for ln in body.splitlines() if ln.startswith("k3_unit ")]
    index = {h: i for i, h in enumerate(dict.fromkeys(h.name for h in plan.hosts if h.gpus))}
    procs = {p.id: p for p in plan.processes}
    want = [["k3_unit", u.name, u.role, *(f"{p}=http://$K3_ADDR_{index[procs[p].node]}:{procs[p].http_port}{'/liveness' if u.role == 'router' else '/health'}" if p in u.http else p
                                          for p in u.processes)] for u in us]
    assert got == want
    assert "k3_supervise" not in body


def test_unsupervised_scripts_carry_no_watch_library() -> None:
    text = make_sbatch_string(*case_plan("pd_cluster")[:2], LOG_DIR)
    assert "k3_watch" not in text and "k3launch watch library" not in text and text.endswith("k3_supervise\n")


# ------------------------------------------------------------------ parity with Supervision
TREE = RecipeTree()


@cache
def plan_of(strategy: str, recipe: str = "moonshotai/Kimi-K3") -> Plan:
    return api.plan(None, recipe=recipe, strategy=strategy, name="t-" + strategy.replace("_", "-"))


PLANS = {"replicas": ("multi_node_replicas", "k3launch/tiny-llama"), "pd": ("pd_cluster", "moonshotai/Kimi-K3"),
         "dep": ("multi_node_dep", "moonshotai/Kimi-K3"), "single": ("single_node_tp", "moonshotai/Kimi-K3")}


@dataclass
class Look:
    ms: int  # the fake clock
    dead: dict[str, int]  # process -> exit code (the steps that ended since the last look)
    serves: set[str]  # units whose HTTP processes all answer (matters while they start)


def harness(plan: Plan, policy: RestartPolicy, looks: list[Look], events: Path) -> str:
    """A bash program: the watch library, the plan's units, then for each look what k3_watch does
    (k3_rs_look per unit not given up, the restart reported started, the failed check)."""
    procs = [p.id for p in plan.processes]
    nodes = [p.node for p in plan.processes]
    start = policy.start_timeout or 1800
    out = [watch_library(), "k3_say() { :; }",
           f"K3_LOGDIR={shlex.quote(str(events.parent))} K3_DEPLOYMENT={shlex.quote(plan.name)}",
           f"K3_RS_POLICY={policy.policy} K3_RS_MAX={policy.max_restarts} K3_RS_WINDOW_MS={round(policy.window * 1000)}",
           f"K3_RS_BACKOFF_MS={round(policy.backoff * 1000)} K3_RS_BACKOFF_MAX_MS={round(policy.backoff_max * 1000)}",
           f"K3_RS_START_TIMEOUT_MS={round(start * 1000)}",
           f"K3_STEP_NAME=({' '.join(procs)}) K3_STEP_HOST=({' '.join(nodes)})"]
    us = units(plan)
    for u in us:
        out.append(shlex.join(["k3_unit", u.name, u.role, *(f"{p}=http://x/health" if p in u.http else p for p in u.processes)]))
    for look in looks:
        for i, u in enumerate(us):
            first = next((p for p in u.processes if p in look.dead), None)
            obs = f"{procs.index(first)} {look.dead[first]}" if first else ""
            out.append(f'if [ "${{K3_U_STATE[{i}]}}" != gave-up ]; then k3_rs_look {i} {look.ms} {int(u.name in look.serves)} {obs}; '
                       f'[ "$K3_DO" != restart ] || k3_rs_started {i} {look.ms}; fi')
        out.append(f"k3_rs_can_serve || {{ k3_rs_failed {look.ms}; exit 0; }}")
    return "\n".join(out) + "\n"


def python_events(plan: Plan, policy: RestartPolicy, looks: list[Look]) -> list[Event]:
    s = Supervision(plan, policy, start_timeout=1800)
    http = {p: u for u in s.units for p in u.http}
    out: list[Event] = []
    for look in looks:
        now = look.ms / 1000
        healthy = {p: s.state(u.name) is not UnitState.STARTING or u.name in look.serves for p, u in http.items()}
        events, actions = s.step(Observation(now, dead={p: f"exited with code {c}" for p, c in look.dead.items()}, healthy=healthy))
        out += events
        for a in actions:
            if isinstance(a, Restart):
                s.started(a.unit, now)
        if any(isinstance(a, StopAll) for a in actions):
            break
    return out


def bash_events(plan: Plan, policy: RestartPolicy, looks: list[Look], tmp: Path) -> list[Event]:
    path = tmp / "events.jsonl"
    path.unlink(missing_ok=True)
    (tmp / "harness.sh").write_text(harness(plan, policy, looks, path))
    res = subprocess.run(["bash", "-u", str(tmp / "harness.sh")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not res.stderr, res.stderr
    return [Event.model_validate_json(line) for line in path.read_text().splitlines()] if path.exists() else []


def fields(e: Event) -> dict[str, object]:
    d = e.model_dump(exclude={"log_tail"})
    if e.kind == "restarted":  # "{took:.1f}": a tie (x.x5) may round either way; `seconds` carries the exact figure
        assert re.fullmatch(r"serving again after \d+\.\ds", e.reason), e.reason
        d["reason"] = "serving again"
    return d


def random_looks(rng: random.Random, plan: Plan, n: int) -> list[Look]:
    """Looks on a fake clock: processes die now and then (one-shot, as the job reaps them), restarted
    units answer or not; whatever dies is alive again only by a restart (the decisions decide those)."""
    us = units(plan)
    t, looks = rng.randrange(0, 5000), []
    for _ in range(n):
        t += rng.choice([100, 700, 1000, 2500, 4000, 9000, 30000, 61000]) + rng.randrange(0, 1000)
        dead = {p: rng.choice([1, 137, 9, 0]) for u in us if rng.random() < 0.25 for p in rng.sample(u.processes, 1)}
        serves = {u.name for u in us if rng.random() < 0.5}
        looks.append(Look(t, dead, serves))
    return looks


def random_policy(rng: random.Random) -> RestartPolicy:
    return RestartPolicy(policy="never" if rng.random() < 0.1 else "on-failure", max_restarts=rng.randrange(0, 5),
                         window=rng.choice([5, 20, 60.5, 600, 3600]), backoff=rng.choice([0, 0.5, 1.2, 3, 10]),
                         backoff_max=rng.choice([0.5, 4, 8, 300]), start_timeout=rng.choice([1, 3.5, 8, 30]))


@pytest.mark.parametrize("shape", sorted(PLANS))
def test_the_jobs_decisions_are_the_supervisors_on_random_sequences(shape: str, tmp_path: Path) -> None:
    """The same looks through the bash functions and through Supervision: the same events (time,
    kind, unit, process, node, reason, attempt, seconds), in the same order, up to the end."""
    plan = plan_of(*PLANS[shape])
    rng = random.Random(f"k3-slurm-parity-{shape}")
    kinds: set[str] = set()
    for _ in range(12):
        policy = random_policy(rng)
        looks = random_looks(rng, plan, 40)
        want = [fields(e) for e in python_events(plan, policy, looks)]
        got = [fields(e) for e in bash_events(plan, policy, looks, tmp_path)]
        assert got == want, f"policy {policy!r}\nlooks {looks!r}"
        kinds |= {str(e["kind"]) for e in want}
    # the sequences exercised every decision
    assert kinds >= {"detected", "restarting", "restarted", "backoff", "restart-failed", "gave-up"}, kinds


def test_a_crash_loop_backs_off_doubling_then_gives_up_as_the_supervisor_does(tmp_path: Path) -> None:
    plan = plan_of("single_node_tp")
    policy = RestartPolicy(max_restarts=3, window=600, backoff=2, backoff_max=3, start_timeout=60)
    t0 = 1_700_000_000_000  # the clock is the epoch's, in ms
    looks = [Look(t0 + ms, dead, serves) for ms, dead, serves in [
        (0, {"serve-0": 1}, set()), (1000, {}, {"serve-0"}), (5000, {"serve-0": 1}, set()), (6000, {}, set()), (7000, {}, set()),
        (8000, {}, {"serve-0"}), (9000, {"serve-0": 137}, set()), (11000, {}, set()), (12000, {}, set()), (13000, {"serve-0": 1}, set())]]
    want = python_events(plan, policy, looks)
    got = bash_events(plan, policy, looks, tmp_path)
    assert [fields(e) for e in got] == [fields(e) for e in want]
    assert [(e.kind, e.seconds) for e in got] == [
        ("detected", None), ("restarting", None), ("restarted", 1.0), ("detected", None), ("backoff", 2.0), ("restarting", None),
        ("restarted", 3.0), ("detected", None), ("backoff", 3.0), ("restarting", None), ("restart-failed", None), ("gave-up", None),
        ("failed", None)]
    assert got[-1].reason == "serve-0 given up: 3 restarts within 600s; last failure: serve-0 exited with code 1"


@pytest.mark.parametrize(("after_ms", "kinds"), [(10_000, ["detected", "gave-up", "failed"]), (10_001, ["detected", "restarting"])])
def test_a_restart_exactly_window_seconds_old_still_counts(after_ms: int, kinds: list[str], tmp_path: Path) -> None:
    plan = plan_of("single_node_tp")
    policy = RestartPolicy(max_restarts=1, window=10, backoff=0, start_timeout=60)
    t0 = 1_700_000_000_000
    looks = [Look(t0, {"serve-0": 1}, set()), Look(t0 + 1000, {}, {"serve-0"}), Look(t0 + after_ms, {"serve-0": 1}, set())]
    want = python_events(plan, policy, looks)
    got = bash_events(plan, policy, looks, tmp_path)
    assert [fields(e) for e in got] == [fields(e) for e in want]
    assert [e.kind for e in got][3:] == kinds


def test_event_lines_are_json_whatever_the_reason_holds(tmp_path: Path) -> None:
    lib = watch_library()
    nasty = 'a "quoted" \\back\\slash\tand\nnewline $(touch pwned) \x01'
    script = f"{lib}\nK3_LOGDIR={shlex.quote(str(tmp_path))} K3_DEPLOYMENT=d\nk3_event 1234567 detected u p n {shlex.quote(nasty)} 2 1500\n"
    res = subprocess.run(["bash", "-u", "-c", script], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    e = json.loads((tmp_path / "events.jsonl").read_text())
    assert e == {"time": 1234.567, "kind": "detected", "deployment": "d", "unit": "u", "process": "p", "node": "n",
                 "reason": nasty.replace("\x01", " "), "attempt": 2, "seconds": 1.5}
    assert not (tmp_path / "pwned").exists()


# ------------------------------------------------------------------ the whole script under fakes
# fake srun: records its argv (NUL-separated); a step named in K3_FAKE_DIE ("name:times:seconds:code")
# exits after seconds with code, the first `times` times it is started; every other step serves. The
# doctor and prepare steps answer "ok" for every host.
FAKE_SRUN = r"""#!/bin/bash
d=$K3_FAKE_OUT name=
for a in "$@"; do case $a in --job-name=*) name=${a#--job-name=} ;; esac; done
if [ "$name" = k3-doctor ] || [ "$name" = k3-prepare ]; then
  for h in $K3_FAKE_HOSTS; do echo "k3launch-${name#k3-} $h ok"; done
  exit 0
fi
printf '%s\0' "$@" >"$d/srun.$$.argv"
[ "$name" != "${K3_FAKE_DEAF:-}" ] || trap '' TERM  # this step ignores SIGTERM (a hung engine)
for spec in ${K3_FAKE_DIE:-}; do
  IFS=: read -r n times t c <<<"$spec"
  [ "$name" = "$n" ] || continue
  k=$(ls "$d" | grep -c "^died-$name-" || true)
  if [ "$k" -lt "$times" ]; then /bin/sleep "$t"; touch "$d/died-$name-$$"; exit "$c"; fi
done
exec /bin/sleep 60
"""
FAKE_CURL = "#!/bin/sh\necho \"$@\" >>\"$K3_FAKE_OUT/curl.calls\"\nexit 0\n"
FAKE_SQUEUE = "#!/bin/sh\nexit 1\n"  # no step ids: the job falls back to signalling srun


def run_supervised(script: str, tmp: Path, die: str, timeout: float = 60, deaf: str = "",
                   term_on: str | None = None) -> tuple[subprocess.CompletedProcess[str], Path, list[int]]:
    """Run the job script under the fakes (``term_on``: SIGTERM it, as `down` does through scancel
    --batch, once it wrote an event of that kind); its result, the fakes' record, and the steps
    still alive 2 s after it ended (none, unless it left some behind)."""
    bindir, out = tmp / "fakebin", tmp / "rec"
    bindir.mkdir()
    out.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("sleep", FAKE_SLEEP), ("curl", FAKE_CURL),
                       ("squeue", FAKE_SQUEUE), ("scancel", "#!/bin/sh\nexit 1\n")):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    (tmp / "job.sbatch").write_text(script)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp), "SLURM_JOB_NODELIST": "fake[1-9]", "SLURM_JOB_ID": "4242",
           "K3_FAKE_OUT": str(out), "K3_FAKE_NODELIST": "fake[1-9]", "K3_FAKE_HOSTS": " ".join(FAKE_HOSTS), "K3_FAKE_DIE": die,
           "K3_STOP_GRACE_S": "1" if term_on is None else "3", "K3_FAKE_DEAF": deaf}
    try:
        p = subprocess.Popen(["bash", str(tmp / "job.sbatch")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)
        if term_on is not None:
            events = tmp / "logs" / "events.jsonl"
            deadline = time.monotonic() + 15
            while f'"kind":"{term_on}"' not in (events.read_text() if events.exists() else "") and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # well inside the restart's stop (3 s of grace for a step that ignores SIGTERM)
            p.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            raise AssertionError(f"the job script did not end within {timeout:g}s:\n{stdout}\n{stderr}") from None
        res = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
        deadline = time.monotonic() + 2
        while (left := [pid for pid in step_pids(out) if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for pid in step_pids(out):  # nothing the fakes started may outlive the test (a step serves with exec sleep)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    return res, out, left


def step_pids(out: Path) -> list[int]:
    return [int(p.name.split(".")[1]) for p in out.glob("srun.*.argv")]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def argvs(out: Path) -> list[list[str]]:
    return [[w.decode() for w in p.read_bytes().split(b"\0")[:-1]] for p in sorted(out.glob("srun.*.argv"), key=lambda p: p.stat().st_mtime_ns)]


def test_a_crash_loop_restarts_the_unit_with_its_own_arguments_then_ends_the_job_with_the_reason(tmp_path: Path) -> None:
    """Hostile values: serve-1 of a two-node DEP exits three times; each restart starts the whole
    group again with exactly the first words; the third exit exceeds max_restarts=2: the job
    fails, names the process, and every step is stopped."""
    inv = hostile_inventory(tmp_path, "bare")
    assert inv.slurm is not None
    plan = build_plan(TREE, Selection(strategy="multi_node_dep", nodes=2), inventory=inv, name="k3t-sv-hostile")
    policy = RestartPolicy(max_restarts=2, window=600, backoff=0.2, backoff_max=1, poll=0.1, start_timeout=30)
    logs = tmp_path / "logs"
    res, out, left = run_supervised(make_sbatch_string(plan, inv.slurm, str(logs), supervise=policy), tmp_path, "serve-1:3:0.3:5")
    assert res.returncode == 1, res.stdout + res.stderr
    assert left == []  # every step stopped
    calls = argvs(out)
    by_name: dict[str, list[list[str]]] = {}
    for argv in calls:
        by_name.setdefault(next(w.split("=", 1)[1] for w in argv if w.startswith("--job-name=")), []).append(argv)
    assert sorted(by_name) == ["router", "serve-0", "serve-1"]
    assert len(by_name["serve-0"]) == len(by_name["serve-1"]) == 3 and len(by_name["router"]) == 1  # the group, twice again; the router alone
    assert all(a == by_name["serve-1"][0] for a in by_name["serve-1"]) and all(a == by_name["serve-0"][0] for a in by_name["serve-0"])
    assert f"K3_PEER=http://{FAKE_ADDRS[1]}:9000/?a=$(touch {tmp_path}/pwned-env6)&b={FAKE_ADDRS[0]}'x'\"y\" -v/:/host" in by_name["serve-0"][0]
    events = [Event.model_validate_json(ln) for ln in (logs / "events.jsonl").read_text().splitlines()]
    assert [e.kind for e in events] == ["watching", "detected", "restarting", "restarted", "detected", "backoff", "restarting",
                                        "restarted", "detected", "gave-up", "failed"]
    assert events[1].unit == "serve" and events[1].process == "serve-1" and events[1].node == FAKE_HOSTS[1] and "code 5" in events[1].reason
    assert events[-1].reason == "serve given up: 2 restarts within 600s; last failure: serve-1 exited with code 5"
    assert f"k3launch: serve-1 on node 1 ({FAKE_HOSTS[1]}) exited with code 5; supervision gave up" in res.stderr
    assert (logs / "serve-1.log.1").is_file()  # the previous run's log beside the new one
    assert not list(tmp_path.glob("pwned*")), "a hostile value ran as a command"


# ------------------------------------------------------------------ the login side, with Slurm faked
def slurm_record(tmp: Path, store: StateStore, *, supervised: RestartPolicy | None = POLICY, state: str = "ready") -> SlurmRecord:
    inv = Inventory.model_validate({"name": "u", "backend": "slurm", "hardware": "b300", "engine": "sim", "defaults": {"runtime": "bare"},
                                    "slurm": {"container": "bare", "log_dir": str(tmp / "logs")}})
    plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inv, name="u-sv")
    log_dir = tmp / "logs" / "u-sv"
    log_dir.mkdir(parents=True, exist_ok=True)
    rec = SlurmRecord(name="u-sv", state=state, created=1.0, updated=1.0, endpoint="http://127.0.0.254:9", plan=plan,  # type: ignore[arg-type]
                      slurm=SlurmJob(job_id="42", log_dir=str(log_dir), script="", supervised=supervised, hosts={"slurm-node-0": "k3n1"},
                                     addresses={"slurm-node-0": "127.0.0.254"}))
    store.save(rec)
    return rec


def job_event(log_dir: str, t: float, kind: str, **kw: object) -> None:
    with (Path(log_dir) / "events.jsonl").open("a") as f:  # as the job writes them (bash: "time":1700000001.500)
        f.write(json.dumps({"time": t, "kind": kind, "deployment": "u-sv", **kw}) + "\n")


def test_status_shows_the_job_supervising_itself_its_restarts_and_then_failed_with_the_reason(tmp_path: Path,
                                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import k3launch.deploy.slurm.ops as ops

    store = StateStore(tmp_path / "state")
    rec = slurm_record(tmp_path, store)
    log_dir = rec.slurm.log_dir
    job_event(log_dir, 1700000000.25, "watching", node="k3n1", reason="job 42 supervises itself; units: serve-0")
    for t in (1700000010.0, 1700000020.0):
        job_event(log_dir, t, "detected", unit="serve-0", process="serve-0", node="k3n1", reason="serve-0 exited with code 137")
        job_event(log_dir, t, "restarting", unit="serve-0", reason="serve-0 exited with code 137", attempt=1)
    fakes = iter([FakeSlurm([JobInfo("42", "RUNNING", ["k3n1"])]), FakeSlurm([JobInfo("42", "FAILED", ["k3n1"])])])
    monkeypatch.setattr(ops, "SlurmClient", lambda: next(fakes))
    snap = api.status("u-sv", state_dir=store.root)
    assert snap.supervisor is not None and snap.supervisor.model_dump() == {"host": "k3n1", "pid": None, "since": 1700000000.25, "restarts": 2,
                                                                            "detached": True, "job": "42"}
    assert snap.state == "degraded" and snap.error is None  # the engine does not answer here (no engine runs)
    job_event(log_dir, 1700000030.0, "gave-up", unit="serve-0", reason="2 restarts within 1800s; last failure: serve-0 exited with code 1")
    job_event(log_dir, 1700000030.0, "failed", reason="serve-0 given up: 2 restarts within 1800s; last failure: serve-0 exited with code 1")
    snap = api.status("u-sv", state_dir=store.root)
    why = f"the job gave up: serve-0 given up: 2 restarts within 1800s; last failure: serve-0 exited with code 1; logs in {log_dir}"
    assert snap.state == "failed" and snap.error == why and snap.as_dict()["error"] == why
    cur = store.load("u-sv")
    assert cur.state == "failed" and cur.error == why  # the record says it too (`list`)
    from rich.console import Console

    from k3launch.cli import show_deploy

    con = Console(record=True, width=300)
    show_deploy.status(con, snap)
    text = con.export_text()
    assert f"failed: {why}" in text and "supervised by job 42 itself (on k3n1) since " in text and "2 restart(s)" in text


def test_events_merge_the_jobs_own_and_down_keeps_them_in_the_state_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import k3launch.deploy.slurm.ops as ops

    store = StateStore(tmp_path / "state")
    rec = slurm_record(tmp_path, store)
    job_event(rec.slurm.log_dir, 1700000000.5, "watching", node="k3n1")
    job_event(rec.slurm.log_dir, 1700000002.0, "detected", unit="serve-0", process="serve-0", reason="serve-0 exited with code 9")
    eventlog.append(store, Event(time=1700000001.0, kind="hook-failed", deployment="u-sv", reason="a state-dir event"))
    assert [e.kind for e in api.events("u-sv", state_dir=store.root)] == ["watching", "hook-failed", "detected"]  # merged, by time
    followed = list(api.follow_events("u-sv", lambda: True, state_dir=store.root))
    assert [e.kind for e in followed] == ["watching", "hook-failed", "detected"]
    monkeypatch.setattr(ops, "SlurmClient", lambda: FakeSlurm([JobInfo("42", "RUNNING", ["k3n1"])]))
    report = api.down("u-sv", state_dir=store.root)
    assert report.clean and store.try_load("u-sv") is None
    shutil.rmtree(rec.slurm.log_dir)  # the job's log directory may go too: its events were adopted
    assert [e.kind for e in api.events("u-sv", state_dir=store.root)] == ["watching", "hook-failed", "detected"]  # each once


def test_supervise_says_a_self_supervising_job_needs_no_supervisor_and_plain_jobs_get_the_hint(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    slurm_record(tmp_path, store)
    res = subprocess.run([sys.executable, "-m", "k3launch", "supervise", "u-sv", "--state-dir", str(store.root)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.splitlines() == ["error: u-sv supervises itself: job 42 restarts failed steps inside its allocation [self-supervised]",
                                       "hint: `k3launch events u-sv` shows what it did, `k3launch status u-sv` its restarts"]
    with pytest.raises(K3Error, match="supervises itself"):
        api.supervise_detached("u-sv", state_dir=store.root)
    slurm_record(tmp_path, store, supervised=None)
    with pytest.raises(K3Error) as plain:
        api.supervise("u-sv", state_dir=store.root)
    assert plain.value.code == "not-supported" and "`k3launch up --supervise`" in plain.value.hint


def test_up_supervise_is_refused_where_a_login_node_supervises_and_nothing_starts(tmp_path: Path) -> None:
    plan = api.plan(None, strategy="single_node_tp", name="u-local")
    with pytest.raises(K3Error) as ei:
        api.up(plan, None, state_dir=tmp_path, supervise=True)
    assert ei.value.code == "not-supported" and "supervise NAME --detach" in ei.value.hint
    assert not StateStore(tmp_path).list()


def test_a_supervised_launch_renders_the_watch_records_the_policy_and_sets_the_last_jobs_events_aside(tmp_path: Path) -> None:
    inv = Inventory.model_validate({"name": "u", "backend": "slurm", "hardware": "b300", "engine": "sim", "defaults": {"runtime": "bare"},
                                    "slurm": {"container": "bare", "log_dir": str(tmp_path / "logs")},
                                    "restart": {"max_restarts": 2, "backoff": 1}})
    plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inv, name="u-launch")
    old = tmp_path / "logs" / "u-launch" / "events.jsonl"
    old.parent.mkdir(parents=True)
    old.write_text('{"time": 1.0, "kind": "failed", "deployment": "u-launch", "reason": "an earlier job"}\n')
    fake = FakeSlurm([JobInfo("42", "PENDING", [], "Resources")])
    policy = api.lifecycle.self_policy(inv, {"window": 60})
    assert policy is not None and (policy.max_restarts, policy.backoff, policy.window, policy.start_timeout) == (2, 1, 60, None)
    sl = SlurmLaunch(plan, inv, StateStore(tmp_path / "state"), client=fake, supervise=policy)
    sl.start()
    want = policy.model_copy(update={"start_timeout": api.ready_timeout(plan)})  # the plan's ready timeout (VLLM_ENGINE_READY_TIMEOUT_S)
    assert want.start_timeout == 3600 and sl.record.slurm.supervised == want
    script = Path(sl.record.slurm.script).read_text()
    assert script.endswith("k3_unit serve-0 serve serve-0=http://\"$K3_ADDR_0\":8000/health\nk3_watch\n")
    assert "K3_RS_POLICY=on-failure K3_RS_MAX=2 K3_RS_WINDOW_MS=60000 K3_RS_BACKOFF_MS=1000" in script
    assert not old.exists() and (old.parent / "events.jsonl.1").is_file()
    assert SlurmRecord.model_validate_json(sl.record.to_json()).slurm.supervised == sl.record.slurm.supervised


def test_a_stop_request_during_a_restart_stops_everything_and_starts_nothing_more(tmp_path: Path) -> None:
    """serve-1 exits; the restart stops serve-0, which ignores SIGTERM (3 s grace); SIGTERM to the job
    script (`down`) comes during that wait: the job stops every step, ends cleanly, and the restart
    never starts its steps again."""
    plan, slurm, _ = case_plan("multi_node_tp_2")
    policy = RestartPolicy(max_restarts=3, poll=0.1, start_timeout=30)
    logs = tmp_path / "logs"
    t0 = time.monotonic()
    res, out, left = run_supervised(make_sbatch_string(plan, slurm, str(logs), supervise=policy), tmp_path, "serve-1:1:0.3:9",
                                    deaf="serve-0", term_on="restarting", timeout=30)
    took = time.monotonic() - t0
    assert res.returncode == 0 and "k3launch: stop requested (SIGTERM); stopping the deployment" in res.stdout, res.stdout + res.stderr
    assert took < 12, took  # the grace (3 s), then SIGKILL: not the restart's grace and then the job's again, twice
    names = [next(w.split("=", 1)[1] for w in a if w.startswith("--job-name=")) for a in argvs(out)]
    assert sorted(names) == ["serve-0", "serve-1"]  # started once each: the restart started nothing
    assert left == []  # serve-0 too, which ignored SIGTERM
    assert [json.loads(ln)["kind"] for ln in (logs / "events.jsonl").read_text().splitlines()] == ["watching", "detected", "restarting"]


def test_following_logs_picks_up_a_restarted_steps_new_log(tmp_path: Path) -> None:
    from k3launch.deploy.slurm.ops import follow_files

    store = StateStore(tmp_path / "state")
    rec = slurm_record(tmp_path, store)
    log = Path(rec.slurm.log_dir) / "serve-0.log"
    log.write_text("a long first life of the engine\n" * 20)
    got: list[str] = []

    def restart() -> None:
        time.sleep(0.3)
        log.rename(log.with_name("serve-0.log.1"))  # as k3_restart_unit does
        log.write_text("second life\n")

    t = threading.Thread(target=restart)
    t.start()
    follow_files(rec, ["serve-0"], got.append, poll_s=0.1, max_s=1.0)
    t.join()
    assert got == ["serve-0| second life"]
