"""End to end over real sshd hosts (tests/infra, one network namespace per host) with the simulated
engine: every strategy reaches "serving" through `k3launch up`, answers a completion through its
public endpoint, reports every process alive and healthy, has logs, and `down` leaves nothing —
no process of the deployment anywhere (this machine's /proc: the hosts share its kernel), no
planned port listening, no record.

Half the cases go through the real CLI in a subprocess, half through the library API (plan →
Fleet → doctor → Launch.up → teardown); status and logs always through the CLI. Root needed
(skipped otherwise). Every subprocess is bounded; every test ends with a `down` safety net.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from e2e_helpers import (
    Cli,
    cleanup,
    complete,
    host_netns,
    inventory,
    leftovers,
    lib_down,
    lib_up,
    log_sections,
    netns,
    processes,
    sel_args,
    session,
)

from k3launch.models.record import Status

if TYPE_CHECKING:
    from sshhosts import Hosts

pytestmark = [pytest.mark.e2e, pytest.mark.ssh]


@dataclass(frozen=True)
class Case:
    id: str
    via: str  # "cli" or "lib"
    sel: dict[str, Any]
    nodes: int  # engine nodes
    router: bool
    port_base: int


CASES = [
    Case("single-tp", "cli", {"strategy": "single_node_tp"}, 1, False, 21000),
    Case("tp-3", "lib", {"strategy": "multi_node_tp", "nodes": 3}, 3, False, 21100),
    Case("tep-2", "cli", {"strategy": "multi_node_tep", "nodes": 2}, 2, False, 21200),
    Case("dep-2", "lib", {"strategy": "multi_node_dep", "nodes": 2}, 2, True, 21300),
    Case("dep-4", "cli", {"strategy": "multi_node_dep", "nodes": 4}, 4, True, 21400),
    # prefill TEP on 2 nodes (one headless rank) + decode DEP on 2, behind the real vllm-router
    Case("pd", "cli", {"strategy": "pd_cluster", "prefill_nodes": 2, "decode_nodes": 2}, 4, True, 21500),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_up_serve_status_logs_down(ssh_hosts: Hosts, tmp_path: Path, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    if case.router and shutil.which("vllm-router") is None:
        pytest.skip("vllm-router is not installed (pip install '.[test]')")
    from k3launch.transport import runners

    # library cases count SSH connections and remote shells: one of each per host for the whole up
    opened: list[str] = []
    shells: list[object] = []
    real_open, real_shell = runners.SshRunner._open, runners.Shell
    monkeypatch.setattr(runners.SshRunner, "_open", lambda self, t: (opened.append(t.name), real_open(self, t))[1])
    monkeypatch.setattr(runners, "Shell", lambda *a: (shells.append(a), real_shell(*a))[1])
    cli = Cli(tmp_path / "state")
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml")
    port_base = case.port_base + session(ssh_hosts)[1]
    name = ""
    try:
        # ---- up ----------------------------------------------------------------------------
        if case.via == "cli":
            r = cli.run("up", "-i", str(inv), *sel_args(case.sel), "--port-base", str(port_base), "--ready-timeout", "60", "--json")
            assert r.returncode == 0, r.stdout + r.stderr
            out = json.loads(r.stdout)
            name = out["name"]
            assert out["state"] == "ready"
        else:
            rec_obj, stages, _ = lib_up(inv, cli.state_dir, port_base, **case.sel)
            name = rec_obj.name
            assert rec_obj.state == "ready"
            assert [s.split(":")[0] for s in stages][-2:] == ["completion", "ready"], stages
            nodes = sorted({p.node for p in rec_obj.plan.processes if p.node != "login"})
            assert sorted(opened) == nodes, opened  # doctor, start and every poll share one connection per host
            assert len(shells) == len(nodes)
        rec = cli.record(name)
        plan = rec["plan"]
        engines = [p for p in plan["processes"] if p["role"] != "router"]
        assert len({p["node"] for p in engines}) == case.nodes
        assert any(p["role"] == "router" for p in plan["processes"]) == case.router
        assert rec["known_hosts"] == ssh_hosts.known_hosts  # a later `down` checks the same keys

        # every engine runs on its planned host: inside that host's network namespace
        running = processes(name)
        by_id = {proc: pid for pid, proc in running.items()}
        assert {p["id"] for p in plan["processes"]} <= set(by_id), running
        if ssh_hosts.mode == "netns":
            for p in engines:
                assert netns(by_id[p["id"]]) == host_netns(ssh_hosts, p["node"]), p["id"]

        # ---- the public endpoint answers ----------------------------------------------------
        data = complete(rec["endpoint"])
        assert data["choices"][0]["text"] and data["usage"]["completion_tokens"] > 0, data
        if case.router:
            router = next(p for p in plan["processes"] if p["role"] == "router")
            assert rec["endpoint"] == f"http://127.0.0.1:{router['http_port']}" and router["node"] == "login"

        # ---- status --json: every process alive, every HTTP process healthy --------------------
        snap = cli.json("status", name)
        assert Status.model_validate(snap).as_dict() == snap  # exactly the published Status shape
        assert snap["state"] == "ready" and snap["unreachable"] == []
        assert {p["id"] for p in snap["processes"]} == {p["id"] for p in plan["processes"]}
        http = {p["id"] for p in plan["processes"] if p["http_port"] is not None}
        for p in snap["processes"]:
            assert p["alive"] is True, p
            assert p["healthy"] is (True if p["id"] in http else None), p

        # ---- logs: lines of every process ---------------------------------------------------
        r = cli.run("logs", name, "-n", "5")
        assert r.returncode == 0, r.stderr
        sections = log_sections(r.stdout)
        assert set(sections) == {p["id"] for p in plan["processes"]}, r.stdout
        for pid, lines in sections.items():
            assert lines and not lines[0].startswith("(unavailable"), (pid, lines)
        assert any("HTTP/1.1\" 200" in ln or "vllm_router" in ln for lines in sections.values() for ln in lines), sections

        # ---- down leaves nothing -------------------------------------------------------------
        if case.via == "cli":
            d = cli.json("down", name)
            assert d["clean"] is True and d["unreachable"] == {} and d["leftovers"] == {} and d["busy_ports"] == [], d
        else:
            report = lib_down(name, cli.state_dir)
            assert report.clean, report
            assert set(report.stopped) == {p["id"] for p in plan["processes"]}
        procs, ports = leftovers(ssh_hosts, rec)
        assert procs == {} and ports == [], (procs, ports)
        assert cli.records() == {}
    finally:
        if name:
            cleanup(cli, [name])


def test_unknown_host_key_refused_then_accepted(ssh_hosts: Hosts, tmp_path: Path) -> None:
    """known_hosts without one host: refused with host-key-unknown (nothing started); with
    --accept-unknown-hosts the deployment comes up and the key is appended, not rewritten."""
    a, b = ssh_hosts.names[:2]
    known = tmp_path / "known_hosts"
    lines = Path(ssh_hosts.known_hosts).read_text().splitlines()
    kept = [ln for ln in lines if not ln.startswith(f"{b},")]
    assert len(kept) == len(lines) - 1
    known.write_text("\n".join(kept) + "\n")
    inv = inventory(ssh_hosts, tmp_path / "inv.yaml", names=[a, b], extra={"known_hosts": str(known)})
    cli = Cli(tmp_path / "state")
    sfx, off = session(ssh_hosts)
    name = f"e2e-hostkey-{sfx}"
    args = ["up", "-i", str(inv), "--strategy", "multi_node_tp", "--nodes", "2", "--port-base", str(21600 + off), "--ready-timeout", "60",
            "--name", name]
    try:
        err = cli.json(*args)["error"]
        assert err["code"] == "host-key-unknown", err
        assert b in err["message"] and a not in err["message"].split("(")[0]
        assert "--accept-unknown-hosts" in err["hint"]
        r = cli.run(*args)  # the people's form says the same on stderr, exit 2
        assert r.returncode == 2 and "host-key-unknown" not in r.stdout and "--accept-unknown-hosts" in r.stderr
        assert cli.records() == {} and processes(name) == {}

        out = cli.json(*args, "--accept-unknown-hosts")
        assert (out["name"], out["state"]) == (name, "ready"), out
        rec = cli.record(name)
        added = known.read_text().splitlines()[len(kept):]
        assert known.read_text().splitlines()[: len(kept)] == kept  # the user's lines are untouched
        addr = ssh_hosts.addresses[b]
        assert len(added) == 1 and added[0].split()[0] in (addr, f"[{addr}]:{ssh_hosts.port}"), added
        assert added[0].split()[1:] == next(ln for ln in lines if ln.startswith(f"{b},")).split()[1:]
        # remembered: a plain `down` (no flag) reaches b
        d = cli.json("down", name)
        assert d["clean"] is True, d
        assert leftovers(ssh_hosts, rec) == ({}, [])
    finally:
        cleanup(cli, [name])


def test_nodes_reached_through_ssh_config_aliases(ssh_hosts: Hosts, tmp_path: Path) -> None:
    """Nodes named by ~/.ssh/config-style aliases (user, port, key, ConnectTimeout from ssh_config):
    fabric used to refuse these ("ambiguous" timeout) when ssh_config set ConnectTimeout."""
    import yaml

    path = inventory(ssh_hosts, tmp_path / "inv.yaml", names=ssh_hosts.names[:2])
    inv = yaml.safe_load(path.read_text())
    for k in ("user", "port", "identity_file"):
        inv["defaults"].pop(k)
    for n in inv["nodes"]:
        n["ssh_host"] = n["name"]
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    assert "ConnectTimeout" in Path(ssh_hosts.ssh_config).read_text()
    sfx, off = session(ssh_hosts)
    cli, name = Cli(tmp_path / "state"), f"e2e-alias-{sfx}"
    try:
        out = cli.json("up", "-i", str(path), "--strategy", "multi_node_tep", "--nodes", "2", "--port-base", str(21700 + off), "--name", name)
        assert out.get("state") == "ready", out
        rec = cli.record(name)
        assert [h["ssh_host"] for h in rec["plan"]["hosts"]] == ssh_hosts.names[:2]
        assert complete(rec["endpoint"])["usage"]["completion_tokens"] > 0
        assert cli.json("down", name)["clean"] is True
        assert leftovers(ssh_hosts, rec) == ({}, [])
    finally:
        cleanup(cli, [name])
