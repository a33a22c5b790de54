"""``up``'s first step on a plan whose weights are staged (the inventory's ``weights.stage``).

Before the doctor checks the nodes, the model's hub cache is copied from the plan's
``stage.source`` (a directory every node sees) into ``stage.dir`` on each engine node whose copy
is not complete there: ``weights fetch --from-path``'s copy (:func:`k3launch.deploy.ssh.fetch.fetch`:
one ``cp -a`` per node, all nodes at once, every user value quoted), with its progress reported
as the ``weights`` stage. A node already complete is not copied to again. Any node left without a
complete copy stops ``up`` before anything starts (``weights-stage-failed``); the copies that did
complete are kept, so the next ``up`` copies only what is missing.
"""

from __future__ import annotations

import time

from k3launch.deploy.ssh.fetch import fetch
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import Stage, StageFn
from k3launch.models.weights import FetchProgress, Source
from k3launch.transport.fleet import Fleet

GB = 1e9
PROGRESS_S = 30.0  # a progress line every so often while the copies run


def stage(plan: Plan, fleet: Fleet, on_stage: StageFn, interval: float = PROGRESS_S) -> None:
    """Copy the model to every engine node of ``plan`` that lacks a complete staged copy."""
    assert plan.stage is not None
    where = f"{plan.stage.dir} from {plan.stage.source}"
    t0 = time.monotonic()

    def progress(p: FetchProgress) -> None:
        if p.nodes_done < p.nodes:
            on_stage(Stage.WEIGHTS, f"staging {plan.model} to {where}: {p.done_bytes / GB:,.1f} of ~{p.total_bytes / GB:,.1f} GB, "
                     f"{p.nodes_done}/{p.nodes} node(s) done")

    rows = fetch(plan, fleet, Source("path", path=plan.stage.source), progress, interval)
    bad = [r for r in rows if not r.complete]
    if bad:
        first = bad[0]
        why = first.error or (first.state.problem() if first.state is not None else "not checked")
        more = f" (and {len(bad) - 1} more node(s))" if len(bad) > 1 else ""
        raise K3Error("weights-stage-failed", f"staging {plan.model} to {where} failed on {first.node}: {why}{more}",
                      "fix the inventory's weights.path (it must hold models--ORG--NAME, or hub/ with it) or the node's disk, "
                      "then `up` again: complete copies are kept")
    copied = sum(1 for r in rows if r.fetched)
    on_stage(Stage.WEIGHTS, f"{plan.model} staged in {plan.stage.dir} on {len(rows)} node(s): copied to {copied}, "
             f"{len(rows) - copied} already complete ({time.monotonic() - t0:,.0f} s)")
