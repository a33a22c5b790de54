"""A long-lived ``bash`` per SSH host: a command costs a write and a read, not a new session.

Why: every ``exec`` request makes sshd fork a session and start the login shell. Measured on
the 2-CPU test machine: one poll of 32 hosts took 2.4 s over new exec channels and 25 ms over
open shells — and ``up`` polls every 0.5 s, so the session cost alone would delay noticing a
dead rank by seconds (and eat the CPU the engines load with).

Protocol (one command at a time per shell; :class:`~k3launch.transport.runners.SshRunner` falls back to
an exec channel when the shell is busy, broken or cannot start):

* start: ``exec bash --noprofile --norc`` (whatever the login shell is), fd 3 = the channel's
  stdout, a handshake within the connect timeout;
* each command is sent *quoted* and ``eval``-ed in a subshell, so a syntax error, ``exit`` or
  ``cd`` affects only that command and an unbalanced quote cannot desynchronise the stream;
  its stdin is ``/dev/null`` (it cannot read the protocol), its stdout goes to the channel
  as is, its stderr is captured and sent after a marker, then an end marker with the exit code.
  Markers carry a random per-shell token and a sequence number, so no output can fake them;
* a command that overruns its timeout, or a channel that closes, ends the shell (the next
  command starts a new one);
* every wait is bounded: opening the channel and the handshake by the open timeout (the
  connect timeout), a write and each read by the command's timeout; a host that goes silent
  mid-command is noticed sooner, by the connection's heartbeat
  (:mod:`k3launch.transport.heartbeat`), which closes the channel under the read.
"""

from __future__ import annotations

import secrets
import shlex
import threading
import time


class ShellBroken(Exception):
    """The shell's channel closed or never answered: use another path (or report unreachable).

    ``silent``: the host did not answer the request to open the channel in time (a silent host,
    not one without a usable bash)."""

    def __init__(self, message: str, silent: bool = False) -> None:
        super().__init__(message)
        self.silent = silent


class ShellTimeout(Exception):
    """The command did not finish in time; the shell has been closed."""


class Shell:
    def __init__(self, transport: object, open_timeout: float) -> None:
        self.lock = threading.Lock()
        self._token = secrets.token_hex(8)
        self._seq = 0
        self._buf = b""
        t0 = time.monotonic()
        try:
            self._ch = transport.open_session(timeout=open_timeout)  # type: ignore[attr-defined]
        except Exception as exc:  # paramiko's SSHException, EOFError, socket errors: no shell here
            raise ShellBroken(str(exc) or type(exc).__name__, silent=time.monotonic() - t0 >= open_timeout) from None
        try:
            self._ch.settimeout(open_timeout)  # bounds the handshake's write (paramiko's default: wait forever)
            self._ch.exec_command("exec bash --noprofile --norc")
        except Exception as exc:
            self.close()
            raise ShellBroken(str(exc) or type(exc).__name__) from None
        try:
            rc, out, _ = self.run("exec 3>&1; echo k3launch-shell", open_timeout, _init=True)
        except ShellTimeout:  # a bash that does not answer in time is no usable shell (the channel is closed)
            raise ShellBroken(f"no answer from bash within {open_timeout:g}s") from None
        if rc != 0 or out.strip() != "k3launch-shell":
            self.close()
            raise ShellBroken(f"no usable bash (exit {rc})")

    def run(self, command: str, timeout: float, _init: bool = False) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of ``command``; raises ShellBroken / ShellTimeout."""
        self._seq += 1
        mark = f"@@{self._token}:{self._seq}"
        if _init:
            line = f"{command}; printf '\\n%s\\n\\n%s 0\\n' '{mark}:err' '{mark}:end'\n"
        else:
            line = (f"k3err=$( ( eval {shlex.quote(command)} ) </dev/null 2>&1 1>&3 3>&- ); k3rc=$?; "
                    f"printf '\\n%s\\n%s\\n%s %d\\n' '{mark}:err' \"$k3err\" '{mark}:end' \"$k3rc\"\n")
        err_mark, end_mark = f"\n{mark}:err\n".encode(), f"\n{mark}:end ".encode()
        deadline = time.monotonic() + timeout
        try:
            self._ch.settimeout(timeout)  # a write waits for the peer's window: bounded too
            self._ch.sendall(line.encode())
        except Exception as exc:  # socket errors, EOFError, paramiko.SSHException ("channel closed")
            self.close()
            raise ShellBroken(str(exc) or type(exc).__name__) from None
        scanned = 0
        while True:
            i_end = self._buf.find(end_mark, max(0, scanned - len(end_mark)))
            if i_end >= 0:
                nl = self._buf.find(b"\n", i_end + len(end_mark))
                if nl >= 0:
                    break
            scanned = len(self._buf)
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise ShellTimeout(f"timed out after {timeout:g}s")
            self._ch.settimeout(min(left, 1.0))
            try:
                chunk = self._ch.recv(65536)
            except TimeoutError:  # socket.timeout: check the deadline, then wait again
                continue
            except (OSError, EOFError) as exc:
                self.close()
                raise ShellBroken(str(exc) or type(exc).__name__) from None
            if not chunk:
                self.close()
                raise ShellBroken("the channel closed")
            self._buf += chunk
        i_err = self._buf.rfind(err_mark, 0, i_end)
        rc_text = self._buf[i_end + len(end_mark) : nl].decode(errors="replace").strip()
        out = self._buf[: max(i_err, 0)].decode(errors="replace")
        err = self._buf[i_err + len(err_mark) : i_end].decode(errors="replace") if i_err >= 0 else ""
        self._buf = self._buf[nl + 1 :]
        return (int(rc_text) if rc_text.lstrip("-").isdigit() else 255), out, err

    @property
    def alive(self) -> bool:
        return not bool(self._ch.closed)

    def close(self) -> None:
        try:
            self._ch.close()
        except Exception:  # closing a broken channel may fail; nothing to do
            pass
