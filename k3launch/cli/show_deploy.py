"""Rich output of the deployment commands (``--json`` prints the data instead)."""

from __future__ import annotations

import time

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from k3launch.cli.common import rule, say
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord, ReplicaStatus, Status
from k3launch.models.reports import Check, DoctorReport, DryRun, TeardownReport

# How a check's or a node's result reads on a terminal (doctor and weights tables alike).
ICON = {
    "pass": "[green]ok[/]",
    "fail": "[red]FAIL[/]",
    "warn": "[yellow]warn[/]",
    "skip": "[dim]skipped[/]",
    "complete": "[green]complete[/]",
    "missing": "[red]missing[/]",
}


def dry_run(con: Console, plan: Plan, dry: DryRun) -> None:
    con.print(f"[bold]dry run[/]: {plan.name} ({plan.strategy} on {plan.nodes} x {plan.hardware}); nothing is started")
    for st in dry.steps:
        rule(con, f"{st.node} ({st.address}) — {st.step}: `bash -c` of", align="left")
        con.print(Text(st.script), soft_wrap=True)


def table(con: Console, title: str, cols: tuple[str, ...], rows: list[tuple[str, ...]], status: int) -> None:
    """A rich table on a terminal (column ``status`` coloured); elsewhere (CI, nohup, a pipe) one
    plain line per row, never wrapped or cut at the 80 columns rich assumes there."""
    if not con.is_terminal:
        for row in rows:
            typer.echo("  ".join(x for x in row if x))
        return
    t = Table(title=title, show_header=True, header_style="bold")
    for col in cols:
        t.add_column(col, overflow="fold")
    for row in rows:  # values are data, not markup ("[N/A]" stays as it is)
        t.add_row(*(Text.from_markup(ICON.get(x, x)) if i == status else Text(x) for i, x in enumerate(row)))
    con.print(t)


def doctor(con: Console, checks: list[Check]) -> None:
    """The pre-flight checks, one row each (``doctor``, and ``up`` before it starts anything)."""
    rows: list[tuple[str, ...]] = [
        (c.node, c.name, c.status, c.detail, f"hint: {c.hint}" if c.hint and c.status != "pass" else "") for c in checks
    ]
    table(con, "doctor", ("node", "check", "result", "detail", "hint"), rows, status=2)


def doctor_summary(con: Console, report: DoctorReport) -> None:
    """After the table: every node passes, or the refusal ``up`` would give."""
    if report.ok:
        con.print(f"[green]all {len({c.node for c in report.checks})} node(s) pass[/]")
    else:
        say(report.error())


def log_block(con: Console, pid: str, tail: str) -> None:
    rule(con, f"last log lines of {pid}", align="left", style="red")
    con.print(Text(tail.rstrip()), soft_wrap=True)
    rule(con, style="red")


def ready(con: Console, rec: DeploymentRecord) -> None:
    model = rec.plan.model
    con.print(f"\n[bold green]{rec.name} is serving[/] at {rec.endpoint}")
    con.print(
        f"curl -s {rec.endpoint}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'",
        soft_wrap=True, markup=False, highlight=False,
    )
    con.print(f"stop it with: k3launch down {rec.name}", markup=False)


def status(con: Console, snap: Status) -> None:
    con.print(f"[bold]{snap.name}[/]  state [bold]{snap.state}[/]  endpoint {snap.endpoint}")
    job = snap.job
    if job is not None:
        reason = f" ({job.reason})" if job.reason else ""
        con.print(f"Slurm job {job.id}: {job.state}{reason} on {','.join(job.nodes) or '-'}; logs in {job.log_dir}", markup=False)
    t = Table(show_header=True, header_style="bold")
    copies = bool(snap.replicas)  # a column and a section per copy; a one-copy table stays as it was
    for col in ("process", *(("copy",) if copies else ()), "node", "role", "alive", "healthy"):
        t.add_column(col, overflow="fold")  # at 80 columns a long name wraps, never ends in '…'
    for i, p in enumerate(snap.processes):
        healthy = "-" if p.healthy is None else ("yes" if p.healthy else "[red]no[/]")
        copy = (("-" if p.replica is None else f"r{p.replica}"),) if copies else ()
        last = copies and (i + 1 == len(snap.processes) or snap.processes[i + 1].replica != p.replica)
        t.add_row(p.id, *copy, p.node, p.role, "yes" if p.alive else "[red]no[/]", healthy, end_section=last)
    con.print(t)
    for r in snap.replicas:
        con.print(f"copy r{r.replica}: {REPLICA_STATE[r.state]}{escape(_replica_detail(r, snap))}", highlight=False)
    if snap.reason:
        con.print(f"[yellow]{escape(snap.reason)}[/]", highlight=False)
    for s in snap.units if len(snap.units) > 1 else []:
        router = "" if s.in_router is None else ("; in the router" if s.in_router else "; standby, out of the router" if s.standby
                                                 else "; [red]not in the router[/]")
        plans = "" if s.desired == s.running == "current" else f"; runs the {s.running} plan, should run the {s.desired}"
        con.print(f"unit {escape(s.name)}: {'serving' if s.serving else '[red]not serving[/]'}{router}{escape(plans)}"
                  + (f" ({escape(s.controller)})" if s.controller not in (None, "serving") else ""), highlight=False)
    for u in snap.unreachable:
        con.print(f"[red]unreachable[/]: {u}")
    if snap.error:
        con.print(f"[red]failed[/]: {escape(snap.error)}")
    sv = snap.supervisor
    if sv is not None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sv.since))
        who = f"job {sv.job} itself ({'on ' + sv.host if sv.host else 'not running yet'})" if sv.job is not None else \
            f"pid {sv.pid} on {sv.host}{' (detached)' if sv.detached else ''}"
        con.print(f"supervised by {who} since {since}; {sv.restarts} restart(s); `k3launch events {snap.name}`", markup=False)
    elif snap.state == "failed":  # nothing to keep serving: a supervisor refuses it (not-ready)
        con.print(f"[dim]`k3launch down {snap.name}`, then `up` again[/]")
    elif snap.state == "starting":
        pass  # `up` still brings it up
    elif snap.job is not None:
        con.print("[dim]not supervised: `k3launch up --supervise` makes the job restart failed steps itself[/]")
    else:
        con.print(f"[dim]not supervised: `k3launch supervise {snap.name} --detach` keeps it serving[/]")
    ro = snap.rollout
    if ro is not None:
        head = f"rollout ({' '.join(ro.changes)}) " + (f"stopped: {ro.stopped}" if ro.stopped else "under way")
        con.print(head, markup=False)
        con.print("  units: " + ", ".join(f"{u.name} on the {u.on} plan" + (f" (failed: {u.failed})" if u.failed else "") for u in ro.units),
                  markup=False)
        if ro.stopped:
            con.print(f"  `k3launch rollout {snap.name} --continue` finishes it; `--rollback` undoes it", markup=False)


REPLICA_STATE = {"serving": "[green]serving[/]", "degraded": "[yellow]degraded[/]", "down": "[red]down[/]"}


def _replica_detail(r: ReplicaStatus, snap: Status) -> str:
    """What keeps a copy from serving: its processes not alive, then those alive but not healthy."""
    procs = [p for p in snap.processes if p.id in r.processes]
    if r.state == "serving":
        return f" ({len(procs)} process(es))"
    if r.state == "down":
        return ": no process alive"
    why = [f"{p.id} not alive" for p in procs if not p.alive] + [f"{p.id} not healthy" for p in procs if p.alive and p.healthy is False]
    return ": " + ", ".join(why)


def down(con: Console, name: str, report: TeardownReport) -> None:
    if report.supervisor:
        con.print(report.supervisor, markup=False)
    if report.set_aside:
        con.print(f"unreadable record kept aside as {report.set_aside}")
    if report.rollout:
        con.print(f"a rollout was under way ({report.rollout}): abandoned", markup=False)
    if report.clean:
        what = f"{len(report.stopped)} process(es) stopped" if report.stopped else "nothing was running"
        what += f", {len(report.exited)} had exited already ({', '.join(report.exited)})" if report.exited else ""
        con.print(f"[green]{name} is down[/]: {what}; {report.verified}")
        for node, items in report.others.items():
            con.print(f"  left alone on {node} (not started from this state directory): {', '.join(items)}", markup=False)
        if report.hint:
            con.print(f"hint: {report.hint}")
        return
    con.print(f"[red]{name} is not fully down[/]")
    for node, why in report.unreachable.items():
        con.print(f"  unreachable {node}: {why} (kept in the record; run `k3launch down {name}` again)")
    for node, items in report.leftovers.items():
        con.print(f"  left on {node}: {', '.join(items)}")
    for p in report.busy_ports:
        con.print(f"  port still in use: {p}")
    for node, items in report.others.items():
        con.print(f"  left alone on {node} (not started from this state directory): {', '.join(items)}", markup=False)


def listing(con: Console, recs: list[DeploymentRecord]) -> None:
    if not recs:
        con.print("no deployments")
        return
    t = Table(show_header=True, header_style="bold")
    for col in ("name", "state", "strategy", "hardware", "nodes", "endpoint", "age"):
        t.add_column(col, overflow="fold")  # a name or endpoint is copied from here: whole, wrapped
    for r in recs:
        age = int(time.time() - r.created)
        nodes = f"{r.plan.nodes} (Slurm job {r.job.job_id})" if r.job is not None else str(r.plan.nodes)
        t.add_row(r.name, r.state, r.plan.strategy, r.plan.hardware, nodes, r.endpoint, f"{age // 60}m{age % 60:02d}s")
    con.print(t)
