"""Supervision over real sshd test hosts (tests/infra: one network namespace per host): a host cut
from the network is detected by the SSH heartbeat, cordoned, its unit re-placed onto a spare host
and serving again behind the real vllm-router; when the host heals, what was left there is
stopped, and `uncordon` puts it back. The engines are the simulated engine; the failure is real
(the host's link is cut)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from e2e_helpers import Cli, Load, cleanup, events, leftovers, processes, session, try_complete, wait_event

if TYPE_CHECKING:
    from sshhosts import Hosts

pytestmark = [pytest.mark.e2e, pytest.mark.ssh]


@pytest.mark.parametrize("cut", [1, 0])
def test_a_cut_host_is_cordoned_its_copy_re_placed_on_a_spare_and_reclaimed_when_it_heals(ssh_hosts: Hosts, tmp_path: Path, cut: int) -> None:
    """Either copy's host cut: that copy alone moves to the spare; the other keeps its node and its pid."""
    if ssh_hosts.mode != "netns":
        pytest.skip("loopback mode: a host cannot be cut from the network")
    names = ssh_hosts.names[:3]
    inv = ssh_hosts.write_inventory(tmp_path / "inv.yaml", names=names, extra={
        "defaults": {"env": {"K3LAUNCH_SIM_LOAD_S": "1"}},
        "restart": {"poll": 0.5, "node_lost_after": 4},
    })
    cli = Cli(tmp_path / "state")
    sfx, off = session(ssh_hosts)
    name = f"sv-cut{cut}-{sfx}"
    try:
        r = cli.run("up", "-i", str(inv), "--recipe", "k3launch/tiny-llama", "--strategy", "single_node_tp", "--replicas", "2",
                    "--name", name, "--port-base", str(23500 + off + 16 * cut), "--supervise", "--connect-timeout", "3", "--json",
                    timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        out = json.loads(r.stdout)
        rec = cli.record(name)
        model = rec["plan"]["model"]
        engines = {p["id"]: p["node"] for p in rec["plan"]["processes"] if p["role"] != "router"}
        assert engines == {"r0-serve-0": names[0], "r1-serve-0": names[1]}, engines
        gone_id, kept_id = (f"r{cut}-serve-0", f"r{1 - cut}-serve-0")
        old = int(rec["processes"][gone_id]["handle"])
        kept_pid = rec["processes"][kept_id]["handle"]

        with Load(out["endpoint"], model, workers=2, limit=2000) as load:
            time.sleep(1)
            t_cut = time.time()
            ssh_hosts.isolate(names[cut])
            lost = wait_event(cli, name, "node-lost", after=t_cut, within=60)
            moved = wait_event(cli, name, "replaced", after=t_cut, within=60)
            back = wait_event(cli, name, "restarted", gone_id, after=t_cut, within=60)
            time.sleep(1)
        assert lost["node"] == names[cut]
        assert f"{gone_id} {names[cut]} -> {names[2]}" in moved["reason"] and moved["reason"].endswith(f"restarted: {gone_id}"), moved
        assert try_complete(out["endpoint"], model) is None
        now = cli.record(name)
        assert {p["id"]: p["node"] for p in now["plan"]["processes"] if p["role"] != "router"} == {
            gone_id: names[2], kept_id: names[1 - cut]}
        assert now["processes"][kept_id]["handle"] == kept_pid  # the other copy was not touched
        # the Prometheus targets moved with it: the spare's address, the other copy's unchanged
        targets = {g["labels"]["process"]: (g["labels"]["node"], g["targets"][0])
                   for g in json.loads((cli.state_dir / "monitoring" / "targets" / f"{name}.json").read_text())}
        where = {p["id"]: (p["node"], f"{p['address']}:{p['http_port']}") for p in now["plan"]["processes"] if p["role"] != "router"}
        assert {k: v for k, v in targets.items() if k in where} == where and where[gone_id][0] == names[2], (targets, where)
        assert names[cut] in now["left_behind"] and now["left_behind"][names[cut]]["processes"][gone_id]["handle"] == str(old)
        cordoned = cli.json("cordon", "-i", str(inv))
        assert [c["node"] for c in cordoned["cordoned"]] == [names[cut]], cordoned
        assert f"supervisor of {name}" in cordoned["cordoned"][0]["by"]
        print(f"\n[host of r{cut} cut: lost after {lost['time'] - t_cut:.1f}s, re-placed {moved['time'] - t_cut:.1f}s, "
              f"serving on {names[2]} {back['time'] - t_cut:.1f}s; client {load.ok} ok, {load.failed} failed]")
        for t, why in load.failures[:3] + load.failures[-3:]:
            print(f"  failed {t - t_cut:+.1f}s after the cut: {why}")
        assert load.failed == 0 and load.ok > 0, load.failures[:5]  # the router was told, not restarted

        # the host heals: the replica left there (it kept running, cut off) is stopped by the supervisor
        t_heal = time.time()
        ssh_hosts.heal(names[cut])
        gone = wait_event(cli, name, "reclaimed", after=t_heal, within=90)
        assert gone["node"] == names[cut] and gone_id in gone["reason"]
        assert old not in processes(name) and cli.record(name)["left_behind"] == {}
        u = cli.run("uncordon", names[cut], "-i", str(inv))
        assert u.returncode == 0, u.stdout + u.stderr
        assert cli.json("cordon", "-i", str(inv))["cordoned"] == []

        d = cli.json("down", name, timeout=120)
        assert d["clean"] is True and d["supervisor"], d
        procs, ports = leftovers(ssh_hosts, now)
        assert procs == {} and ports == [], (procs, ports)
        assert cli.records() == {}
        kinds = [e["kind"] for e in events(cli, name)]
        assert kinds.index("node-unreachable") < kinds.index("node-lost") < kinds.index("cordoned") < kinds.index("replaced"), kinds
    finally:
        ssh_hosts.heal(names[cut])
        cleanup(cli, [name])
