"""The Slurm render tests' cases and readers, shared by the sbatch tests (goldens, fake runs, one real
job on the local cluster) and the supervised job's tests: the recipe tree, slurm inventories
without a nodelist, the named cases (:data:`CASES`) and their plans, the "allocated" hosts the
fakes hand out, plan node order, ``bash -n`` and the inventory full of hostile values.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3launch.models.plan import Plan
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import Inventory, SlurmSection
from k3launch.planning.recipes import RecipeTree

TREE = RecipeTree()
LOG_DIR = "/shared/k3logs"
# "Allocated" host names the fake scontrol hands out (deliberately unlike the placeholders).
FAKE_HOSTS = ("gpu-a07", "gpu-b11.cluster", "gpu-c03", "gpu-d19", "gpu-e02")
# Their NodeAddr, as the fake `scontrol show node` reports it: what engines bind and URLs carry.
FAKE_ADDRS = tuple(f"10.77.0.{i + 1}" for i in range(len(FAKE_HOSTS)))


def slurm_inventory(hardware: str, container: str, *, engine: str = "vllm", defaults: dict[str, Any] | None = None,
                    **slurm: Any) -> Inventory:
    """A slurm inventory without nodelist: the plan's nodes are slurm-node-i placeholders."""
    return Inventory.model_validate({
        "name": f"slurm-{hardware}", "backend": "slurm", "hardware": hardware, "engine": engine,
        "defaults": {"iface": "ib0", **(defaults or {})}, "slurm": {"container": container, **slurm},
    })


@dataclass(frozen=True)
class Case:
    hardware: str
    container: str
    sel: Selection
    slurm: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    extra_sbatch: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def inventory(self) -> Inventory:
        return slurm_inventory(self.hardware, self.container, defaults=self.defaults, **self.slurm)


CASES: dict[str, Case] = {
    "single_node_tp": Case("b300", "pyxis", Selection(strategy="single_node_tp"),
                           {"partition": "gpu", "account": "research", "time_limit": "01:30:00", "extra_sbatch": ["--mail-type=END,FAIL"]},
                           {"hf_cache": "/lustre/hf-cache"}, extra_sbatch=("--comment=k3 golden $(not run)", "--signal=B:USR1@120")),
    "multi_node_tp_2": Case("b200", "pyxis", Selection(strategy="multi_node_tp", nodes=2),
                            {"partition": "gpu", "qos": "high", "reservation": "k3-launch", "constraint": "ib&b200", "gres": "gpus-per-node",
                             "exclusive": False, "exclude": "gpu-13"},
                            {"hf_cache": "/lustre/hf-cache", "image": "reg.example:5000/team/vllm@sha256:" + "0f" * 32,
                             "env": {"NCCL_DEBUG": "INFO", "K3_PEER_URL": "http://slurm-node-1:9000/metrics?from=slurm-node-0"}},
                            exclude=("gpu-07", "gpu-09")),
    "multi_node_tp_3": Case("h100", "bare", Selection(strategy="multi_node_tp", nodes=3), {"partition": "h100", "account": "research"}),
    "multi_node_tep_2": Case("gb300", "apptainer", Selection(strategy="multi_node_tep", nodes=2),
                             {"partition": "gb300", "constraint": "nvl72"}, {"hf_cache": "/scratch/hf"}),
    "multi_node_dep_2": Case("mi355x", "apptainer", Selection(strategy="multi_node_dep", nodes=2),
                             {"partition": "mi355x", "account": "amd-lab"}, {"hf_cache": "/scratch/hf"}),
    "multi_node_dep_4": Case("gb300", "pyxis", Selection(strategy="multi_node_dep", nodes=4),
                             {"partition": "gb300", "time_limit": "2-00:00:00"}, {"hf_cache": "/lustre/hf-cache"}),
    "pd_cluster": Case("b300", "pyxis", Selection(strategy="pd_cluster"), {"partition": "gpu", "account": "research"},
                       {"hf_cache": "/lustre/hf-cache"}),
    # Copies (--replicas 2) of a multi-node engine: one job, one allocation of 2 x 2 nodes, each copy's
    # ranks meeting at their own head (checked beyond the golden below).
    "multi_node_dep_2_replicas_2": Case("b300", "pyxis", Selection(strategy="multi_node_dep", nodes=2, replicas=2),
                                        {"partition": "gpu", "account": "research"}, {"hf_cache": "/lustre/hf-cache"}),
    "multi_node_tp_2_replicas_2": Case("h200", "apptainer", Selection(strategy="multi_node_tp", nodes=2, replicas=2),
                                       {"partition": "h200", "time_limit": "12:00:00"}, {"hf_cache": "/scratch/hf"}),
    # Hostile values in every free-form field that reaches the script: they must stay data.
    "hostile_values": Case("b300", "apptainer", Selection(strategy="multi_node_tp", nodes=2),
                           {"partition": "gpu", "account": "lab$(touch${IFS}/tmp/k3-golden-pwned-account)",
                            "extra_sbatch": ["--comment=$(touch /tmp/k3-golden-pwned-comment) `id`; rm -rf ~"]},
                           {"hf_cache": "/data/hf cache $(touch /tmp/k3-golden-pwned-cache) 'q\"",
                            "compile_cache": "/data/cc $(touch /tmp/k3-golden-pwned-cc) `id`; 'q\"",
                            "env": {"NCCL_DEBUG": "INFO $(touch /tmp/k3-golden-pwned-env) `id` \"; exit 1",
                                    "K3_NOTE": "it's http://slurm-node-1:9/?x=$(id)&y=${HOME}"}},
                           extra_sbatch=("--signal=B:USR1@60; touch /tmp/k3-golden-pwned-extra",)),
}


def deployment_name(case: str) -> str:
    return "golden-" + case.replace("_", "-")


def case_plan(case: str) -> tuple[Plan, SlurmSection, Case]:
    c = CASES[case]
    inv = c.inventory()
    plan = build_plan(TREE, c.sel, inventory=inv, name=deployment_name(case))
    assert inv.slurm is not None
    return plan, inv.slurm, c


def node_order(plan: Plan) -> list[str]:
    """Plan nodes with GPUs, in plan order: plan node i is the i-th allocated host."""
    return [h.name for h in plan.hosts if h.gpus]


def bash_n(path: Path) -> None:
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"{path.name}: {res.stderr}"


def hostile_inventory(tmp: Path, container: str) -> Inventory:
    m = f"{tmp}/pwned"
    return slurm_inventory("b300", container, partition="gpu", defaults={
        "hf_cache": f"{tmp}/hf cache $(touch {m}-cache1) `touch {m}-cache2`; touch {m}-cache3 'q\"",
        "compile_cache": f"{tmp}/cc $(touch {m}-cc1) `touch {m}-cc2`; touch {m}-cc3 'q\"",
        "image": "reg.example:5000/team/img@sha256:" + "0f" * 32,
        "env": {
            "NCCL_DEBUG": f"INFO $(touch {m}-env1) `touch {m}-env2`",
            "K3_NOTE": f"b'; touch {m}-env3; '\" && touch {m}-env4\nline2 $(touch {m}-env5) $K3_HOST_0 ${{K3_ADDR_1}}",
            "K3_PEER": f"http://slurm-node-1:9000/?a=$(touch {m}-env6)&b=slurm-node-0'x'\"y\" -v/:/host",
        },
    })
