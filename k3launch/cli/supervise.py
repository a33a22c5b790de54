"""``k3launch supervise / events``: keep a deployment serving, and what its supervisors did."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from k3launch.cli.common import INTERRUPTED, STATE, AcceptUnknown, ConnectTimeout, JsonOut, StateDir, app, console
from k3launch.cli.show_events import line
from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.models.supervise import Event

Seconds = float | None


def _opt(flag: str, what: str) -> Any:
    return typer.Option(flag, help=what, show_default=False)


@app.command()
def supervise(
    name: Annotated[str, typer.Argument(help="Deployment name.")],
    detach: Annotated[bool, typer.Option("--detach", help="Run in the background on this machine (its host and pid go into the record).")] = False,
    restart: Annotated[str | None, _opt("--restart", "on-failure (default) or never.")] = None,
    max_restarts: Annotated[int | None, _opt("--max-restarts", "Restarts of one unit within --window before giving it up (default 3).")] = None,
    window: Annotated[Seconds, _opt("--window", "Seconds over which restarts are counted (default 3600).")] = None,
    backoff: Annotated[Seconds, _opt("--backoff", "Seconds before the second restart in the window; doubles each time (default 10).")] = None,
    backoff_max: Annotated[Seconds, _opt("--backoff-max", "Cap of the backoff, seconds (default 300).")] = None,
    unhealthy_after: Annotated[Seconds, _opt("--unhealthy-after", "Seconds of failing or silent /health before an engine counts as hung (default 60).")] = None,
    node_lost_after: Annotated[Seconds, _opt("--node-lost-after", "Seconds without an answer before a node counts as lost (default 300).")] = None,
    poll: Annotated[Seconds, _opt("--poll", "Seconds between looks (default 2).")] = None,
    start_timeout: Annotated[Seconds, _opt("--start-timeout", "Seconds a restarted unit has to serve (default: the plan's ready timeout).")] = None,
    stall_after: Annotated[Seconds, _opt("--stall-after", "Seconds a restarting engine may use no CPU at all before it counts as hung (default 120; 0: never).")] = None,
    canary_interval: Annotated[Seconds, _opt("--canary-interval", "Seconds between replays of the correctness canary while every engine serves (default 600; 0: never).")] = None,
    on_event: Annotated[str | None, _opt("--on-event", "A command run (bash -c, on this machine) with each event as JSON on stdin, e.g. to page someone.")] = None,
    state_dir: StateDir = None, accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False,
) -> None:
    """Keep a deployment serving until it is taken down: restart what died or hung, give up cleanly.

    The restart policy is the inventory's `restart:` section; these flags override it. Ctrl-C
    stops watching, never the deployment; `down` stops the supervisor first. Every event goes to
    the deployment's event log (`k3launch events NAME`)."""
    STATE.json = json_out
    from k3launch import api

    overrides = {"policy": restart, "max_restarts": max_restarts, "window": window, "backoff": backoff, "backoff_max": backoff_max,
                 "unhealthy_after": unhealthy_after, "node_lost_after": node_lost_after, "poll": poll, "start_timeout": start_timeout,
                 "stall_after": stall_after, "canary_interval": canary_interval}
    con = console()
    try:
        policy = api.restart_policy(name, overrides, state_dir=state_dir)
        if detach:
            sv = api.supervise_detached(name, policy=policy, on_event_command=on_event, state_dir=state_dir,
                                        access=api.Access(accept_unknown_hosts, connect_timeout))
            if json_out:
                typer.echo(json.dumps({"name": name, "supervisor": sv.model_dump(mode="json")}))
            else:
                con.print(f"supervising {name} in the background: pid {sv.pid} on {sv.host}; `k3launch events {name} -f` follows it")
            return

        def show(e: Event) -> None:
            typer.echo(e.model_dump_json(exclude_defaults=True) if json_out else line(e))

        outcome = api.supervise(name, state_dir=state_dir, policy=policy, on_event=show, on_event_command=on_event,
                                access=api.Access(accept_unknown_hosts, connect_timeout))
    except KeyboardInterrupt:
        raise typer.Exit(INTERRUPTED) from None
    if outcome == "failed":
        raise typer.Exit(1)


@app.command()
def events(
    name: Annotated[str, typer.Argument(help="Deployment name (its events are kept after `down`).")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events (Ctrl-C stops).")] = False,
    state_dir: StateDir = None, json_out: JsonOut = False,
) -> None:
    """What supervisors (on Slurm, the job itself) saw and did: detections, restarts, backoffs, cordons, give-ups (time, unit, process, node, reason)."""
    STATE.json = json_out
    from k3launch import api

    def show(e: Event) -> None:
        typer.echo(e.model_dump_json(exclude_defaults=True) if json_out else line(e))

    try:
        if not follow:
            got = api.events(name, state_dir=state_dir)
            if not got and api.record(name, state_dir) is None:
                raise K3Error("unknown-deployment", f"no deployment and no events named {name!r}", "see `k3launch list`")
            for e in got:
                show(e)
            return
        for e in api.follow_events(name, lambda: False, state_dir=state_dir):
            show(e)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
