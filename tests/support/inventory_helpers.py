"""Helpers shared by the inventory, placement and render tests.

The CLI is driven in-process with Typer's ``CliRunner`` (fast, same code path as ``k3launch``);
``HOME`` always points at an empty directory so a developer's ``~/.ssh/config`` cannot leak
into a plan.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paths import ROOT
from typer.testing import CliRunner

from k3launch.cli import app
from k3launch.planning.inventory import Inventory, load_inventory

INVENTORIES = ROOT / "inventories"
EXAMPLES = sorted(p.stem for p in INVENTORIES.glob("*.yaml"))
# What a placeholder address looks like: plan.placeholder_nodes, the slurm stand-ins, the login node.
PLACEHOLDER = re.compile(r"^(node-\d+|slurm-node-\d+|login)$")


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    def error(self) -> dict[str, str]:
        assert self.code == 2, (self.code, self.stdout, self.stderr)
        err: dict[str, str] = self.json()["error"]
        assert set(err) == {"code", "message", "hint"}, err
        assert err["code"] and err["message"].strip(), err
        assert "Traceback" not in self.stdout + self.stderr
        return err


def run_cli(args: list[str], home: Path, env: dict[str, str] | None = None) -> CliResult:
    res = CliRunner().invoke(app, args, env={"HOME": str(home), **(env or {})}, catch_exceptions=False)
    return CliResult(res.exit_code, res.stdout, res.stderr)


def plan_json(inventory: Path | str, args: list[str], home: Path) -> dict[str, Any]:
    res = run_cli(["plan", "--json", "-i", str(inventory), *args], home)
    assert res.code == 0, res.stdout + res.stderr
    out: dict[str, Any] = res.json()
    return out


def example(name: str) -> Path:
    return INVENTORIES / f"{name}.yaml"


def load_example(name: str) -> Inventory:
    return load_inventory(example(name))


def write_yaml(tmp: Path, text: str, name: str = "inv.yaml") -> Path:
    path = tmp / name
    path.write_text(text, encoding="utf-8")
    return path


def q(value: str) -> str:
    """A YAML scalar holding exactly ``value`` (JSON strings are YAML double-quoted scalars)."""
    return json.dumps(value)


def inventory_addresses(inv: Inventory) -> dict[str, str]:
    """node name -> the address the inventory gives it (explicit address, else the name)."""
    return {n.name: n.address or n.name for n in inv.nodes}
