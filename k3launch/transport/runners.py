"""The one seam for side effects: every local or remote command goes through a :class:`CommandRunner`.

Like dask-jobqueue's single ``_call``, a runner returns a :class:`Result` carrying the command,
exit code, stdout and stderr, and :meth:`Result.check` turns a failure into a
:class:`CommandFailed` with all of them. Fan-out (:func:`run_many`) runs on many hosts with
bounded concurrency and collects one outcome per host, like fabric's ``GroupResult`` — never
"stop at the first failure and forget the rest".

Runners: :class:`LocalRunner` (this machine; the ``local`` backend and the login node),
:class:`SshRunner` (fabric/paramiko, one connection per host reused for the whole run, host keys
verified against known_hosts unless explicitly told otherwise, a host that stops answering
declared unreachable within the connect timeout: :mod:`k3launch.transport.heartbeat`), and, in tests,
:class:`k3launch.testing.FakeRunner`, which records commands and scripts replies.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from k3launch.errors import HOST_KEY_HINT, K3Error
from k3launch.transport.heartbeat import Heartbeat
from k3launch.transport.sshshell import Shell, ShellBroken, ShellTimeout

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CONCURRENCY = 64  # connections at once: a 64-node fan-out is one wave


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
    """A host that cannot be connected to, or (``lost``) one that stopped answering on an open connection."""

    def __init__(self, target: str, why: str, lost: bool = False) -> None:
        if lost:
            super().__init__("unreachable", f"{target}: connection lost: {why}", "check the host and its network (up? sshd running?)")
        else:
            super().__init__("unreachable", f"{target}: cannot connect: {why}", "check the address, ssh config and that sshd runs there")
        self.target = target


def _short(cmd: str, n: int = 120) -> str:
    one = " ".join(cmd.split())
    return one if len(one) <= n else one[: n - 3] + "..."


class CommandRunner(Protocol):
    def run(self, target: Target, command: str, *, timeout: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> Result:
        """Run ``command`` on ``target``; ``env``: the command's whole environment (None: the runner's default)."""
        ...

    def close(self) -> None: ...


def _text(data: bytes | str | None) -> str:
    """Output as the remote shells give it: every byte kept (text mode would turn vLLM's ``\\r\\n``
    into ``\\n``, and log offsets counted from the text would drift), invalid UTF-8 replaced."""
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


class LocalRunner:
    """Runs ``bash -c COMMAND`` on this machine."""

    def run(self, target: Target, command: str, *, timeout: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> Result:
        """``env``: the command's whole environment (default: this process's)."""
        t0 = time.monotonic()
        try:
            p = subprocess.run(["bash", "-c", command], capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
                               env=None if env is None else dict(env))
        except subprocess.TimeoutExpired as exc:
            return Result(target.name, command, 124, _text(exc.stdout), f"timed out after {timeout:g}s", time.monotonic() - t0)
        return Result(target.name, command, p.returncode, _text(p.stdout), _text(p.stderr), time.monotonic() - t0)

    def close(self) -> None:
        return None


@dataclass
class SshRunner:
    """fabric/paramiko: one cached connection per host, host keys checked against known_hosts.

    ``accept_unknown_hosts`` switches paramiko's policy from reject to auto-add; it is only ever
    set from an explicit user flag. ``~/.ssh/config`` (or ``ssh_config``) is honoured for host
    aliases, users, ports, identities and ``ConnectTimeout`` (``connect_timeout`` is the default
    when it sets none). A connection is opened once, under a per-host lock, and reused by every
    command of the run (parallel commands become channels of that one connection); a dropped
    one is reopened on next use. Commands go to a long-lived bash on the host
    (:mod:`k3launch.transport.sshshell`: a write and a read instead of a new sshd session per command),
    or to an exec channel when that shell is busy with another command or cannot start;
    ``K3LAUNCH_SSH_SHELL=0`` (or ``persistent_shell=False``) always uses exec channels.

    Every wait is bounded by the connect timeout while the host is silent: the TCP connect, the
    SSH banner, authentication and opening a channel directly; an open connection by a
    :class:`~k3launch.transport.heartbeat.Heartbeat`, which aborts it when keepalives go
    unanswered that long. A command on a host that stops answering therefore fails with
    :class:`Unreachable` within the connect timeout plus one beat, whatever its own timeout
    (a start may take minutes on a host that answers).
    """

    known_hosts: str | None = None
    ssh_config: str | None = None
    accept_unknown_hosts: bool = False
    connect_timeout: float = 10.0
    _conns: dict[Target, object] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    persistent_shell: bool = field(default_factory=lambda: os.environ.get("K3LAUNCH_SSH_SHELL", "1") != "0")
    _host_locks: dict[Target, threading.Lock] = field(default_factory=dict)
    _config: object | None = None
    _shells: dict[Target, Shell] = field(default_factory=dict)
    _no_shell: set[Target] = field(default_factory=set)
    _beats: dict[Target, Heartbeat] = field(default_factory=dict)

    def _fabric_config(self) -> object:
        from fabric import Config

        if self._config is None:  # parsed once: every host shares one ssh_config
            overrides: dict[str, object] = {"load_ssh_configs": True, "timeouts": {"connect": max(1, round(self.connect_timeout))}}
            if self.ssh_config:
                overrides["ssh_config_path"] = os.path.expanduser(self.ssh_config)
            self._config = Config(overrides=overrides)
        return self._config

    def _connection(self, target: Target) -> object:
        with self._lock:
            host_lock = self._host_locks.setdefault(target, threading.Lock())
        with host_lock:
            conn = self._conns.get(target)
            if conn is not None and conn.is_connected:  # type: ignore[attr-defined]
                return conn
            if conn is not None:
                lost = self._lost(target)
                self._drop(target)
                if lost:  # say so now: reconnecting to a silent host would cost another connect timeout
                    raise Unreachable(target.name, lost, lost=True)
            conn = self._open(target)
            with self._lock:
                self._conns[target] = conn
            return conn

    def _open(self, target: Target) -> object:
        import paramiko
        from fabric import Connection

        with self._lock:
            config = self._fabric_config()
        # The connect timeout comes from fabric's config (ssh_config ConnectTimeout, else ours):
        # passing it in connect_kwargs too makes fabric refuse ("ambiguous") for hosts whose
        # ssh_config sets ConnectTimeout. Banner, auth and channel opens get the same bound: a
        # host that accepts TCP but never speaks SSH must fail as fast as one that drops packets
        # (paramiko's default for opening a channel is an hour).
        kwargs: dict[str, object] = {
            "banner_timeout": self.connect_timeout,
            "auth_timeout": self.connect_timeout,
            "channel_timeout": self.connect_timeout,
        }
        if target.identity_file:
            kwargs["key_filename"] = os.path.expanduser(target.identity_file)
        c = Connection(target.host, user=target.user, port=target.port, config=config, connect_kwargs=kwargs)
        client = c.client
        # Host keys are verified: known_hosts is loaded and unknown keys are rejected (not the
        # paramiko default warning, not auto-add) unless the user explicitly asked.
        client.load_system_host_keys()
        if self.known_hosts:
            client.load_host_keys(os.path.expanduser(self.known_hosts))
        client.set_missing_host_key_policy(_Remember(self._known_hosts_file(), self._lock) if self.accept_unknown_hosts else paramiko.RejectPolicy())
        try:
            c.open()
        except paramiko.BadHostKeyException as exc:
            raise K3Error("host-key-mismatch", f"{target.name}: {exc}",
                          "the host's key changed: check why (reinstalled node? someone in the middle?) before fixing known_hosts") from None
        except paramiko.SSHException as exc:
            if "known_hosts" in str(exc):
                raise K3Error("host-key-unknown", f"{target.name}: {exc}", HOST_KEY_HINT) from None
            raise Unreachable(target.name, str(exc) or type(exc).__name__) from None
        except (TimeoutError, OSError, EOFError) as exc:
            raise Unreachable(target.name, _why(exc)) from None
        # keepalives that want a reply: a host that goes silent is noticed within its connect
        # timeout (ssh_config's ConnectTimeout, else ours), and NAT or firewalls do not drop the
        # idle connection between polls
        transport = client.get_transport()
        if transport is not None:
            beat = Heartbeat(transport, float(getattr(c, "connect_timeout", None) or self.connect_timeout), name=target.name)
            with self._lock:
                self._beats[target] = beat.start()
        return c

    def _known_hosts_file(self) -> str:
        return os.path.expanduser(self.known_hosts or "~/.ssh/known_hosts")

    def _shell(self, target: Target, conn: object) -> Shell | None:
        if not self.persistent_shell:
            return None
        with self._lock:
            host_lock = self._host_locks.setdefault(target, threading.Lock())
        with host_lock:
            sh = self._shells.get(target)
            if sh is not None and sh.alive:
                return sh
            if target in self._no_shell:
                return None
            transport = conn.client.get_transport()  # type: ignore[attr-defined]
            try:
                sh = Shell(transport, self.connect_timeout)
            except ShellBroken as exc:
                if transport is not None and transport.is_active() and not exc.silent:
                    self._no_shell.add(target)  # the host gives no usable bash: exec channels for it
                return None  # (a dead or silent connection is reported by the exec path)
            self._shells[target] = sh
            return sh

    def run(self, target: Target, command: str, *, timeout: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> Result:
        """``env`` must be None: an environment is never sent over SSH (sshd drops most of it, and
        what it keeps would be the remote login's business); put settings into the command."""
        if env is not None:
            raise K3Error("ssh-env", f"{target.name}: cannot pass an environment to a command over SSH",
                          "put the variables into the command (the launch scripts do), or run it with the local runner")
        t0 = time.monotonic()
        conn = self._connection(target)
        sh = self._shell(target, conn)
        if sh is not None and sh.lock.acquire(blocking=False):
            try:
                rc, out, err = sh.run(command, timeout)
                return Result(target.name, command, rc, out, err, time.monotonic() - t0)
            except ShellTimeout:
                self._drop_shell(target)
                return Result(target.name, command, 124, "", f"timed out after {timeout:g}s", time.monotonic() - t0)
            except ShellBroken as exc:
                # not retried over an exec channel: the command may have run (a start must not run twice)
                raise self._gone(target, f"during a command ({exc})", lost=True) from None
            finally:
                sh.lock.release()
        return self._exec(target, conn, command, timeout, t0)

    def _exec(self, target: Target, conn: object, command: str, timeout: float, t0: float) -> Result:
        import paramiko

        try:
            r = conn.run(command, hide=True, warn=True, timeout=timeout, in_stream=False)  # type: ignore[attr-defined]
        except paramiko.SSHException as exc:
            if "Timeout opening channel" in str(exc):  # an open connection whose host went silent (before its heartbeat said so)
                raise self._gone(target, f"no answer for {self.connect_timeout:g}s (opening a channel)", lost=True) from None
            raise self._gone(target, str(exc) or type(exc).__name__) from None
        except (TimeoutError, OSError, EOFError) as exc:
            raise self._gone(target, _why(exc)) from None
        except Exception as exc:  # invoke's CommandTimedOut and friends
            if type(exc).__name__ == "CommandTimedOut":
                self._drop(target)
                return Result(target.name, command, 124, "", f"timed out after {timeout:g}s", time.monotonic() - t0)
            raise
        if r.exited is None or r.exited < 0:
            # the channel closed without an exit status: sshd (or the link) went away mid-command
            raise self._gone(target, "during a command", lost=True)
        return Result(target.name, command, r.exited, r.stdout, r.stderr, time.monotonic() - t0)

    def _drop_shell(self, target: Target) -> None:
        with self._lock:
            sh = self._shells.pop(target, None)
        if sh is not None:
            sh.close()

    def _lost(self, target: Target) -> str | None:
        """Why the heartbeat aborted ``target``'s connection (None: it did not)."""
        with self._lock:
            beat = self._beats.get(target)
        return beat.lost if beat is not None else None

    def _gone(self, target: Target, why: str, lost: bool = False) -> Unreachable:
        """Drop ``target``'s connection after a failure; the error to raise (the heartbeat's reason first)."""
        silent = self._lost(target)
        self._drop(target)
        return Unreachable(target.name, silent or why, lost=lost or silent is not None)

    def _drop(self, target: Target) -> None:
        self._drop_shell(target)
        with self._lock:
            conn = self._conns.pop(target, None)
            beat = self._beats.pop(target, None)
        if beat is not None:
            beat.stop()
        if conn is not None:
            try:
                conn.close()  # type: ignore[attr-defined]
            except Exception:  # closing a broken connection may fail; nothing to do
                pass

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
            shells = list(self._shells.values())
            beats = list(self._beats.values())
            self._conns.clear()
            self._shells.clear()
            self._beats.clear()
        for beat in beats:
            beat.stop()
        for sh in shells:
            sh.close()
        for c in conns:
            try:
                c.close()  # type: ignore[attr-defined]
            except Exception:  # best effort on shutdown
                pass


class _Remember:
    """``--accept-unknown-hosts``: accept a key not seen before and *append* it to known_hosts.

    Not paramiko's AutoAddPolicy: that rewrites the whole file in its own format on every new
    key (comments, markers and the original lines' host lists are lost, and parallel connects
    race on the file). Keys that *changed* are still refused (paramiko raises before asking).
    """

    def __init__(self, path: str, lock: threading.Lock) -> None:
        self.path = path
        self.lock = lock

    def missing_host_key(self, client: object, hostname: str, key: object) -> None:
        name, b64 = key.get_name(), key.get_base64()  # type: ignore[attr-defined]
        client.get_host_keys().add(hostname, name, key)  # type: ignore[attr-defined]
        with self.lock:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(f"{hostname} {name} {b64}\n")


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) or type(exc).__name__ == "timeout":
        return "timed out (no answer)"
    return str(exc) or type(exc).__name__


Outcome = Result | K3Error


def run_many(runner: CommandRunner, jobs: Iterable[tuple[Target, str]], *, timeout: float = DEFAULT_TIMEOUT_S,
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
