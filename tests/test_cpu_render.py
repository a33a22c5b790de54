"""Rendering a CPU plan: no GPU devices for containers (nor --nv/--rocm, nor a GPU request on
Slurm), and a node's venv first on the engine's PATH (test_render.py runs such a script)."""

from __future__ import annotations

from pathlib import Path

from inventory_helpers import write_yaml

from k3launch import api
from k3launch.models.plan import Plan
from k3launch.planning.inventory import SlurmSection
from k3launch.render.sbatch import make_sbatch_string
from k3launch.render.scripts import script, start_command

TINY = "k3launch/tiny-llama"


def cpu_plan(tmp: Path, runtime: str, extra: str = "", backend: str = "ssh") -> Plan:
    inv = write_yaml(tmp, f"""name: cpu-{runtime}
backend: {backend}
hardware: cpu-x86
defaults: {{runtime: {runtime}, image: "reg.example/vllm-cpu:0.32.0", iface: eth0{extra}}}
nodes:
  - {{name: c1, address: 10.1.0.1}}
  - {{name: c2, address: 10.1.0.2}}
""", f"{runtime}.yaml")
    return api.plan(inv, recipe=TINY, strategy="multi_node_dep")


def test_containers_on_cpu_get_no_gpu_devices(tmp_path: Path) -> None:
    for runtime in ("docker", "podman", "apptainer"):
        plan = cpu_plan(tmp_path, runtime)
        proc = plan.processes[0]
        words = start_command(plan, proc, plan.hosts[0])
        for gpu in ("--gpus", "nvidia.com/gpu=all", "/dev/kfd", "--nv", "--rocm"):
            assert gpu not in words, (runtime, gpu)
        assert words[-len(proc.argv) + 1:] == proc.argv[1:], runtime  # the engine's argv, word for word


def test_slurm_asks_for_no_gpus_on_cpu(tmp_path: Path) -> None:
    plan = cpu_plan(tmp_path, "bare", ", venv: /opt/vllm-cpu")
    text = make_sbatch_string(plan, SlurmSection(container="bare"), "/shared/logs")
    assert "--gres" not in text and "--gpus-per-node" not in text
    assert "k3_doctor 0 /opt/vllm-cpu/bin/vllm " in text  # no GPUs to see; the venv's vllm must be there
    assert text.count('env PATH=/opt/vllm-cpu/bin:"$PATH" ') == 2  # both engines (the dense model's DEP has no router)


def test_a_home_venv_expands_on_the_node(tmp_path: Path) -> None:
    plan = cpu_plan(tmp_path, "bare", ", venv: ~/envs/vllm cpu/")
    assert 'env PATH="$HOME"/\'envs/vllm cpu/bin\':"$PATH" ' in script(plan, "c1")
