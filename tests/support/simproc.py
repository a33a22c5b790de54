"""Helpers for the sim tests: start sims (and vllm-router) as subprocesses and always kill them.

Every process is started in its own session and tracked by :class:`Procs`; teardown kills each
process group that is still alive, so a failing test never leaves a listener behind. Output
goes to a log file per process (a pipe nobody reads could fill up and stall the process).

The ``procs`` fixture (a :class:`Procs` per test) is used by the local end-to-end tests and the
engine tier alike, so this module is a plugin of the root ``tests/conftest.py`` (``pytest_plugins``).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

SIM = [sys.executable, "-m", "k3launch.sim", "serve"]
MODEL = "moonshotai/Kimi-K3"
# Fast defaults: short loads, a tiny latency model, and rendezvous that fail within seconds.
FAST_ENV = {
    "K3LAUNCH_SIM_LOAD_S": "0.3",
    "K3LAUNCH_SIM_TTFT_MS": "5",
    "K3LAUNCH_SIM_ITL_MS": "1",
    "K3LAUNCH_SIM_RENDEZVOUS_TIMEOUT_S": "10",
}
# The flags the sim's fault-tolerant DEP ranks start with in the fault-tolerance tests.
FT_FLAGS = ["--enable-fault-tolerance", "--all2all-backend", "deepep_low_latency", "--enable-expert-parallel"]
_used_ports: set[int] = set()


def free_port() -> int:
    """A port free on loopback, never handed out twice in one test session."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _used_ports and port < 60000:  # room for side-channel port + DP rank
            _used_ports.add(port)
            return port


def port_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except OSError:
        return False
    return True


class Proc:
    def __init__(self, popen: subprocess.Popen[bytes], log: Path, name: str) -> None:
        self.popen = popen
        self.log_path = log
        self.name = name

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log())
            if m:
                return m
            time.sleep(0.02)
        raise AssertionError(f"{self.name}: no {pattern!r} in log within {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout: float = 10.0) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout}s:\n{self.log()}") from None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)


class Procs:
    """Processes started by one test (or module); :meth:`kill_all` is the fixture's teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []

    def start(self, argv: list[str], env: dict[str, str] | None = None, name: str = "") -> Proc:
        name = name or f"proc{len(self.procs)}"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("K3LAUNCH_", "VLLM_"))}
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(argv, env={**base, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        proc = Proc(popen, log, name)
        self.procs.append(proc)
        return proc

    def sim(self, args: list[str], env: dict[str, str] | None = None, name: str = "") -> Proc:
        return self.start([*SIM, MODEL, *args], {**FAST_ENV, **(env or {})}, name)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.alive():
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """The test's own :class:`Procs`: whatever it started is killed after it, failed or not."""
    pool = Procs(tmp_path)
    try:
        yield pool
    finally:
        pool.kill_all()


def sim_bench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``k3launch-sim bench serve ARGS`` (the sim's `vllm bench serve`) to its end, in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "k3launch.sim", "bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(url: str, body: dict[str, object], timeout: float = 10.0) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream(host: str, port: int, path: str, body: dict[str, object]) -> list[str]:
    """POST with ``stream: true``; the ``data:`` payloads in order."""
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        text = resp.read().decode()
    finally:
        conn.close()
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def wait_healthy(host: str, port: int, proc: Proc | None = None, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise AssertionError(f"{proc.name} exited {proc.popen.returncode}:\n{proc.log()}")
        try:
            if get(f"http://{host}:{port}/health", timeout=1)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.03)
    raise AssertionError(f"http://{host}:{port}/health not ready in {timeout}s" + (f":\n{proc.log()}" if proc else ""))
