"""``k3launch up / status / logs / down / list``: the deployment lifecycle from a login node."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from k3launch.cli_common import STATE, JsonOut, PlanArgs, app, console, fail, with_selection
from k3launch.errors import K3Error
from k3launch.inventory import Inventory
from k3launch.nodes import Fleet
from k3launch.plan_models import Plan
from k3launch.state import DeploymentRecord, StateStore

StateDir = Annotated[Path | None, typer.Option("--state-dir", help="Deployment records (default ~/.k3launch or $K3LAUNCH_STATE_DIR).")]
AcceptUnknown = Annotated[bool, typer.Option("--accept-unknown-hosts", help="Accept (and remember) SSH host keys not in known_hosts. Off by default.")]
ConnectTimeout = Annotated[float, typer.Option("--connect-timeout", help="Seconds to wait for a node's SSH connection (ssh_config ConnectTimeout wins).")]
INTERRUPTED = 130  # the shell's code for a command ended by SIGINT


def bundled_inventory(name: str) -> Path:
    here = Path(__file__).resolve().parent
    for cand in (here / "_inventories" / f"{name}.yaml", here.parent / "inventories" / f"{name}.yaml"):
        if cand.is_file():
            return cand
    raise K3Error("missing-inventory", f"the bundled {name} inventory is missing", "pass --inventory FILE")


def fleet_for(plan: Plan, ssh_config: str | None, known_hosts: str | None, accept_unknown: bool, connect_timeout: float = 10.0) -> Fleet:
    from k3launch.runners import LocalRunner, SshRunner

    if plan.backend == "ssh":
        runner = SshRunner(known_hosts=known_hosts, ssh_config=ssh_config, accept_unknown_hosts=accept_unknown, connect_timeout=connect_timeout)
        return Fleet.for_plan(plan, runner, LocalRunner())
    return Fleet.for_plan(plan)


def _load_inv(path: Path) -> Inventory:
    from k3launch.inventory import load_inventory

    return load_inventory(path)


@app.command()
@with_selection
def up(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print exactly what would run on each node, and stop.")] = False,
    ready_timeout: Annotated[float | None, typer.Option("--ready-timeout", help="Seconds to wait for serving (default: the plan's VLLM_ENGINE_READY_TIMEOUT_S, else 1800).")] = None,
    keep_on_failure: Annotated[bool, typer.Option("--keep-on-failure", help="Leave processes running when up fails (for debugging).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Use nodes another live deployment holds.")] = False,
    skip_doctor: Annotated[bool, typer.Option("--skip-doctor", help="Do not run the pre-flight checks.")] = False,
    state_dir: StateDir = None, accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False,
    *, args: PlanArgs,
) -> None:
    """Launch a deployment and wait until it serves (default: the simulated K3 on this machine)."""
    STATE.json = json_out
    from k3launch import show_deploy
    from k3launch.doctor import doctor
    from k3launch.launch import Launch

    con = console()
    try:
        if args.inventory_path is None:
            args = PlanArgs({**args.values, "inventory": bundled_inventory("local")})
            if not json_out:
                con.print(f"[dim]no --inventory: using the embedded default {args.inventory_path} (simulated engine on this machine)[/]")
        inv = _load_inv(args.inventory_path)  # type: ignore[arg-type]
        plan = args.build()
        store = StateStore(state_dir)
        if dry_run:
            steps = show_deploy.start_scripts(plan, inv.hf_token_file)
            if json_out:
                typer.echo(json.dumps({"name": plan.name, "steps": [{"step": st, "node": n, "script": sc} for st, n, sc in steps]}, indent=2))
            else:
                show_deploy.dry_run(con, plan, steps)
            return
        if store.exists(plan.name):
            raise K3Error("deployment-exists", f"a deployment named {plan.name!r} already exists", f"`k3launch down {plan.name}` first, or pass --name")
        held = store.nodes_in_use()
        clash = sorted({f"{h.name} ({held[h.address]})" for h in plan.hosts if h.address in held and h.gpus})
        if clash and not force:
            raise K3Error("nodes-in-use", f"nodes held by live deployments: {', '.join(clash)}", "`k3launch down` that deployment, --exclude the nodes, or pass --force")
        fleet = fleet_for(plan, inv.ssh_config, inv.known_hosts, accept_unknown_hosts, connect_timeout)
        with store.lock(plan.name):
            emit = show_deploy.stage_printer(con, quiet=json_out)  # times count from here, doctor included
            try:
                if not skip_doctor:
                    report = doctor(plan, fleet, [r.name for r in store.list()])
                    show_deploy.doctor(con, report, quiet=json_out)
                    if not report.ok:
                        raise report.error()
                    emit("doctor", f"{len(fleet.nodes())} node(s) checked")
                launch = Launch(plan, fleet, store, inventory=str(args.inventory_path), hf_token_file=inv.hf_token_file, on_stage=emit,
                                on_failure=lambda exc: show_deploy.log_block(con, exc.failing or "?", exc.log_tail) if exc.log_tail and not json_out else None,
                                ssh_config=inv.ssh_config, known_hosts=inv.known_hosts)
                t0 = time.monotonic()
                rec = launch.up(timeout=ready_timeout, keep_on_failure=keep_on_failure)
            finally:
                fleet.close()
    except K3Error as err:
        fail(err)
    except KeyboardInterrupt:
        # Launch.up has torn down what it started (the record stays if something was left)
        typer.echo("interrupted: what was started has been torn down", err=True)
        raise typer.Exit(INTERRUPTED) from None
    if json_out:
        typer.echo(json.dumps({"name": rec.name, "state": rec.state, "endpoint": rec.endpoint, "seconds": round(time.monotonic() - t0, 2)}))
    else:
        show_deploy.ready(con, rec)


@app.command()
def status(name: Annotated[str, typer.Argument(help="Deployment name (see `k3launch list`).")], state_dir: StateDir = None,
           accept_unknown_hosts: AcceptUnknown = False, connect_timeout: ConnectTimeout = 10.0, json_out: JsonOut = False) -> None:
    """Per process: alive, healthy; the deployment's state and endpoint."""
    STATE.json = json_out
    from k3launch import show_deploy
    from k3launch.observe import observe

    try:
        rec = StateStore(state_dir).load(name)
        fleet = fleet_for(rec.plan, rec.ssh_config, rec.known_hosts, accept_unknown_hosts, connect_timeout)
        try:
            snap = observe(rec, fleet)
        finally:
            fleet.close()
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
    from k3launch.observe import follow_logs, tail_logs

    try:
        rec = StateStore(state_dir).load(name)
        ids = [p.id for p in rec.plan.processes if (role is None or p.role == role) and (node is None or p.node == node)]
        if not ids:
            raise K3Error("no-processes", "no process matches --role/--node", "processes: " + ", ".join(f"{p.id}@{p.node}" for p in rec.plan.processes))
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
    from k3launch import show_deploy
    from k3launch.teardown import teardown

    try:
        store = StateStore(state_dir)
        with store.lock(name):
            rec = store.load(name)
            fleet = fleet_for(rec.plan, rec.ssh_config, rec.known_hosts, accept_unknown_hosts, connect_timeout)
            try:
                report = teardown(rec, fleet, store, grace_s=grace)
            finally:
                fleet.close()
            if report.clean:
                store.delete(name)
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
                                "hardware": r.plan.hardware, "nodes": r.plan.nodes} for r in recs], indent=2))
        return
    from k3launch import show_deploy

    show_deploy.listing(console(), recs)
