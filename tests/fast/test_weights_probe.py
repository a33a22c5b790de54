"""``k3launch weights probe``: each node's read throughput of the disk its weights load from.

Command construction and parsing against the FakeRunner (a hostile path stays one word); the
node-side program run for real on this machine (small files), including its fall-back when
O_DIRECT is refused (a ``dd`` that refuses ``iflag=direct`` first on PATH). The CLI end to end:
test_weights_probe_e2e.py (local inventory), test_weights_probe_ssh.py (sshd test hosts).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from paths import ROOT

from k3launch import api
from k3launch.deploy.ssh import probe as pr
from k3launch.deploy.ssh.probe import MIB
from k3launch.errors import K3Error
from k3launch.models.plan import Host
from k3launch.models.weights import Probe, path_error, probes_json, read_probes
from k3launch.testing import FakeRunner
from k3launch.transport.fleet import Fleet

if TYPE_CHECKING:
    pass


HOST = Host(name="n1", address="127.0.0.1", role="serve", gpus=0, placeholder=False, runtime="bare")
HOSTILE = "/tmp/x y'$(touch PWNED);`touch PWNED2`\"&"


def run_real(cmd: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=cwd, timeout=60, env=env)


def test_the_command_quotes_every_value_and_a_hostile_directory_is_probed_as_itself(tmp_path: Path) -> None:
    d = tmp_path / HOSTILE.lstrip("/")
    d.mkdir(parents=True)
    cmd = pr.probe_command(HOST, [str(d)], 2 * MIB, 10)
    r = run_real(cmd, tmp_path)
    got = pr.parse("n1", r.stdout, [str(d)])
    assert r.returncode == 0 and got.ok and got.dir == str(d), r.stdout + r.stderr
    assert got.bytes == got.written == 2 * MIB and got.method == "o_direct"  # ext4 here: O_DIRECT works
    assert not list(tmp_path.rglob("PWNED*")) and list(d.iterdir()) == []  # nothing ran from the name; the file is gone


def test_the_default_directory_is_where_the_engine_looks_then_the_hub_cache() -> None:
    plan = api.plan(None)  # the bundled local inventory: a bare engine, a hub model
    host = next(h for h in plan.hosts if h.name == plan.processes[0].node)
    dirs = pr.directories(plan, host, None)
    assert dirs[0].endswith("/hub/models--moonshotai--Kimi-K3") and dirs[1].endswith("/hub"), dirs
    assert pr.directories(plan, host, "/data/w") == ["/data/w"]
    assert "'~/x y'" not in pr.probe_command(host, ["~/x y"], MIB, 5) and '"$HOME"/' in pr.probe_command(host, ["~/x y"], MIB, 5)


def test_bytes_are_whole_mib_and_the_time_bound_is_in_the_command() -> None:
    cmd = pr.probe_command(HOST, ["/w"], 256 * MIB + 5, 42.7)
    assert " k3launch-probe 256 42 python3 /w 2>&1" in cmd, cmd


def test_parse_reads_a_fallback_a_timed_out_read_and_failures() -> None:
    out = ("K3P dir=/w d\nK3P written=104857600 write_ns=2000000000 write_rc=0\nK3P resident=4096\n"
           "K3P method=fadvise bytes=52428800 read_ns=1000000000 read_rc=124\n")
    p = pr.parse("n1", out, ["/w d"])
    assert (p.dir, p.method, p.bytes, p.read_s, p.resident, p.timed_out) == ("/w d", "fadvise", 52428800, 1.0, 4096, True)
    assert p.ok and round(p.read_mbps) == 52 and round(p.write_mbps) == 52
    missing = pr.parse("n1", "K3P error=nodir\n", ["/a", "/b"])
    assert missing.code == "probe-path" and missing.error == "no directory /a or /b" and not missing.ok
    ro = pr.parse("n1", "K3P dir=/ro\nK3P error=unwritable\n", ["/ro"])
    assert ro.code == "probe-path" and ro.error == "cannot create a file in /ro"
    broken = pr.parse("n1", "bash: timeout: command not found\n", ["/w"])
    assert broken.code == "" and "did not run: bash: timeout: command not found" in broken.error
    bad_read = pr.parse("n1", "K3P dir=/w\nK3P method=cached bytes=0 read_ns=5 read_rc=1\nK3P error=read dd: Input/output error\n", ["/w"])
    assert not bad_read.ok and bad_read.error == "read dd: Input/output error"


def test_probe_over_a_fleet_reports_per_node_and_a_path_error_is_one_line_with_a_hint(tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "name: probe-test\nbackend: ssh\nhardware: b300\nengine: sim\ndefaults: {runtime: bare}\n"
        "nodes:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2}\n  - {name: c, address: 10.0.0.3}\n"
        "router: {node: login, address: 127.0.0.1}\n"
    )
    plan = api.plan(inv, strategy="multi_node_tp", nodes=3)
    good = "K3P dir=/w\nK3P written=1048576 write_ns=1000000 write_rc=0\nK3P method=o_direct bytes=1048576 read_ns=1000000 read_rc=0\n"
    remote = FakeRunner(respond=[(r"10\.0\.0\.2|k3launch-probe", (0, good, ""))], fail_on=["10.0.0.3"])
    fleet = Fleet.for_plan(plan, remote, FakeRunner())
    rows = {p.node: p for p in pr.probe(plan, fleet, "/w 'q'", 8 * MIB, 30)}
    assert rows["a"].ok and rows["b"].ok and round(rows["a"].read_mbps) == 1049
    assert not rows["c"].ok and rows["c"].code == "" and "timed out" in rows["c"].error
    assert all("'/w '\"'\"'q'\"'\"''" in c for c in remote.commands()), remote.commands()  # the path: one quoted word
    assert all(c.timeout == 90 for c in remote.calls)  # bounded: twice the bound plus a margin
    err = path_error([Probe("a", "/x", error="no directory /x", code="probe-path"), Probe("b", "/x", error="no directory /x", code="probe-path")])
    assert err is not None and err.code == "probe-path" and "\n" not in err.message and "(and 1 more node(s))" in err.message
    assert "--path DIR" in err.hint and path_error(list(rows.values())) is None


def test_saved_probes_round_trip_and_slurm_refuses(tmp_path: Path) -> None:
    rows = [Probe("a", "/w", "o_direct", 10, 1.0, 10, 1.0), Probe("b", "/w", error="unreachable")]
    text = probes_json("inv", rows, 1.0)
    assert read_probes(text) == rows and json.loads(text)["nodes"][0]["read_mbps"] == 0.0  # 10 B/s
    for bad in ('{"nodes": [{"nope": 1}]}', '{"nodes": [1]}', '[]', '{"nodes": [{"node": "a", "dir": "/w", "bytes": "10"}]}'):
        with pytest.raises(ValueError):
            read_probes(bad)
    slurm = ROOT / "inventories" / "slurm-b200.yaml"
    with pytest.raises(K3Error) as exc:
        api.weights_probe(api.plan(slurm), slurm)
    assert exc.value.code == "not-supported" and "weights probe" in exc.value.message


def test_without_o_direct_the_page_cache_is_dropped_and_the_method_says_so(tmp_path: Path) -> None:
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "dd").write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = iflag=direct ] && { echo "dd: failed to open: Invalid argument" >&2; exit 1; }; done\n'
                             f'exec {shutil.which("dd")} "$@"\n')
    (shim / "dd").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}
    r = run_real(pr.probe_command(HOST.model_copy(update={"python": sys.executable}), [str(tmp_path)], 2 * MIB, 10), tmp_path, env)
    got = pr.parse("n1", r.stdout, [str(tmp_path)])
    assert got.ok and got.method == "fadvise" and got.bytes == 2 * MIB, r.stdout + r.stderr
    r = run_real(pr.probe_command(HOST.model_copy(update={"python": "/nonexistent/python"}), [str(tmp_path)], 2 * MIB, 10), tmp_path, env)
    got = pr.parse("n1", r.stdout, [str(tmp_path)])
    assert got.ok and got.method == "nocache", r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # every probe file removed
