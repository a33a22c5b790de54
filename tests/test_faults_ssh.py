"""Faults over real sshd hosts (tests/infra) with the simulated engine; every test ends with nothing
of its deployment running anywhere (checked in this machine's /proc, which the hosts share) and
its planned ports free.

A rank dying during load, sshd killed mid-`up`, a host that never answers, Ctrl-C during `up`,
`down` with a host unreachable, a second `up` onto held nodes, `--dry-run`, an engine that
generates no tokens. Loads are made long (K3LAUNCH_SIM_LOAD_S=30) where `up` must fail *during*
the load: a failure reported long before the load could finish proves fail-fast. Root needed
(skipped otherwise); every subprocess bounded; hosts stopped or isolated here are restored in
`finally`.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from e2e_helpers import Cli, Recording, cleanup, host_netns, inventory, leftovers, lib_down, lib_up, netns, processes, session

if TYPE_CHECKING:
    from sshhosts import Hosts

pytest_plugins = ["sshhosts"]
pytestmark = [pytest.mark.e2e, pytest.mark.ssh]

SLOW_LOAD = {"K3LAUNCH_SIM_LOAD_S": "30"}
TP3 = ["--strategy", "multi_node_tp", "--nodes", "3"]


def test_rank_exits_during_load_fails_fast_naming_it(ssh_hosts: Hosts, tmp_path: Path) -> None:
    env = {**SLOW_LOAD, "K3LAUNCH_SIM_FAIL": "exit-during-load", "K3LAUNCH_SIM_FAIL_PROCESS": "serve-2", "K3LAUNCH_SIM_FAIL_AFTER_S": "1.5"}
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml", env=env)
    cli, name = Cli(tmp_path / "state"), f"fault-exit-{session(ssh_hosts)[0]}"
    args = ["-i", str(inv), *TP3, "--port-base", str(22000 + session(ssh_hosts)[1]), "--name", name]
    planned = cli.plan_of(*args)
    try:
        t0 = time.monotonic()
        r = cli.run("up", *args, timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 2, r.stdout + r.stderr
        error = next(ln for ln in r.stderr.splitlines() if ln.startswith("error: "))
        # the rank that died first is named (not the head that lost it afterwards), with its node
        assert error.startswith(f"error: serve-2 (serve, node rank 2) on {ssh_hosts.names[2]} exited with code 1 during"), error
        assert "uncorrectable ECC error" in r.stdout  # its last log lines are shown
        assert took < 15, f"up took {took:.1f}s to report a rank that died 1.5s into a 30s load"
        assert "failed" in r.stdout.split("teardown")[0]  # reported before the teardown began
        assert cli.records() == {}
        assert leftovers(ssh_hosts, planned) == ({}, [])
    finally:
        cleanup(cli, [name])


def test_sshd_killed_mid_up_then_down_after_restart(ssh_hosts: Hosts, tmp_path: Path) -> None:
    a, b, c = ssh_hosts.names[:3]
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml", env=SLOW_LOAD)
    cli, name = Cli(tmp_path / "state"), f"fault-sshd-{session(ssh_hosts)[0]}"
    args = ["-i", str(inv), *TP3, "--port-base", str(22100 + session(ssh_hosts)[1]), "--name", name]
    planned = cli.plan_of(*args)
    try:
        p = cli.start("up", *args, "--connect-timeout", "3")
        cli.wait_started(name, 3, p)
        t_stop = time.monotonic()
        try:
            ssh_hosts.stop_host(b)
            r = Cli.wait(p, 60, ["up"])
            took = time.monotonic() - t_stop
        finally:
            ssh_hosts.start_host(b)  # the session's hosts must be whole again, whatever happened
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"error: node {b} stopped answering" in r.stderr, r.stderr
        assert took < 15, f"{took:.1f}s from sshd killed to up failing"
        rec = cli.record(name)
        assert rec["state"] == "down-incomplete" and rec["unreachable"] == [b], (rec["state"], rec["unreachable"])
        if ssh_hosts.mode == "netns":  # the reachable rest was torn down: nothing left in a's or c's namespace
            ns = {host_netns(ssh_hosts, a), host_netns(ssh_hosts, c)}
            assert not [proc for pid, proc in processes(name).items() if netns(pid) in ns]
        d = cli.json("down", name)
        assert d["clean"] is True, d
        assert cli.records() == {}
        assert leftovers(ssh_hosts, planned) == ({}, [])
    finally:
        cleanup(cli, [name])


def test_host_that_never_answers(ssh_hosts: Hosts, tmp_path: Path) -> None:
    """Isolated host: doctor fails within the connect timeout naming it, nothing starts; with
    --skip-doctor the start fails the same way and what started elsewhere is torn down."""
    c = ssh_hosts.names[2]
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml")
    cli, name = Cli(tmp_path / "state"), f"fault-silent-{session(ssh_hosts)[0]}"
    args = ["-i", str(inv), *TP3, "--port-base", str(22200 + session(ssh_hosts)[1]), "--name", name, "--connect-timeout", "3"]
    planned = cli.plan_of(*args[:-2])
    ssh_hosts.isolate(c)
    try:
        t0 = time.monotonic()
        err = cli.json("up", *args, timeout=60)["error"]
        took = time.monotonic() - t0
        assert err["code"] == "unreachable" and f"cannot reach {c}:" in err["message"], err
        assert took < 12, f"{took:.1f}s with a 3s connect timeout"
        assert cli.records() == {} and processes(name) == {}

        r = cli.run("up", *args, "--skip-doctor", timeout=60)
        assert r.returncode == 2 and f"on {c}: {c}: cannot connect" in r.stderr, r.stderr
        rec = cli.record(name)  # a and b were started, then torn down; c is kept for the next down
        assert rec["state"] == "down-incomplete" and rec["unreachable"] == [c]
        assert processes(name) == {}
    finally:
        ssh_hosts.heal(c)
    try:
        assert cli.json("down", name)["clean"] is True
        assert leftovers(ssh_hosts, planned) == ({}, [])
    finally:
        cleanup(cli, [name])


def test_ctrl_c_during_up_tears_down(ssh_hosts: Hosts, tmp_path: Path) -> None:
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml", env=SLOW_LOAD)
    cli, name = Cli(tmp_path / "state"), f"fault-sigint-{session(ssh_hosts)[0]}"
    args = ["-i", str(inv), *TP3, "--port-base", str(22300 + session(ssh_hosts)[1]), "--name", name]
    planned = cli.plan_of(*args)
    try:
        p = cli.start("up", *args)
        cli.wait_started(name, 3, p)
        assert len(processes(name)) >= 3
        os.kill(p.pid, signal.SIGINT)
        r = Cli.wait(p, 60, ["up"])
        assert r.returncode == 130, r.stdout + r.stderr
        assert "interrupted" in r.stderr
        assert cli.records() == {}
        assert leftovers(ssh_hosts, planned) == ({}, [])
    finally:
        cleanup(cli, [name])


def test_down_with_host_unreachable_then_again_after_heal(ssh_hosts: Hosts, tmp_path: Path) -> None:
    c = ssh_hosts.names[2]
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml")
    cli, name = Cli(tmp_path / "state"), f"fault-down-{session(ssh_hosts)[0]}"
    try:
        up = cli.json("up", "-i", str(inv), *TP3, "--port-base", str(22400 + session(ssh_hosts)[1]), "--name", name)
        assert up["state"] == "ready", up
        rec = cli.record(name)
        ssh_hosts.isolate(c)
        try:
            t0 = time.monotonic()
            r = cli.run("down", name, "--connect-timeout", "3", "--json")
            took = time.monotonic() - t0
            assert r.returncode == 1, r.stdout + r.stderr
            d = json.loads(r.stdout)
            assert d["clean"] is False and list(d["unreachable"]) == [c] and d["leftovers"] == {}, d
            assert took < 15, f"down took {took:.1f}s with a 3s connect timeout"
            kept = cli.record(name)
            assert kept["state"] == "down-incomplete" and kept["unreachable"] == [c]
            if ssh_hosts.mode == "netns":  # a and b are clean; what remains is c's
                ns_c = host_netns(ssh_hosts, c)
                assert all(netns(pid) == ns_c for pid in processes(name)), processes(name)
        finally:
            ssh_hosts.heal(c)
        d = cli.json("down", name)
        assert d["clean"] is True, d
        assert cli.records() == {}
        assert leftovers(ssh_hosts, rec) == ({}, [])
    finally:
        cleanup(cli, [name])


def test_second_up_on_held_nodes_refused_unless_force(ssh_hosts: Hosts, tmp_path: Path) -> None:
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml")
    cli = Cli(tmp_path / "state")
    first, second = f"held-a-{session(ssh_hosts)[0]}", f"held-b-{session(ssh_hosts)[0]}"
    try:
        assert cli.json("up", "-i", str(inv), "--strategy", "multi_node_tp", "--nodes", "2", "--port-base", str(22500 + session(ssh_hosts)[1]), "--name", first)["state"] == "ready"
        again = ["up", "-i", str(inv), "--strategy", "multi_node_tep", "--nodes", "2", "--port-base", str(22600 + session(ssh_hosts)[1]), "--name", second]
        err = cli.json(*again)["error"]
        assert err["code"] == "nodes-in-use" and first in err["message"] and ssh_hosts.names[0] in err["message"], err
        assert "--force" in err["hint"]
        assert cli.run(*again).returncode == 2
        assert set(cli.records()) == {first} and processes(second) == {}

        assert cli.json(*again, "--force")["state"] == "ready"
        snap = cli.json("status", first)  # the first deployment is untouched
        assert snap["state"] == "ready" and all(p["alive"] for p in snap["processes"])
        recs = [cli.record(first), cli.record(second)]
        for n in (second, first):
            assert cli.json("down", n)["clean"] is True
        for rec in recs:
            assert leftovers(ssh_hosts, rec) == ({}, [])
    finally:
        cleanup(cli, [first, second])


def test_dry_run_prints_exactly_what_up_runs_and_starts_nothing(ssh_hosts: Hosts, tmp_path: Path) -> None:
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml")
    cli, name = Cli(tmp_path / "state"), f"dry-{session(ssh_hosts)[0]}"
    args = ["-i", str(inv), "--strategy", "multi_node_dep", "--nodes", "2", "--port-base", str(22700 + session(ssh_hosts)[1]), "--name", name]
    planned = cli.plan_of(*args)
    try:
        r = cli.run("up", *args, "--dry-run")
        assert r.returncode == 0, r.stderr
        hosts = {h["name"]: h["address"] for h in planned["plan"]["hosts"]}
        for p in planned["plan"]["processes"]:
            section = _section(r.stdout, f"{p['node']} ({hosts[p['node']]})")
            assert f"K3LAUNCH_PROCESS={p['id']}" in section, (p["id"], section)
            argv = p["argv"]
            for flag, value in itertools.pairwise(argv):
                if flag.startswith("--") and not value.startswith("--"):
                    assert f"{flag} {shlex.quote(value)}" in section, (p["id"], flag)
        steps = cli.json("up", *args, "--dry-run")["steps"]
        assert [(s["step"], s["node"]) for s in steps] == [("engines", ssh_hosts.names[0]), ("engines", ssh_hosts.names[1]), ("router", "login")]
        assert processes(name) == {} and cli.records() == {}
        assert leftovers(ssh_hosts, planned, wait_s=0) == ({}, [])

        # exactly: what `up` then runs on each node is `bash -c` of the printed script
        runners: list[Recording] = []

        def wrap(r: object) -> Recording:
            runners.append(Recording(r))
            return runners[-1]

        rec, _, _ = lib_up(inv, cli.state_dir, 22700 + session(ssh_hosts)[1], wrap=wrap, name=name, strategy="multi_node_dep", nodes=2)
        assert rec.state == "ready"
        ran = sorted((node, cmd) for rr in runners for node, cmd in rr.calls if cmd.startswith("bash -c "))
        assert ran == sorted((s["node"], "bash -c " + shlex.quote(s["script"])) for s in steps)
        assert lib_down(name, cli.state_dir).clean
        assert leftovers(ssh_hosts, planned) == ({}, [])
    finally:
        cleanup(cli, [name])


def test_engine_generating_no_tokens_fails_at_completion(ssh_hosts: Hosts, tmp_path: Path) -> None:
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml", env={"K3LAUNCH_SIM_FAIL": "zero-tokens"})
    cli, name = Cli(tmp_path / "state"), f"fault-zero-{session(ssh_hosts)[0]}"
    args = ["-i", str(inv), "--strategy", "multi_node_tep", "--nodes", "2", "--port-base", str(22800 + session(ssh_hosts)[1]), "--name", name]
    planned = cli.plan_of(*args)
    try:
        r = cli.run("up", *args, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "error: completion stage:" in r.stderr and "no tokens" in r.stderr, r.stderr
        assert "serve-0 healthy (1/1)" in r.stdout  # it got past health: the failure is the completion's
        assert cli.records() == {}
        assert leftovers(ssh_hosts, planned) == ({}, [])
    finally:
        cleanup(cli, [name])


def _section(text: str, header: str) -> str:
    """The dry run's block under the rule titled ``header`` (up to the next rule)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if header in ln and "─" in ln)
    end = next((i for i in range(start + 1, len(lines)) if "─" in lines[i] and " — " in lines[i]), len(lines))
    return "\n".join(lines[start + 1 : end])
