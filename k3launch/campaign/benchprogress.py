"""How far one benchmark run got: requests done of total, read from the client's own progress bar.

``vllm bench serve`` (and k3launch's client, :mod:`k3launch.sim.bar`) draws tqdm's bar on stderr:
``" 45%|####      | 90/200 [00:10<00:12,  8.90it/s]"``. The local client writes it into the run's
log, which is read every second while the client runs; vLLM's own client on a node reports once
it is done, so meanwhile only the elapsed time is known (a heartbeat).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

BenchProgressFn = Callable[[str, int | None, int, float], None]
"""``(tag, requests done (None: not known yet), total, seconds elapsed)``."""

BAR = re.compile(r"(\d+)/(\d+) \[[\d:]+<")
TAIL_BYTES = 4096
HEARTBEAT_S = 10.0


def parse(text: str) -> tuple[int, int] | None:
    """(done, total) of the last bar drawn in ``text``."""
    last = None
    for m in BAR.finditer(text):
        last = m
    return (int(last.group(1)), int(last.group(2))) if last else None


def tail_of(path: Path, size: int = TAIL_BYTES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def report(on_progress: BenchProgressFn, tag: str, log: Path, total: int, elapsed: float) -> None:
    got = parse(tail_of(log))
    on_progress(tag, got[0] if got else None, got[1] if got else total, elapsed)


def wait_watching(p: subprocess.Popen[bytes], log: Path, timeout_s: float, tag: str, total: int, on_progress: BenchProgressFn) -> None:
    """``p.wait(timeout_s)`` (raising TimeoutExpired), reporting the bar in ``log`` every second."""
    t0 = time.monotonic()
    while True:
        left = t0 + timeout_s - time.monotonic()
        try:
            p.wait(timeout=max(0.0, min(1.0, left)))
            break
        except subprocess.TimeoutExpired:
            if left <= 1.0:
                raise
        report(on_progress, tag, log, total, time.monotonic() - t0)
    report(on_progress, tag, log, total, time.monotonic() - t0)


class Heartbeat:
    """Reports the elapsed time every :data:`HEARTBEAT_S` while a client runs out of sight (a context manager)."""

    def __init__(self, on_progress: BenchProgressFn, tag: str, total: int, every_s: float = HEARTBEAT_S) -> None:
        self.on_progress, self.tag, self.total, self.every_s = on_progress, tag, total, every_s
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="bench-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.on_progress(self.tag, None, self.total, time.monotonic() - self._t0)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
