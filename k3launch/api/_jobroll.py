"""A rollout of a Slurm job's copies, inside its allocation (``k3launch rollout`` on a job brought
up with ``--supervise``).

The job's own controller (:mod:`k3launch.deploy.slurm.injob`, on its batch host) is the
deployment's one controller, so a rollout is what it is on a login node: a new revision of the
spec, converged unit by unit behind the router. Only the place differs: the spec goes to the
job's state directory (``<log dir>/control/supervise/NAME.spec.json``, on the filesystem the job
shares with the login node), with both plans bound to the job's hosts (the addresses the router
lists); the controller renders each rolled step's ``srun`` words from the new plan with the job
script's own rendering. This command follows the controller's record there and, when the rollout
converged or stopped, writes the plan each process now runs into the login node's record.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from k3launch.deploy.control.process import JobStore, read_spec
from k3launch.deploy.rollout import RolloutResult, with_processes
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord
from k3launch.models.rollout import RolloutState

POLL_S = 0.5
JOB_CHECK_S = 5.0  # how often the job itself is asked whether it still runs
ADOPT_WAIT_S = 60.0  # the controller looks every `poll` seconds: a revision not taken up by then is said


def _bind(rec: DeploymentRecord, plan: Plan) -> Plan:
    from k3launch.deploy.registry import canary_ops

    return canary_ops(rec.backend, "rollout").served_plan(rec.model_copy(update={"plan": plan}))


def converge_in_job(st: StateStore, name: str, state: RolloutState, say: Callable[[str], None]) -> RolloutResult:
    """Write ``state`` to the job's spec and follow its controller until the rollout converged or stopped."""
    rec = st.load(name)
    job = rec.job
    assert job is not None
    if job.supervised is None:
        raise K3Error("rollout-needs-controller", f"{name}'s job {job.job_id} runs no controller: it fails fast, and nothing in it "
                      "can roll a copy while the others serve", f"bring it up with `k3launch up ... --supervise` (`k3launch down {name}` first)")
    if state.surge:
        raise K3Error("surge-slurm", "--surge needs spare nodes beside the running engines; a Slurm job has only its allocation",
                      "roll copies one at a time (--replicas 2 behind the router), or `down` then `up` the new plan")
    jst = JobStore(job.log_dir)
    with st.lock(name):
        jrec = jst.try_load(name)
        if jrec is None or jrec.state != "ready":
            raise K3Error("job-not-serving", f"the controller of job {job.job_id} does not supervise {name} "
                          f"({'not started yet' if jrec is None else jrec.state})", f"`k3launch status {name}`, `k3launch events {name}`")
        spec = read_spec(jst, name)
        done = jrec.control.revision if jrec.control is not None else 0
        if (jrec.rollout is not None and not jrec.rollout.stopped) or (spec is not None and spec.revision > done and spec.rollout is not None):
            raise K3Error("rollout-running", f"{name} is in a rollout under way", f"`k3launch status {name}` follows it")
        from k3launch.api.supervision import write_spec

        bound = state.model_copy(update={"old": _bind(rec, state.old), "new": _bind(rec, state.new)})
        revision = write_spec(jst, name, rollout=bound)
    say(f"the controller of job {job.job_id} rolls {name} inside its allocation (spec revision {revision})")
    ro = _follow(st, jst, rec, revision, say)
    return _settle(st, name, state, ro)


def _follow(st: StateStore, jst: JobStore, rec: DeploymentRecord, revision: int, say: Callable[[str], None]) -> RolloutState:
    """The job's rollout of spec ``revision`` once it converged (done or stopped), progress said per unit."""
    from k3launch.deploy.registry import backend

    name = rec.name
    seen: dict[str, str] = {}
    t0 = last_check = time.monotonic()
    while True:
        cur = st.try_load(name)
        if cur is None or cur.state != "ready":
            raise K3Error("rollout-ended", f"{name} is {cur.state if cur else 'gone'}: the rollout ended with it", f"`k3launch events {name}`")
        if time.monotonic() - last_check > JOB_CHECK_S:
            last_check = time.monotonic()
            snap = backend(rec.backend).status(cur)
            if (snap.job is not None and snap.job.state != "RUNNING") or snap.state == "failed":
                raise K3Error("rollout-ended", f"job {rec.job.job_id if rec.job else '?'} is {snap.state}: the rollout ended with it",
                              f"`k3launch events {name}`")
        jrec = jst.try_load(name)
        control = jrec.control if jrec is not None else None
        adopted = control is not None and control.revision >= revision
        if not adopted and time.monotonic() - t0 > ADOPT_WAIT_S:
            raise K3Error("rollout-not-adopted", f"the job's controller has not taken up spec revision {revision} in {ADOPT_WAIT_S:g}s",
                          f"`k3launch events {name}`; the rollout is still written and goes on once it does")
        ro = jrec.rollout if jrec is not None else None
        if adopted and ro is not None:
            for u in ro.units:
                if seen.get(u.name) != u.on:
                    seen[u.name] = u.on
                    say(f"{u.name}: {u.on}" + (f" ({u.failed})" if u.failed else ""))
        if adopted and control is not None:
            if ro is None and control.finished is not None and control.finished.revision == revision:
                return control.finished
            if ro is not None and ro.revision == revision and ro.stopped and not any(u.on == "rolling" for u in ro.units):
                return ro
        time.sleep(POLL_S)


def _settle(st: StateStore, name: str, state: RolloutState, ro: RolloutState) -> RolloutResult:
    """The login node's record as the job runs now: the target plan, or a stopped rollout's mix
    (with the rollout kept for ``--continue`` / ``--rollback``); the plans as ``up`` records them."""
    on_new = [p for u in ro.units if u.on == "new" for p in u.processes]
    with st.lock(name):
        rec = st.load(name)
        if ro.stopped:
            rec.plan = with_processes(state.old, state.new, on_new)
            rec.rollout = ro.model_copy(update={"old": state.old, "new": state.new})
        else:
            rec.plan = state.old if ro.back else state.new
            rec.rollout = None
        st.save(rec)
    return RolloutResult.of(rec.plan, ro)
