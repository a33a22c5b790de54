"""``k3launch rollout NAME``: change a live deployment one unit at a time, behind its router."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from k3launch.cli.common import INTERRUPTED, STATE, AcceptUnknown, ConnectTimeout, JsonOut, StateDir, app, console
from k3launch.errors import K3Error


@app.command()
def rollout(
    name: Annotated[str, typer.Argument(help="Deployment name.")],
    sets: Annotated[list[str] | None, typer.Option("--set", help="FLAG=VALUE for every engine (repeatable); replaces an earlier --set of FLAG.")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", help="NAME=VALUE in every engine's environment (repeatable); replaces an earlier --env NAME.")] = None,
    unsets: Annotated[list[str] | None, typer.Option("--unset", help="Drop a flag or env the deployment was given with --set/--env (repeatable).")] = None,
    image: Annotated[str | None, typer.Option("--image", help="Container image for every engine.")] = None,
    vllm_version: Annotated[str | None, typer.Option("--vllm-version", help="Plan for this vLLM version (its flag schema).")] = None,
    resume: Annotated[bool, typer.Option("--continue", help="Finish a stopped rollout (the units not on its new plan yet).")] = False,
    rollback: Annotated[bool, typer.Option("--rollback", help="Undo a stopped rollout (its rolled units back to the old plan).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the new plan's changes per process and the units to roll; touch nothing.")] = False,
    max_unavailable: Annotated[int, typer.Option("--max-unavailable", help="Units out of the router and restarting at a time.")] = 1,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", help="Seconds to wait for a unit's in-flight requests before stopping it.")] = 120.0,
    start_timeout: Annotated[float | None, typer.Option("--start-timeout", help="Seconds a restarted unit has to pass its gate (default: the plan's ready timeout).")] = None,
    surge: Annotated[bool, typer.Option("--surge", help="Start the whole new set of engines on spare nodes, gate it, switch the router to it, then drain and stop the old set.")] = False,
    no_canary: Annotated[bool, typer.Option("--no-canary", help="Gate restarted units on health and a completion only, not the correctness canary.")] = False,
    rebaseline: Annotated[bool, typer.Option("--rebaseline", help="The change alters answers on purpose (model, sampling flags): the first unit rolled records the canary anew.")] = False,
    allow_downtime: Annotated[bool, typer.Option("--allow-downtime", help="Roll even when no engine is left in the router meanwhile (one engine, or --max-unavailable as many).")] = False,
    state_dir: StateDir = None, accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False,
) -> None:
    """Change a live deployment one unit at a time: out of the router, drained, restarted on the new plan, gated, back in.

    The new plan is the deployment's own (same inventory, nodes and ports) with the changes; a unit that fails its gate (health and a real completion) is rolled back and the rollout stops there: `--continue` resumes it, `--rollback` undoes it."""
    STATE.json = json_out
    from k3launch.api import Access
    from k3launch.api.rollouts import refusal, rollout_continue, rollout_preview
    from k3launch.api.rollouts import rollout as do_rollout

    con = console()
    say = (lambda s: None) if json_out else con.print
    try:
        if resume or rollback:
            if (resume and rollback) or sets or env or unsets or image or vllm_version or dry_run or surge or rebaseline:
                raise K3Error("bad-option", "--continue and --rollback take no change, no --dry-run and not each other",
                              f"`k3launch status {name}` shows the stopped rollout")
            result = rollout_continue(name, rollback=rollback, drain_timeout=drain_timeout, start_timeout=start_timeout,
                                      max_unavailable=max_unavailable, say=say, state_dir=state_dir, canary=not no_canary,
                                      access=Access(accept_unknown_hosts, connect_timeout))
        else:
            preview = rollout_preview(name, sets=sets or [], unsets=unsets or [], env=env or [], image=image,
                                          vllm_version=vllm_version, surge=surge, state_dir=state_dir)
            # a dry run ends as the real run would: refused (exit 2), after the changes it would have made
            refused = refusal(name, preview, max_unavailable, allow_downtime) if dry_run and preview.units else None
            if refused is not None and json_out:
                raise refused
            if dry_run or not json_out:
                diffs = [{"process": d.process, "changes": [c.line() for c in d.changes]} for d in preview.diffs if d.changed]
                if json_out:
                    typer.echo(json.dumps({"name": name, "processes": diffs, "units": [u.name for u in preview.units],
                                           "rebaseline": list(preview.rebaseline)}))
                else:
                    for d in diffs:
                        con.print(f"{d['process']}:", *[f"  {c}" for c in d["changes"]], sep="\n", markup=False)
                    con.print(f"units to roll, in order: {', '.join(u.name for u in preview.units) or 'none'}")
                    if preview.rebaseline:
                        con.print("the canary's recorded answers do not apply to the new plan (--rebaseline records new ones): "
                                  + "; ".join(preview.rebaseline), markup=False)
                if refused is not None:
                    raise K3Error(refused.code, f"the rollout would be refused: {refused.message}", refused.hint)
                if dry_run:
                    return
            result = do_rollout(name, preview=preview, drain_timeout=drain_timeout, start_timeout=start_timeout,
                                max_unavailable=max_unavailable, allow_downtime=allow_downtime, say=say, state_dir=state_dir,
                                canary=not no_canary, rebaseline=rebaseline,
                                access=Access(accept_unknown_hosts, connect_timeout))
    except KeyboardInterrupt:
        raise typer.Exit(INTERRUPTED) from None
    rolled = [{"unit": r.unit, "seconds": round(r.seconds, 3), "drained_s": round(r.drained_s, 3), "downtime_s": round(r.downtime_s, 3)}
              for r in result.rolled]
    if json_out:
        typer.echo(json.dumps({"name": name, "ok": result.ok, "rolled": rolled, "failed": result.failed, "reason": result.reason,
                               "logs": result.logs}))
    elif result.ok and rollback:
        con.print(f"{name} rolled back: {len(rolled)} unit(s) in {sum(r.seconds for r in result.rolled):.1f}s" if rolled else
                  f"{name}: no unit ran the new plan, so none was rolled back; the stopped rollout is dropped", markup=False)
    elif result.ok:
        down = sum(r.downtime_s for r in result.rolled)
        con.print(f"{name} rolled: {len(rolled)} unit(s) in {sum(r.seconds for r in result.rolled):.1f}s"
                  + (f"; not serving for {down:.1f}s (no router in front)" if down else ""))
    else:
        con.print(f"rollout stopped at {result.failed} (rolled back): {result.reason}", markup=False)
        for path in result.logs:
            con.print(f"  its last lines: {path}", markup=False)
        con.print(f"`k3launch rollout {name} --continue` tries again; `--rollback` undoes what rolled", markup=False)
    if not result.ok:
        raise typer.Exit(1)


@app.command()
def scale(
    name: Annotated[str, typer.Argument(help="Deployment name.")],
    replicas: Annotated[int | None, typer.Option("--replicas", help="Copies that serve behind the router (default: as now).")] = None,
    standby: Annotated[int | None, typer.Option("--standby", help="Hot standbys: copies started and serving, kept out of the router, that take a failed copy's place at once (default: as now).")] = None,
    state_dir: StateDir = None, accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False,
) -> None:
    """Change how many copies of the engine serve, and how many hot standbys wait beside them.

    Out: new copies start on free nodes of the inventory (the doctor first), then join the router (standbys stay out). In: the copies with the highest indices leave the router, drain and stop. The deployment's supervisor does it; without one, this command does until it is done."""
    STATE.json = json_out
    from k3launch.api import Access
    from k3launch.api.scaling import scale as do_scale

    con = console()
    say = (lambda s: None) if json_out else (lambda s: con.print(s, markup=False))
    try:
        if replicas is None and standby is None:
            raise K3Error("no-change", "nothing to scale", "give --replicas N and/or --standby K")
        result = do_scale(name, replicas=replicas, standby=standby, say=say, state_dir=state_dir,
                          access=Access(accept_unknown_hosts, connect_timeout))
    except KeyboardInterrupt:
        raise typer.Exit(INTERRUPTED) from None
    if json_out:
        typer.echo(json.dumps({"name": name, "copies": result.copies, "standby": result.standby, "seconds": result.seconds}))
    else:
        extra = f", {len(result.standby)} standby ({', '.join(result.standby)})" if result.standby else ""
        con.print(f"{name} runs {result.copies} copies{extra} after {result.seconds:.1f}s", markup=False)
