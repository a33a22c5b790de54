"""Rich output of the deployment commands (``--json`` prints the data instead)."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from k3launch.deploy.ssh.doctor import DoctorReport
from k3launch.deploy.ssh.teardown import TeardownReport
from k3launch.deploy.state import DeploymentRecord
from k3launch.models.plan import Plan

_ICON = {"pass": "[green]ok[/]", "fail": "[red]FAIL[/]", "warn": "[yellow]warn[/]", "skip": "[dim]skipped[/]"}


def start_scripts(plan: Plan, hf_token_file: str | None) -> list[tuple[str, str, str]]:
    """``(step, node, script)`` in the order ``up`` runs them: exactly the text ``up`` hands to
    ``bash -c`` on each node (nothing is connected to or started to build them)."""
    from k3launch.deploy.ssh.launch import node_script, start_steps
    from k3launch.transport.fleet import Fleet

    fleet = Fleet.for_plan(plan)
    out = []
    for group in start_steps(plan):
        step = "router" if group[0].role == "router" else "engines"
        for node in dict.fromkeys(p.node for p in group):
            out.append((step, node, node_script(plan, fleet, [p for p in group if p.node == node], hf_token_file)))
    return out


def dry_run(con: Console, plan: Plan, steps: list[tuple[str, str, str]]) -> None:
    con.print(f"[bold]dry run[/]: {plan.name} ({plan.strategy} on {plan.nodes} x {plan.hardware}); nothing is started")
    for step, node, text in steps:
        host = next(h for h in plan.hosts if h.name == node)
        con.rule(f"{node} ({host.address}) — {step}: `bash -c` of", align="left")
        con.print(Text(text), soft_wrap=True)


def doctor(con: Console, report: DoctorReport, quiet: bool) -> None:
    if quiet:
        return
    t = Table(title="doctor", show_header=True, header_style="bold")
    for col in ("node", "check", "result", "detail"):
        t.add_column(col)
    for c in report.checks:
        t.add_row(c.node, c.name, _ICON.get(c.status, c.status), c.detail)
    con.print(t)


def stage_printer(con: Console, quiet: bool) -> Callable[[str, str], None]:
    t0 = time.monotonic()

    def emit(stage: str, message: str) -> None:
        if not quiet:
            con.print(f"[dim]{time.monotonic() - t0:7.1f}s[/] [bold]{stage:<10}[/] {message}")

    return emit


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


def status(con: Console, snap: dict[str, object]) -> None:
    con.print(f"[bold]{snap['name']}[/]  state [bold]{snap['state']}[/]  endpoint {snap['endpoint']}")
    job = snap.get("job")
    if isinstance(job, dict):
        reason = f" ({job['reason']})" if job.get("reason") else ""
        con.print(f"Slurm job {job['id']}: {job['state']}{reason} on {','.join(job.get('nodes') or []) or '-'}; logs in {job['log_dir']}",
                  markup=False)
    t = Table(show_header=True, header_style="bold")
    for col in ("process", "node", "role", "alive", "healthy"):
        t.add_column(col)
    for p in snap["processes"]:  # type: ignore[attr-defined]
        healthy = "-" if p["healthy"] is None else ("yes" if p["healthy"] else "[red]no[/]")
        t.add_row(p["id"], p["node"], p["role"], "yes" if p["alive"] else "[red]no[/]", healthy)
    con.print(t)
    for u in snap.get("unreachable") or []:  # type: ignore[attr-defined]
        con.print(f"[red]unreachable[/]: {u}")


def down(con: Console, name: str, report: TeardownReport) -> None:
    if report.clean:
        con.print(f"[green]{name} is down[/]: {len(report.stopped)} process(es) stopped; {report.verified}")
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
        nodes = f"{r.plan.nodes} (Slurm job {r.slurm.job_id})" if r.slurm is not None else str(r.plan.nodes)
        t.add_row(r.name, r.state, r.plan.strategy, r.plan.hardware, nodes, r.endpoint, f"{age // 60}m{age % 60:02d}s")
    con.print(t)
