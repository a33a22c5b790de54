"""The parts of a rollout beyond the controller's decisions: a rollout's result, a half-rolled
plan (:func:`with_processes`), an engine's ``vllm:num_requests_running`` for the drain, vLLM's own
``--shutdown-timeout`` for the grace, and ``--surge`` (:meth:`Roller.surge`), which starts a whole
new set of engines beside the old one, gates it, switches the router and stops the old set as
one action of the controller. Rolling unit by unit is the controller's
(:mod:`k3launch.models.control.converge` decides, :mod:`k3launch.deploy.control.actor` acts). Time is read through
``clock`` and waits go through ``sleep`` so tests can drive it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from k3launch.deploy.base import Watcher
from k3launch.models.plan import Plan, Process
from k3launch.models.record import DeploymentRecord
from k3launch.models.rollout import RolloutState
from k3launch.models.supervise import Unit
from k3launch.transport import http

GRACE_S = 30.0
SHUTDOWN_MARGIN_S = 10.0  # past a process's own --shutdown-timeout before SIGKILL
POLL_S = 0.5
DRAIN_POLL_S = 0.1  # a request that ends just after a look should not cost a whole POLL_S of drain


@dataclass
class UnitRolled:
    unit: str
    seconds: float
    drained_s: float  # of which waiting for in-flight requests
    downtime_s: float = 0.0  # no router in front (--allow-downtime): from its stop until it served again


Gate = Callable[[Plan, Sequence[Process]], str]
"""An extra check of restarted engines (the canary): "" when they pass, else why not."""


@dataclass
class RolloutResult:
    plan: Plan  # what runs now (the target plan if every unit rolled)
    rolled: list[UnitRolled] = field(default_factory=list)
    failed: str = ""  # the units that failed their gate, comma separated ("" if none)
    reason: str = ""
    logs: list[str] = field(default_factory=list)  # kept log tails of the failed unit

    @property
    def ok(self) -> bool:
        return not self.failed

    @classmethod
    def of(cls, plan: Plan, ro: RolloutState) -> RolloutResult:
        """What a converged rollout (done, or stopped with every unit back on one plan) came to."""
        rolled = [UnitRolled(u.name, u.seconds, u.drained_s, u.downtime_s) for u in ro.units if u.on == ro.target and u.seconds]
        bad = [u.name for u in ro.units if u.failed]
        return cls(plan, rolled=rolled, failed=", ".join(bad) if ro.stopped else "", reason=ro.stopped, logs=list(ro.logs))


def with_processes(base: Plan, source: Plan, ids: Sequence[str]) -> Plan:
    """``base`` with the processes ``ids`` as ``source`` has them (a plan half rolled)."""
    theirs = {p.id: p for p in source.processes if p.id in ids}
    return base.model_copy(update={"processes": [theirs.get(p.id, p) for p in base.processes]})


def shutdown_timeout(p: Process) -> float:
    """``--shutdown-timeout S`` (or ``=S``) of an engine's argv; 0 when absent or unreadable."""
    for i, word in enumerate(p.argv):
        value = word.partition("=")[2] if word.startswith("--shutdown-timeout=") else \
            (p.argv[i + 1] if word == "--shutdown-timeout" and i + 1 < len(p.argv) else None)
        if value is not None:
            try:
                return max(0.0, float(value))
            except ValueError:
                return 0.0
    return 0.0


def pd_plan(plan: Plan) -> bool:
    """A P/D plan: prefill and decode instances behind vllm-router's P/D mode."""
    return any(p.role in ("prefill", "decode") for p in plan.processes)


def _url(p: Process) -> str:
    return f"http://{p.address}:{p.http_port}"


def running_requests(url: str, timeout: float = 3.0) -> float | None:
    """The engine's ``vllm:num_requests_running`` (summed over its label sets); None if unreadable."""
    from k3launch.transport.http import metric_sums

    got = metric_sums(url, ("vllm:num_requests_running",), timeout)
    return None if got is None else got.get("vllm:num_requests_running")


class Roller:
    """A ``--surge`` over ``watcher``, from ``current`` (what runs now) to ``target``; ``gate`` is
    an extra check of the new engines. (A surge is refused for P/D: its router is always told.)"""

    def __init__(self, watcher: Watcher, current: Plan, target: Plan, *, drain_timeout: float, start_timeout: float,
                 grace_s: float = GRACE_S, say: Callable[[str], None] = lambda _: None, gate: Gate | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 route: Callable[[Process, Sequence[str], Sequence[str]], str | None] | None = None) -> None:
        self.w, self.current, self.target = watcher, current, target
        # the router's worker list changes through the controller's one router function (its events), when given
        self.route = route or watcher.reroute
        self.drain_timeout, self.start_timeout, self.grace_s = drain_timeout, start_timeout, grace_s
        self.say, self.extra_gate, self.clock, self.sleep = say, gate, clock, sleep
        self.router = next((p for p in current.processes if p.role == "router"), None)

    def surge(self, both: Plan, final: Plan, new: Sequence[Unit], old: Sequence[Unit]) -> RolloutResult:
        """``--surge``: start the ``new`` units (on spare nodes; ``both`` is the plan with both
        sets) while the ``old`` ones serve, gate them, add them to the router, take the old ones
        out, drain and stop them; the watcher then runs on ``final``. A new set that fails the
        doctor or its gate is stopped and the old one never left the router."""
        result = RolloutResult(self.current)
        t0 = self.clock()
        names = ", ".join(u.name for u in new)
        new_ids = [p for u in new for p in u.processes]
        spares = sorted({n for u in new for n in u.nodes})
        self.w.adopt(both, "")
        self.say(f"{names}: starting beside the running engines on {', '.join(spares)}")
        refused = self.w.check(both, spares)
        failed = {new[0].name: "the doctor refused a spare: " + "; ".join(refused[:3])} if refused else {}
        if not failed:
            for u in new:
                broken = self.w.restart(u, self.grace_s, lambda: True)
                if broken:
                    failed[u.name] = broken[0].message
            failed |= self._gate(both, [u for u in new if u.name not in failed])
        if failed:
            result.logs = [str(p) for p in self.w.keep_logs(new_ids)]
            self._abandon(new_ids)
            return self._stop(result, ", ".join(failed), "; ".join(f"{n}: {w}" for n, w in failed.items()) + "; the running engines were not touched")
        old_urls = [_url(p) for p in self.current.processes if p.role != "router" and p.http_port]
        new_urls = [_url(p) for p in both.processes if p.id in new_ids and p.http_port]
        if self.router is not None:
            why = self.route(self.router, [], new_urls) or self.route(self.router, old_urls, [])
            if why:
                self.route(self.router, new_urls, old_urls)  # as it was: the old set serves on
                self._abandon(new_ids)
                return self._stop(result, names, f"the router did not switch to {names}: {why}")
        self.say(f"{names}: serving; the old engines are out of the router, draining")
        drained = self._drain(old_urls)
        old_ids = [p for u in old for p in u.processes]
        self.w.stop(old_ids, max([self._grace(self.current, u) for u in old], default=self.grace_s))
        self._forget(old_ids)
        self.w.adopt(final, "")
        for u in new:
            result.rolled.append(UnitRolled(u.name, self.clock() - t0, drained))
        result.plan = final
        self.say(f"{names}: surged in {self.clock() - t0:.1f}s")
        return result

    def _abandon(self, new_ids: Sequence[str]) -> None:
        """A surge's new set stopped and forgotten: the watcher runs on the plan it had."""
        self.w.stop(new_ids, self.grace_s)
        self._forget(new_ids)
        self.w.adopt(self.current, "")

    def _forget(self, ids: Sequence[str]) -> None:
        """Stopped processes leave the record (a unit's restart would otherwise find them)."""
        def drop(rec: DeploymentRecord) -> None:
            for i in ids:
                rec.processes.pop(i, None)
        self.w.note(drop)

    def _stop(self, result: RolloutResult, names: str, why: str) -> RolloutResult:
        result.failed, result.reason = names, why
        return result

    def _drain(self, urls: Sequence[str]) -> float:
        t0 = self.clock()
        while self.clock() - t0 < self.drain_timeout:
            left = [running_requests(u) for u in urls]
            if all(n is None or n == 0 for n in left):
                break
            self.sleep(DRAIN_POLL_S)
        return self.clock() - t0

    def _grace(self, plan: Plan, u: Unit) -> float:
        """SIGTERM to SIGKILL for ``u`` as ``plan`` runs it: vLLM's ``--shutdown-timeout S`` drains
        in-flight requests for up to S seconds after SIGTERM, so the grace covers that, and more."""
        asked = [shutdown_timeout(p) for p in plan.processes if p.id in u.processes]
        return max([self.grace_s, *(s + SHUTDOWN_MARGIN_S for s in asked if s)])

    def _gate(self, plan: Plan, group: Sequence[Unit]) -> dict[str, str]:
        """Every HTTP server of each unit healthy (the watcher's look: it also sees a process that
        exited) within ``start_timeout``, then a real completion from each engine and the extra
        gate; unit name -> why not."""
        deadline = self.clock() + self.start_timeout
        failed: dict[str, str] = {}
        waiting = list(group)
        while waiting:
            obs = self.w.observe(self.clock())
            for u in list(waiting):
                dead = next((pid for pid in u.processes if pid in obs.dead), None)
                if dead is not None:
                    failed[u.name] = f"{dead} {obs.dead[dead]}"
                    waiting.remove(u)
                elif all(obs.healthy.get(pid) for pid in u.http):
                    waiting.remove(u)
            if waiting and self.clock() > deadline:
                failed.update({u.name: f"{u.name} did not answer /health within {self.start_timeout:g}s" for u in waiting})
                break
            if waiting:
                self.sleep(POLL_S)
        for u in group:
            engines = [p for p in plan.processes if p.id in u.http and p.role != "router"]
            if u.name in failed or not engines:
                continue
            for p in engines:
                c = http.completion(_url(p), plan.model, timeout=max(10.0, deadline - self.clock()))
                if not c.ok:
                    failed[u.name] = f"{p.id} serves /health but its completion failed: {c.detail}"
                    break
            if u.name not in failed and self.extra_gate is not None:
                why = self.extra_gate(plan, engines)
                if why:
                    failed[u.name] = why
        return failed
