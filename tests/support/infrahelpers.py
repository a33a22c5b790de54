"""What the pytest-side wrappers of ``tests/infra`` (sshhosts.py, slurmcluster.py) have in common.

A plain module, not a plugin: running an infra script with a timeout that kills its whole process
group, cleaning up after an up that failed, taking the first free "slot" of machine-wide names,
one running set per pytest session with "skip, or fail when required" if it cannot start; and two
small helpers of the infra tests (process liveness on a VM that reaps late, bounded polling).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Generic, NoReturn, Protocol, TypeVar

import pytest
from paths import TESTS

INFRA = TESTS / "infra"

T = TypeVar("T")


class InfraError(RuntimeError):
    """A tests/infra script failed; the message carries the tail of its stderr."""


def run_script(script: str, *args: str, env: Mapping[str, str], timeout: float) -> str:
    """Run ``tests/infra/SCRIPT ARGS`` with exactly ``env`` and return its stdout; raise InfraError on failure.

    The script runs in its own session and the whole group is killed on timeout: a child still
    holding the pipes (apt-get, an ssh or a wait loop it waits on) would otherwise hang us too.
    The daemons it starts daemonize into sessions of their own and are not affected.
    """
    cmd = ["bash", str(INFRA / script), *args]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=dict(env))
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise InfraError(f"{script} {' '.join(args)}: timed out after {timeout:g}s\n{err[-2000:]}") from None
    if p.returncode != 0:
        raise InfraError(f"{script} {' '.join(args)}: exit {p.returncode}\n{err.strip()[-2000:]}")
    return out


class RunInfra(Protocol):
    """sshhosts.run_infra / slurmcluster.run_infra: run_script with that module's environment."""

    def __call__(self, script: str, *args: str, env: Mapping[str, str] | None = ..., timeout: float = ...) -> str: ...


def up_or_clean_up(run: RunInfra, up: str, down: str, dir: Path | str, *, env: Mapping[str, str], timeout: float) -> None:
    """``run(UP, DIR)``; if that fails, ``run(DOWN, DIR)`` (its own failure ignored) before InfraError
    is raised again: a half-made set (namespaces, claims, some daemons) must not outlive the failure."""
    try:
        run(up, str(dir), env=env, timeout=timeout)
    except InfraError:
        try:
            run(down, str(dir), timeout=120)
        except InfraError:
            pass
        raise


def in_first_free_slot(start: Callable[[Mapping[str, str] | None], T], slot_env: Callable[[int], dict[str, str]], *,
                       slot_knobs: Iterable[str], taken: Iterable[str], slots: int) -> T:
    """``start(slot_env(slot))`` for slot 0, 1, ... until one is not refused for names another DIR
    holds (InfraError whose message has one of ``taken``); other failures, and the last slot's, are
    raised. Knobs of ``slot_knobs`` set explicitly in the environment win: ``start(None)``, no search.
    """
    if any(k in os.environ for k in slot_knobs):
        return start(None)
    for slot in range(slots):
        try:
            return start(slot_env(slot))
        except InfraError as exc:
            if slot == slots - 1 or not any(t in str(exc) for t in taken):
                raise
    raise AssertionError("unreachable")


def unavailable(env_required: str, reason: str) -> NoReturn:
    """Skip the test with ``reason``; fail it instead when ``env_required`` is "1" (so CI cannot go green by skipping)."""
    if os.environ.get(env_required) == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


class _Stoppable(Protocol):
    def down(self) -> None: ...


S = TypeVar("S", bound=_Stoppable)


class SessionInfra(Generic[S]):
    """One running set (hosts, a cluster) per pytest session, even if several modules set the fixture up."""

    def __init__(self, env_required: str, needs_root: str, cannot_start: str) -> None:
        self.env_required = env_required
        self.needs_root = needs_root  # the reason when not root
        self.cannot_start = cannot_start  # the reason when start fails, before ": <InfraError>"
        self.current: S | None = None

    def provide(self, start: Callable[[], S]) -> Iterator[S]:
        """The body of the session fixture (``yield from``): the running set, or ``start()``'s, which is
        stopped (``down()``) at the end. Skips (fails with ``env_required``=1) when not root or when
        ``start`` raises InfraError."""
        if self.current is not None:
            yield self.current
            return
        if os.geteuid() != 0:
            unavailable(self.env_required, self.needs_root)
        try:
            started = start()
        except InfraError as exc:
            unavailable(self.env_required, f"{self.cannot_start}: {exc}")
        self.current = started
        try:
            yield started
        finally:
            self.current = None
            started.down()


# ---- for the infra tests -------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
    """Not a zombie: this VM's PID 1 reaps late, so exited processes linger as Z for a while."""
    try:
        states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0] for t in os.listdir(f"/proc/{pid}/task")]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return any(s not in ("Z", "X") for s in states)


def wait_until(cond: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    """Poll ``cond`` every ``step`` s for up to ``timeout`` s; whether it came true (checked once more at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())
