"""``k3launch up / status / logs / down / list``: the deployment lifecycle from a login node."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from k3launch.cli.common import (
    INTERRUPTED,
    STATE,
    AcceptUnknown,
    ConnectTimeout,
    JsonOut,
    PlanArgs,
    StateDir,
    app,
    console,
    fail,
    number_option,
    rule,
    with_selection,
)
from k3launch.errors import K3Error
from k3launch.util import bounds

if TYPE_CHECKING:
    from rich.console import Console

    from k3launch.models.bringups import Comparison
    from k3launch.models.plan import Plan
    from k3launch.models.record import DeploymentRecord
    from k3launch.models.reports import DryRun



@app.command()
@with_selection
def up(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print exactly what would run on each node, and stop.")] = False,
    ready_timeout: Annotated[float | None, number_option("--ready-timeout", bounds.READY_TIMEOUT,
                                                         "Seconds to wait for serving (default: the plan's VLLM_ENGINE_READY_TIMEOUT_S, else 1800).")] = None,
    keep_on_failure: Annotated[bool, typer.Option("--keep-on-failure", help="Leave processes running when up fails (for debugging).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Use nodes another live deployment holds.")] = False,
    skip_doctor: Annotated[bool, typer.Option("--skip-doctor", help="Do not run the pre-flight checks.")] = False,
    supervise: Annotated[bool, typer.Option("--supervise", help="Keep it serving (policy: the inventory's restart:): once it serves, a detached `k3launch supervise`; on Slurm the job restarts failed steps itself.")] = False,
    extra_sbatch: Annotated[list[str] | None, typer.Option("--extra-sbatch", help="Slurm: one more #SBATCH directive, verbatim (repeatable), e.g. --extra-sbatch=--mail-type=END.")] = None,
    queue_timeout: Annotated[float | None, number_option("--queue-timeout", bounds.QUEUE_TIMEOUT,
                                                         "Slurm: seconds the job may wait in the queue (default: no limit).")] = None,
    no_canary: Annotated[bool, typer.Option("--no-canary", help="Record no correctness canary once it serves (see `k3launch canary`).")] = False,
    standby: Annotated[int, typer.Option("--standby", min=0, max=64, help="Hot standbys: this many more copies, started and gated, kept out of the router by the supervisor until one takes a failed copy's place (implies --supervise).")] = 0,
    accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False,
    *, args: PlanArgs,
) -> None:
    """Launch a deployment and wait until it serves (default: the simulated K3 on this machine).

    On a slurm inventory: one sbatch job, watched from here until it serves (see docs/slurm.md)."""
    STATE.json = json_out
    from k3launch import api
    from k3launch.cli import show_deploy, show_progress

    con = console()
    access = api.Access(accept_unknown_hosts, connect_timeout)
    try:
        if args.inventory_path is None:
            args = args.or_local()
            if not json_out:
                con.print(f"[dim]no --inventory: using the embedded default {args.inventory_path} (simulated engine on this machine)[/]")
        plan = args.build()
        serving = 0
        if standby:  # the standbys are more copies of the same plan; the supervisor keeps them out of the router
            from k3launch.models.control.scaling import plan_copies

            serving = len(plan_copies(plan)) or 1
            args = PlanArgs({**args.values, "replicas": serving + standby})
            plan = args.build()
            supervise = True
        state_dir = args.state_dir  # a placement option: planning read the inventory's cordoned nodes there
        in_job = supervise and _supervises_itself(plan.backend)  # Slurm: the job script watches its own steps
        if in_job and standby:
            raise K3Error("standby-slurm", "hot standbys are kept by a supervisor on the login node, not by a Slurm job yet",
                          "drop --standby, or bring it up with --replicas N+1")
        if dry_run:
            _dry_run(con, plan, api.dry_run(plan, args.inventory, state_dir=state_dir, extra_sbatch=tuple(extra_sbatch or ()),
                                            supervise=in_job), json_out)
            return
        t0 = time.monotonic()
        with show_progress.UpView(con, quiet=json_out) as view:  # stages, and each process's phase while it waits
            rec = api.up(plan, args.inventory, state_dir=state_dir, ready_timeout=ready_timeout, keep_on_failure=keep_on_failure,
                         force=force, skip_doctor=skip_doctor, access=access,
                         extra_sbatch=tuple(extra_sbatch or ()), queue_timeout=queue_timeout, supervise=in_job,
                         canary=not no_canary, on_stage=view.stage, on_progress=view.progress,
                         on_doctor=lambda report: None if json_out else show_deploy.doctor(con, report.checks),
                         on_failure=lambda exc: show_deploy.log_block(con, exc.failing or "?", exc.log_tail) if exc.log_tail and not json_out else None)
    except KeyboardInterrupt:
        # api.up has torn down what it started (the record stays if something was left)
        typer.echo("interrupted: what was started has been torn down", err=True)
        raise typer.Exit(INTERRUPTED) from None
    seconds = round(time.monotonic() - t0, 2)
    sv = None
    if supervise and not in_job:
        try:
            sv = api.supervise_detached(rec.name, state_dir=state_dir, access=access)
            if standby:  # the supervisor keeps the last copies out of the router, serving, as standbys
                api.scale(rec.name, replicas=serving, standby=standby, state_dir=state_dir, access=access)
        except K3Error as err:  # it serves: say so, then why it is not supervised
            if not json_out:
                show_deploy.ready(con, rec)
            fail(err)
    if json_out:
        out: dict[str, object] = {"name": rec.name, "state": rec.state, "endpoint": rec.endpoint, "seconds": seconds}
        if rec.job is not None:
            out["job"] = {"id": rec.job.job_id, "hosts": rec.job.hosts, "log_dir": rec.job.log_dir, "attempts": rec.job.attempts}
        if rec.canary is not None:
            out["canary"] = rec.canary.model_dump()
        if sv is not None:
            out["supervisor"] = {"host": sv.host, "pid": sv.pid}
        elif in_job and rec.job is not None:
            out["supervisor"] = {"job": rec.job.job_id}
        typer.echo(json.dumps(out))
    else:
        show_deploy.ready(con, rec)
        if rec.canary is not None:  # a canary that did not record, or a target that disagrees, is a notice: it serves
            con.print(("" if rec.canary.agree else "notice: ") + rec.canary.message, style=None if rec.canary.agree else "yellow", markup=False)
        if sv is not None:
            con.print(f"supervised in the background: pid {sv.pid} on {sv.host}; `k3launch events {rec.name} -f` follows it")
        if standby:
            con.print(f"hot standby: {standby} cop{'y' if standby == 1 else 'ies'} serving out of the router, ready to take a failed copy's place")
        elif in_job and rec.job is not None:
            con.print(f"supervised by job {rec.job.job_id} itself: it restarts failed steps inside its allocation; "
                      f"`k3launch events {rec.name} -f` follows it", markup=False)


def _supervises_itself(backend: str) -> bool:
    """Whether ``up --supervise`` builds supervision into what runs (Slurm) rather than starting a supervisor here."""
    from k3launch.models.backends import Feature, names, spec

    return backend in names() and spec(backend).supports(Feature.SELF_SUPERVISE)


def _dry_run(con: Console, plan: Plan, dry: DryRun, json_out: bool) -> None:
    from k3launch.cli import show_deploy

    if dry.sbatch is not None:
        if json_out:
            typer.echo(json.dumps({"name": dry.name, "sbatch": dry.sbatch}, indent=2))
        else:
            rule(con, f"{dry.name}: the sbatch script `up` would submit (nothing is submitted)", align="left")
            typer.echo(dry.sbatch)
        return
    if json_out:
        typer.echo(json.dumps({"name": dry.name, "steps": [{"step": st.step, "node": st.node, "script": st.script} for st in dry.steps]},
                              indent=2))
    else:
        show_deploy.dry_run(con, plan, dry)


@app.command()
def status(name: Annotated[str, typer.Argument(help="Deployment name (see `k3launch list`).")], state_dir: StateDir = None,
           accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False) -> None:
    """Per process: alive, healthy; the deployment's state and endpoint."""
    STATE.json = json_out
    from k3launch import api
    from k3launch.cli import show_deploy

    snap = api.status(name, state_dir=state_dir, access=api.Access(accept_unknown_hosts, connect_timeout))
    if json_out:
        typer.echo(snap.to_json())
    else:
        show_deploy.status(console(), snap)


@app.command()
def logs(
    name: Annotated[str, typer.Argument(help="Deployment name.")],
    role: Annotated[str | None, typer.Option("--role", help="Only processes of this role (serve, prefill, decode, router).")] = None,
    node: Annotated[str | None, typer.Option("--node", help="Only processes on this node.")] = None,
    lines: Annotated[int, number_option("--lines", bounds.LOG_LINES, "Lines per process.", "-n")] = 40,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines (Ctrl-C to stop).")] = False,
    state_dir: StateDir = None, accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0,
) -> None:
    """Print the last log lines of a deployment's processes."""
    from k3launch import api

    try:
        api.logs(name, typer.echo, role=role, node=node, lines=lines, follow=follow, state_dir=state_dir,
                 access=api.Access(accept_unknown_hosts, connect_timeout))
    except KeyboardInterrupt:
        return


@app.command()
def down(name: Annotated[str, typer.Argument(help="Deployment name.")],
         grace: Annotated[float, number_option("--grace", bounds.GRACE, "Seconds between SIGTERM and SIGKILL.")] = 10.0,
         state_dir: StateDir = None, accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0,
         inventory: Annotated[Path | None, typer.Option("--inventory", "-i", help="Without a readable record: search this inventory's machines for the deployment (default: the inventory an unreadable record names, else this machine).")] = None,
         any_owner: Annotated[bool, typer.Option("--any-owner", help="Without a readable record: stop every process, container or Slurm job named NAME, whoever started it (another state directory, an older k3launch, a rendered script run by hand); by default only those started from this state directory.")] = False,
         json_out: JsonOut = False) -> None:
    """Stop every process (router, heads, headless), then verify nothing is left and ports are free.

    Works without a record too (lost or unreadable: it is kept aside as NAME.json.corrupt-TIME):
    the deployment's processes, containers or Slurm jobs are found by name, and only those
    started from this state directory are stopped (--any-owner: anyone's). Exit 0 when nothing
    of NAME is left, 1 when something is, 2 when NAME is unknown here and nothing of it runs."""
    STATE.json = json_out
    from k3launch import api
    from k3launch.cli import show_deploy

    report = api.down(name, state_dir=state_dir, grace=grace, access=api.Access(accept_unknown_hosts, connect_timeout),
                      inventory=inventory, any_owner=any_owner)
    if json_out:
        typer.echo(json.dumps({"name": name, "clean": report.clean, "stopped": report.stopped, "exited": report.exited,
                               "rollout": report.rollout, "leftovers": report.leftovers,
                               "unreachable": report.unreachable, "busy_ports": report.busy_ports, "verified": report.verified,
                               "set_aside": report.set_aside, "hint": report.hint, "supervisor": report.supervisor, "others": report.others},
                              indent=2))
    else:
        show_deploy.down(console(), name, report)
    if not report.clean:
        raise typer.Exit(1)


@app.command()
def timeline(name: Annotated[str, typer.Argument(help="Deployment name (see `k3launch list`); with --compare, also a file "
                                                      "`k3launch timeline NAME --json` wrote.")], state_dir: StateDir = None,
             compare: Annotated[str | None, typer.Option("--compare", metavar="OTHER",
                                                         help="Side by side with another bring-up, phase by phase: a deployment's name, "
                                                              "or a file `k3launch timeline NAME --json` wrote.")] = None,
             restart: Annotated[bool, typer.Option("--restart", help="The last restart a supervisor recorded (of one unit: its "
                                                                     "processes only) instead of the `up`; with --compare NAME, "
                                                                     "against the same processes of the `up`.")] = False,
             json_out: JsonOut = False) -> None:
    """The bring-up's timeline: per process, each phase's start and end; the slowest rank and what it waited for."""
    STATE.json = json_out
    from k3launch import api
    from k3launch.cli import show_progress
    from k3launch.models.bringups import compare as side_by_side
    from k3launch.models.bringups import no_timeline

    if restart:
        _restart_timeline(name, compare, state_dir, json_out)
        return
    if compare is not None:  # NAME too may be a saved file then: two bring-ups of deployments long gone
        mine, other = api.timeline(name, state_dir), api.timeline(compare, state_dir)
        _show_comparison(side_by_side(mine.timeline, other.timeline, name, compare, other.deployment), json_out)
        return
    rec = api.record(name, state_dir)
    if rec is None:
        raise K3Error("unknown-deployment", f"no deployment named {name!r}", "see `k3launch list`")
    if rec.timeline is None:
        raise no_timeline(name, rec.state)
    since = [e for e in api.events(name, state_dir=state_dir) if e.time >= rec.created]  # this life's supervision
    pred, loads = api.load_against(rec, state_dir)
    if json_out:
        known = pred is not None and not pred.unmodelled
        extra = {"weights_load": {"predicted_total_s": round(pred.total_s, 1) if pred and known else None, "basis": pred.basis if pred else "",
                                  **({"unmodelled": pred.unmodelled} if pred and pred.unmodelled else {}), "processes": loads}} if loads else {}
        typer.echo(json.dumps({"name": name, **rec.timeline.as_dict(), **extra,
                               "events": [e.model_dump(mode="json", exclude_defaults=True) for e in since]}, indent=2))
    else:
        con = console()
        show_progress.timeline(con, name, rec.timeline)
        basis = (pred.basis + (f"; not predicted: {pred.unmodelled}" if pred.unmodelled else "")) if pred else ""
        for text in show_progress.load_lines(loads, basis):
            typer.echo(text)
        shown = [e for e in since if e.kind not in ("watching", "stopped-watching")]
        if shown:
            from k3launch.cli.show_events import line

            con.print(f"[bold]since it served[/]: {len(shown)} supervisor event(s) (`k3launch events {name}`)")
            for e in shown:
                con.print(line(e), markup=False, soft_wrap=True)


def _show_comparison(cmp: Comparison, json_out: bool) -> None:
    from k3launch.cli import show_progress

    if json_out:
        typer.echo(json.dumps(cmp.as_dict(), indent=2))
    else:
        show_progress.comparison(console(), cmp)


def _restart_timeline(name: str, compare: str | None, state_dir: Path | None, json_out: bool) -> None:
    """``timeline NAME --restart [--compare OTHER]``: the last restart's timeline, alone or against OTHER's same processes."""
    from k3launch import api
    from k3launch.cli import show_progress
    from k3launch.models.bringups import compare as side_by_side
    from k3launch.models.bringups import narrow

    ev, mine = api.restart_timeline(name, state_dir)
    other = api.timeline(compare, state_dir) if compare is not None else None
    tl = mine.timeline
    label = f"{name} restart of {ev.unit}" + (f" (attempt {ev.attempt})" if ev.attempt else "")
    if other is not None:
        _show_comparison(side_by_side(tl, narrow(other.timeline, {p.id for p in tl.processes}), label, compare or "", other.deployment),
                         json_out)
        return
    if json_out:
        about = {"unit": ev.unit, "kind": ev.kind, "attempt": ev.attempt, "time": ev.time, "detected_to_serving_s": ev.seconds}
        typer.echo(json.dumps({"name": name, "restart": about, **tl.as_dict()}, indent=2))
    else:
        show_progress.timeline(console(), label, tl)
        if ev.seconds is not None:
            typer.echo(f"from the failure's detection to serving: {ev.seconds:.1f}s (`k3launch events {name}`)")


@app.command("list")
def list_(state_dir: StateDir = None, json_out: JsonOut = False) -> None:
    """Deployments in the state directory."""
    STATE.json = json_out
    from k3launch import api

    recs: list[DeploymentRecord] = api.deployments(state_dir)
    if json_out:
        typer.echo(json.dumps([{"name": r.name, "state": r.state, "endpoint": r.endpoint, "strategy": r.plan.strategy,
                                "hardware": r.plan.hardware, "nodes": r.plan.nodes, "slurm_job": r.job.job_id if r.job else None}
                               for r in recs], indent=2))
        return
    from k3launch.cli import show_deploy

    show_deploy.listing(console(), recs)


@app.command()
def chat(
    name: Annotated[str, typer.Argument(help="Deployment name (see `k3launch list`).")],
    message: Annotated[str, typer.Argument(help="The user message.")],
    max_tokens: Annotated[int, number_option("--max-tokens", bounds.TOKENS, "Most tokens to generate.")] = 64,
    state_dir: Annotated[Path | None, typer.Option("--state-dir", help="Deployment records (default ~/.k3launch).")] = None,
    json_out: JsonOut = False,
) -> None:
    """Send one chat completion to a deployment's public endpoint and print the reply."""
    STATE.json = json_out
    from k3launch import api

    data = api.chat(name, message, max_tokens=max_tokens, state_dir=state_dir)
    rec = api.record(name, state_dir)
    if json_out:
        typer.echo(json.dumps(data))
        return
    choice = (data.get("choices") or [{}])[0].get("message", {})
    typer.echo(choice.get("content") or "")
    usage = data.get("usage") or {}
    where = f", {rec.endpoint}" if rec is not None else ""
    typer.echo(f"[{usage.get('prompt_tokens', '?')} prompt + {usage.get('completion_tokens', '?')} completion tokens{where}]", err=True)


