"""Real TCP for the sim's control planes: JSON lines over sockets, listeners, retrying connects.

The rendezvous (TP master, DP coordinator) and the NIXL side channel all use plain TCP so that
a wrong address, port or rank fails the way it does on GPUs: a bind on an address this host
does not own is refused by the kernel, a connect to a port nobody listens on is refused, and a
peer that dies is an EOF. Messages are one JSON object per line; the payloads are tiny.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable

Json = dict[str, object]
_MAX_LINE = 1 << 20


class Stopped(Exception):
    """The process is shutting down while a blocking step was waiting."""


class Peer:
    """One JSON-lines connection; ``send`` is thread-safe, ``recv`` has one reader."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self._wlock = threading.Lock()
        try:
            host, port = sock.getpeername()[:2]
            self.address = f"{host}:{port}"
        except OSError:
            self.address = "?"

    def send(self, msg: Json) -> bool:
        """Send one message; False if the peer is gone (callers treat that like an EOF)."""
        data = (json.dumps(msg) + "\n").encode()
        with self._wlock:
            try:
                self.sock.sendall(data)
            except OSError:
                return False
        return True

    def recv(self, timeout: float | None) -> Json | None:
        """The next message, or None on EOF. Raises ``TimeoutError`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise
            except OSError:
                return None
            if not chunk:
                return None
            self._buf += chunk
            if len(self._buf) > _MAX_LINE:
                return None  # not our protocol: treat as a broken peer
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            return None
        return msg if isinstance(msg, dict) else None

    def close(self) -> None:
        close_socket(self.sock)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def listen(host: str, port: int) -> socket.socket:
    """Bind and listen on exactly ``host:port``; the kernel refuses addresses this host lacks."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        # Like torch's TCPStore and uvicorn: a restarted process must not wait out TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def can_bind(host: str) -> bool:
    """Whether ``host`` is an address of this machine (port 0: nothing is reserved)."""
    try:
        listen(host, 0).close()
    except (OSError, OverflowError, UnicodeError):
        return False
    return True


def connect(host: str, port: int, timeout: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect_retry(host: str, port: int, deadline: float, stop: threading.Event) -> socket.socket:
    """Connect, retrying refusals until ``deadline`` (the peer may still be starting)."""
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{last}" if last else "timed out")
        try:
            return connect(host, port, min(2.0, remaining))
        except OSError as exc:
            last = exc
        if stop.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            raise Stopped


def close_socket(sock: socket.socket) -> None:
    # shutdown() first: on Linux it wakes a thread blocked in accept()/recv() on this socket,
    # which close() alone does not, so the port is released now and not at thread exit.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def serve_accepts(sock: socket.socket, handle: Callable[[socket.socket], None], name: str) -> threading.Thread:
    """Accept connections on ``sock`` until it is closed; each runs ``handle`` in its own thread."""

    def loop() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed by close_socket(): the listener is done
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_guarded, args=(handle, conn), name=f"{name}-conn", daemon=True).start()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


def _guarded(handle: Callable[[socket.socket], None], conn: socket.socket) -> None:
    try:
        handle(conn)
    except OSError:
        close_socket(conn)  # a peer vanishing mid-exchange is that peer's failure, not ours
