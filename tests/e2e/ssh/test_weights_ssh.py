"""``k3launch weights fetch`` between two sshd test hosts over the same SSH: every file of the model
arrives over the relay (``weights check / fetch`` on local nodes: test_weights.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import standin
from e2e_helpers import Cli

if TYPE_CHECKING:
    from sshhosts import Hosts


@pytest.mark.e2e
@pytest.mark.ssh
def test_fetch_between_ssh_hosts_over_the_same_ssh(ssh_hosts: Hosts, tmp_path: Path) -> None:
    n1, n2 = ssh_hosts.names[:2]
    nodes = [{"name": n, "address": ssh_hosts.addresses[n], "env": {"HF_HOME": str(tmp_path / f"hf-{n}")}} for n in (n1, n2)]
    inv = ssh_hosts.write_inventory(tmp_path / "inv.yaml", names=[n1, n2], extra={"nodes": nodes})
    standin.hf_cache(tmp_path / f"hf-{n1}" / "hub", shards=4)
    sel = ("-i", str(inv), "--strategy", "multi_node_tp", "--nodes", "2")
    r = Cli(tmp_path / "state").run("weights", "fetch", *sel, "--from-node", n1, "--interval", "0.2", "--json", timeout=120)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["complete"], r.stdout + r.stderr
    assert {n["node"]: n["fetched"] for n in out["nodes"]} == {n1: False, n2: True}
    blobs = tmp_path / f"hf-{n2}" / "hub" / "models--moonshotai--Kimi-K3" / "blobs"
    assert len(list(blobs.iterdir())) == 6  # config, index, 4 shards: each arrived over the relay
