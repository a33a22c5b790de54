"""``up`` refuses missing weights when the inventory opts in (the simulated engine loads none, so it
checks them only then), end to end on local nodes with stand-in Hugging Face caches
(``weights check / fetch``: test_weights.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import standin
from e2e_helpers import Cli

from k3launch.deploy.ssh import weights

if TYPE_CHECKING:
    pass


@pytest.mark.e2e
def test_up_refuses_missing_weights_when_the_inventory_opts_in(tmp_path: Path) -> None:
    """The simulated engine loads no weights, so `up` checks them only when the node env opts in."""
    inv, caches = standin.two_nodes(tmp_path, env={weights.OPT_IN: "1"})
    standin.hf_cache(caches["w-1"] / "hub")
    cli = Cli(tmp_path / "state")
    r = cli.run("up", "-i", str(inv), "--strategy", "multi_node_tp", "--nodes", "2", "--port-base", "24200", "--name", "wm-optin", "--json",
                timeout=120)
    err = json.loads(r.stdout.strip().splitlines()[-1]).get("error", {})
    if r.returncode == 0:  # never leave a deployment behind, whatever the outcome
        cli.run("down", "wm-optin", timeout=120)
    assert r.returncode == 2 and err.get("code") == "weights-missing" and "w-2" in err["message"] and "w-1" not in err["message"], r.stdout
    assert "k3launch weights fetch" in err["hint"]
