"""``k3launch up / status / logs / down / list``: the deployment lifecycle from a login node."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from k3launch.cli.common import STATE, JsonOut, PlanArgs, app, console, fail, with_selection
from k3launch.deploy.state import DeploymentRecord, StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.planning.inventory import Inventory
from k3launch.transport.fleet import Fleet

if TYPE_CHECKING:
    from rich.console import Console

StateDir = Annotated[Path | None, typer.Option("--state-dir", help="Deployment records (default ~/.k3launch or $K3LAUNCH_STATE_DIR).")]
AcceptUnknown = Annotated[bool, typer.Option("--accept-unknown-hosts", help="Accept (and remember) SSH host keys not in known_hosts. Off by default.")]
ConnectTimeout = Annotated[float, typer.Option("--connect-timeout", help="Seconds to wait for a node's SSH connection (ssh_config ConnectTimeout wins).")]
INTERRUPTED = 130  # the shell's code for a command ended by SIGINT


def fleet_for(plan: Plan, ssh_config: str | None, known_hosts: str | None, accept_unknown: bool, connect_timeout: float = 10.0) -> Fleet:
    from k3launch.api import fleet_for as _fleet_for

    fleet: Fleet = _fleet_for(plan, ssh_config, known_hosts, accept_unknown, connect_timeout)
    return fleet


@app.command()
@with_selection
def up(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print exactly what would run on each node, and stop.")] = False,
    ready_timeout: Annotated[float | None, typer.Option("--ready-timeout", help="Seconds to wait for serving (default: the plan's VLLM_ENGINE_READY_TIMEOUT_S, else 1800).")] = None,
    keep_on_failure: Annotated[bool, typer.Option("--keep-on-failure", help="Leave processes running when up fails (for debugging).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Use nodes another live deployment holds.")] = False,
    skip_doctor: Annotated[bool, typer.Option("--skip-doctor", help="Do not run the pre-flight checks.")] = False,
    extra_sbatch: Annotated[list[str] | None, typer.Option("--extra-sbatch", help="Slurm: one more #SBATCH directive, verbatim (repeatable), e.g. --extra-sbatch=--mail-type=END.")] = None,
    queue_timeout: Annotated[float | None, typer.Option("--queue-timeout", help="Slurm: seconds the job may wait in the queue (default: no limit).")] = None,
    state_dir: StateDir = None, accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False,
    *, args: PlanArgs,
) -> None:
    """Launch a deployment and wait until it serves (default: the simulated K3 on this machine).

    On a slurm inventory: one sbatch job, watched from here until it serves (see README "Slurm")."""
    STATE.json = json_out
    from k3launch import api
    from k3launch.cli import show_deploy

    con = console()
    try:
        if args.inventory_path is None:
            args = PlanArgs({**args.values, "inventory": api.bundled_inventory("local")})
            if not json_out:
                con.print(f"[dim]no --inventory: using the embedded default {args.inventory_path} (simulated engine on this machine)[/]")
        inv = api.load(args.inventory_path)[0]
        plan = args.build()
        if dry_run:
            _dry_run(con, plan, inv, state_dir, tuple(extra_sbatch or ()), json_out)
            return
        emit = show_deploy.stage_printer(con, quiet=json_out)  # times count from here, doctor included
        t0 = time.monotonic()
        rec = api.up(plan, args.inventory_path, state_dir=state_dir, ready_timeout=ready_timeout, keep_on_failure=keep_on_failure,
                     force=force, skip_doctor=skip_doctor, accept_unknown_hosts=accept_unknown_hosts, connect_timeout=connect_timeout,
                     extra_sbatch=tuple(extra_sbatch or ()), queue_timeout=queue_timeout, on_stage=emit,
                     on_doctor=lambda report: show_deploy.doctor(con, report, quiet=json_out),
                     on_failure=lambda exc: show_deploy.log_block(con, exc.failing or "?", exc.log_tail) if exc.log_tail and not json_out else None)
    except K3Error as err:
        fail(err)
    except KeyboardInterrupt:
        # api.up has torn down what it started (the record stays if something was left)
        typer.echo("interrupted: what was started has been torn down", err=True)
        raise typer.Exit(INTERRUPTED) from None
    if json_out:
        out: dict[str, object] = {"name": rec.name, "state": rec.state, "endpoint": rec.endpoint, "seconds": round(time.monotonic() - t0, 2)}
        if rec.slurm is not None:
            out["job"] = {"id": rec.slurm.job_id, "hosts": rec.slurm.hosts, "log_dir": rec.slurm.log_dir, "attempts": rec.slurm.attempts}
        typer.echo(json.dumps(out))
    else:
        show_deploy.ready(con, rec)


def _dry_run(con: Console, plan: Plan, inv: Inventory, state_dir: Path | None, extra_sbatch: tuple[str, ...], json_out: bool) -> None:
    from k3launch.cli import show_deploy

    if inv.backend == "slurm":
        from k3launch.deploy.slurm.launch import log_dir_for
        from k3launch.render.sbatch import make_sbatch_string

        assert inv.slurm is not None
        text = make_sbatch_string(plan, inv.slurm, log_dir_for(StateStore(state_dir), inv, plan.name), extra_sbatch,
                                  hf_token_file=inv.hf_token_file)
        if json_out:
            typer.echo(json.dumps({"name": plan.name, "sbatch": text}, indent=2))
        else:
            con.rule(f"{plan.name}: the sbatch script `up` would submit (nothing is submitted)", align="left")
            typer.echo(text)
        return
    steps = show_deploy.start_scripts(plan, inv.hf_token_file)
    if json_out:
        typer.echo(json.dumps({"name": plan.name, "steps": [{"step": st, "node": n, "script": sc} for st, n, sc in steps]}, indent=2))
    else:
        show_deploy.dry_run(con, plan, steps)


@app.command()
def status(name: Annotated[str, typer.Argument(help="Deployment name (see `k3launch list`).")], state_dir: StateDir = None,
           accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False) -> None:
    """Per process: alive, healthy; the deployment's state and endpoint."""
    STATE.json = json_out
    from k3launch import api
    from k3launch.cli import show_deploy

    try:
        snap = api.status(name, state_dir=state_dir, accept_unknown_hosts=accept_unknown_hosts, connect_timeout=connect_timeout)
    except K3Error as err:
        fail(err)
    if json_out:
        typer.echo(json.dumps(snap, indent=2))
    else:
        show_deploy.status(console(), snap)


@app.command()
def logs(
    name: Annotated[str, typer.Argument(help="Deployment name.")],
    role: Annotated[str | None, typer.Option("--role", help="Only processes of this role (serve, prefill, decode, router).")] = None,
    node: Annotated[str | None, typer.Option("--node", help="Only processes on this node.")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines per process.")] = 40,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines (Ctrl-C to stop).")] = False,
    state_dir: StateDir = None, accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0,
) -> None:
    """Print the last log lines of a deployment's processes."""
    from k3launch.deploy.ssh.observe import follow_logs, tail_logs

    try:
        rec = StateStore(state_dir).load(name)
        ids = [p.id for p in rec.plan.processes if (role is None or p.role == role) and (node is None or p.node == node)]
        if not ids:
            raise K3Error("no-processes", "no process matches --role/--node", "processes: " + ", ".join(f"{p.id}@{p.node}" for p in rec.plan.processes))
        if rec.slurm is not None:
            from k3launch.deploy.slurm.ops import follow_files
            from k3launch.deploy.slurm.ops import tail_logs as slurm_tail

            hosts = {p.id: rec.slurm.hosts.get(p.node, p.node) for p in rec.plan.processes}
            # without --role/--node, the job's own output (binding, doctor, which step ended) comes first
            for pid, text in slurm_tail(rec, ids if role or node else ["job", *ids], lines).items():
                typer.echo(f"==> job {rec.slurm.job_id} output <==" if pid == "job" else f"==> {pid} on {hosts[pid]} <==")
                typer.echo(text.rstrip())
            if follow:
                follow_files(rec, ids, typer.echo)
            return
        fleet = fleet_for(rec.plan, rec.ssh_config, rec.known_hosts, accept_unknown_hosts, connect_timeout)
        node_of = {p.id: p.node for p in rec.plan.processes}
        try:
            for pid, text in tail_logs(rec, fleet, ids, lines).items():
                typer.echo(f"==> {pid} on {node_of[pid]} <==")
                typer.echo(text.rstrip())
            if follow:
                follow_logs(rec, fleet, ids, typer.echo)
        finally:
            fleet.close()
    except K3Error as err:
        fail(err)
    except KeyboardInterrupt:
        return


@app.command()
def down(name: Annotated[str, typer.Argument(help="Deployment name.")],
         grace: Annotated[float, typer.Option("--grace", help="Seconds between SIGTERM and SIGKILL.")] = 10.0,
         state_dir: StateDir = None, accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0,
         json_out: JsonOut = False) -> None:
    """Stop every process (router, heads, headless), then verify nothing is left and ports are free."""
    STATE.json = json_out
    from k3launch import api
    from k3launch.cli import show_deploy

    try:
        report = api.down(name, state_dir=state_dir, grace=grace, accept_unknown_hosts=accept_unknown_hosts, connect_timeout=connect_timeout)
    except K3Error as err:
        fail(err)
    if json_out:
        typer.echo(json.dumps({"name": name, "clean": report.clean, "stopped": report.stopped, "leftovers": report.leftovers,
                               "unreachable": report.unreachable, "busy_ports": report.busy_ports}, indent=2))
    else:
        show_deploy.down(console(), name, report)
    if not report.clean:
        raise typer.Exit(1)


@app.command("list")
def list_(state_dir: StateDir = None, json_out: JsonOut = False) -> None:
    """Deployments in the state directory."""
    STATE.json = json_out
    try:
        recs: list[DeploymentRecord] = StateStore(state_dir).list()
    except K3Error as err:
        fail(err)
    if json_out:
        typer.echo(json.dumps([{"name": r.name, "state": r.state, "endpoint": r.endpoint, "strategy": r.plan.strategy,
                                "hardware": r.plan.hardware, "nodes": r.plan.nodes, "slurm_job": r.slurm.job_id if r.slurm else None}
                               for r in recs], indent=2))
        return
    from k3launch.cli import show_deploy

    show_deploy.listing(console(), recs)
