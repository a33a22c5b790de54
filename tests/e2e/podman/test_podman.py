"""The container path for real: `k3launch up/down` with podman (Debian 4.3, runc) on a locally built
image whose `vllm` is the simulated engine (tests/infra/podman-image.sh).

Needs root and a podman that can run containers here; skipped otherwise, with the reason. The
image is built once and cached between sessions (K3LAUNCH_PODMAN_REBUILD=1 rebuilds it,
K3LAUNCH_PODMAN_RMI=1 removes it at the end). k3launch runs as a CLI subprocess. Every wait is
bounded; every container, secret, router process and bridge made here is removed here.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.request
import uuid
from typing import Any

import pytest
from podmanenv import K3, MODEL, PREFIX, TAG, containers, marked_pids, podman

from k3launch.deploy.state import StateStore
from k3launch.models.plan import Plan


def _complete(endpoint: str) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": "Hello from a container", "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{endpoint}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    assert out["usage"]["completion_tokens"] > 0, out
    return out


def _port_free(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=0.5).close()
    except OSError:
        return True
    return False


def _check_containers(k3: K3, name: str) -> Plan:
    """Labels, exact argv (entrypoint + cmd) and env of every engine container; the token only by file."""
    plan = k3.plan(name)
    engines = {p.id: p for p in plan.processes if p.role != "router"}
    listed = {c["Names"][0]: c for c in containers(name)}
    assert set(listed) == {f"k3-{name}-{pid}" for pid in engines}, listed.keys()
    for pid, proc in engines.items():
        cname = f"k3-{name}-{pid}"
        assert listed[cname]["State"] == "running", listed[cname]
        ident = k3.deployment_id(name)  # the deployment's identity beyond its name (models.identity)
        assert {k: v for k, v in listed[cname]["Labels"].items() if k.startswith("k3launch.") and k != "k3launch.sim-hash"
                and k != "k3launch.purpose"} == {"k3launch.deployment": name, "k3launch.process": pid, "k3launch.role": proc.role,
                                                 "k3launch.id": ident, "k3launch.owner": ident.split("-")[0]}
        raw = podman("inspect", cname)
        info = json.loads(raw)[0]
        ep = info["Config"]["Entrypoint"]
        ep = [ep] if isinstance(ep, str) else list(ep)
        assert ep + list(info["Config"]["Cmd"]) == list(proc.argv), (ep, info["Config"]["Cmd"], proc.argv)
        assert [info["Path"], *info["Args"]] == list(proc.argv)
        env = dict(e.split("=", 1) for e in info["Config"]["Env"])
        want = {**proc.env, "K3LAUNCH_DEPLOYMENT": name, "K3LAUNCH_PROCESS": pid}
        assert {k: env.get(k) for k in want} == want
        assert k3.token not in raw and "HF_TOKEN" not in env, "HF_TOKEN's value is in the container config"
        # ... yet the engine can read it (huggingface_hub: HF_TOKEN, else the file HF_TOKEN_PATH names)
        got = podman("exec", cname, "python3", "-c",
                     "import os; t = os.environ.get('HF_TOKEN') or open(os.environ['HF_TOKEN_PATH']).read(); print(t)").strip()
        assert got == k3.token
    return plan


def _check_down(k3: K3, name: str, plan: Plan) -> None:
    t0 = time.monotonic()
    out = k3.down(name)
    assert out["clean"], out
    assert time.monotonic() - t0 < 60
    assert containers(name) == []
    assert not [s for s in podman("secret", "ls", "--format", "{{.Name}}").split() if s.startswith(f"k3-{name}-")]
    assert not marked_pids(name)
    busy = [f"{u.address}:{u.port}" for u in plan.ports if not _port_free(u.address, u.port)]
    assert not busy, busy
    assert not StateStore(k3.state).exists(name)


def _assert_secret_free(k3: K3, *texts: str) -> None:
    for t in texts:
        assert k3.token not in t
    for f in k3.state.rglob("*"):
        if f.is_file():
            assert k3.token not in f.read_text(errors="replace"), f


@pytest.mark.e2e
@pytest.mark.podman
def test_single_node_tp_in_a_container(k3: K3) -> None:
    name = f"{PREFIX}tp-{uuid.uuid4().hex[:6]}"
    r = k3.up(name, "--port-base", "18300", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["state"] == "ready"
    plan = k3.plan(name)
    assert plan.strategy == "single_node_tp" and [h.runtime for h in plan.hosts] == ["podman"]
    _complete(res["endpoint"])
    _check_containers(k3, name)
    _assert_secret_free(k3, r.stdout, r.stderr)
    _check_down(k3, name, plan)


@pytest.mark.e2e
@pytest.mark.podman
def test_pd_engines_in_containers_router_bare(k3: K3) -> None:
    if shutil.which("vllm-router") is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router)")
    name = f"{PREFIX}pd-{uuid.uuid4().hex[:6]}"
    r = k3.up(name, "--strategy", "pd_cluster", "--port-base", "18400", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    plan = _check_containers(k3, name)
    roles = sorted(p.role for p in plan.processes)
    assert "router" in roles and "prefill" in roles and "decode" in roles, roles
    rec = StateStore(k3.state).load(name)
    assert rec.processes["router"].runtime == "bare" and rec.processes["router"].handle.isdigit()
    assert res["endpoint"].startswith("http://127.0.77.1:")
    for _ in range(3):
        _complete(res["endpoint"])
    # a stopped container is still removed by down
    victim = next(p.id for p in plan.processes if p.role == "decode")
    podman("stop", "-t", "2", f"k3-{name}-{victim}", timeout=30)
    assert any(c["State"] == "exited" for c in containers(name))
    _assert_secret_free(k3, r.stdout, r.stderr)
    _check_down(k3, name, plan)


@pytest.mark.e2e
@pytest.mark.podman
def test_engine_exiting_during_load_fails_fast_and_leaves_nothing(k3: K3) -> None:
    k3.inventory = k3.write_inventory({"K3LAUNCH_SIM_LOAD_S": "1", "K3LAUNCH_SIM_FAIL": "exit-during-load"})
    name = f"{PREFIX}fail-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    r = k3.up(name, "--port-base", "18500", token=False)
    took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert took < 30, f"up took {took:.1f}s to notice"
    assert "exited during" in out and "serve-0" in out
    assert "simulated: K3LAUNCH_SIM_FAIL=exit-during-load" in out  # the container's log tail
    assert containers(name) == []
    assert not [s for s in podman("secret", "ls", "--format", "{{.Name}}").split() if s.startswith(f"k3-{name}-")]
    assert not StateStore(k3.state).exists(name)
    assert _port_free("127.0.77.11", 18500)


@pytest.mark.e2e
@pytest.mark.podman
def test_doctor_sees_a_stopped_leftover_container(k3: K3) -> None:
    # a stopped container of this deployment's own name, left by a run whose state is lost (on the
    # local backend, other deployments' containers on this machine are only a note)
    name = f"{PREFIX}doc-{uuid.uuid4().hex[:6]}"
    ghost = f"k3-{name}-serve-0-old"
    podman("create", "--name", ghost, "--label", f"k3launch.deployment={name}", "--network", "none", TAG)
    try:
        r = k3.up(name, "--port-base", "18600")
        assert r.returncode != 0, r.stdout + r.stderr
        assert "leftovers" in r.stdout + r.stderr and name in r.stdout + r.stderr
        assert [n for c in containers(name) for n in c["Names"]] == [ghost]  # nothing started; the leftover is left to the user
    finally:
        podman("rm", "-f", ghost, check=False)
