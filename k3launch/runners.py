"""The one seam for side effects: every local or remote command goes through a :class:`Runner`.

Like dask-jobqueue's single ``_call``, a runner returns a :class:`Result` carrying the command,
exit code, stdout and stderr, and :meth:`Result.check` turns a failure into a
:class:`CommandFailed` with all of them. Fan-out (:func:`run_many`) runs on many hosts with
bounded concurrency and collects one outcome per host, like fabric's ``GroupResult`` — never
"stop at the first failure and forget the rest".

Runners: :class:`LocalRunner` (this machine; the ``local`` backend and the login node),
:class:`SshRunner` (fabric/paramiko, one connection per host reused for the whole run, host keys
verified against known_hosts unless explicitly told otherwise), and, in tests, a fake that
records commands and scripts replies.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from k3launch.errors import K3Error

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CONCURRENCY = 32


@dataclass(frozen=True)
class Target:
    """Where a command runs: ``name`` for people, the rest for the transport."""

    name: str
    host: str = "localhost"  # ssh host (address or ~/.ssh/config alias); "localhost" for local
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    local: bool = True


@dataclass(frozen=True)
class Result:
    target: str
    command: str
    exit_code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self) -> Result:
        if self.exit_code != 0:
            raise CommandFailed(self)
        return self


class CommandFailed(K3Error):
    """A command exited non-zero; carries everything needed to say why."""

    def __init__(self, result: Result) -> None:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or [""]
        super().__init__(
            "command-failed",
            f"{result.target}: `{_short(result.command)}` exited {result.exit_code}: {tail[0]}",
            "see the full output with --debug, or run the command by hand on that host",
        )
        self.result = result


class Unreachable(K3Error):
    def __init__(self, target: str, why: str) -> None:
        super().__init__("unreachable", f"{target}: cannot connect: {why}", "check the address, ssh config and that sshd runs there")
        self.target = target


def _short(cmd: str, n: int = 120) -> str:
    one = " ".join(cmd.split())
    return one if len(one) <= n else one[: n - 3] + "..."


class Runner(Protocol):
    def run(self, target: Target, command: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> Result: ...

    def close(self) -> None: ...


class LocalRunner:
    """Runs ``bash -c COMMAND`` on this machine."""

    def run(self, target: Target, command: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> Result:
        t0 = time.monotonic()
        try:
            p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return Result(target.name, command, 124, out, f"timed out after {timeout:g}s", time.monotonic() - t0)
        return Result(target.name, command, p.returncode, p.stdout, p.stderr, time.monotonic() - t0)

    def close(self) -> None:
        return None


@dataclass
class SshRunner:
    """fabric/paramiko: one cached connection per host, host keys checked against known_hosts.

    ``accept_unknown_hosts`` switches paramiko's policy from reject to auto-add; it is only ever
    set from an explicit user flag. ``~/.ssh/config`` (or ``ssh_config``) is honoured for host
    aliases, users, ports and identities.
    """

    known_hosts: str | None = None
    ssh_config: str | None = None
    accept_unknown_hosts: bool = False
    connect_timeout: float = 10.0
    _conns: dict[Target, object] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _connection(self, target: Target) -> object:
        with self._lock:
            conn = self._conns.get(target)
            if conn is not None:
                return conn
        import os

        import paramiko
        from fabric import Config, Connection

        overrides: dict[str, object] = {"load_ssh_configs": True}
        if self.ssh_config:
            overrides["ssh_config_path"] = os.path.expanduser(self.ssh_config)
        config = Config(overrides=overrides)
        kwargs: dict[str, object] = {"timeout": self.connect_timeout, "banner_timeout": self.connect_timeout, "auth_timeout": self.connect_timeout}
        if target.identity_file:
            kwargs["key_filename"] = os.path.expanduser(target.identity_file)
        c = Connection(target.host, user=target.user, port=target.port, config=config, connect_kwargs=kwargs)
        client = c.client
        # Host keys are verified: known_hosts is loaded and unknown keys are rejected (not the
        # paramiko default warning, not auto-add) unless the user explicitly asked.
        client.load_system_host_keys()
        if self.known_hosts:
            client.load_host_keys(os.path.expanduser(self.known_hosts))
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy() if self.accept_unknown_hosts else paramiko.RejectPolicy())
        with self._lock:
            self._conns[target] = c
        return c

    def run(self, target: Target, command: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> Result:

        import paramiko

        t0 = time.monotonic()
        conn = self._connection(target)
        try:
            r = conn.run(command, hide=True, warn=True, timeout=timeout, in_stream=False)  # type: ignore[attr-defined]
        except paramiko.SSHException as exc:
            self._drop(target)
            if "not found in known_hosts" in str(exc) or "known_hosts" in str(exc):
                raise K3Error("host-key-unknown", f"{target.name}: {exc}", "add the host key to known_hosts, or pass --accept-unknown-hosts once") from None
            raise Unreachable(target.name, str(exc) or type(exc).__name__) from None
        except (TimeoutError, OSError, EOFError) as exc:
            self._drop(target)
            raise Unreachable(target.name, str(exc) or type(exc).__name__) from None
        except Exception as exc:  # invoke's CommandTimedOut and friends
            if type(exc).__name__ == "CommandTimedOut":
                self._drop(target)
                return Result(target.name, command, 124, "", f"timed out after {timeout:g}s", time.monotonic() - t0)
            raise
        return Result(target.name, command, r.exited, r.stdout, r.stderr, time.monotonic() - t0)

    def _drop(self, target: Target) -> None:
        with self._lock:
            conn = self._conns.pop(target, None)
        if conn is not None:
            try:
                conn.close()  # type: ignore[attr-defined]
            except Exception:  # closing a broken connection may fail; nothing to do
                pass

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for c in conns:
            try:
                c.close()  # type: ignore[attr-defined]
            except Exception:  # best effort on shutdown
                pass


Outcome = Result | K3Error


def run_many(runner: Runner, jobs: Iterable[tuple[Target, str]], *, timeout: float = DEFAULT_TIMEOUT_S,
             concurrency: int = DEFAULT_CONCURRENCY) -> dict[str, Outcome]:
    """Run each (target, command) with bounded concurrency; one outcome per target name."""
    jobs = list(jobs)
    out: dict[str, Outcome] = {}
    if not jobs:
        return out

    def one(job: tuple[Target, str]) -> tuple[str, Outcome]:
        t, cmd = job
        try:
            return t.name, runner.run(t, cmd, timeout=timeout)
        except K3Error as exc:
            return t.name, exc

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(jobs)))) as pool:
        for name, outcome in pool.map(one, jobs):
            out[name] = outcome
    return out


def each(runner: Runner, targets: Iterable[Target], command: Callable[[Target], str], **kw: float) -> dict[str, Outcome]:
    return run_many(runner, [(t, command(t)) for t in targets], **kw)  # type: ignore[arg-type]


def failures(outcomes: Mapping[str, Outcome]) -> dict[str, str]:
    """target → one-line reason, for every outcome that is an error or a non-zero exit."""
    bad: dict[str, str] = {}
    for name, o in outcomes.items():
        if isinstance(o, K3Error):
            bad[name] = o.message
        elif not o.ok:
            bad[name] = CommandFailed(o).message
    return bad
