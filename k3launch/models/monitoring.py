"""The inventory's ``monitoring:`` section: where a controller serves its metrics, and the
thresholds of the alert rules (docs/monitoring.md, "Alert rules")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DAY = 86400.0


class Monitoring(BaseModel):
    """Every threshold has a default; an inventory names only those it changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # where `supervise` serves k3launch's own metrics: ADDRESS:PORT (port 0: any free one, recorded
    # in the deployment's record and target file); 127.0.0.1 keeps them on the login node
    listen: str = Field(default="127.0.0.1:0", pattern=r"^[A-Za-z0-9.:_-]+:\d{1,5}$")
    down_for: float = Field(default=60.0, gt=0, le=DAY)  # an engine, router or controller not scraped this long
    not_serving_for: float = Field(default=300.0, gt=0, le=DAY)  # requests waiting or running, no token out, this long
    ttft_p99: float = Field(default=10.0, gt=0, le=3600)  # seconds: p99 time to first token over 5 minutes above it
    itl_p99: float = Field(default=0.5, gt=0, le=3600)  # seconds: p99 inter-token latency over 5 minutes above it
    slo_for: float = Field(default=600.0, gt=0, le=DAY)  # ... this long
    kv_usage: float = Field(default=0.95, gt=0, le=1)  # KV cache use above this while requests are preempted
    restarts: int = Field(default=3, ge=1, le=1000)  # restarts of a deployment within restart_window: a loop
    restart_window: float = Field(default=1800.0, gt=0, le=30 * DAY)
    rollout_stuck: float = Field(default=1800.0, gt=0, le=30 * DAY)  # a rollout with no unit rolled this long
    controller_silent: float = Field(default=120.0, gt=0, le=DAY)  # a controller's last look this old
