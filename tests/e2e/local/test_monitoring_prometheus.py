"""A supervised deployment watched by a real Prometheus and Alertmanager (Debian's packages).

Two copies of the simulated engine behind the real vllm-router, a detached controller, and
Prometheus reading k3launch's own scrape configuration and rule file (as `k3launch monitoring
config` and `monitoring rules -i` print them, thresholds from the inventory). Every target is
scraped; a ``kill -9`` of an engine fires K3EngineDown at Prometheus and reaches the webhook
through Alertmanager, then resolves once the controller has restarted it; an engine that latches
(``K3LAUNCH_SIM_FAIL=latch``: requests held, no token, ``/health`` 200) fires K3UpButNotServing
while its ``/health`` answers, the controller restarts it as hung, and the alert resolves. Then
``k3launch top`` reads the same deployment (``--once --json`` and the table).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from e2e_helpers import Cli, events
from promstack import Stack, skip_or_fail

pytestmark = pytest.mark.e2e


def _alerts(stack: Stack, alert: str, process: str, status: str) -> list[tuple[float, dict[str, object]]]:
    return [(t, a) for t, a in stack.webhook.alerts()
            if a["labels"]["alertname"] == alert and a["labels"].get("process") == process and a["status"] == status]


def _hold(url: str, model: str, n: int) -> None:
    """``n`` completions sent straight to one engine, each on a thread of its own (a latched engine never answers)."""
    body = json.dumps({"model": model, "prompt": "held", "max_tokens": 4}).encode()

    def one() -> None:
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).read()
        except OSError:
            pass  # cut when the controller restarts the engine

    for _ in range(n):
        threading.Thread(target=one, daemon=True).start()


def _complete(url: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "top", "max_tokens": 8}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def test_prometheus_scrapes_a_supervised_deployment_and_its_alerts_fire_reach_the_webhook_and_resolve(
        state_cli: Cli, local_inventory: Path, tmp_path: Path) -> None:
    skip_or_fail()
    cli, name = state_cli, "mon-sim"
    inv = yaml.safe_load(local_inventory.read_text())
    # a restart takes 6 s: long enough for a 2 s down_for; copy r1's engine latches after its first request
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": "6", "K3LAUNCH_SIM_FAIL": "latch", "K3LAUNCH_SIM_FAIL_PROCESS": "r1-serve-0"}
    inv["restart"] = {"poll": 0.5, "unhealthy_after": 15, "backoff": 0}
    inv["monitoring"] = {"down_for": 2, "not_serving_for": 4, "controller_silent": 10}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    r = cli.run("up", "-i", str(path), "--recipe", "k3launch/tiny-llama", "--strategy", "single_node_tp", "--replicas", "2", "--no-canary",
                "--name", name, "--port-base", "23860", "--json", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    cli.json("supervise", name, "--detach")
    rec = cli.record(name)
    model = rec["plan"]["model"]
    engines = {i: int(p["handle"]) for i, p in rec["processes"].items() if i != "router"}
    r1 = next(f"http://{p['address']}:{p['http_port']}" for p in rec["plan"]["processes"] if p["id"] == "r1-serve-0")
    scrape = cli.run("monitoring", "config", "--interval", "1").stdout
    rules = cli.run("monitoring", "rules", "-i", str(path)).stdout
    stack = Stack(tmp_path / "prometheus", scrape, rules)
    try:
        t0 = time.time()
        def all_up() -> list[dict[str, object]] | None:
            t = stack.targets()
            return t if len(t) == 4 and all(x["health"] == "up" for x in t) else None

        up = stack.wait(all_up, 60, "the two engines, the router and the controller scraped")
        t_up = time.time() - t0
        scraped = sorted((x["labels"]["job"], x["labels"]["process"]) for x in up)

        # a kill -9: K3EngineDown at the webhook, then resolved once the controller has restarted it
        t_kill = time.time()
        os.kill(engines["r0-serve-0"], signal.SIGKILL)
        fired = stack.wait(lambda: _alerts(stack, "K3EngineDown", "r0-serve-0", "firing"), 60, "K3EngineDown delivered")
        resolved = stack.wait(lambda: _alerts(stack, "K3EngineDown", "r0-serve-0", "resolved"), 90, "K3EngineDown resolved")

        # a latch: requests held, no token, /health 200
        t_latch = time.time()
        _hold(r1, model, 2)
        firing = stack.wait(lambda: [a for a in stack.alerts("K3UpButNotServing")
                                     if a["labels"]["process"] == "r1-serve-0" and a["state"] == "firing"], 60, "K3UpButNotServing firing")
        with urllib.request.urlopen(r1 + "/health", timeout=5) as h:
            health = h.status
        delivered = stack.wait(lambda: _alerts(stack, "K3UpButNotServing", "r1-serve-0", "firing"), 30, "K3UpButNotServing delivered")
        back = stack.wait(lambda: _alerts(stack, "K3UpButNotServing", "r1-serve-0", "resolved"), 120, "K3UpButNotServing resolved")
        targets_after = stack.wait(all_up, 60, "every target scraped again once the latched engine was restarted")
    finally:
        stack.close()

    # `top --once --json` while r0 serves completions and one goes through the router (r1, restarted, answers its first)
    r0 = next(f"http://{p['address']}:{p['http_port']}" for p in rec["plan"]["processes"] if p["id"] == "r0-serve-0")
    busy = threading.Thread(target=lambda: [_complete(r0, model) for _ in range(20)] + [_complete(rec["endpoint"], model)], daemon=True)
    busy.start()
    view = cli.json("top", name, "--interval", "2", timeout=60)
    busy.join(60)
    text = cli.run("top", name, "--once", "--interval", "0.5").stdout
    log = events(cli, name)
    hung = [e for e in log if e["kind"] == "detected" and e.get("unit") == "r1-serve-0" and e["time"] >= t_latch]
    print(f"\n[targets up {t_up:.1f}s after Prometheus started; kill -> K3EngineDown delivered {fired[0][0] - t_kill:.1f}s, "
          f"resolved {resolved[0][0] - t_kill:.1f}s; latch -> K3UpButNotServing delivered {delivered[0][0] - t_latch:.1f}s, "
          f"controller restart {hung[0]['time'] - t_latch if hung else float('nan'):.1f}s, resolved {back[0][0] - t_latch:.1f}s]")
    assert scraped == [("k3launch-controller", "controller"), ("k3launch-vllm", "r0-serve-0"), ("k3launch-vllm", "r1-serve-0"),
                       ("k3launch-vllm-router", "router")], scraped
    labels = fired[0][1]["labels"]
    assert isinstance(labels, dict) and labels["deployment"] == name and labels["inventory"] == "local" and labels["copy"] == "r0", labels
    assert health == 200  # the engine answered /health while the alert fired
    assert firing[0]["labels"]["deployment"] == name
    assert hung and "request(s) held and no token generated" in hung[0]["reason"], hung  # the controller repaired it
    assert len(targets_after) == 4
    rows = {r["process"]: r for r in view["processes"]}
    assert sorted(rows) == ["r0-serve-0", "r1-serve-0", "router"] and all(r["up"] for r in rows.values()), view
    assert rows["r0-serve-0"]["generation_tps"] > 0 and rows["r0-serve-0"]["unit_state"] == "serving", rows["r0-serve-0"]
    assert rows["router"]["requests_ps"] is not None and view["supervised"] is True, rows["router"]
    assert "r0-serve-0" in text and "TTFT p50/p99 ms" in text, text
    d = cli.json("down", name, timeout=120)
    assert d["clean"] is True, d
    assert not (cli.state_dir / "monitoring" / "targets" / f"{name}.json").exists()  # down removed its targets
