"""Keep-alive HTTP connections for the sim's benchmark client, reused as vLLM's client reuses them.

``vllm bench serve`` sends every request through one aiohttp session whose connector keeps
connections alive (``vllm/benchmarks/serve.py``: ``TCPConnector(limit=max_concurrency,
keepalive_timeout=60, force_close=False)``): a request takes the most recently released idle
connection, or opens one; a response read to its end gives its connection back. So, after the
first requests, no request pays for a TCP handshake and the server sees as many connections as
requests were ever in flight at once — which is what this pool reproduces with the stdlib, so
both clients measure the same TTFT against the same server.
"""

from __future__ import annotations

import http.client
import select
import threading
import time
import urllib.parse

KEEPALIVE_S = 60.0  # aiohttp's keepalive_timeout in vLLM's client: an idle connection older than this is closed


class Pool:
    """Idle connections to one server, last released first (as aiohttp's connector hands them out)."""

    def __init__(self, url: str, timeout: float, keepalive_s: float = KEEPALIVE_S) -> None:
        u = urllib.parse.urlsplit(url)
        self._cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self._host = u.hostname or "127.0.0.1"
        self._port = u.port
        self._timeout = timeout
        self._keepalive_s = keepalive_s
        self._idle: list[tuple[float, http.client.HTTPConnection]] = []
        self._lock = threading.Lock()
        self.opened = 0  # connections this pool ever opened

    def get(self) -> http.client.HTTPConnection:
        """An idle connection still open, else a new one (it connects on its first request)."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    self.opened += 1
                    break
                released, conn = self._idle.pop()
            if now - released <= self._keepalive_s and _usable(conn):
                return conn
            conn.close()
        return self._cls(self._host, self._port, timeout=self._timeout)

    def put(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        """Give ``conn`` back once ``response`` was read to its end, unless the server closes it."""
        if response.isclosed() and not response.will_close:
            with self._lock:
                self._idle.append((time.monotonic(), conn))
        else:
            conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, conn in idle:
            conn.close()


def _usable(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive connection has nothing to read; readable means the server closed it
    (uvicorn does after 5 s idle), which aiohttp learns from its event loop and this pool here."""
    if conn.sock is None:
        return False
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable
