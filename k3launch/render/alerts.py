"""Prometheus alert rules for k3launch deployments (docs/monitoring.md, "Alert rules"): pure.

One rule file per inventory (its thresholds: the inventory's ``monitoring:`` section, defaults in
:class:`~k3launch.models.monitoring.Monitoring`), its rules scoped to that inventory's deployments
by the ``inventory`` label every target carries; without an inventory, every deployment with the
defaults. The expressions read three sources: ``up`` of the targets k3launch writes, vLLM's own
metrics (names as vLLM 0.32/0.33 export them; tests/engine/test_engine_monitoring.py checks them
against the real engine), and the controller's (:mod:`k3launch.render.monitoring`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from k3launch.models.monitoring import Monitoring
from k3launch.render.monitoring import JOB_CONTROLLERS as CONTROLLERS
from k3launch.render.monitoring import JOB_ENGINES as ENGINES
from k3launch.render.monitoring import JOB_ROUTERS as ROUTERS

RUNBOOK = "docs/monitoring.md#what-each-alert-means"


@dataclass(frozen=True)
class Rule:
    alert: str
    expr: str
    for_s: float
    severity: str
    summary: str  # a Go template: {{ $labels.deployment }} ...


def _dur(seconds: float) -> str:
    return f"{round(seconds)}s"


def _sel(inventory: str | None, **more: str) -> str:
    """A label selector's inside: ``job="..."``, ``inventory="..."`` (values JSON-quoted, which
    PromQL's string syntax accepts)."""
    pairs = dict(more, **({"inventory": inventory} if inventory else {}))
    return ",".join(f"{k}={json.dumps(v)}" for k, v in pairs.items())


def rules(m: Monitoring, inventory: str | None = None) -> list[Rule]:
    s = _sel(inventory)
    eng, rtr, ctl = _sel(inventory, job=ENGINES), _sel(inventory, job=ROUTERS), _sel(inventory, job=CONTROLLERS)
    # a rate needs samples: half the time a stall must last, at least 10 s, at most 2 minutes
    window = _dur(min(max(m.not_serving_for / 2, 10.0), 120.0))
    by = "deployment, process"
    return [
        Rule("K3EngineDown", f"up{{{eng}}} == 0", m.down_for, "critical",
             "{{ $labels.deployment }}: engine {{ $labels.process }} on {{ $labels.node }} does not answer /metrics"),
        Rule("K3RouterDown", f"up{{{rtr}}} == 0", m.down_for, "critical",
             "{{ $labels.deployment }}: the router on {{ $labels.node }} does not answer"),
        Rule("K3UpButNotServing",
             f"(sum by ({by}) (vllm:num_requests_running{{{s}}} + vllm:num_requests_waiting{{{s}}}) > 0)"
             f" and on ({by}) (sum by ({by}) (rate(vllm:generation_tokens_total{{{s}}}[{window}])) == 0)"
             f" and on ({by}) (up{{{eng}}} == 1)",
             m.not_serving_for, "critical",
             "{{ $labels.deployment }}: {{ $labels.process }} holds {{ $value }} request(s) and generates no token, though it answers"),
        Rule("K3TTFTAboveSLO",
             f"histogram_quantile(0.99, sum by (deployment, le) (rate(vllm:time_to_first_token_seconds_bucket{{{s}}}[5m]))) > {m.ttft_p99:g}",
             m.slo_for, "warning", f"{{{{ $labels.deployment }}}}: p99 time to first token {{{{ $value }}}} s, above {m.ttft_p99:g} s"),
        Rule("K3ITLAboveSLO",
             f"histogram_quantile(0.99, sum by (deployment, le) (rate(vllm:inter_token_latency_seconds_bucket{{{s}}}[5m]))) > {m.itl_p99:g}",
             m.slo_for, "warning", f"{{{{ $labels.deployment }}}}: p99 inter-token latency {{{{ $value }}}} s, above {m.itl_p99:g} s"),
        Rule("K3KVCachePressure",
             f"(max by ({by}) (vllm:kv_cache_usage_perc{{{s}}}) > {m.kv_usage:g})"
             f" and on ({by}) (sum by ({by}) (rate(vllm:num_preemptions_total{{{s}}}[5m])) > 0)",
             m.down_for, "warning", "{{ $labels.deployment }}: {{ $labels.process }}'s KV cache is full and requests are preempted"),
        Rule("K3DeploymentDegraded", f"k3launch_units_serving{{{s}}} < k3launch_units_desired{{{s}}}", m.down_for, "warning",
             "{{ $labels.deployment }}: {{ $value }} unit(s) serving, fewer than desired"),
        Rule("K3RestartLoop", f"increase(k3launch_restarts_total{{{s}}}[{_dur(m.restart_window)}]) >= {m.restarts}", 0, "warning",
             f"{{{{ $labels.deployment }}}}: {m.restarts} restarts or more within {_dur(m.restart_window)}"),
        Rule("K3UnitGivenUp", f"k3launch_units_given_up{{{s}}} > 0", 0, "critical",
             "{{ $labels.deployment }}: {{ $value }} unit(s) given up by the controller (k3launch events)"),
        Rule("K3CanaryMismatch", f"k3launch_canary_agree{{{s}}} == 0", 0, "critical",
             "{{ $labels.deployment }}: an engine's answers differ from the canary baseline (k3launch events)"),
        Rule("K3RolloutStuck",
             f"(k3launch_rollout_active{{{s}}} == 1) and on (deployment)"
             f" (time() - k3launch_rollout_progress_timestamp_seconds{{{s}}} > {m.rollout_stuck:g})",
             0, "warning", "{{ $labels.deployment }}: a rollout has rolled no unit for too long"),
        Rule("K3NodeLost", f"k3launch_nodes_lost{{{s}}} > 0", 0, "critical",
             "{{ $labels.deployment }}: {{ $value }} node(s) lost (unreachable past node_lost_after)"),
        Rule("K3ControllerSilent",
             f"(up{{{ctl}}} == 0) or (time() - k3launch_last_look_timestamp_seconds{{{ctl}}} > {m.controller_silent:g})",
             m.down_for, "critical", "{{ $labels.deployment }}: its controller does not answer or has stopped looking"),
    ]


def rule_file(m: Monitoring, inventory: str | None = None) -> str:
    """The rule file (YAML)."""
    import yaml

    group = {
        "name": f"k3launch-{inventory}" if inventory else "k3launch",
        "rules": [
            {
                "alert": r.alert,
                "expr": r.expr,
                **({"for": _dur(r.for_s)} if r.for_s else {}),
                "labels": {"severity": r.severity},
                "annotations": {"summary": r.summary, "runbook": f"{RUNBOOK}"},
            }
            for r in rules(m, inventory)
        ],
    }
    return str(yaml.safe_dump({"groups": [group]}, sort_keys=False, width=1000, allow_unicode=True))
