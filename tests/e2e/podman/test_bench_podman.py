"""The engine-container client path for real: `vllm bench serve` run with `podman exec` in the head
container (the test image's `vllm` is the sim, which answers `vllm bench serve`), the result JSON
read back with `cat`. Needs root and podman (the fixtures of this folder's conftest.py build the image and
skip, or fail under K3LAUNCH_TEST_PODMAN_REQUIRED=1, when they cannot)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import yaml
from podmanenv import K3, PREFIX, containers

from k3launch.campaign.results import read_rows

pytestmark = [pytest.mark.e2e, pytest.mark.podman]


def test_bench_runs_vllm_bench_serve_inside_the_head_container(k3: K3, tmp_path: Path) -> None:
    name = f"{PREFIX}bench-{uuid.uuid4().hex[:6]}"
    r = k3.up(name, "--port-base", "32768", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "res"
    b = k3.run("bench", name, "--client", "engine", "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "4",
               "--max-concurrency", "2", "--result-dir", str(out), "--json", timeout=120)
    assert b.returncode == 0, b.stdout + b.stderr
    res = json.loads(b.stdout)
    assert res["client"] == "engine" and res["valid"] and res["result"]["completed"] == 8
    assert res["result"]["total_output_tokens"] == 32 and res["result"]["max_concurrency"] == 2
    log = Path(res["result_file"]).with_suffix(".log").read_text()
    assert log.startswith("$ podman exec k3-") and "vllm bench serve" in log and "Serving Benchmark Result" in log
    assert not list(Path("/tmp").glob(f"k3launch-bench-bench-{name}-*"))  # the node-side copy is removed
    assert k3.down(name)["clean"]


def test_campaign_on_containers_records_the_image(k3: K3, tmp_path: Path) -> None:
    cname = f"{PREFIX[:-1]}c{uuid.uuid4().hex[:5]}"
    camp = tmp_path / "c.yaml"
    camp.write_text(yaml.safe_dump({"name": cname, "inventory": str(k3.inventory), "port_base": 33280, "ready_timeout": 60,
                                    "base": {"strategy": "single_node_tp"},
                                    "load": {"max_concurrency": [1, 2], "input_len": 16, "output_len": 4, "num_prompts": 4}}))
    k3.names.append(f"{cname}-")  # cleanup sweeps containers named after the campaign
    r = k3.run("campaign", "run", str(camp), "--out", str(tmp_path / "out"), "--json", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(r.stdout)
    assert (s["engine_starts"], s["valid"]) == (1, 2)
    rows = read_rows(tmp_path / "out")
    assert len(rows) == 2
    for row in rows:
        p = row.provenance
        assert p is not None and p.client == "engine" and p.runtime == "podman"
        assert p.image == "localhost/k3launch-sim:test" and p.image_id and len(p.image_id) >= 12
    assert not [c for c in containers(f"{cname}-{rows[0].provenance.plan_hash[:8]}")]  # type: ignore[union-attr]
