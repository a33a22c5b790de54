"""Supervision, the pure part: restart policy, recovery units, events, and the decisions.

A supervisor (``k3launch supervise``, :mod:`k3launch.deploy.control.loop`) observes a deployment
every ``poll`` seconds and hands what it saw to :class:`Supervision`, which decides — without any
I/O, time passed in — what to restart, when, and when to give up. Everything it decides is an
:class:`Event` (docs/supervise.md has the table of recovery units and the policy).

Recovery units (:func:`units`): vLLM's multi-node engines are fail-stop — one dead rank of a
multi-node TP, TEP or DEP engine stalls every other rank — so the ranks of one engine restart
together (a *group*: stop every rank, start them as ``up`` does), never one rank into a running
group. An engine on one node (a single-node TP engine, a replica, a P/D instance) restarts
alone (an *engine*) while the router routes around it, and so does the router.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from k3launch.models.phases import Timeline
from k3launch.models.plan import Plan, Process


class RestartPolicy(BaseModel):
    """The inventory's ``restart:`` section (and ``supervise``'s flags): how a supervisor restarts.

    The n-th restart of a unit within ``window`` seconds waits ``backoff * 2**(n-1)`` seconds
    (capped at ``backoff_max``; the first restart goes at once); a unit that failed
    ``max_restarts`` times within ``window`` is given up. ``never``: the first failure is given up.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["on-failure", "never"] = "on-failure"
    max_restarts: int = Field(default=3, ge=0, le=1000)
    window: float = Field(default=3600.0, gt=0, le=30 * 86400)  # seconds
    backoff: float = Field(default=10.0, ge=0, le=3600)  # seconds before the second restart in the window
    backoff_max: float = Field(default=300.0, ge=0, le=86400)
    unhealthy_after: float = Field(default=60.0, gt=0, le=86400)  # /health failing or silent this long: hung
    node_lost_after: float = Field(default=300.0, gt=0, le=30 * 86400)  # unreachable this long: the node is lost
    poll: float = Field(default=2.0, ge=0.1, le=60)  # seconds between looks
    start_timeout: float | None = Field(default=None, gt=0, le=86400)  # a restarted unit must serve within (None: the plan's ready timeout)
    # a restarted process whose session used no CPU this long is hung (0: never); bare processes only
    stall_after: float = Field(default=120.0, ge=0, le=86400)
    # the correctness canary is replayed this often while every engine serves (0: never); a mismatch is an event
    canary_interval: float = Field(default=600.0, ge=0, le=30 * 86400)
    # Plans of DEP pools on this inventory use vLLM's own fault tolerance (planning reads it: `--fault-tolerance`
    # / `--no-fault-tolerance` override it per plan; docs/supervise.md ("vLLM's own fault tolerance")).
    fault_tolerance: bool = False

    def delay(self, restarts_in_window: int) -> float:
        """Seconds to wait before the next restart, after ``restarts_in_window`` earlier ones."""
        if restarts_in_window <= 0:
            return 0.0
        return float(min(self.backoff * 2 ** (restarts_in_window - 1), self.backoff_max))


EventKind = Literal[
    "watching",  # a supervisor started watching
    "stopped-watching",  # it stopped (Ctrl-C, down, the deployment is gone)
    "detected",  # a unit failed: a process exited, hung, or its node stopped answering
    "backoff",  # the restart waits (exponential backoff)
    "restarting",  # the unit is being stopped and started again
    "restarted",  # the unit serves again (seconds: from the detection)
    "restart-failed",  # a restart attempt failed (start command, exit while starting, not serving in time)
    "gave-up",  # the unit failed too often (max_restarts within window): stopped and left so
    "failed",  # the deployment cannot serve any more: everything stopped, state failed
    "node-unreachable",  # a node stopped answering
    "node-back",  # it answers again
    "node-lost",  # it did not answer for node_lost_after
    "cordoned",  # the lost node is kept out of plans until `k3launch uncordon`
    "replaced",  # the unit was re-placed onto spare nodes
    "replace-failed",  # it could not be (no spare fits, a spare failed the doctor): the lost node is retried instead
    "reclaimed",  # what was left on a lost node that answers again was stopped there
    "rerouted",  # the running router was told of a moved engine (its worker routes), instead of restarting
    "hook-failed",  # the --on-event command failed or timed out
    "ft-retry",  # vLLM's fault tolerance: every rank of a DEP pool went unhealthy; retry sent to all
    "recovered",  # ... and every rank is healthy again, without a restart
    "canary-mismatch",  # a canary replay got other tokens than the baseline (prompt, expected, got in the reason)
    "canary-ok",  # a replay matched again after a mismatch
    "rolling",  # a unit of a rollout left the router (or restarts in place) to run the rollout's plan
    "rolled",  # ... and serves it, gated (seconds: from leaving the router)
    "roll-failed",  # ... it failed its gate or did not start: it goes back to the plan it had, and the rollout stops
    "rolled-back",  # ... and serves that plan again
    "rollout-done",  # every unit runs the rollout's plan
    "scaling",  # the copy count changes (scale): copies start, or a leaving copy drains
    "scaled",  # ... and the deployment runs that many copies
    "scale-failed",  # ... it could not (no free node fits, the doctor refused one): tried again later
    "standby",  # a serving copy is kept out of the router as a hot standby
    "promoted",  # a standby joined the router in place of a copy that failed (or fewer standbys are wanted)
    "supervisor-error",  # an action failed in a way k3launch did not foresee (a bug): reported, and the watch goes on
]


class Event(BaseModel):
    """One line of a deployment's event log (``k3launch events``)."""

    model_config = ConfigDict(extra="forbid")

    time: float
    kind: EventKind
    deployment: str
    unit: str | None = None
    process: str | None = None
    node: str | None = None
    reason: str = ""
    attempt: int | None = None  # the restart this is about (1: the first in the window)
    seconds: float | None = None  # restarted: from detection to serving; backoff: the wait
    log_tail: str = ""  # the failing process's last log lines
    # restarted: the unit's bring-up, phase by phase, from its new processes' start (restart-failed: what it reached)
    timeline: Timeline | None = None


UnitKind = Literal["engine", "group", "router"]


@dataclass(frozen=True)
class Unit:
    """What restarts together: one process, or every rank of one multi-node engine."""

    name: str
    kind: UnitKind
    role: str  # serve, prefill, decode, router
    processes: tuple[str, ...]
    nodes: tuple[str, ...]
    http: tuple[str, ...]  # its processes that serve HTTP (probed for /health)


def _coupled(p: Process) -> bool:
    return p.node_rank is not None or p.dp_start_rank is not None


def units(plan: Plan) -> list[Unit]:
    """The plan's recovery units, in the order ``up`` starts them (engines, then the router)."""
    groups: dict[str, list[Process]] = {}
    out: list[Unit] = []
    for p in plan.processes:
        if p.role != "router" and _coupled(p):
            groups.setdefault(p.pool or p.role, []).append(p)
    done: set[str] = set()
    for p in plan.processes:
        key = p.pool or p.role
        if p.id in done:
            continue
        if p.role != "router" and _coupled(p) and len(groups[key]) > 1:
            members = groups[key]
            done.update(m.id for m in members)
            out.append(_unit(key, "group", members))
        else:
            done.add(p.id)
            out.append(_unit(p.id, "router" if p.role == "router" else "engine", [p]))
    return sorted(out, key=lambda u: u.kind == "router")


def _unit(name: str, kind: UnitKind, procs: Sequence[Process]) -> Unit:
    return Unit(name, kind, procs[0].role, tuple(p.id for p in procs), tuple(dict.fromkeys(p.node for p in procs)),
                tuple(p.id for p in procs if p.http_port is not None))


def restarts_of(events: Iterable[Event]) -> int:
    """How many restarts an event log records."""
    return sum(1 for e in events if e.kind == "restarting")


def worker_urls(router: Process) -> list[str]:
    """The engine URLs a (non-P/D) router's argv lists after ``--worker-urls``."""
    argv = router.argv
    if "--worker-urls" not in argv:
        return []
    out = []
    for word in argv[argv.index("--worker-urls") + 1:]:
        if word.startswith("--"):
            break
        out.append(word)
    return out


def reroutable(old: Process, new: Process) -> bool:
    """Whether a running router can become ``new`` by its worker routes alone (add, remove):
    same place, same argv but for the worker URLs, and not a P/D router (vllm-router 0.1.17
    cannot add a prefill or decode worker over HTTP)."""
    if old.role != "router" or "--vllm-pd-disaggregation" in old.argv:
        return False
    same = ("node", "address", "http_port", "env", "image")
    if any(getattr(old, k) != getattr(new, k) for k in same):
        return False
    urls_old, urls_new = worker_urls(old), worker_urls(new)
    return [w for w in old.argv if w not in urls_old] == [w for w in new.argv if w not in urls_new]
