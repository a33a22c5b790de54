"""A Grafana dashboard for k3launch deployments (docs/monitoring.md, "Dashboard"): pure.

Built with grafana-foundation-sdk's typed builders (the schema Grafana itself is generated from),
one dashboard for every deployment: a ``deployment`` variable (the targets' label), panels from
vLLM's own metric names and k3launch's (the same names the alert rules read), and restarts and
rollouts as annotations.
"""

from __future__ import annotations

import json
from typing import Any

from k3launch.render.monitoring import JOB_ENGINES

UID = "k3launch-deployments"
DEP = 'deployment=~"$deployment"'


def _panel(title: str, unit: str, queries: list[tuple[str, str]], width: int = 12, max_val: float | None = None) -> Any:
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.builders.timeseries import Panel
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    p = Panel().title(title).unit(unit).span(width).height(8).datasource(DataSourceRef(type_val="prometheus", uid="${datasource}"))
    if max_val is not None:
        p = p.min(0).max(max_val)
    for expr, legend in queries:
        p = p.with_target(Dataquery().expr(expr).legend_format(legend))
    return p


def _quantile(q: float, hist: str) -> str:
    return f"histogram_quantile({q}, sum by (deployment, le) (rate({hist}_bucket{{{DEP}}}[$__rate_interval])))"


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    from grafana_foundation_sdk.builders.dashboard import AnnotationQuery, Dashboard, DatasourceVariable, QueryVariable, Row
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    by = "deployment, process"
    d = (
        Dashboard("k3launch deployments")
        .uid(UID)
        .tags(["k3launch", "vllm"])
        .refresh("30s")
        .time("now-3h", "now")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(QueryVariable("deployment").label("Deployment").datasource(ds)
                       .query(f'label_values(up{{job="{JOB_ENGINES}"}}, deployment)').multi(True).include_all(True))
        .annotation(AnnotationQuery().name("restarts").datasource(ds).enable(True).icon_color("orange")
                    .expr(f"changes(k3launch_restarts_total{{{DEP}}}[2m]) > 0"))
        .annotation(AnnotationQuery().name("rollouts").datasource(ds).enable(True).icon_color("blue")
                    .expr(f"k3launch_rollout_active{{{DEP}}} == 1"))
        .with_row(Row("Serving"))
        .with_panel(_panel("Generated tokens / s", "short", [(f"sum by (deployment) (rate(vllm:generation_tokens_total{{{DEP}}}[$__rate_interval]))",
                                                              "{{deployment}}")]))
        .with_panel(_panel("Prompt tokens / s", "short", [(f"sum by (deployment) (rate(vllm:prompt_tokens_total{{{DEP}}}[$__rate_interval]))",
                                                           "{{deployment}}")]))
        .with_panel(_panel("Time to first token", "s", [(_quantile(0.5, "vllm:time_to_first_token_seconds"), "{{deployment}} p50"),
                                                        (_quantile(0.99, "vllm:time_to_first_token_seconds"), "{{deployment}} p99")]))
        .with_panel(_panel("Inter-token latency", "s", [(_quantile(0.5, "vllm:inter_token_latency_seconds"), "{{deployment}} p50"),
                                                        (_quantile(0.99, "vllm:inter_token_latency_seconds"), "{{deployment}} p99")]))
        .with_row(Row("Engines and DP ranks"))
        .with_panel(_panel("Requests running and waiting", "short",
                           [(f"sum by ({by}) (vllm:num_requests_running{{{DEP}}})", "{{process}} running"),
                            (f"sum by ({by}) (vllm:num_requests_waiting{{{DEP}}})", "{{process}} waiting")]))
        .with_panel(_panel("KV cache use", "percentunit", [(f"max by ({by}) (vllm:kv_cache_usage_perc{{{DEP}}})", "{{process}}")],
                           max_val=1))
        .with_panel(_panel("Load per DP rank (requests running)", "short",
                           [(f"vllm:num_requests_running{{{DEP}}}", "{{process}} rank {{engine}}")]))
        .with_panel(_panel("Preemptions / s", "short", [(f"sum by ({by}) (rate(vllm:num_preemptions_total{{{DEP}}}[$__rate_interval]))",
                                                         "{{process}}")]))
        .with_row(Row("k3launch"))
        .with_panel(_panel("Units serving / desired", "short", [(f"k3launch_units_serving{{{DEP}}}", "{{deployment}} serving"),
                                                                (f"k3launch_units_desired{{{DEP}}}", "{{deployment}} desired")]))
        .with_panel(_panel("Restarts", "short", [(f"increase(k3launch_restarts_total{{{DEP}}}[$__rate_interval])", "{{deployment}}")]))
        .with_panel(_panel("Targets up", "short", [(f"sum by (deployment, job) (up{{{DEP}}})", "{{deployment}} {{job}}")]))
        .with_panel(_panel("Last bring-up, per phase", "s", [(f"k3launch_bringup_phase_seconds{{{DEP}}}", "{{deployment}} {{phase}}")]))
    )
    out: dict[str, Any] = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    return out


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"
