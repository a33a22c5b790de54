"""The doctor's pre-flight end to end on the sshd test hosts: the real probe with stand-in tools
(tests/infra/standin) first on the nodes' PATH, through ``k3launch doctor`` (passing, then each
fault named) and ``up``'s refusal of missing weights before anything starts (the parsers and
checks: test_preflight.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import standin

if TYPE_CHECKING:
    from sshhosts import Hosts


# ---------------------------------------------------------------- end to end: stand-in tools on sshd hosts
def _inventory(ssh_hosts: Hosts, tmp: Path, knobs: Mapping[str, Mapping[str, str | int]], weights: Mapping[str, bool]) -> Path:
    nodes = []
    for n in ssh_hosts.names[:2]:
        tools = standin.tools(tmp / f"tools-{n}", **knobs.get(n, {}))
        cache = tmp / f"hf-{n}"
        if weights.get(n, True):
            standin.hf_cache(cache / "hub")
        nodes.append({"name": n, "address": ssh_hosts.addresses[n], "env": {"PATH": standin.node_path(tools), "HF_HOME": str(cache)}})
    return ssh_hosts.write_inventory(tmp / "inv.yaml", hardware="b300", engine="vllm", names=ssh_hosts.names[:2], extra={"nodes": nodes})


def _cli(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(state), "COLUMNS": "250", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "k3launch", *args], capture_output=True, text=True, env=env, timeout=180)


@pytest.mark.e2e
@pytest.mark.ssh
def test_doctor_on_ssh_hosts_passes_then_names_each_fault(ssh_hosts: Hosts, tmp_path: Path) -> None:
    n1, n2 = ssh_hosts.names[:2]
    sel = ("--strategy", "multi_node_tp", "--nodes", "2", "--port-base", "24000")
    inv = _inventory(ssh_hosts, tmp_path / "good", {}, {})
    r = _cli("doctor", "-i", str(inv), *sel, "--bandwidth", "--json", state=tmp_path / "state")
    got = {(c["node"], c["name"]): c for c in json.loads(r.stdout)["checks"]}
    memlock = ssh_hosts.ssh(n1, "ulimit -l").stdout.strip()  # the hosts' real limit (a builtin: no stand-in)
    for n in (n1, n2):
        for name in (
            "runtime",
            "vllm-version",
            "gpus",
            "gpu-procs",
            "ecc",
            "persistence",
            "hcas",
            "peermem",
            "nic",
            "mtu",
            "clock",
            "weights",
            "disk",
            "ports",
            "bandwidth",
        ):
            assert got[(n, name)]["status"] == "pass", (n, name, got[(n, name)])
        assert got[(n, "memlock")]["status"] == ("pass" if memlock == "unlimited" else "fail"), got[(n, "memlock")]
    assert got[(n1, "bandwidth-fabric")]["status"] == "pass" and "48.5 GB/s" in got[(n1, "bandwidth-fabric")]["detail"]
    assert r.returncode == (0 if memlock == "unlimited" else 1), r.stdout + r.stderr

    faults = {
        n2: {
            "K3S_APPS": "4242 python3 70000",
            "K3S_ECC": 2,
            "K3S_IB_STATE": "Down",
            "K3S_PEERMEM": 0,
            "K3S_MTU": 9000,
            "K3S_CLOCK_OFFSET": 30,
            "K3S_GPUS": 4,
            "K3S_BUSBW": 12.5,
        }
    }
    inv = _inventory(ssh_hosts, tmp_path / "bad", faults, {n2: False})
    r = _cli("doctor", "-i", str(inv), *sel, "--bandwidth", "--json", state=tmp_path / "state")
    assert r.returncode == 1, r.stdout + r.stderr
    got = {(c["node"], c["name"]): c for c in json.loads(r.stdout)["checks"]}
    for name, words in {
        "gpu-procs": "pid 4242",
        "ecc": "GPU 0: 2",
        "hcas": "no HCA port ACTIVE",
        "peermem": "not loaded",
        "mtu": "mtu 9000",
        "clock": "s from the other nodes",
        "gpus": "4 GPU(s)",
        "weights": "not complete",
        "bandwidth": "12.5 GB/s",
    }.items():
        row = got[(n2, name)]
        assert row["status"] == "fail" and words in row["detail"] and (row["hint"] or name == "weights"), (name, row)
    skew = float(got[(n2, "clock")]["detail"].split()[0])  # +30 s, less the round trip's uncertainty
    assert 28.0 < skew <= 30.0, got[(n2, "clock")]
    assert got[(n1, "gpus")]["status"] == "pass" and got[(n1, "weights")]["status"] == "pass" and got[(n1, "clock")]["status"] == "pass"
    text = _cli("doctor", "-i", str(inv), *sel, state=tmp_path / "state")
    assert (
        text.returncode == 1 and "error: model weights missing on " + n2 in text.stderr and "hint: `k3launch weights fetch`" in text.stderr
    )


@pytest.mark.e2e
@pytest.mark.ssh
def test_up_refuses_missing_weights_before_starting_anything(ssh_hosts: Hosts, tmp_path: Path) -> None:
    n1, n2 = ssh_hosts.names[:2]
    inv = _inventory(ssh_hosts, tmp_path, {}, {n2: False})
    t0 = time.monotonic()
    r = _cli(
        "up",
        "-i",
        str(inv),
        "--strategy",
        "multi_node_tp",
        "--nodes",
        "2",
        "--port-base",
        "24100",
        "--name",
        "pf-weights",
        "--json",
        state=tmp_path / "state",
    )
    took = time.monotonic() - t0
    print(f"\n[up refused in {took:.1f}s]")
    err = json.loads(r.stdout.strip().splitlines()[-1])["error"]
    assert r.returncode == 2 and err["code"] == "weights-missing" and n2 in err["message"] and n1 not in err["message"], r.stdout + r.stderr
    assert "k3launch weights fetch" in err["hint"]
    assert not list((tmp_path / "state").rglob("pf-weights*.json"))  # nothing was started, no record
