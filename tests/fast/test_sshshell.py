"""The persistent remote shell (:class:`k3launch.transport.sshshell.Shell`) without SSH: its channel
is a local ``bash`` behind pipes, so the real framing protocol runs (handshake, quoted ``eval`` in a
subshell, stderr after a marker, end marker with the exit code) and only paramiko is left out.

The fake channel does what paramiko's does for the calls Shell makes: ``exec_command`` starts the
program, ``sendall`` writes its stdin, ``recv`` reads its stdout (``b""`` at EOF, ``TimeoutError``
when ``settimeout``'s time passes without data), ``close`` ends it (its whole process group here,
so nothing a test started outlives it).

:class:`CutTransport` adds what the connection's heartbeat uses (``global_request``, answered
at once like OpenSSH does, ``is_active``, ``close``, ``sock``) and ``cut()``, which makes the
"host" go silent: keepalives stay unanswered and channels deliver nothing, as when its network
is cut. :class:`FakeConnection` stands in for fabric's Connection around it, so
:class:`~k3launch.transport.runners.SshRunner` runs its real code paths over a local bash."""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from paths import ROOT

from k3launch.transport.heartbeat import KEEPALIVE, Heartbeat
from k3launch.transport.runners import SshRunner, Target, Unreachable
from k3launch.transport.sshshell import Shell, ShellBroken, ShellTimeout


class PipeChannel:
    def __init__(self, program: list[str] | None = None) -> None:
        self.program = program  # None: run what exec_command asks for
        self.proc: subprocess.Popen[bytes] | None = None
        self.closed = False
        self.timeout: float | None = None
        self.silent = False  # the host went silent: nothing arrives any more
        self.timeouts_at_send: list[float | None] = []  # the channel's timeout at each write

    def exec_command(self, command: str) -> None:
        self.proc = subprocess.Popen(self.program or ["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def sendall(self, data: bytes) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        if self.closed:
            raise OSError("Socket is closed")
        self.timeouts_at_send.append(self.timeout)
        self.proc.stdin.write(data)  # BrokenPipeError (an OSError) when bash is gone
        self.proc.stdin.flush()

    def settimeout(self, timeout: float) -> None:
        self.timeout = timeout

    def recv(self, n: int) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        if self.silent:  # like paramiko: wait for data until the timeout, or until the channel is closed under the read
            end = time.monotonic() + (self.timeout if self.timeout is not None else 3600.0)
            while not self.closed and time.monotonic() < end:
                time.sleep(0.02)
            if not self.closed:
                raise TimeoutError("timed out")
        if self.closed:
            return b""
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], self.timeout)[0]:
            raise TimeoutError("timed out")
        return os.read(fd, n)

    def close(self) -> None:
        self.closed = True
        if self.proc is not None:
            kill_group(self.proc)

    @property
    def bash_pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=5)
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            try:
                f.close()
            except BrokenPipeError:  # unflushed data for a dead bash
                pass


class FakeTransport:
    """What Shell needs of paramiko's Transport: ``open_session``."""

    def __init__(self, program: list[str] | None = None, refuse: Exception | None = None) -> None:
        self.program, self.refuse = program, refuse
        self.sessions: list[PipeChannel] = []

    def open_session(self, timeout: float | None = None) -> PipeChannel:
        if self.refuse is not None:
            raise self.refuse
        ch = PipeChannel(self.program)
        self.sessions.append(ch)
        return ch


@pytest.fixture
def transport() -> Iterator[FakeTransport]:
    t = FakeTransport()
    yield t
    for ch in t.sessions:  # whatever a test left running
        if ch.proc is not None and ch.proc.poll() is None:
            kill_group(ch.proc)


def shell(t: FakeTransport) -> Shell:
    return Shell(t, open_timeout=5.0)


def test_exit_code_stdout_and_stderr_come_back_separated(transport: FakeTransport) -> None:
    sh = shell(transport)
    assert sh.run("echo out 1; echo err 1 >&2; echo out 2; echo err 2 >&2; exit 3", 5) == (3, "out 1\nout 2\n", "err 1\nerr 2")
    assert sh.run("printf 'no newline'", 5) == (0, "no newline", "")
    assert sh.run("true", 5) == (0, "", "")
    assert sh.run("false", 5)[0] == 1
    rc, out, err = sh.run("no-such-command-k3", 5)
    assert rc == 127 and out == "" and "no-such-command-k3" in err and "command not found" in err


def test_output_that_looks_like_the_frame_markers_does_not_confuse_it(transport: FakeTransport) -> None:
    sh = shell(transport)
    token, seq = sh._token, sh._seq + 1  # the next command's own markers would be @@<token>:<seq>:{err,end}
    fake = "0123456789abcdef" if token != "0123456789abcdef" else "fedcba9876543210"
    lookalikes = [f"@@{fake}:{seq}:end 0", f"@@{fake}:{seq}:err", f"@@{token}:{seq - 1}:end 0", f"@@{token}:{seq - 1}:err",
                  f"@@{token}:{seq + 1}:end 5", "@@:end 0"]
    text = "".join(f"\n{m}\n" for m in lookalikes)
    cmd = f"printf %s {_q(text)}; printf %s {_q(text)} >&2; exit 4"
    assert sh.run(cmd, 5) == (4, text, text.rstrip("\n"))  # stderr as $(...) keeps it: trailing newlines dropped
    assert sh.run("echo still in step", 5) == (0, "still in step\n", "")


def test_quotes_exit_cd_and_stdin_affect_only_their_own_command(transport: FakeTransport) -> None:
    sh = shell(transport)
    rc, _, err = sh.run("echo 'unbalanced", 5)
    assert rc == 2 and "unexpected EOF" in err  # a syntax error of that command, not of the stream
    assert sh.run("cd /tmp && export K3_X=1 && pwd", 5) == (0, "/tmp\n", "")
    assert sh.run("pwd; echo x${K3_X:-unset}", 5)[1] == f"{os.getcwd()}\nxunset\n"  # a subshell per command
    assert sh.run("exit 7", 5)[0] == 7
    assert sh.run("cat; echo read nothing", 5) == (0, "read nothing\n", "")  # stdin is /dev/null, not the protocol
    assert sh.run("echo alive", 5) == (0, "alive\n", "")


def test_several_commands_reuse_one_shell(transport: FakeTransport) -> None:
    sh = shell(transport)
    pids = {sh.run("echo $$", 5)[1] for _ in range(5)}  # $$: the shell's pid, also inside the subshell
    assert len(pids) == 1 and len(transport.sessions) == 1
    assert pids == {f"{transport.sessions[0].bash_pid}\n"} and sh.alive


def test_a_command_that_outlives_its_timeout_raises_and_closes_the_shell(transport: FakeTransport) -> None:
    sh = shell(transport)
    t0 = time.monotonic()
    with pytest.raises(ShellTimeout, match=r"timed out after 0\.3s"):
        sh.run("echo started; sleep 30", 0.3)
    assert time.monotonic() - t0 < 2.0
    assert not sh.alive and transport.sessions[0].proc is not None and transport.sessions[0].proc.poll() is not None


def test_a_shell_whose_bash_died_raises_broken(transport: FakeTransport) -> None:
    sh = shell(transport)
    ch = transport.sessions[0]
    assert ch.proc is not None
    ch.proc.kill()  # between commands
    ch.proc.wait(timeout=5)
    with pytest.raises(ShellBroken):
        sh.run("echo hello", 5)
    assert not sh.alive
    sh2 = shell(transport)
    with pytest.raises(ShellBroken, match="channel closed"):
        sh2.run("kill -9 $$; sleep 0.2; echo too late", 5)  # during a command
    assert not sh2.alive


def test_a_host_without_a_usable_shell_is_broken_at_start() -> None:
    with pytest.raises(ShellBroken):
        Shell(FakeTransport(program=["true"]), open_timeout=2.0)  # exits at once: no handshake
    t = FakeTransport(program=["bash", "--noprofile", "--norc", "-c", "read -r line; echo something else"])
    with pytest.raises(ShellBroken):
        Shell(t, open_timeout=2.0)
    assert t.sessions[0].closed
    with pytest.raises(ShellBroken, match="administratively prohibited"):
        Shell(FakeTransport(refuse=EOFError("administratively prohibited")), open_timeout=2.0)


def test_large_output_arrives_whole(transport: FakeTransport) -> None:
    sh = shell(transport)
    mb = 1 << 20
    rc, out, err = sh.run(f"head -c {mb} /dev/zero | tr '\\0' x; echo; head -c 200000 /dev/zero | tr '\\0' y >&2", 10)
    assert rc == 0 and len(out) == mb + 1 and out == "x" * mb + "\n"
    assert err == "y" * 200000
    assert sh.run("echo after", 5) == (0, "after\n", "")


def test_log_bytes_come_through_as_written_and_background_jobs_leave_no_chatter(transport: FakeTransport, tmp_path: Path) -> None:
    """Live progress reads logs through this shell: vLLM's ``\\r\\n`` lines and an unfinished last line
    arrive byte for byte, and the jobs ``up`` starts in the background (the start helper) add no
    job-control messages ("[1] PID", "[1]+ Done") to this or any later command's output."""
    from k3launch.render.logread import log_from
    from k3launch.render.scripts import BACKGROUND_HELPER

    sh = shell(transport)
    log = tmp_path / "p" / "p.log"
    program = "printf 'a\\r\\n(EngineCore pid=1) INFO x\\r\\nhalf'; sleep 0.2"
    rc, out, _ = sh.run(BACKGROUND_HELPER + f"k3launch_background {_q(str(log))} bash -c {_q(program)}", 10)
    assert rc == 0 and out.startswith("started pid ") and out.count("\n") == 1
    time.sleep(0.5)  # the job has ended: a shell with job control would report it now
    rc, out, _ = sh.run(log_from("p", str(log), 0) + "; sleep 0.1 & wait", 10)
    assert (rc, out) == (0, "@@k3log p\na\r\n(EngineCore pid=1) INFO x\r\nhalf\n@@k3end p\n")
    assert sh.run("true", 5) == (0, "", "")


def _q(text: str) -> str:
    import shlex

    return shlex.quote(text)


# ---- a host that goes silent: the heartbeat and the runner's bounds ------------------------------
class FakeSock:
    """The transport's socket, as far as aborting it goes: records options, then closes."""

    def __init__(self) -> None:
        self.options: list[tuple[int, int, bytes]] = []
        self.closed = False

    def setsockopt(self, level: int, name: int, value: bytes) -> None:
        self.options.append((level, name, value))

    def close(self) -> None:
        self.closed = True


class CutTransport(FakeTransport):
    def __init__(self) -> None:
        super().__init__()
        self.active = True
        self.answering = True
        self.requests: list[tuple[str, bool]] = []  # (kind, wants a reply)
        self.sock = FakeSock()
        self.open_timeouts: list[float | None] = []

    def open_session(self, timeout: float | None = None) -> PipeChannel:
        self.open_timeouts.append(timeout)
        ch = super().open_session(timeout)
        ch.silent = not self.answering
        return ch

    def is_active(self) -> bool:
        return self.active

    def set_keepalive(self, interval: float) -> None:  # paramiko's: keepalives that want no reply
        self.keepalive = interval

    def global_request(self, kind: str, data: object = None, wait: bool = True) -> None:
        """As paramiko's: with ``wait``, return on the reply or once the transport is closed."""
        self.requests.append((kind, wait))
        while wait and self.active and not self.answering:
            time.sleep(0.02)

    def cut(self) -> None:
        self.answering = False
        for ch in self.sessions:
            ch.silent = True

    def close(self) -> None:
        self.active = False
        for ch in self.sessions:  # paramiko closes every channel of a closed transport
            ch.close()
        self.sock.close()


class FakeClient:
    def __init__(self, transport: CutTransport) -> None:
        self.transport = transport

    def load_system_host_keys(self) -> None: ...

    def load_host_keys(self, path: str) -> None: ...

    def set_missing_host_key_policy(self, policy: object) -> None: ...

    def get_transport(self) -> CutTransport:
        return self.transport


class FakeConnection:
    """fabric's Connection as SshRunner uses it, over a CutTransport (the exec path is not used here)."""

    made: list[FakeConnection] = []

    def __init__(self, host: str, user: str | None = None, port: int | None = None, config: Any = None, connect_kwargs: Any = None) -> None:
        self.connect_kwargs = connect_kwargs or {}
        self.connect_timeout = config.timeouts.connect  # what fabric resolves (no ssh_config here)
        self.transport = CutTransport()
        self.client = FakeClient(self.transport)
        FakeConnection.made.append(self)

    def open(self) -> None: ...

    @property
    def is_connected(self) -> bool:
        return self.transport.active

    def close(self) -> None:
        self.transport.close()


@pytest.fixture
def fake_ssh(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeConnection]]:
    import fabric

    FakeConnection.made = []
    monkeypatch.setattr(fabric, "Connection", FakeConnection)
    yield FakeConnection
    for c in FakeConnection.made:
        c.close()
        for ch in c.transport.sessions:
            if ch.proc is not None and ch.proc.poll() is None:
                kill_group(ch.proc)


HOST = Target("h1", "h1.example", local=False)


def in_thread(fn: Callable[[], object], within: float = 30.0) -> object:
    """fn() in a thread: its result or exception; fails if it is still waiting after ``within`` s."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed back to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    assert not t.is_alive(), f"still waiting after {within:g}s"
    return out[0]


def wait_for(cond: Callable[[], bool], within: float = 30.0) -> None:
    end = time.monotonic() + within
    while not cond():
        assert time.monotonic() < end, f"not within {within:g}s"
        time.sleep(0.02)


def test_heartbeat_keeps_an_answering_connection_and_aborts_a_silent_one() -> None:
    t = CutTransport()
    beat = Heartbeat(t, timeout=0.5, interval=0.05).start()
    wait_for(lambda: len(t.requests) >= 3)
    assert beat.lost is None and t.active  # answered keepalives: nothing happens
    assert set(t.requests) == {(KEEPALIVE, True)}  # keepalive@openssh.com, asking for a reply (paramiko's own asks for none)
    t.cut()
    wait_for(lambda: not t.active)
    assert beat.lost == "keepalives unanswered for 0.5s"
    # reset, not closed politely: what is still queued for the host (a start script) never reaches it
    assert t.sock.options == [(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))] and t.sock.closed

    t2 = CutTransport()
    quiet = Heartbeat(t2, timeout=0.5, interval=0.05).start()
    wait_for(lambda: len(t2.requests) >= 1)
    quiet.stop()  # its owner closes the connection: no more beats, and no abort
    t2.cut()
    time.sleep(0.2)
    assert t2.active and quiet.lost is None


def test_ssh_runner_bounds_every_wait_by_the_connect_timeout(fake_ssh: type[FakeConnection]) -> None:
    runner = SshRunner(connect_timeout=3.0)
    try:
        assert runner.run(HOST, "echo hi", timeout=5).stdout == "hi\n"
        (conn,) = fake_ssh.made
        # TCP connect (fabric's config), banner, auth and channel opens: the connect timeout, not paramiko's hour
        assert conn.connect_timeout == 3
        bounds = ("banner_timeout", "auth_timeout", "channel_timeout")
        assert {k: conn.connect_kwargs[k] for k in bounds} == dict.fromkeys(bounds, 3.0)
        # the connection's heartbeat: keepalives that want a reply, a quarter of the connect timeout
        # apart; the connection is given up when none was answered for the whole connect timeout
        beat = runner._beats[HOST]
        assert (beat.timeout, beat.interval) == (3.0, 0.75)
        wait_for(lambda: (KEEPALIVE, True) in conn.transport.requests)
        # the persistent shell: its channel opened within the connect timeout, and no write without a bound
        (ch,) = conn.transport.sessions
        assert conn.transport.open_timeouts == [3.0]
        assert ch.timeouts_at_send and None not in ch.timeouts_at_send
    finally:
        runner.close()
    assert not conn.transport.active


def test_a_command_on_a_host_that_goes_silent_fails_unreachable_long_before_its_own_timeout(fake_ssh: type[FakeConnection]) -> None:
    runner = SshRunner(connect_timeout=1.0)
    try:
        assert runner.run(HOST, "true", timeout=5).ok  # connected, shell open
        (conn,) = fake_ssh.made
        conn.transport.cut()
        got = in_thread(lambda: runner.run(HOST, "echo started", timeout=300))  # a start may take minutes on a host that answers
        assert isinstance(got, Unreachable), got
        assert got.message == "h1: connection lost: keepalives unanswered for 1s", got.message
        assert not conn.transport.active and HOST not in runner._conns
    finally:
        runner.close()


def test_a_host_silent_while_idle_is_reported_by_the_next_command_without_another_connect(fake_ssh: type[FakeConnection]) -> None:
    runner = SshRunner(connect_timeout=1.0)
    try:
        assert runner.run(HOST, "true", timeout=5).ok
        (conn,) = fake_ssh.made
        conn.transport.cut()  # between two polls
        wait_for(lambda: not conn.transport.active)
        got = in_thread(lambda: runner.run(HOST, "true", timeout=300))
        assert isinstance(got, Unreachable) and "keepalives unanswered for 1s" in got.message, got
        assert len(fake_ssh.made) == 1  # not a second connect timeout spent on a host known silent
        assert runner.run(HOST, "echo back", timeout=5).stdout == "back\n"  # the next command reconnects
        assert len(fake_ssh.made) == 2
    finally:
        runner.close()


def test_a_bash_that_never_answers_the_handshake_is_no_shell() -> None:
    with pytest.raises(ShellBroken, match=r"no answer from bash within 0\.3s"):
        Shell(FakeTransport(program=["sleep", "30"]), open_timeout=0.3)  # not ShellTimeout: the runner falls back to exec channels


def test_a_liveness_check_that_hangs_on_a_host_that_answers_is_one_line(tmp_path: Path) -> None:
    """A silent host is an Unreachable (above); a host that answers keepalives but whose check
    overruns (a hung filesystem under a log) is reported by node and bound, not by the check's text."""
    from k3launch.deploy.ssh.observe import poll
    from k3launch.models.record import ProcessRecord, SshRecord
    from k3launch.models.selection import Selection
    from k3launch.planning.build import build_plan
    from k3launch.planning.inventory import load_inventory
    from k3launch.planning.recipes import RecipeTree
    from k3launch.testing import FakeRunner
    from k3launch.transport.fleet import Fleet

    inv = load_inventory(ROOT / "inventories" / "local.yaml")
    plan = build_plan(RecipeTree(), Selection(strategy="multi_node_tp", nodes=2), inventory=inv)
    rec = SshRecord(name=plan.name, state="ready", created=0, updated=0, endpoint=plan.endpoint, plan=plan)
    for i, p in enumerate(plan.processes):
        rec.processes[p.id] = ProcessRecord(
            id=p.id, node=p.node, runtime="bare", handle=str(3000 + i), log=f"/tmp/{p.id}.log", started=True
        )
    hung = plan.processes[1].node

    def answer(t: Target, cmd: str) -> tuple[int, str, str]:
        if t.name == hung:
            return 124, "", "timed out after 10s"
        return 0, "".join(f"{pr.handle} up\n" for pr in rec.processes.values() if pr.node == t.name), ""

    runner = FakeRunner(answer)
    got = poll(rec, Fleet.for_plan(plan, runner, runner))
    assert got.unreachable == {hung: f"{hung}: no answer to the liveness check within 10s"} and got.dead == []
