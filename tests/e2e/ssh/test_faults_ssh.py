"""Faults over real sshd hosts (tests/infra) with the simulated engine; every test ends with nothing
of its deployment running anywhere (checked in this machine's /proc, which the hosts share) and
its planned ports free.

A rank dying during load, sshd killed mid-`up`, a host that never answers, Ctrl-C during `up`,
`down` with a host unreachable, a second `up` onto held nodes, `--dry-run`, an engine that
generates no tokens, and a host's network cut at each stage of `up`, `status` and `down` (the
cut-* tests: declared unreachable within the connect timeout plus one poll, kept in the record,
finished by the next `down`). Loads are made long (K3LAUNCH_SIM_LOAD_S=30) where `up` must fail
*during* the load: a failure reported long before the load could finish proves fail-fast. Root
needed (skipped otherwise); every subprocess bounded; hosts stopped or isolated here are
restored in `finally`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from e2e_helpers import (
    Cli,
    CutOn,
    Recording,
    cleanup,
    host_netns,
    inventory,
    leftovers,
    lib_down,
    lib_fleet,
    lib_up,
    netns,
    processes,
    session,
    ssh_fleet,
    wait_for_record,
)

from k3launch.deploy.ssh.doctor import doctor
from k3launch.deploy.ssh.launch import POLL_S, Launch
from k3launch.deploy.ssh.observe import observe
from k3launch.deploy.ssh.teardown import teardown
from k3launch.deploy.state import StateStore
from k3launch.models.record import SshRecord, Stage, Status
from k3launch.models.reports import LaunchFailed, TeardownReport

if TYPE_CHECKING:
    from sshhosts import Hosts

pytestmark = [pytest.mark.e2e, pytest.mark.ssh]

SLOW_LOAD = {"K3LAUNCH_SIM_LOAD_S": "30"}
TP3 = ["--strategy", "multi_node_tp", "--nodes", "3"]

# Network cuts (the cut-* tests). The promise: a host that stops answering at any moment is
# declared unreachable within --connect-timeout plus one poll interval. Asserted with three times
# that, so that a loaded 2-core machine does not flake; the measured figures are printed (-s).
CUT_CT = 2.0  # --connect-timeout of these tests
CUT_BOUND_S = 3 * (CUT_CT + POLL_S)
# After the failure `up` tears down the reachable nodes: SIGTERM (the simulated engines exit at
# once), then the verification, which waits up to 5 s for ports to close.
TEARDOWN_MARGIN_S = 30.0
CLI_START_S = 5.0  # a `k3launch` process's own start (interpreter, imports) on a loaded machine


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
        # each run of `up` (a dry one too) makes its deployment a new id (models.identity): the dry run's stands for up's
        dry_id = re.search(r"K3LAUNCH_ID=([0-9a-f]{8}-[0-9a-f]{6})", steps[0]["script"])
        assert dry_id is not None and rec.deployment_id and dry_id.group(1).split("-")[0] == rec.deployment_id.split("-")[0]
        assert ran == sorted((s["node"], "bash -c " + shlex.quote(s["script"].replace(dry_id.group(1), rec.deployment_id))) for s in steps)
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


# ---- a host's network cut at each stage of up, status and down -------------------------------
def _bounded(fn: Callable[[], object], within: float) -> object:
    """fn()'s result or exception, run in a thread; fails when it is still waiting after ``within`` s
    (the thread is left to finish on its own once the test heals the host)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # handed back to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    assert not t.is_alive(), f"still waiting {within:g}s after it began"
    return out[0]


def _cut(ssh_hosts: Hosts, node: str, match: Callable[[str], bool], skip: int = 0) -> tuple[list[CutOn], Callable[[object], CutOn]]:
    """A wrap= for ssh_fleet that cuts ``node`` at the chosen command, and the list that receives it."""
    made: list[CutOn] = []

    def wrap(r: object) -> CutOn:
        made.append(CutOn(r, ssh_hosts, node, match, skip))
        return made[0]

    return made, wrap


def _finish_after_heal(cli: Cli, ssh_hosts: Hosts, name: str, rec: Mapping[str, Any]) -> None:
    """The network is back: a second `down` finishes with nothing of the deployment left."""
    d = cli.json("down", name)
    assert d["clean"] is True, d
    assert cli.records() == {}
    assert leftovers(ssh_hosts, rec) == ({}, [])


def test_cut_during_load_of_up(ssh_hosts: Hosts, tmp_path: Path) -> None:
    c = ssh_hosts.names[2]
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml", env=SLOW_LOAD)
    cli, name = Cli(tmp_path / "state"), f"cut-load-{session(ssh_hosts)[0]}"
    args = ["-i", str(inv), *TP3, "--port-base", str(22900 + session(ssh_hosts)[1]), "--name", name]
    planned = cli.plan_of(*args)
    try:
        p = cli.start("up", *args, "--connect-timeout", f"{CUT_CT:g}")
        cli.wait_started(name, 3, p)  # every engine loads (30 s): `up` polls them
        t_cut = time.monotonic()
        try:
            ssh_hosts.isolate(c)
            t_failed, _ = wait_for_record(cli, name, lambda r: r["state"] != "starting", 120, p)
            r = Cli.wait(p, 120, ["up"])
            t_end = time.monotonic()
            kept = cli.record(name)
            if ssh_hosts.mode == "netns":  # the reachable rest was torn down: what remains is c's
                ns_c = host_netns(ssh_hosts, c)
                assert all(netns(pid) == ns_c for pid in processes(name)), processes(name)
        finally:
            ssh_hosts.heal(c)
        detect, took = t_failed - t_cut, t_end - t_cut
        print(
            f"\ncut during the load of up: {c} declared unreachable {detect:.2f}s after the cut began, up ended after {took:.2f}s "
            f"(connect timeout {CUT_CT:g}s, poll {POLL_S:g}s; bound {CUT_BOUND_S:g}s)"
        )
        assert detect <= CUT_BOUND_S, f"{detect:.1f}s from the cut to up failing"
        assert took <= CUT_BOUND_S + TEARDOWN_MARGIN_S, f"{took:.1f}s from the cut to up ending"
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"error: node {c} stopped answering" in r.stderr and "keepalives unanswered" in r.stderr, r.stderr
        teardown_lines = [ln for ln in r.stdout.splitlines() if " teardown " in ln]
        assert c in teardown_lines[-1] and f"k3launch down {name}" in teardown_lines[-1], r.stdout  # the host it could not reach
        assert kept["state"] == "down-incomplete" and kept["unreachable"] == [c], (kept["state"], kept["unreachable"])
        _finish_after_heal(cli, ssh_hosts, name, planned)
    finally:
        cleanup(cli, [name])


def test_cut_as_up_starts_the_engines(ssh_hosts: Hosts, tmp_path: Path) -> None:
    """One node's start script meets a silent host: the start's own timeout is minutes (a host
    that answers may be pulling an image), the loss must still be noticed in seconds."""
    c = ssh_hosts.names[2]
    inv_path = inventory(ssh_hosts, tmp_path / "inv.yaml", env=SLOW_LOAD)
    name = f"cut-start-{session(ssh_hosts)[0]}"
    cli, store = Cli(tmp_path / "state"), StateStore(tmp_path / "state")
    inv, plain = lib_fleet(inv_path, 22920 + session(ssh_hosts)[1], name=name, strategy="multi_node_tp", nodes=3)
    plain.close()  # (never connected: only its plan is used)
    plan = plain.plan
    made, wrap = _cut(ssh_hosts, c, lambda cmd: "@@start " in cmd)
    fleet = ssh_fleet(plan, inv.ssh_config, inv.known_hosts, CUT_CT, wrap)
    failed_at: list[float] = []

    def on_stage(stage: Stage, message: str) -> None:
        if stage == Stage.FAILED:
            failed_at.append(time.monotonic())

    try:
        try:
            assert doctor(plan, fleet, []).ok  # connections and shells open, as in `up`
            launch = Launch(
                plan, fleet, store, inventory=str(inv_path), on_stage=on_stage, ssh_config=inv.ssh_config, known_hosts=inv.known_hosts
            )
            got = _bounded(lambda: launch.up(timeout=60), CUT_BOUND_S + TEARDOWN_MARGIN_S + 30)
            t_end = time.monotonic()
            kept = cli.record(name)
        finally:
            fleet.close()
            ssh_hosts.heal(c)
        cut_at = made[0].cut_at
        assert cut_at is not None and failed_at, (cut_at, failed_at)
        detect, took = failed_at[0] - cut_at, t_end - cut_at
        print(
            f"\ncut as up starts the engines: {c} declared unreachable {detect:.2f}s after the cut began, up ended after {took:.2f}s "
            f"(connect timeout {CUT_CT:g}s; bound {CUT_BOUND_S:g}s)"
        )
        assert isinstance(got, LaunchFailed) and got.code == "unreachable" and got.node == c, got
        assert "keepalives unanswered" in got.message, got.message
        assert detect <= CUT_BOUND_S, f"{detect:.1f}s from the cut to up failing"
        assert took <= CUT_BOUND_S + TEARDOWN_MARGIN_S, f"{took:.1f}s from the cut to up ending"
        assert kept["state"] == "down-incomplete" and kept["unreachable"] == [c], (kept["state"], kept["unreachable"])
        _finish_after_heal(cli, ssh_hosts, name, kept)
    finally:
        cleanup(cli, [name])


@pytest.mark.parametrize(("channels", "port"), [("shell", 22940), ("exec", 22950)])
def test_cut_during_status(ssh_hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, channels: str, port: int) -> None:
    """``channels``: commands through the persistent shell, or (K3LAUNCH_SSH_SHELL=0) an exec channel each."""
    if channels == "exec":
        monkeypatch.setenv("K3LAUNCH_SSH_SHELL", "0")  # this process's runners and the CLI's
    c = ssh_hosts.names[2]
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml")
    cli, name = Cli(tmp_path / "state"), f"cut-status-{channels}-{session(ssh_hosts)[0]}"
    try:
        up = cli.json("up", "-i", str(inv), *TP3, "--port-base", str(port + session(ssh_hosts)[1]), "--name", name)
        assert up["state"] == "ready", up
        rec = StateStore(cli.state_dir).load(name)
        assert isinstance(rec, SshRecord)
        made, wrap = _cut(ssh_hosts, c, lambda cmd: True, skip=1)
        fleet = ssh_fleet(rec.plan, rec.ssh_config, rec.known_hosts, CUT_CT, wrap)
        try:
            try:
                assert fleet.run(c, "true").ok  # the connection and its shell are open: the cut meets them mid-command
                got = _bounded(lambda: observe(rec, fleet), CUT_BOUND_S + 30)  # what `status` runs
                t_lib = time.monotonic()
            finally:
                fleet.close()
            t0 = time.monotonic()
            r = cli.run("status", name, "--connect-timeout", f"{CUT_CT:g}", "--json", timeout=60)  # still cut: at connect
            t_cli = time.monotonic()
            kept = cli.record(name)
        finally:
            ssh_hosts.heal(c)
        cut_at = made[0].cut_at
        assert cut_at is not None
        took, cli_took = t_lib - cut_at, t_cli - t0
        print(
            f"\ncut during status ({channels}): status returned {took:.2f}s after the cut began; `k3launch status` with {c} still cut took "
            f"{cli_took:.2f}s (connect timeout {CUT_CT:g}s; bound {CUT_BOUND_S:g}s, +{CLI_START_S:g}s for the CLI's start)"
        )
        assert isinstance(got, Status), got
        assert took <= CUT_BOUND_S, f"{took:.1f}s from the cut to status returning"
        assert len(got.unreachable) == 1 and got.unreachable[0].startswith(f"{c}: connection lost: "), got.unreachable
        assert {p.id: p.alive for p in got.processes} == {p.id: p.node != c for p in rec.plan.processes}, got.processes
        snap = json.loads(r.stdout)
        assert len(snap["unreachable"]) == 1 and snap["unreachable"][0].startswith(f"{c}: "), snap
        assert cli_took <= CUT_BOUND_S + CLI_START_S, f"`k3launch status` took {cli_took:.1f}s"
        assert kept["state"] == "ready" and {p["node"] for p in kept["processes"].values()} >= {c}  # status changes nothing
        _finish_after_heal(cli, ssh_hosts, name, kept)
    finally:
        cleanup(cli, [name])


@pytest.mark.parametrize(("stage", "port"), [("stop", 22960), ("verify", 22980)])
def test_cut_during_down(ssh_hosts: Hosts, tmp_path: Path, stage: str, port: int) -> None:
    c = ssh_hosts.names[2]
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml")
    cli, name = Cli(tmp_path / "state"), f"cut-down-{stage}-{session(ssh_hosts)[0]}"
    try:
        up = cli.json("up", "-i", str(inv), *TP3, "--port-base", str(port + session(ssh_hosts)[1]), "--name", name)
        assert up["state"] == "ready", up
        store = StateStore(cli.state_dir)
        rec = store.load(name)
        assert isinstance(rec, SshRecord)
        planned = cli.record(name)
        # the first signalling round that reaches c, or the verification once everything stopped
        match: Callable[[str], bool] = (lambda cmd: "kill -s " in cmd) if stage == "stop" else (lambda cmd: "@@procs" in cmd)
        made, wrap = _cut(ssh_hosts, c, match)
        fleet = ssh_fleet(rec.plan, rec.ssh_config, rec.known_hosts, CUT_CT, wrap)
        try:
            try:
                assert fleet.run(c, "true").ok  # connection and shell open, as in a `down` that already reached c
                got = _bounded(lambda: teardown(rec, fleet, store, grace_s=10), CUT_BOUND_S + 60)  # what `down` runs
                t_end = time.monotonic()
            finally:
                fleet.close()
            kept = cli.record(name)
        finally:
            ssh_hosts.heal(c)
        cut_at = made[0].cut_at
        assert cut_at is not None
        took = t_end - cut_at
        print(f"\ncut during down ({stage}): down returned {took:.2f}s after the cut began (bound {CUT_BOUND_S:g}s)")
        assert took <= CUT_BOUND_S, f"{took:.1f}s from the cut to down returning"
        assert isinstance(got, TeardownReport), got
        assert list(got.unreachable) == [c] and "keepalives unanswered" in got.unreachable[c], got.unreachable
        assert got.leftovers == {} and got.busy_ports == [], got
        assert kept["state"] == "down-incomplete" and kept["unreachable"] == [c], (kept["state"], kept["unreachable"])
        _finish_after_heal(cli, ssh_hosts, name, planned)
    finally:
        cleanup(cli, [name])
