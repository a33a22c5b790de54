"""``k3launch monitoring``: what a Prometheus needs to watch the deployments (docs/monitoring.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3launch.cli.common import StateDir, app, number_option
from k3launch.util.bounds import SCRAPE_INTERVAL

monitoring_app = typer.Typer(help="Prometheus targets, alert rules and dashboards of the deployments.", no_args_is_help=True)
app.add_typer(monitoring_app, name="monitoring")


@monitoring_app.command("config")
def config(
    interval: Annotated[int, number_option("--interval", SCRAPE_INTERVAL, "Scrape interval.")] = 15,
    state_dir: StateDir = None,
) -> None:
    """Print the Prometheus scrape configuration that reads every ready deployment's targets."""
    from k3launch import api

    typer.echo(api.prometheus_config(state_dir, interval), nl=False)


@monitoring_app.command("rules")
def rules(
    inventory: Annotated[Path | None, typer.Option("--inventory", "-i", help="Rules for this inventory's deployments, with its monitoring: thresholds.")] = None,
) -> None:
    """Print the Prometheus alert rules (promtool-checked) for the deployments of an inventory, or of every inventory with the defaults."""
    from k3launch import api

    typer.echo(api.alert_rules(inventory, every=inventory is None), nl=False)


@monitoring_app.command("dashboard")
def dashboard() -> None:
    """Print a Grafana dashboard (JSON) of every deployment: throughput, TTFT/ITL percentiles, queue, KV cache, DP ranks, restarts and rollouts."""
    from k3launch import api

    typer.echo(api.grafana_dashboard(), nl=False)
