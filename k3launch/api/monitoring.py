"""What a Prometheus needs to watch the deployments of a state directory (docs/monitoring.md).

Each ready deployment's target file is kept by the state store (written with its record, removed
with it); :func:`prometheus_config` prints the configuration that reads them.
"""

from __future__ import annotations

from pathlib import Path

from k3launch.api._common import InventoryArg, load, store


def targets_dir(state_dir: str | Path | None = None) -> Path:
    """The directory of the ``file_sd`` target files (``NAME.json`` per ready deployment)."""
    return store(state_dir).targets_dir()


def prometheus_config(state_dir: str | Path | None = None, interval_s: int = 15) -> str:
    """The ``scrape_configs`` entry (YAML) a Prometheus on this machine needs to scrape every
    ready deployment of the state directory, engines and routers."""
    from k3launch.render.monitoring import scrape_config

    return scrape_config(str(targets_dir(state_dir).resolve()), interval_s)


def alert_rules(inventory: InventoryArg | None = None, *, every: bool = False) -> str:
    """The Prometheus rule file (YAML) for the deployments of ``inventory``, with its
    ``monitoring:`` thresholds (defaults where it names none); ``every``: the rules for every
    deployment, with the defaults."""
    from k3launch.models.monitoring import Monitoring
    from k3launch.render.alerts import rule_file

    if every:
        return rule_file(Monitoring())
    inv = load(inventory).inventory
    return rule_file(inv.monitoring or Monitoring(), inv.name)


def grafana_dashboard() -> str:
    """The Grafana dashboard (JSON) of every deployment, with a ``deployment`` variable."""
    from k3launch.render.dashboard import dashboard_json

    return dashboard_json()
