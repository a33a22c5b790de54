"""Deadline polling: ask again at a fixed cadence until the answer is good or time is up.

The lifecycle's stage machines (``up``'s readiness, a Slurm job array) keep their own loops:
they decide per poll what to report. Everything that only waits for a condition uses
:func:`poll_until`; everything that repeats until a deadline uses :func:`ticks`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def poll_until(probe: Callable[[], T], done: Callable[[T], object], *, timeout: float, interval: float) -> T:
    """Call ``probe`` until ``done(answer)`` or ``timeout`` seconds passed; the last answer either way.

    The cadence is fixed: the probe's own time is part of the interval."""
    t_end = time.monotonic() + timeout
    while True:
        t = time.monotonic()
        answer = probe()
        if done(answer) or time.monotonic() >= t_end:
            return answer
        time.sleep(max(0.0, min(interval - (time.monotonic() - t), t_end - time.monotonic())))


def ticks(interval: float, max_s: float | None = None) -> Iterator[float]:
    """Yield every ``interval`` seconds (after the first wait) until ``max_s`` passed, forever without it;
    the value is the time (``time.time()``) of the tick."""
    t_end = None if max_s is None else time.monotonic() + max_s
    while t_end is None or time.monotonic() < t_end:
        time.sleep(interval)
        yield time.time()
