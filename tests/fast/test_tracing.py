"""OpenTelemetry traces from the inventory's ``observability:`` (k3launch.planning.tracing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from paths import ROOT

from k3launch import api
from k3launch.errors import K3Error
from k3launch.planning import tracing
from k3launch.planning.inventory import Observability
from k3launch.planning.schema import FlagSchema


def _inventory(tmp_path: Path, observability: object) -> Path:
    inv = yaml.safe_load((ROOT / "inventories" / "h200-pair.yaml").read_text())
    inv["observability"] = observability
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def test_every_http_engine_is_traced_with_the_inventory_as_provenance(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, {"otlp_endpoint": "grpc://otel.lab:4317", "detailed_traces": ["model", "worker"]})
    plan = api.plan(str(inv), strategy="multi_node_tp", nodes=2, name="k3-traced")
    traced = {p.id for p in plan.processes if "--otlp-traces-endpoint" in p.argv}
    assert traced == {p.id for p in plan.processes if p.http_port and p.role != "router"}  # the head; headless ranks serve no HTTP
    head = next(p for p in plan.processes if p.id in traced)
    i = head.argv.index("--otlp-traces-endpoint")
    assert head.argv[i:i + 4] == ["--otlp-traces-endpoint", "grpc://otel.lab:4317", "--collect-detailed-traces", "model,worker"]
    assert head.provenance["--otlp-traces-endpoint"][0].origin == "inventory observability.otlp_endpoint"
    copies = api.plan(str(inv), strategy="multi_node_dep", nodes=2, name="k3-traced-dep")
    assert any(n.code == "tracing-router" for n in copies.notices)
    assert not any("--otlp-traces-endpoint" in p.argv for p in copies.processes if p.role == "router")


def test_no_observability_changes_nothing(tmp_path: Path) -> None:
    a = api.plan(str(ROOT / "inventories" / "h200-pair.yaml"), strategy="multi_node_tp", nodes=2, name="k3-a")
    b = api.plan(str(_inventory(tmp_path, {})), strategy="multi_node_tp", nodes=2, name="k3-a")
    assert a.processes == b.processes


def test_a_vllm_without_the_flag_is_refused_not_planned_untraced() -> None:
    plan = api.plan(None, strategy="single_node_tp", name="k3-x")
    with pytest.raises(K3Error) as info:
        tracing.apply(plan.processes, Observability(otlp_endpoint="http://otel:4317"), FlagSchema("0.9.0", [], frozenset()), [])
    assert info.value.code == "tracing-unsupported" and "vLLM 0.9.0 has no --otlp-traces-endpoint" in info.value.message


@pytest.mark.parametrize("bad", [{"otlp_endpoint": "otel.lab:4317"}, {"otlp_endpoint": "http://x; touch /tmp/p"}, {"detailed_traces": ["gpu"]},
                                 {"otlp_endpoint": "http://otel:4317", "sample": 1}])
def test_a_bad_observability_section_is_refused_naming_the_key(tmp_path: Path, bad: dict[str, object]) -> None:
    with pytest.raises(K3Error) as info:
        api.plan(str(_inventory(tmp_path, bad)), strategy="single_node_tp", name="k3-bad")
    assert info.value.code == "bad-inventory" and "observability" in info.value.message, info.value.message
