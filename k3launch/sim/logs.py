"""Log lines shaped like vLLM's, so log scrapers written against vLLM work on the sim too.

vLLM logs ``(APIServer pid=N) INFO 11-29 20:49:01 [api_server.py] message`` to stdout; the sim
keeps that shape. One lock serialises writes because request threads, rendezvous threads and
the main thread all log, and interleaved half-lines would break line-based readiness probes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TextIO

_LOCK = threading.Lock()


class Logger:
    """A vLLM-looking logger for one sim process."""

    def __init__(self, component: str = "APIServer", stream: TextIO | None = None) -> None:
        self.prefix = f"({component} pid={os.getpid()}) "
        self._stream = stream

    def _emit(self, level: str, src: str, msg: str) -> None:
        stamp = time.strftime("%m-%d %H:%M:%S", time.localtime())
        text = "".join(f"{self.prefix}{level} {stamp} [{src}] {line}\n" for line in msg.splitlines() or [""])
        stream = self._stream or sys.stdout
        with _LOCK:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass  # a closed pipe must not take the engine down with it

    def info(self, msg: str, src: str = "api_server.py") -> None:
        self._emit("INFO", src, msg)

    def warning(self, msg: str, src: str = "api_server.py") -> None:
        self._emit("WARNING", src, msg)

    def error(self, msg: str, src: str = "api_server.py") -> None:
        self._emit("ERROR", src, msg)

    def uvicorn(self, msg: str) -> None:
        """A line of vLLM's HTTP server (uvicorn): ``INFO:     message``, without vLLM's prefix."""
        self.raw(f"INFO:     {msg}")

    def raw(self, line: str) -> None:
        """A line as written, without vLLM's prefix: uvicorn's, or a tqdm progress bar's."""
        with _LOCK:
            try:
                stream = self._stream or sys.stdout
                stream.write(f"{line}\n")
                stream.flush()
            except (OSError, ValueError):
                pass

    def fatal(self, exc_type: str, msg: str) -> None:
        """The last line of a Python traceback, on stderr, as a dying vLLM prints it."""
        with _LOCK:
            try:
                sys.stderr.write(f"{exc_type}: {msg}\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
