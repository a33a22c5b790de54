"""Fault corpus end to end: real simulated deployments on this machine -- on their own loopback
addresses (127.0.78.x) and their own state dir, so they never meet a user's deployment -- whose
record is then corrupted, deleted or orphaned, an ``up`` killed, a ``down`` interrupted; ``down``
must still stop everything: after each case the count of processes carrying the deployment's
marker and of its ports still listening must be 0. The in-process cases: test_faults_state.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import CLI, local_leftovers
from paths import ROOT

# ----------------------------------------------------------------------------- end to end (local)
FAST = {"K3LAUNCH_SIM_LOAD_S": "0.3", "K3LAUNCH_SIM_TTFT_MS": "2", "K3LAUNCH_SIM_ITL_MS": "1"}


def _inventory(tmp: Path, slot: int) -> Path:
    """The bundled local inventory on this test's own loopback addresses."""
    inv = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    inv["nodes"] = [{"name": f"t-{i}", "address": f"127.0.78.{10 * slot + i}"} for i in (1, 2)]
    inv["router"] = {"node": "login", "address": f"127.0.78.{10 * slot}"}
    inv["defaults"]["env"] = FAST
    path = tmp / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def _cli(state: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(state), "COLUMNS": "250", "NO_COLOR": "1"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def _up(tmp: Path, name: str, slot: int) -> tuple[Path, Path, dict[str, Any]]:
    inv, state = _inventory(tmp, slot), tmp / "state"
    r = _cli(state, "up", "-i", str(inv), "--name", name, "--port-base", str(23000 + 100 * slot), "--strategy", "multi_node_dep",
             "--nodes", "2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = {"name": name, "plan": json.loads((state / "deployments" / f"{name}.json").read_text())["plan"]}
    assert local_leftovers(rec, wait_s=0)[0], "the deployment should run"
    return inv, state, rec


CORRUPTIONS = {
    "truncated": lambda text: text[: len(text) // 3],
    "garbage": lambda text: "\x00\x01 not json at all",
    "empty": lambda text: "",
    "wrong-shape": lambda text: json.dumps({"name": "x", "inventory": json.loads(text)["inventory"], "state": 7}),
    "deleted": None,
}


@pytest.mark.e2e
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_down_stops_everything_whatever_became_of_the_record(tmp_path: Path, kind: str) -> None:
    slot = list(CORRUPTIONS).index(kind) + 1
    name = f"fs-{kind}"
    inv, state, rec = _up(tmp_path, name, slot)
    path = state / "deployments" / f"{name}.json"
    try:
        spoil = CORRUPTIONS[kind]
        spoiled = None if spoil is None else spoil(path.read_text())
        if spoiled is None:
            path.unlink()
        else:
            path.write_text(spoiled)
        st = _cli(state, "status", name, "--json")
        assert st.returncode == 2 and "Traceback" not in st.stdout + st.stderr
        r = _cli(state, "down", name, "-i", str(inv), "--grace", "2", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        out = json.loads(r.stdout)
        assert out["clean"] and len(out["stopped"]) == len(rec["plan"]["processes"]) >= 2, out
        procs, ports = local_leftovers(rec)
        print(f"{kind}: {len(out['stopped'])} stopped, {len(procs)} process(es) and {len(ports)} port(s) left")
        assert (procs, ports) == ({}, []), (procs, ports)
        if spoiled is not None:
            assert out["set_aside"] and Path(out["set_aside"]).read_text() == spoiled, out  # kept, never deleted
        again = _cli(state, "down", name, "-i", str(inv), "--json")
        assert again.returncode == 0 and json.loads(again.stdout)["stopped"] == []  # idempotent
        assert not list(state.rglob("*.lock"))
    finally:
        _cli(state, "down", name, "-i", str(inv), "--grace", "1")


@pytest.mark.e2e
def test_killed_up_lists_as_interrupted_and_down_cleans_up(tmp_path: Path) -> None:
    inv, state = _inventory(tmp_path, 7), tmp_path / "state"
    name = "fs-killed"
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(state), "K3LAUNCH_SIM_LOAD_S": "30"}
    inv_data = yaml.safe_load(inv.read_text())
    inv_data["defaults"]["env"] = {**FAST, "K3LAUNCH_SIM_LOAD_S": "30"}  # long load: `up` is killed while it waits
    inv.write_text(yaml.safe_dump(inv_data))
    p = subprocess.Popen([*CLI, "up", "-i", str(inv), "--name", name, "--port-base", "23700", "--strategy", "multi_node_dep", "--nodes", "2"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    path = state / "deployments" / f"{name}.json"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if path.exists() and all(pr.get("started") for pr in json.loads(path.read_text()).get("processes", {}).values()) \
                    and json.loads(path.read_text()).get("processes"):
                break
            time.sleep(0.2)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        rec = {"name": name, "plan": json.loads(path.read_text())["plan"]}
        assert local_leftovers(rec, wait_s=0)[0], "the engines outlive the killed launcher"
        listed = json.loads(_cli(state, "list", "--json").stdout)
        assert [(d["name"], d["state"]) for d in listed] == [(name, "interrupted")]
        r = _cli(state, "down", name, "--grace", "2", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["clean"], r.stdout + r.stderr
        assert local_leftovers(rec) == ({}, [])
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        _cli(state, "down", name, "-i", str(inv), "--grace", "1")


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
@pytest.mark.parametrize("after_s", [0.15, 0.3, 0.5])  # while importing, while scanning, while stopping (or after)
def test_down_interrupted_at_any_moment_is_finished_by_the_next_down(tmp_path: Path, sig: signal.Signals, after_s: float) -> None:
    """Ctrl-C (or a kill) while `down` stops the processes: one line at most, never a traceback;
    the record stays (interrupted, or down-incomplete) and the next `down` leaves nothing."""
    slot = {0.15: 8, 0.3: 9, 0.5: 10}[after_s] + (3 if sig == signal.SIGKILL else 0)
    name = f"fs-down-{slot}"
    inv, state, rec = _up(tmp_path, name, slot)
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(state), "COLUMNS": "250", "NO_COLOR": "1"}
    try:
        p = subprocess.Popen([*CLI, "down", name, "--grace", "5"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        time.sleep(after_s)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
        assert "Traceback" not in out + err, err
        # -SIGINT: Python re-raised the signal on its way out after printing the line; the shell shows 130 either way
        assert p.returncode in (0, 130, -signal.SIGINT, -signal.SIGKILL), (p.returncode, out, err)
        if p.returncode in (130, -signal.SIGINT):
            assert err.strip().splitlines()[-1].startswith("error: interrupted") or "interrupted" in err, err
        again = _cli(state, "down", name, "--grace", "2", "--json")
        assert again.returncode == 0 and json.loads(again.stdout)["clean"], again.stdout + again.stderr
        procs, ports = local_leftovers(rec)
        print(f"{sig.name} at {after_s}s: first down exit {p.returncode}; left after the second: {len(procs)} process(es), {len(ports)} port(s)")
        assert (procs, ports) == ({}, []), (procs, ports)
        assert not list(state.rglob("*.lock"))
    finally:
        _cli(state, "down", name, "-i", str(inv), "--grace", "1")
