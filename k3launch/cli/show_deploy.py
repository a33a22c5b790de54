"""Rich output of the deployment commands (``--json`` prints the data instead)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table
from rich.text import Text

from k3launch.deploy.base import DoctorReport, DryRun, TeardownReport
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord, Status

_ICON = {"pass": "[green]ok[/]", "fail": "[red]FAIL[/]", "warn": "[yellow]warn[/]", "skip": "[dim]skipped[/]"}


def dry_run(con: Console, plan: Plan, dry: DryRun) -> None:
    con.print(f"[bold]dry run[/]: {plan.name} ({plan.strategy} on {plan.nodes} x {plan.hardware}); nothing is started")
    for st in dry.steps:
        con.rule(f"{st.node} ({st.address}) — {st.step}: `bash -c` of", align="left")
        con.print(Text(st.script), soft_wrap=True)


def doctor(con: Console, report: DoctorReport, quiet: bool) -> None:
    if quiet:
        return
    t = Table(title="doctor", show_header=True, header_style="bold")
    for col in ("node", "check", "result", "detail"):
        t.add_column(col)
    for c in report.checks:
        t.add_row(c.node, c.name, _ICON.get(c.status, c.status), c.detail)
    con.print(t)


def log_block(con: Console, pid: str, tail: str) -> None:
    con.rule(f"last log lines of {pid}", align="left", style="red")
    con.print(Text(tail.rstrip()), soft_wrap=True)
    con.rule(style="red")


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
    for col in ("process", "node", "role", "alive", "healthy"):
        t.add_column(col)
    for p in snap.processes:
        healthy = "-" if p.healthy is None else ("yes" if p.healthy else "[red]no[/]")
        t.add_row(p.id, p.node, p.role, "yes" if p.alive else "[red]no[/]", healthy)
    con.print(t)
    for u in snap.unreachable:
        con.print(f"[red]unreachable[/]: {u}")


def down(con: Console, name: str, report: TeardownReport) -> None:
    if report.set_aside:
        con.print(f"unreadable record kept aside as {report.set_aside}")
    if report.clean:
        what = f"{len(report.stopped)} process(es) stopped" if report.stopped else "nothing was running"
        con.print(f"[green]{name} is down[/]: {what}; {report.verified}")
        return
    con.print(f"[red]{name} is not fully down[/]")
    for node, why in report.unreachable.items():
        con.print(f"  unreachable {node}: {why} (kept in the record; run `k3launch down {name}` again)")
    for node, items in report.leftovers.items():
        con.print(f"  left on {node}: {', '.join(items)}")
    for p in report.busy_ports:
        con.print(f"  port still in use: {p}")


def listing(con: Console, recs: list[DeploymentRecord]) -> None:
    if not recs:
        con.print("no deployments")
        return
    t = Table(show_header=True, header_style="bold")
    for col in ("name", "state", "strategy", "hardware", "nodes", "endpoint", "age"):
        t.add_column(col)
    for r in recs:
        age = int(time.time() - r.created)
        nodes = f"{r.plan.nodes} (Slurm job {r.job.job_id})" if r.job is not None else str(r.plan.nodes)
        t.add_row(r.name, r.state, r.plan.strategy, r.plan.hardware, nodes, r.endpoint, f"{age // 60}m{age % 60:02d}s")
    con.print(t)
