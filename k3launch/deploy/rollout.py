"""Apply a rollout one recovery unit at a time, through a supervisor's :class:`Watcher`.

For each unit whose processes change (engines first, the router last):

1. out of the router: its HTTP servers leave vllm-router's worker list (``/remove_worker``), so
   no new request reaches them;
2. drain: wait until each of them reports ``vllm:num_requests_running`` 0 on ``/metrics`` (or
   ``drain_timeout`` passes: what still runs is cut by the stop), then stop the unit as a
   supervisor restart does (SIGTERM, SIGKILL after the grace);
3. start it on the new plan (same nodes and ports: the rollout's preview refuses anything else);
4. gate: every HTTP server of the unit answers ``/health`` and a real completion within
   ``start_timeout``; then back into the router (``/add_worker``).

A unit that fails its gate is started again on the plan it had (the same steps), and the rollout
stops there with the reason and the unit's last log lines kept; the units before it stay on the
new plan, the rest on the old one, and the record says which runs which. A unit without a router
in front (one engine alone) is simply restarted: that is downtime, and the caller must have
asked for it. Time is read through ``clock`` and waits go through ``sleep`` so tests can drive it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from k3launch.deploy.base import Watcher
from k3launch.models.plan import Plan, Process
from k3launch.models.supervise import Unit
from k3launch.transport import http

GRACE_S = 30.0
POLL_S = 0.5


@dataclass
class UnitRolled:
    unit: str
    seconds: float
    drained_s: float  # of which waiting for in-flight requests


@dataclass
class RolloutResult:
    plan: Plan  # what runs now (the new plan if every unit rolled)
    rolled: list[UnitRolled] = field(default_factory=list)
    failed: str = ""  # the unit that failed its gate ("" if none)
    reason: str = ""
    logs: list[str] = field(default_factory=list)  # kept log tails of the failed unit

    @property
    def ok(self) -> bool:
        return not self.failed


def with_processes(base: Plan, source: Plan, ids: Sequence[str]) -> Plan:
    """``base`` with the processes ``ids`` as ``source`` has them (a plan half rolled)."""
    theirs = {p.id: p for p in source.processes if p.id in ids}
    return base.model_copy(update={"processes": [theirs.get(p.id, p) for p in base.processes]})


def _url(p: Process) -> str:
    return f"http://{p.address}:{p.http_port}"


def running_requests(url: str, timeout: float = 3.0) -> float | None:
    """The engine's ``vllm:num_requests_running`` (summed over its label sets); None if unreadable."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None
    vals = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:num_requests_running") and " " in ln]
    return sum(vals) if vals else None


class Roller:
    """One rollout's steps over ``watcher`` (already running on ``old``)."""

    def __init__(self, watcher: Watcher, old: Plan, new: Plan, *, drain_timeout: float, start_timeout: float, grace_s: float = GRACE_S,
                 say: Callable[[str], None] = lambda _: None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.w, self.old, self.new = watcher, old, new
        self.drain_timeout, self.start_timeout, self.grace_s = drain_timeout, start_timeout, grace_s
        self.say, self.clock, self.sleep = say, clock, sleep
        self.router = next((p for p in old.processes if p.role == "router"), None)

    def run(self, units: Sequence[Unit]) -> RolloutResult:
        current = self.old
        result = RolloutResult(current)
        for u in units:
            t0 = self.clock()
            urls = [_url(p) for p in current.processes if p.id in u.http and u.kind != "router"]
            router = self.router if urls else None  # the router in front of this unit, if any
            if router is not None:
                why = self.w.reroute(router, urls, [])
                if why:
                    return self._stop(result, u, f"the router did not take {u.name} out: {why}")
            self.say(f"{u.name}: out of the router, draining" if router else f"{u.name}: restarting")
            drained = self._drain(urls) if router else 0.0
            target = with_processes(current, self.new, u.processes)
            why = self._swap(target, u)
            if why:
                self.say(f"{u.name}: {why}; rolling it back")
                result.logs = [str(p) for p in self.w.keep_logs(u.processes)]
                back = self._swap(current, u)
                if router is not None and not back:
                    self.w.reroute(router, [], urls)
                result.plan = current
                return self._stop(result, u, why + (f"; rolling back failed too: {back}" if back else ""))
            if router is not None:
                self.w.reroute(router, [], urls)
            current = target
            result.plan = current
            result.rolled.append(UnitRolled(u.name, self.clock() - t0, drained))
            self.say(f"{u.name}: rolled in {self.clock() - t0:.1f}s")
        return result

    def _stop(self, result: RolloutResult, u: Unit, why: str) -> RolloutResult:
        result.failed, result.reason = u.name, why
        return result

    def _drain(self, urls: Sequence[str]) -> float:
        t0 = self.clock()
        while self.clock() - t0 < self.drain_timeout:
            left = [running_requests(u) for u in urls]
            if all(n is None or n == 0 for n in left):
                break
            self.sleep(POLL_S)
        return self.clock() - t0

    def _swap(self, plan: Plan, u: Unit) -> str:
        """Run ``u`` on ``plan``; "" once it passes the gate, else why not."""
        self.w.adopt(plan, "")
        failed = self.w.restart(u, self.grace_s, lambda: True)
        if failed:
            return failed[0].message
        return self._gate(plan, u)

    def _gate(self, plan: Plan, u: Unit) -> str:
        """Every HTTP server of ``u`` healthy (the watcher's look: it also sees a process that
        exited) within ``start_timeout``, then a real completion from each engine; "" or why not."""
        deadline = self.clock() + self.start_timeout
        while True:
            obs = self.w.observe(self.clock())
            dead = next((pid for pid in u.processes if pid in obs.dead), None)
            if dead is not None:
                return f"{dead} {obs.dead[dead]}"
            if all(obs.healthy.get(pid) for pid in u.http):
                break
            if self.clock() > deadline:
                return f"{u.name} did not answer /health within {self.start_timeout:g}s"
            self.sleep(POLL_S)
        for p in plan.processes:
            if p.id in u.http and p.role != "router":
                c = http.completion(_url(p), plan.model, timeout=max(10.0, deadline - self.clock()))
                if not c.ok:
                    return f"{p.id} serves /health but its completion failed: {c.detail}"
        return ""
