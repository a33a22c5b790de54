"""The persistent remote shell (:class:`k3launch.transport.sshshell.Shell`) without SSH: its channel
is a local ``bash`` behind pipes, so the real framing protocol runs (handshake, quoted ``eval`` in a
subshell, stderr after a marker, end marker with the exit code) and only paramiko is left out.

The fake channel does what paramiko's does for the calls Shell makes: ``exec_command`` starts the
program, ``sendall`` writes its stdin, ``recv`` reads its stdout (``b""`` at EOF, ``TimeoutError``
when ``settimeout``'s time passes without data), ``close`` ends it (its whole process group here,
so nothing a test started outlives it)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from k3launch.transport.sshshell import Shell, ShellBroken, ShellTimeout


class PipeChannel:
    def __init__(self, program: list[str] | None = None) -> None:
        self.program = program  # None: run what exec_command asks for
        self.proc: subprocess.Popen[bytes] | None = None
        self.closed = False
        self.timeout: float | None = None

    def exec_command(self, command: str) -> None:
        self.proc = subprocess.Popen(self.program or ["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def sendall(self, data: bytes) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        if self.closed:
            raise OSError("Socket is closed")
        self.proc.stdin.write(data)  # BrokenPipeError (an OSError) when bash is gone
        self.proc.stdin.flush()

    def settimeout(self, timeout: float) -> None:
        self.timeout = timeout

    def recv(self, n: int) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
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
    with pytest.raises(ShellBroken, match="connection lost"):
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


def _q(text: str) -> str:
    import shlex

    return shlex.quote(text)
