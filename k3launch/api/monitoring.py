"""What a Prometheus needs to watch the deployments of a state directory (docs/monitoring.md).

Each ready deployment's target file is kept by the state store (written with its record, removed
with it); :func:`prometheus_config` prints the configuration that reads them.
"""

from __future__ import annotations

from pathlib import Path

from k3launch.api._common import store


def targets_dir(state_dir: str | Path | None = None) -> Path:
    """The directory of the ``file_sd`` target files (``NAME.json`` per ready deployment)."""
    return store(state_dir).targets_dir()


def prometheus_config(state_dir: str | Path | None = None, interval_s: int = 15) -> str:
    """The ``scrape_configs`` entry (YAML) a Prometheus on this machine needs to scrape every
    ready deployment of the state directory, engines and routers."""
    from k3launch.render.monitoring import scrape_config

    return scrape_config(str(targets_dir(state_dir).resolve()), interval_s)
