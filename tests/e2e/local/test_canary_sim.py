"""The correctness canary on a real local P/D deployment: the simulated engine as processes, the real
vllm-router in front (docs/canary.md).

``up`` records the baseline once the deployment serves and ``k3launch canary`` finds every target
agreeing; then the decode is started again under the ``corrupt-pd`` fault (its own argv, env and
directory, plus ``K3LAUNCH_SIM_FAIL``: what a decode with a broken KV path looks like, /health 200
throughout) and the canary exits 1 naming the pairing and the router, while the decode asked
directly still agrees. ``down`` leaves nothing, the baseline included.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import Cli, local_leftovers

pytestmark = [pytest.mark.e2e]

NAME = "canary-pd"
PORT_BASE = 25000


def _healthy(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url}/health did not answer 200 within {timeout}s")


def _restart_with(pid: int, log: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Kill ``pid`` and start it again as it was (argv, environment, directory), plus ``env``."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    was = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
    cwd = os.readlink(f"/proc/{pid}/cwd")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(log, "ab") as out:  # the marker env comes along: `down` finds it as it finds the rest
        return subprocess.Popen(argv, env={**was, **{k.encode(): v.encode() for k, v in env.items()}}, cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _verdicts(out: dict[str, Any]) -> dict[str, str]:
    return {t["target"]: t["outcome"] for t in out["targets"]}


def test_up_records_the_canary_and_a_corrupted_pd_path_is_caught(state_cli: Cli, local_inventory: Path) -> None:
    cli = state_cli
    inv = yaml.safe_load(local_inventory.read_text())
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": "0.5"}
    local_inventory.write_text(yaml.safe_dump(inv))
    r = cli.run("up", "-i", str(local_inventory), "--strategy", "pd_cluster", "--decode-strategy", "tp", "--decode-nodes", "1",
                "--name", NAME, "--port-base", str(PORT_BASE), "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    up = json.loads(r.stdout)
    assert up["canary"]["recorded"] is True and up["canary"]["agree"] is True, up
    assert up["canary"]["message"] == "canary recorded from prefill-0: 4 of 4 target(s) agree"
    baseline = cli.state_dir / "canary" / f"{NAME}.json"
    assert stat.S_IMODE(baseline.stat().st_mode) == 0o600
    rec = cli.record(NAME)
    assert rec["canary"] == up["canary"]

    t0 = time.monotonic()
    r = cli.run("canary", NAME, "--json")
    clean_s = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    clean = json.loads(r.stdout)
    assert _verdicts(clean) == {"prefill-0": "ok", "decode-0": "ok", "prefill-0>decode-0": "ok", "router": "ok"}, clean
    replay_s = max(t["seconds"] for t in clean["targets"])

    decode = next(p for p in rec["plan"]["processes"] if p["id"] == "decode-0")
    proc = _restart_with(int(rec["processes"]["decode-0"]["handle"]), rec["processes"]["decode-0"]["log"],
                         {"K3LAUNCH_SIM_FAIL": "corrupt-pd"})
    try:
        _healthy(f"http://{decode['address']}:{decode['http_port']}")
        _healthy(up["endpoint"])  # vllm-router's /health is 503 until every worker is back
        r = cli.run("canary", NAME)
        assert r.returncode == 1, r.stdout + r.stderr
        rows = {line.split()[0]: line.split()[1] for line in r.stdout.splitlines() if line.startswith("  ") and len(line.split()) > 1}
        assert rows["prefill-0>decode-0"] == "MISMATCH" and rows["router"] == "MISMATCH", r.stdout
        assert rows["prefill-0"] == "ok" and rows["decode-0"] == "ok", r.stdout  # asked directly, the decode prefills itself: right
        assert "prefill-0>decode-0: complete-capital (completion): the answer differs from token 1 on" in r.stdout
        assert 'prompt:   "The capital of France is"' in r.stdout and "expected: [" in r.stdout and "got:      [" in r.stdout
        assert "2 of 4 target(s) gave the recorded answers" in r.stdout
        for p in rec["plan"]["processes"]:  # /health 200 everywhere: only the canary sees it
            _healthy(f"http://{p['address']}:{p['http_port']}", timeout=2)
    finally:
        d = cli.json("down", NAME, timeout=120)
        proc.wait(10)
    assert d["clean"] is True, d
    assert not baseline.exists()
    assert local_leftovers(rec) == ({}, [])
    print(f"\n[canary on a local P/D sim deployment: `k3launch canary` {clean_s:.2f}s end to end, "
          f"the slowest target {replay_s:.2f}s for {len(clean['baseline']['requests'])} requests]")


def test_up_no_canary_records_none_and_canary_says_how_to_record_one(state_cli: Cli, local_inventory: Path) -> None:
    cli = state_cli
    name = "canary-off"
    r = cli.run("up", "-i", str(local_inventory), "--strategy", "single_node_tp", "--name", name, "--port-base", str(PORT_BASE + 40),
                "--no-canary", "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "canary" not in json.loads(r.stdout) and cli.record(name)["canary"] is None
    try:
        r = cli.run("canary", name)
        assert r.returncode == 2 and f"error: {name} has no canary baseline" in r.stderr, r.stderr
        assert f"hint: `k3launch canary {name} --rebaseline` records its answers now" in r.stderr
        r = cli.run("canary", name, "--rebaseline", "--json")
        out = json.loads(r.stdout)
        assert r.returncode == 0 and out["recorded"] is True and [t["target"] for t in out["targets"]] == ["serve-0"], out
    finally:
        assert cli.json("down", name, timeout=120)["clean"] is True
    assert not (cli.state_dir / "canary" / f"{name}.json").exists()
