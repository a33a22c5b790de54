"""``k3launch scale NAME --replicas N [--standby K]``: how many copies of the engine serve, and how
many hot standbys wait beside them.

A new revision of the deployment's spec, converged by its controller
(:mod:`k3launch.models.control.scaling`, :func:`k3launch.api._converge.converge`): out, new copies start
on free nodes of the inventory (the doctor first; cordoned nodes and other deployments' nodes are
not free; warm compile caches and staged weights are used as ``up`` uses them); in, the copies
with the highest indices leave the router, drain and stop. Standbys serve, gated, out of the
router, and take a failed copy's place at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k3launch.api._common import store
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.access import Access
from k3launch.models.backends import Feature, require
from k3launch.models.control.scaling import plan_copies
from k3launch.models.record import DeploymentRecord

MIN_COPIES = 2  # one copy's plan has other process ids and no router: `down` and `up` for that


@dataclass(frozen=True)
class ScaleResult:
    copies: int  # copies the deployment runs now
    standby: list[str]  # of which standbys
    seconds: float


def scale(name: str, *, replicas: int | None = None, standby: int | None = None, say: Callable[[str], None] = lambda _: None,
          state_dir: str | Path | None = None, access: Access = Access()) -> ScaleResult:
    """Converge ``name`` to ``replicas`` serving copies and ``standby`` standbys (None: as now).
    Refused: a deployment without copies, a P/D one, fewer than two copies in all, a rollout under way."""
    import time

    from k3launch.api._converge import converge
    from k3launch.deploy.control.process import read_spec

    st = store(state_dir)
    rec = st.load(name)
    require(rec.backend, Feature.ROLLOUT, "scale")
    if rec.state != "ready":
        raise K3Error("not-ready", f"{name} is {rec.state}: only a ready deployment is scaled", f"`k3launch status {name}`")
    if rec.job is not None:
        raise K3Error("scale-slurm", "a Slurm job's copies are not scaled yet: its controller runs inside the allocation, "
                      "whose nodes Slurm gave it", f"`k3launch down {name}`, then `up --replicas N` with the count you want")
    have = plan_copies(rec.plan)
    if not have:
        raise K3Error("scale-no-copies", f"{name} is not a deployment of copies behind a router",
                      f"bring it up with --replicas 2 or more (`k3launch down {name}`, then `up --replicas N`)")
    if any(p.role in ("prefill", "decode") for p in rec.plan.processes):
        raise K3Error("scale-pd", "P/D pools are not scaled yet: vllm-router 0.1.17's P/D mode cannot add an instance over HTTP",
                      "bring it up again with other --prefill-nodes/--decode-nodes")
    spec = read_spec(st, name)
    now_standby = len(rec.control.standby) if rec.control is not None else 0
    want_standby = standby if standby is not None else (spec.standby if spec is not None else now_standby)
    want = replicas if replicas is not None else (spec.replicas if spec is not None and spec.replicas else len(have) - want_standby)
    if want < 1 or want_standby < 0:
        raise K3Error("bad-value", f"--replicas {want} --standby {want_standby}: at least one copy serves, standbys are 0 or more",
                      "e.g. --replicas 2 --standby 1")
    if want + want_standby < MIN_COPIES:
        raise K3Error("scale-min", f"{want + want_standby} copy in all: a deployment of copies keeps at least {MIN_COPIES}",
                      f"--standby 1 keeps a second copy ready; `k3launch down {name}` then `up` for one engine alone")
    total = want + want_standby

    def refuse(st: StateStore, cur: DeploymentRecord) -> None:
        if cur.rollout is not None and not cur.rollout.stopped:
            raise K3Error("rollout-running", f"{name} is in a rollout under way", f"`k3launch status {name}` follows it; scale it once it is done")

    def done(cur: DeploymentRecord) -> bool:
        c = cur.control
        return c is not None and c.scaled and c.copies == total and len(c.standby) == want_standby

    t0 = time.monotonic()
    say(f"{name}: {len(have)} -> {total} copies ({want} serving, {want_standby} standby)")
    converge(name, {"replicas": want, "standby": want_standby}, done=done, refuse=refuse, what="scale", say=say,
             state_dir=state_dir, access=access)
    after = st.load(name)
    c = after.control
    if c is None or not done(after):
        raise K3Error("scale-incomplete", f"{name} runs {len(plan_copies(after.plan))} copies, not {total}: "
                      + next((e for e in _last_failure(st, name)), "the controller did not get there"),
                      f"`k3launch events {name}` says why; free or add nodes, then `k3launch scale {name}` again")
    return ScaleResult(copies=c.copies, standby=list(c.standby), seconds=round(time.monotonic() - t0, 3))


def _last_failure(st: StateStore, name: str) -> list[str]:
    from k3launch.deploy import eventlog

    return [e.reason for e in reversed(eventlog.read(st, name, [])) if e.kind == "scale-failed"][:1]
