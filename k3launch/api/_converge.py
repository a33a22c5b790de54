"""How a command changes a live deployment: a new spec revision, then the one controller
converges to it (:mod:`k3launch.deploy.control.loop`), and the command sees it happen.

With a controller running (``supervise``) the command waits for it and says the progress; with
none, it runs the controller in the foreground until the spec is reached. Interrupted (Ctrl-C),
a foreground controller hands over to a detached one, which goes on from the memory saved in
the record. A command waiting for a controller that was killed takes over after
:data:`TAKEOVER_S`. ``rollout`` and ``scale`` both go through :func:`converge`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from k3launch.api._common import store
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.access import Access
from k3launch.models.record import DeploymentRecord
from k3launch.models.supervise import Event

WAIT_POLL_S = 0.5
TAKEOVER_S = 10.0  # a command waits this long for a killed supervisor's successor before it converges on itself
SHOWN = ("rolling", "rolled", "roll-failed", "rolled-back", "restarting", "restarted", "detected", "scaling", "scaled",
         "scale-failed", "standby", "promoted")

Done = Callable[[DeploymentRecord], bool]
"""Whether the record shows the spec reached (it is read once the controller adopted the revision)."""


def converge(name: str, change: Mapping[str, Any], *, done: Done, refuse: Callable[[StateStore, DeploymentRecord], None],
             what: str, say: Callable[[str], None], state_dir: str | Path | None, access: Access,
             progress: Callable[[DeploymentRecord], list[str]] | None = None) -> int:
    """Write ``change`` as a new spec revision (under the deployment's lock, after ``refuse``),
    then see the controller reach it (``done``); the revision written."""
    from k3launch.api.supervision import refuse_self_supervised, supervise, supervise_detached, write_spec
    from k3launch.deploy.control.process import lock_path
    from k3launch.util.locks import held

    st = store(state_dir)
    with st.lock(name):  # one writer of the spec at a time; a `down` meanwhile is refused
        rec = st.load(name)
        refuse_self_supervised(rec)
        refuse(st, rec)
        revision = write_spec(st, name, **change, access=access)
    if held(lock_path(st, name)):
        say(f"the supervisor of {name} converges it (spec revision {revision})")
        if follow(st, name, revision, done, say, progress):
            return revision
        say(f"no supervisor has watched {name} for {TAKEOVER_S:g}s: this command goes on from the saved memory")

    def on_event(e: Event) -> None:
        if e.kind in SHOWN:
            say(f"{e.unit or name}: {e.kind}: {e.reason}")

    outcome = "stopped"
    try:
        outcome = supervise(name, state_dir=state_dir, on_event=on_event, until_converged=True, access=access)
    finally:
        if outcome == "stopped":  # interrupted: a detached controller finishes what this one started
            from k3launch.deploy.control.process import stop_path

            cur = st.try_load(name)
            if cur is None or cur.state != "ready" or stop_path(st, name).exists():  # `down` stopped it: nothing to hand over
                say(f"{name} is being taken down: the {what} ends with it")
            else:
                try:
                    sv = supervise_detached(name, state_dir=state_dir, access=access)
                    say(f"interrupted: the {what} goes on under a detached supervisor (pid {sv.pid} on {sv.host}); "
                        f"`k3launch status {name}` follows it")
                except K3Error as exc:  # e.g. a `down` that came meanwhile
                    say(f"interrupted, and not handed over: {exc.message}; `k3launch status {name}`, then `k3launch rollout "
                        f"{name} --continue` or `k3launch supervise {name} --detach`")
    return revision


def follow(st: StateStore, name: str, revision: int, done: Done, say: Callable[[str], None],
           progress: Callable[[DeploymentRecord], list[str]] | None) -> bool:
    """Wait for a running controller to reach spec ``revision``; False when no controller has run
    for :data:`TAKEOVER_S` (killed, and nobody started another): the caller runs one."""
    from k3launch.deploy.control.process import lock_path
    from k3launch.util.locks import held

    said: set[str] = set()
    gone: float | None = None
    while True:
        if held(lock_path(st, name)):
            gone = None
        elif gone is None:
            gone = time.monotonic()
        elif time.monotonic() - gone > TAKEOVER_S:
            return False
        rec = st.try_load(name)
        if rec is None or rec.state != "ready":
            raise K3Error("converge-ended", f"{name} is {rec.state if rec else 'gone'}: the change ended with it", f"`k3launch events {name}`")
        adopted = rec.control is not None and rec.control.revision >= revision
        for line in progress(rec) if progress is not None and adopted else []:
            if line not in said:
                said.add(line)
                say(line)
        if adopted and done(rec):
            return True
        time.sleep(WAIT_POLL_S)
