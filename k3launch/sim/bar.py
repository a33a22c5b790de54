"""The progress bar ``vllm bench serve`` draws (tqdm's default format, on stderr), so the benchmark's
log tells how far it got the same way from the real client and from the sim's.

tqdm redraws one line with ``\\r`` (here at most every :data:`MIN_INTERVAL_S`) and ends it with a
newline when it closes: ``" 45%|####      | 90/200 [00:10<00:12,  8.90it/s]"``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

MIN_INTERVAL_S = 0.5


def clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def render(n: int, total: int, elapsed: float) -> str:
    frac = n / total if total else 1.0
    bar = "#" * int(frac * 10)
    rate = n / elapsed if elapsed > 0 else 0.0
    left = clock((total - n) / rate) if rate > 0 else "?"
    return f"{frac * 100:3.0f}%|{bar:<10}| {n}/{total} [{clock(elapsed)}<{left}, {rate:5.2f}it/s]"


class Bar:
    """A thread-safe counter that redraws the bar on ``stream`` (nothing when ``disable``)."""

    def __init__(self, total: int, disable: bool = False, stream: TextIO | None = None) -> None:
        self.total = total
        self.disable = disable
        self.stream = stream or sys.stderr
        self.n = 0
        self.t0 = time.perf_counter()
        self._drawn = 0.0
        self._lock = threading.Lock()
        self._draw(force=True)

    def update(self) -> None:
        with self._lock:
            self.n += 1
            self._draw(force=self.n >= self.total)

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.disable or (not force and now - self._drawn < MIN_INTERVAL_S):
            return
        self._drawn = now
        try:
            self.stream.write("\r" + render(self.n, self.total, now - self.t0))
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed stream must not stop the benchmark

    def close(self) -> None:
        with self._lock:
            self._draw(force=True)
            if not self.disable:
                try:
                    self.stream.write("\n")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass
