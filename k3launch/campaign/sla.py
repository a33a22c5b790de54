"""The pure core of an SLA search: which load to probe next, whether a probe meets the SLOs, what it found.

No I/O. A campaign with ``sla:`` does not list values of the searched load axis
(``request_rate`` or ``max_concurrency``); for each deployment and each point of its other load
axes, :class:`Search` proposes probes and is told whether each met every SLO:

1. **bracketing**: ``start``, then doubling (capped at ``max``) while probes pass, until one fails
   or ``max`` passes;
2. **bisection** between the highest passing and the lowest failing probe, until they are within
   the tolerance: ``fail - pass <= tolerance * pass`` (for concurrency, whole requests, at least 1);
3. at most ``max_probes`` probes in all.

On a deployment whose latency grows with load, the true capacity C (the highest load that meets
the SLOs) then satisfies ``pass <= C < fail``: the capacity reported is ``pass``, at most the
tolerance below C. The search is a pure function of the probes' verdicts, so a resumed run
replays it over the rows already recorded and measures only the probes still missing; a report
replays it the same way (:func:`replay`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from k3launch.campaign.file import Sla
from k3launch.models.bench import LoadPoint

Status = Literal["found", "at-max", "below-start", "probe-limit", "incomplete"]


@dataclass(frozen=True)
class Probe:
    value: float
    passed: bool
    why: str  # the SLO it missed with its figure, or every SLO's figure when it passed


@dataclass
class Capacity:
    """What a search found: the capacity and the two probes that bound it."""

    variable: str
    status: Status
    capacity: float | None  # the highest passing probe (None: none passed)
    passing: Probe | None  # the probe the capacity is
    failing: Probe | None  # the lowest failing probe above it (None: ``max`` passed, or no probe failed)
    tolerance: float
    probes: list[Probe] = field(default_factory=list)  # in the order they ran

    def bracket(self) -> str:
        lo = "-" if self.passing is None else f"{self.passing.value:g}"
        hi = "-" if self.failing is None else f"{self.failing.value:g}"
        return f"[{lo}, {hi})"


def _round(value: float, integer: bool) -> float:
    # 4 significant digits: a probe's load key (r3.375) is exact, and a replay finds the same cell
    return float(math.floor(value)) if integer else float(f"{value:.4g}")


class Search:
    """Bracketing, then bisection, in a bounded number of probes; fed one verdict at a time."""

    def __init__(self, sla: Sla) -> None:
        self.sla = sla
        self.integer = sla.variable == "max_concurrency"
        self.probes: list[Probe] = []

    def _pass(self) -> Probe | None:
        return max((p for p in self.probes if p.passed), key=lambda p: p.value, default=None)

    def _fail(self) -> Probe | None:
        lo = self._pass()
        above = [p for p in self.probes if not p.passed and (lo is None or p.value > lo.value)]
        return min(above, key=lambda p: p.value, default=None)

    def close_enough(self, lo: float, hi: float) -> bool:
        gap = self.sla.tolerance * lo
        return hi - lo <= (max(1.0, math.floor(gap)) if self.integer else gap)

    def next(self) -> float | None:
        """The next load to probe, or None when the search is over."""
        s = self.sla
        if not self.probes:
            return s.start
        lo, hi = self._pass(), self._fail()
        if lo is None:
            return None  # the start fails: nothing lower is searched
        if len(self.probes) >= s.max_probes:
            return None
        if hi is None:
            return None if lo.value >= s.max else min(_round(lo.value * 2, self.integer), s.max)
        if self.close_enough(lo.value, hi.value):
            return None
        mid = _round((lo.value + hi.value) / 2, self.integer)
        return None if mid <= lo.value or mid >= hi.value else mid

    def record(self, value: float, passed: bool, why: str) -> None:
        self.probes.append(Probe(value, passed, why))

    def result(self, complete: bool = True) -> Capacity:
        lo, hi = self._pass(), self._fail()
        status: Status
        if not complete:
            status = "incomplete"
        elif lo is None:
            status = "below-start"
        elif hi is None:
            status = "at-max" if lo.value >= self.sla.max else "probe-limit"
        elif self.close_enough(lo.value, hi.value) or (self.next() is None and len(self.probes) < self.sla.max_probes):
            status = "found"
        else:
            status = "probe-limit"
        return Capacity(self.sla.variable, status, None if lo is None else lo.value, lo, hi, self.sla.tolerance, list(self.probes))


def probe_load(base: LoadPoint, variable: str, value: float) -> LoadPoint:
    """The load point of a probe: the base point with the searched axis set."""
    return base.model_copy(update={variable: int(value) if variable == "max_concurrency" else value})


def judge(slo: Mapping[str, float], figures: Mapping[str, float | None]) -> tuple[bool, str]:
    """Whether ``figures`` (one point's, medians over its runs) meet every SLO, and the figures that say so."""
    missed, met = [], []
    for key, bound in slo.items():
        v = figures.get(key)
        if v is None or not math.isfinite(v):
            missed.append(f"{key} not measured")
        elif v > bound:
            missed.append(f"{key} {v:.4g} > {bound:g}")
        else:
            met.append(f"{key} {v:.4g} <= {bound:g}")
    return (not missed, ", ".join(missed) if missed else ", ".join(met))


# a probe's verdict from what is recorded: None when the probe has not been measured (enough) yet
Verdict = Callable[[float], tuple[bool, str] | None]


def replay(sla: Sla, verdict: Verdict) -> tuple[Capacity, float | None]:
    """Run the search over recorded verdicts: what it found, and the first probe still to measure."""
    s = Search(sla)
    while (v := s.next()) is not None:
        got = verdict(v)
        if got is None:
            return s.result(complete=False), v
        s.record(v, *got)
    return s.result(), None
