"""Converging to a number of copies, the pure part: ``scale`` out and in, and hot standbys.

A deployment of copies (``--replicas``) has a desired count of serving copies and of standbys
(the spec's ``replicas`` and ``standby``). These decisions, part of
:class:`~k3launch.models.control.decisions.Supervision`, move it there:

* **Out**: while every unit serves, one :class:`Resize` to the total; the executor plans the
  deployment again with that many copies, every existing copy keeping its nodes (planning's
  ``keep``), checks the new nodes with the doctor, and starts the new copies, which then serve
  as any restarted unit does.
* **In**: the copies with the highest indices leave: out of the router, drained (their running
  requests finish, or ``drain_timeout`` passes), then one :class:`Resize` stops them and the
  deployment runs on the smaller plan.
* **Standbys** are serving copies kept out of the router. When a serving copy fails, a standby
  that serves takes its place in the router in the same look (a ``promoted`` event), and the
  failed copy restarts as the standby: capacity comes back in seconds, not after a bring-up.

A copy is named by its process ids' prefix (``r2-serve-0`` is copy ``r2``); copies leave and join
as wholes. A deployment keeps at least two copies (one copy's plan has other process ids and no
router of its own); P/D pools are not scaled here.
"""

from __future__ import annotations

import re

from k3launch.models.control.actions import Action, Resize
from k3launch.models.control.memory import Memory, UnitState
from k3launch.models.control.observation import Observation
from k3launch.models.plan import Plan
from k3launch.models.supervise import Event, EventKind, Unit

DRAIN_S = 120.0  # a leaving copy's in-flight requests get this long
_COPY = re.compile(r"^(r\d+)-")


def copy_of(name: str) -> str | None:
    """``r2`` for ``r2-serve-0`` (or the group ``r2-serve``); None outside copies."""
    m = _COPY.match(name)
    return m.group(1) if m else None


def plan_copies(plan: Plan) -> list[str]:
    """The copies a plan runs (``r0``, ``r1``, ...), by index; none for a plan without copies."""
    return sorted({c for p in plan.processes if p.role != "router" and (c := copy_of(p.id)) is not None}, key=lambda c: int(c[1:]))


class Scale:
    """The copy-count half of :class:`~k3launch.models.control.decisions.Supervision`."""

    units: list[Unit]
    memory: dict[str, Memory]
    copies_wanted: int | None
    standby_wanted: int
    standby: set[str]
    resizing: bool
    resize_blocked: float  # a failed resize is tried again only after this time

    def _event(self, now: float, kind: EventKind, unit: Unit | None = None, **kw: object) -> Event:
        raise NotImplementedError

    def copies(self) -> dict[str, list[Unit]]:
        """Copy -> its units, by index."""
        out: dict[str, list[Unit]] = {}
        for u in self.units:
            c = copy_of(u.name)
            if c is not None and u.kind != "router":
                out.setdefault(c, []).append(u)
        return dict(sorted(out.items(), key=lambda kv: int(kv[0][1:])))

    def out_of_router(self, u: Unit) -> bool:
        """A standby's or a leaving copy's unit: serving, but not the router's."""
        return copy_of(u.name) in self.standby or self.memory[u.name].leaving

    def _serving(self, units: list[Unit]) -> bool:
        return all(self.memory[u.name].state is UnitState.SERVING for u in units)

    def promote(self, u: Unit, now: float, events: list[Event], then: str = "restarts") -> None:
        """A serving copy failed (or starts rolling: ``then`` "rolls"): a standby that serves takes
        its place in the router at once, and the copy restarts (rolls) as the standby."""
        failed = copy_of(u.name)
        if failed is None or failed in self.standby or self.memory[u.name].leaving:
            return
        ready = next((c for c, us in self.copies().items() if c in self.standby and self._serving(us)), None)
        if ready is None:
            return
        self.standby.discard(ready)
        self.standby.add(failed)
        events.append(self._event(now, "promoted", u, reason=f"standby {ready} joins the router in place of {failed}, which {then} as the standby"))

    def scaled(self) -> bool:
        """The copy count and the standbys are as wanted, and every unit serves."""
        if self.copies_wanted is None:
            return True
        cps = self.copies()
        return (not self.resizing and len(cps) == self.copies_wanted + self.standby_wanted and len(self.standby) == self.standby_wanted
                and all(self._serving(us) for us in cps.values()))

    def scale(self, obs: Observation, events: list[Event], calm: bool) -> list[Action]:
        """Out, in, or standbys reassigned; ``calm``: no rollout or other change under way."""
        cps = self.copies()
        if self.copies_wanted is None or not cps or self.resizing or not calm:
            return []
        now, total = obs.now, self.copies_wanted + self.standby_wanted
        if len(cps) < total:
            if now < self.resize_blocked or not all(self._serving(us) for us in cps.values()):
                return []
            self.resizing = True
            events.append(self._event(now, "scaling", reason=f"{len(cps)} -> {total} copies ({self.standby_wanted} standby)"))
            return [Resize(total, (), f"out to {total} copies")]
        if len(cps) > total:
            leaving = list(cps)[total:]
            units = [u for c in leaving for u in cps[c]]
            for u in units:
                m = self.memory[u.name]
                if not m.leaving:
                    m.leaving, m.since = True, now
                    if m.state is UnitState.SERVING:
                        m.state, m.until = UnitState.DRAINING, now + DRAIN_S
                        events.append(self._event(now, "scaling", u, reason=f"{copy_of(u.name)} leaves: out of the router, draining"))
            done = [u for u in units if self.memory[u.name].state is not UnitState.DRAINING
                    or all(obs.running.get(p) in (None, 0.0) for p in u.http) or now >= self.memory[u.name].until]
            if len(done) < len(units):
                return []
            self.resizing = True
            self.standby -= set(leaving)
            return [Resize(total, tuple(leaving), f"in to {total} copies: {', '.join(leaving)} drained")]
        self._assign(list(cps), now, events)
        return []

    def _assign(self, names: list[str], now: float, events: list[Event]) -> None:
        """Standbys as many as wanted: those there stay; more are the highest-indexed serving copies."""
        self.standby &= set(names)
        while len(self.standby) > self.standby_wanted:
            back = min(self.standby, key=lambda c: int(c[1:]))
            self.standby.discard(back)
            events.append(self._event(now, "promoted", reason=f"standby {back} joins the router (fewer standbys wanted)"))
        for c in reversed(names):
            if len(self.standby) >= self.standby_wanted or len(names) - len(self.standby) <= (self.copies_wanted or 0):
                break
            if c not in self.standby:
                self.standby.add(c)
                events.append(self._event(now, "standby", reason=f"{c} serves as a standby, out of the router"))

    def resize_failed(self, why: str, now: float) -> list[Event]:
        self.resizing = False
        self.resize_blocked = now + 60.0
        for m in self.memory.values():
            if m.leaving and m.state is UnitState.DRAINING:
                m.leaving, m.state = False, UnitState.SERVING
        return [self._event(now, "scale-failed", reason=f"{why}; tried again in 60s")]
