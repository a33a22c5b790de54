"""The alert rules k3launch renders, checked and unit-tested by the real ``promtool``.

``promtool check rules`` on the rule file with the defaults and with an inventory's thresholds;
``promtool test rules`` with series in and alerts out: for every rule one case where it fires
(labels and annotations as Prometheus renders them) and one where it does not, and the rules of
one inventory never fire on another inventory's deployments. Skipped when ``promtool`` is absent
(Debian: ``apt install prometheus``), failed instead with ``K3LAUNCH_TEST_PROMETHEUS_REQUIRED=1``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3launch.models.monitoring import Monitoring
from k3launch.render.alerts import CONTROLLERS, ENGINES, ROUTERS, rule_file, rules

PROMTOOL = shutil.which("promtool")
if PROMTOOL is None:
    if os.environ.get("K3LAUNCH_TEST_PROMETHEUS_REQUIRED") == "1":
        pytest.fail("promtool is not installed (apt install prometheus)", pytrace=False)
    pytest.skip("promtool is not installed (apt install prometheus)", allow_module_level=True)

INV = "lab"
# thresholds of a test inventory: short enough for a few minutes of series
M = Monitoring(down_for=60, not_serving_for=120, slo_for=120, restart_window=600, restarts=3, rollout_stuck=600, controller_silent=120)
SUMMARY = {r.alert: r.summary for r in rules(M, INV)}
SEVERITY = {r.alert: r.severity for r in rules(M, INV)}


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


@dataclass
class Case:
    alert: str
    series: list[dict[str, str]]
    at: str  # eval_time
    fires: dict[str, str] | None  # the alert's labels (beyond alertname and severity); None: it does not fire
    value: str = ""  # what {{ $value }} renders as
    extra: list[dict[str, Any]] = field(default_factory=list)


def _summary(alert: str, labels: dict[str, str], value: str) -> str:
    text = SUMMARY[alert].replace("{{ $value }}", value)
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)


ENG = {"job": ENGINES, "inventory": INV, "deployment": "k3", "process": "serve-0", "node": "n1"}
RTR = {"job": ROUTERS, "inventory": INV, "deployment": "k3", "process": "router", "node": "n0"}
CTL = {"job": CONTROLLERS, "inventory": INV, "deployment": "k3", "process": "controller", "node": "login"}
DEP = {"inventory": INV, "deployment": "k3"}
PROC = {"deployment": "k3", "process": "serve-0"}


def _engine_metrics(running: str, tokens: str) -> list[dict[str, str]]:
    return [_series("up", "1x40", **ENG), _series("vllm:num_requests_running", running, **ENG),
            _series("vllm:num_requests_waiting", "0x40", **ENG), _series("vllm:generation_tokens_total", tokens, **ENG)]


def _histogram(name: str, bound: str, rising: bool) -> list[dict[str, str]]:
    """Observations all above ``bound`` (rising) or all at or under it."""
    counts = "0+10x40"
    return [_series(f"{name}_bucket", "0x40" if rising else counts, le=bound, **ENG),
            _series(f"{name}_bucket", counts, le="+Inf", **ENG)]


def _controller(name: str, values: str, labels: dict[str, str] = CTL) -> dict[str, str]:
    return _series(name, values, **labels)


CASES = [
    Case("K3EngineDown", [_series("up", "1 1 0x20", **ENG)], "3m", ENG),
    Case("K3EngineDown", [_series("up", "1 1 0x20", **{**ENG, "inventory": "other"})], "3m", None),  # another inventory's
    Case("K3EngineDown", [_series("up", "1x20 0x20", **ENG)], "5m30s", None),  # down 30 s: not yet for 60 s
    Case("K3RouterDown", [_series("up", "0x20", **RTR)], "2m", RTR),
    Case("K3RouterDown", [_series("up", "1x20", **RTR)], "2m", None),
    Case("K3UpButNotServing", _engine_metrics("2x40", "100x40"), "6m", PROC, value="2"),
    Case("K3UpButNotServing", _engine_metrics("2x40", "100+10x40"), "6m", None),  # tokens come out
    Case("K3UpButNotServing", _engine_metrics("0x40", "100x40"), "6m", None),  # idle: nothing to serve
    Case("K3TTFTAboveSLO", _histogram("vllm:time_to_first_token_seconds", "20", rising=True), "6m", {"deployment": "k3"}, value="20"),
    Case("K3TTFTAboveSLO", _histogram("vllm:time_to_first_token_seconds", "1", rising=False), "6m", None),
    Case("K3ITLAboveSLO", _histogram("vllm:inter_token_latency_seconds", "1", rising=True), "6m", {"deployment": "k3"}, value="1"),
    Case("K3ITLAboveSLO", _histogram("vllm:inter_token_latency_seconds", "0.25", rising=False), "6m", None),
    Case("K3KVCachePressure", [_series("vllm:kv_cache_usage_perc", "0.99x40", **ENG), _series("vllm:num_preemptions_total", "0+3x40", **ENG)],
         "8m", PROC),
    Case("K3KVCachePressure", [_series("vllm:kv_cache_usage_perc", "0.99x40", **ENG), _series("vllm:num_preemptions_total", "7x40", **ENG)],
         "8m", None),  # full, and nothing preempted: a busy engine
    Case("K3DeploymentDegraded", [_controller("k3launch_units_serving", "1x20", DEP), _controller("k3launch_units_desired", "2x20", DEP)],
         "3m", DEP, value="1"),
    Case("K3DeploymentDegraded", [_controller("k3launch_units_serving", "2x20", DEP), _controller("k3launch_units_desired", "2x20", DEP)],
         "3m", None),
    Case("K3RestartLoop", [_controller("k3launch_restarts_total", "0 0 1 1 2 2 3 3 3 3", DEP)], "2m", DEP),
    Case("K3RestartLoop", [_controller("k3launch_restarts_total", "0 0 1 1 1 1 2 2 2 2", DEP)], "2m", None),
    Case("K3UnitGivenUp", [_controller("k3launch_units_given_up", "0 0 1x10", DEP)], "2m", DEP, value="1"),
    Case("K3UnitGivenUp", [_controller("k3launch_units_given_up", "0x10", DEP)], "2m", None),
    Case("K3CanaryMismatch", [_controller("k3launch_canary_agree", "1 1 0x10", DEP)], "2m", DEP),
    Case("K3CanaryMismatch", [_controller("k3launch_canary_agree", "1x10", DEP)], "2m", None),
    Case("K3RolloutStuck", [_controller("k3launch_rollout_active", "1x80", DEP), _controller("k3launch_rollout_progress_timestamp_seconds", "0x80", DEP)],
         "15m", DEP),
    Case("K3RolloutStuck", [_controller("k3launch_rollout_active", "1x80", DEP),
                            _controller("k3launch_rollout_progress_timestamp_seconds", "0+15x80", DEP)], "15m", None),
    Case("K3NodeLost", [_controller("k3launch_nodes_lost", "0 1x10", DEP)], "1m", DEP, value="1"),
    Case("K3NodeLost", [_controller("k3launch_nodes_lost", "0x10", DEP)], "1m", None),
    Case("K3ControllerSilent", [_controller("up", "0x20")], "2m", CTL),
    Case("K3ControllerSilent", [_controller("up", "1x40"), _controller("k3launch_last_look_timestamp_seconds", "0x40")], "5m", CTL),  # answers, looks no more
    Case("K3ControllerSilent", [_controller("up", "1x40"), _controller("k3launch_last_look_timestamp_seconds", "0+15x40")], "5m", None),
]


def test_every_rule_has_a_firing_and_a_quiet_case() -> None:
    names = {r.alert for r in rules(M, INV)}
    assert {c.alert for c in CASES if c.fires is not None} == names
    assert {c.alert for c in CASES if c.fires is None} == names


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("inventory", [None, INV])
def test_promtool_checks_the_rule_file(tmp_path: Path, inventory: str | None) -> None:
    (tmp_path / "rules.yml").write_text(rule_file(M if inventory else Monitoring(), inventory))
    r = _promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert r.returncode == 0 and f"SUCCESS: {len(rules(M))} rules found" in r.stdout, r.stdout + r.stderr


def test_promtool_unit_tests_fire_each_rule_when_it_should_and_only_then(tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(rule_file(M, INV))
    tests = []
    for c in CASES:
        exp = []
        if c.fires is not None:
            exp = [{"exp_labels": {**c.fires, "severity": SEVERITY[c.alert]},
                    "exp_annotations": {"summary": _summary(c.alert, c.fires, c.value), "runbook": "docs/monitoring.md#what-each-alert-means"}}]
        tests.append({"interval": "15s", "input_series": c.series,
                      "alert_rule_test": [{"eval_time": c.at, "alertname": c.alert, "exp_alerts": exp}]})
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "15s", "tests": tests}))
    r = _promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout[-6000:] + r.stderr[-6000:]


def test_a_broken_expectation_fails_promtool(tmp_path: Path) -> None:
    """The harness can fail: a quiet case expected to fire is reported by promtool."""
    (tmp_path / "rules.yml").write_text(rule_file(M, INV))
    quiet = next(c for c in CASES if c.fires is None)
    test = {"interval": "15s", "input_series": quiet.series,
            "alert_rule_test": [{"eval_time": quiet.at, "alertname": quiet.alert, "exp_alerts": [{"exp_labels": ENG}]}]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "tests": [test]}))
    r = _promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert r.returncode == 1 and "FAILED" in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_cli_prints_an_inventorys_rules_with_its_thresholds(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from k3launch.cli import app

    inv = tmp_path / "inv.yaml"
    inv.write_text("name: prod-a\nbackend: local\nhardware: b300\nengine: sim\nnodes: [{name: n1, address: 127.0.0.1}]\n"
                   "monitoring: {ttft_p99: 2.5, down_for: 30}\n")
    res = CliRunner().invoke(app, ["monitoring", "rules", "-i", str(inv)])
    assert res.exit_code == 0, res.output
    (tmp_path / "rules.yml").write_text(res.stdout)
    assert _promtool("check", "rules", "rules.yml", cwd=tmp_path).returncode == 0
    by_name = {r["alert"]: r for r in yaml.safe_load(res.stdout)["groups"][0]["rules"]}
    assert by_name["K3TTFTAboveSLO"]["expr"].endswith("> 2.5") and 'inventory="prod-a"' in by_name["K3EngineDown"]["expr"]
    assert by_name["K3EngineDown"]["for"] == "30s"
    inv.write_text(inv.read_text().replace("ttft_p99", "ttft_p95"))
    bad = CliRunner().invoke(app, ["monitoring", "rules", "-i", str(inv)])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert bad.stderr.startswith("error: ") and "ttft_p95" in bad.stderr, bad.stderr


def _dashboard_exprs() -> list[str]:
    from k3launch.render.dashboard import dashboard

    d = dashboard()
    panels = [p for p in d["panels"] if p.get("type") != "row"]
    return [t["expr"] for p in panels for t in p["targets"]] + [a["expr"] for a in d["annotations"]["list"] if "expr" in a]


def test_the_dashboard_is_grafanas_model_and_its_queries_are_promql(tmp_path: Path) -> None:
    """The JSON reads back as grafana-foundation-sdk's typed model, and every panel's and
    annotation's query, with Grafana's variables filled in, passes promtool as a recording rule."""
    from grafana_foundation_sdk.models.dashboard import Dashboard

    from k3launch.render.dashboard import dashboard

    d = dashboard()
    typed = Dashboard.from_json(d)
    assert typed.title == "k3launch deployments" and typed.uid == "k3launch-deployments"
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "deployment"]
    exprs = _dashboard_exprs()
    assert len(exprs) >= 14
    filled = [e.replace("$__rate_interval", "1m").replace("$deployment", ".*") for e in exprs]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"k3launch:dashboard_query_{i}", "expr": e} for i, e in enumerate(filled)]}]}
    (tmp_path / "q.yml").write_text(yaml.safe_dump(rules))
    r = _promtool("check", "rules", "q.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_vllm_metric_the_rules_and_dashboard_read_is_one_the_simulated_engine_exports() -> None:
    """The same check against the real vLLM is in tests/engine/test_engine.py."""
    from k3launch.sim.metrics import Metrics, render

    exported = set(re.findall(r"^(vllm:\w+)", render("m", {0: Metrics()}), re.M))
    used = {n for e in [r.expr for r in rules(M)] + _dashboard_exprs() for n in re.findall(r"vllm:\w+", e)}
    assert len(used) >= 7 and used <= exported, sorted(used - exported)
