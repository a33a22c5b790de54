"""``canary``: replay a deployment's recorded greedy answers on every target and compare
(``rebaseline``: record new answers first), and ``record_at_ready``, what ``up`` does once a
deployment serves. The targets come through the backend seam (``Feature.CANARY``: where each
HTTP server answers from this machine); the requests and the comparison are
:mod:`k3launch.deploy.canary`'s. Docs: docs/canary.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from k3launch.api._common import store
from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.deploy.state import StateStore
    from k3launch.models.canary import CanaryReport, Tolerance
    from k3launch.models.record import CanaryNote, DeploymentRecord

DEFAULT_TIMEOUT_S = 30.0  # k3launch.deploy.canary.DEFAULT_TIMEOUT_S, without importing it for a signature


def _tolerance(match_prefix: int | None) -> Tolerance | None:
    from k3launch.models.canary import Tolerance
    from k3launch.util import bounds

    return None if match_prefix is None else Tolerance(prefix=int(bounds.CANARY_PREFIX.parse("match_prefix", match_prefix)))


def canary(name: str, *, rebaseline: bool = False, match_prefix: int | None = None, timeout: float = DEFAULT_TIMEOUT_S,
           state_dir: str | Path | None = None) -> CanaryReport:
    """Replay ``name``'s canary baseline on every target — each engine HTTP server, each (prefill,
    decode) pairing of a P/D deployment, the router — and compare (``report.ok``: every target
    matched). ``rebaseline``: record the answers anew first (a model or sampling change), from the
    first target that answers, and compare every other target with them. ``match_prefix``: only
    the first N tokens of each answer must match (docs/canary.md, "Tolerance"); kept in a new
    baseline, else for this replay only. ``timeout``: seconds for one request.

    K3Error (exit 2): an unknown deployment, one that is not ready, one without a baseline
    (``no-baseline``: rebaseline records one), a backend without the canary."""
    from k3launch.deploy import canary as io
    from k3launch.deploy.registry import canary_ops
    from k3launch.models.canary import CanaryReport, rebaseline_reasons
    from k3launch.util import bounds

    tol = _tolerance(match_prefix)
    timeout = float(bounds.CANARY_TIMEOUT.parse("timeout", timeout))
    st = store(state_dir)
    rec = st.load(name)
    if rec.state != "ready":
        raise K3Error("not-ready", f"{name} is {rec.state}: the canary asks a ready deployment", f"`k3launch status {name}`")
    plan = canary_ops(rec.backend, "the canary").served_plan(rec)
    if rebaseline:
        with st.lock(name):  # a rollout or a down meanwhile would leave a baseline of half a plan
            baseline, reports = io.record(plan, name, tolerance=tol, timeout=timeout)
            io.save(st, baseline)
        return CanaryReport(deployment=name, baseline=baseline, targets=reports, recorded=True)
    found = io.load(st, name)
    if found is None:
        raise K3Error("no-baseline", f"{name} has no canary baseline", f"`k3launch canary {name} --rebaseline` records its answers now")
    reports = io.replay(plan, found, tolerance=tol, timeout=timeout)
    return CanaryReport(deployment=name, baseline=found, targets=reports, rebaseline=rebaseline_reasons(found, plan))


def record_at_ready(rec: DeploymentRecord, st: StateStore) -> CanaryNote:
    """``up``'s canary, once ``rec`` serves: record the baseline and say how it went. Never raises:
    a deployment that serves is not failed by its canary; what went wrong is the note's message
    (and the record's, saved here)."""
    from k3launch.deploy import canary as io
    from k3launch.deploy.registry import canary_ops
    from k3launch.models.record import CanaryNote

    try:
        baseline, reports = io.record(canary_ops(rec.backend, "the canary").served_plan(rec), rec.name)
        io.save(st, baseline)
        bad = [r for r in reports if r.outcome != "ok"]
        said = f"canary recorded from {baseline.source}: {len(reports) - len(bad)} of {len(reports)} target(s) agree"
        if bad:
            said += "; " + "; ".join(f"{r.target} {r.outcome}" + (f" ({r.reason})" if r.reason else "") for r in bad[:4])
            said += f"; `k3launch canary {rec.name}` shows the answers"
        note = CanaryNote(recorded=True, agree=not bad, message=said)
    except K3Error as exc:
        note = CanaryNote(recorded=False, agree=False, message=f"no canary recorded: {exc.message}; {exc.hint}")
    except Exception as exc:
        note = CanaryNote(recorded=False, agree=False, message=f"no canary recorded: {type(exc).__name__}: {exc}")
    rec.canary = note
    try:
        st.save(rec)
    except K3Error:
        pass  # the note is still on up's output
    return note
