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
from k3launch.render.words import cache_dir

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


def _with_devices(plan: Plan, platform: str) -> Plan:
    """The same plan for a GPU platform: every engine with a GPU, as a CUDA/ROCm profile plans it."""
    procs = [p.model_copy(update={"gpus": 1}) if p.role != "router" else p for p in plan.processes]
    return plan.model_copy(update={"platform": platform, "processes": procs})


DEVICE_FLAGS = {
    ("docker", "cuda"): ["--gpus", "all"],
    ("podman", "cuda"): ["--device", "nvidia.com/gpu=all"],
    ("docker", "rocm"): ["--device", "/dev/kfd", "--device", "/dev/dri", "--group-add", "video", "--security-opt", "seccomp=unconfined"],
    ("podman", "rocm"): ["--device", "/dev/kfd", "--device", "/dev/dri", "--group-add", "video", "--security-opt", "seccomp=unconfined"],
}


def test_a_cpu_container_gets_the_gpu_argv_minus_the_device_flags(tmp_path: Path) -> None:
    for (runtime, platform), flags in DEVICE_FLAGS.items():
        plan = cpu_plan(tmp_path, runtime)
        gpu = _with_devices(plan, platform)
        cpu_words = start_command(plan, plan.processes[0], plan.hosts[0])
        gpu_words = start_command(gpu, gpu.processes[0], gpu.hosts[0])
        i = gpu_words.index(flags[0])
        assert gpu_words[i:i + len(flags)] == flags, (runtime, platform, gpu_words)
        assert gpu_words[:i] + gpu_words[i + len(flags):] == cpu_words, (runtime, platform)


def test_docker_cpu_argv_golden(tmp_path: Path) -> None:
    plan = cpu_plan(tmp_path, "docker")
    proc = plan.processes[0]
    words = [str(w) for w in start_command(plan, proc, plan.hosts[0])]
    key = cache_dir(plan, proc, plan.hosts[0])
    assert key is not None and key.startswith("~/.cache/k3launch/compile/tiny-llama-"), key
    cc = "/root/.cache/k3launch-compile"
    assert words == [
        "docker", "run", "-d", "--name", f"k3-{plan.name}-serve-0", "--label", f"k3launch.deployment={plan.name}",
        "--label", "k3launch.process=serve-0", "--label", "k3launch.role=serve",
        "--ipc=host", "--network", "host", "--shm-size", "64g",  # no --gpus: a CPU profile
        "-v", '"$HOME"/.cache/huggingface:/root/.cache/huggingface',
        "-v", f'"$HOME"/{key.removeprefix("~/")}:{cc}',
        "-e", f"VLLM_CACHE_ROOT={cc}/vllm", "-e", f"TORCHINDUCTOR_CACHE_DIR={cc}/inductor", "-e", f"TRITON_CACHE_DIR={cc}/triton",
        "-e", f"CUDA_CACHE_PATH={cc}/cuda", "-e", f"FLASHINFER_WORKSPACE_BASE={cc}/flashinfer", "-e", f"DG_JIT_CACHE_DIR={cc}/deep_gemm",
        "-e", "GLOO_SOCKET_IFNAME=eth0", "-e", "NCCL_SOCKET_IFNAME=eth0", "-e", "VLLM_HOST_IP=10.1.0.1",
        "-e", f"K3LAUNCH_DEPLOYMENT={plan.name}", "-e", "K3LAUNCH_PROCESS=serve-0", "-e", "HF_TOKEN",
        "--entrypoint", "vllm", "reg.example/vllm-cpu:0.32.0", "serve", "/var/cache/k3launch/vllm-cpu/tiny-llama", "--max-model-len", "512",
        "--disable-expert-parallel", "--no-data-parallel-hybrid-lb", "--tensor-parallel-size", "1", "--data-parallel-size", "2",
        "--data-parallel-size-local", "1", "--data-parallel-address", "10.1.0.1", "--data-parallel-rpc-port", "13345",
        "--port", "8000", "--host", "10.1.0.1", "--disable-access-log-for-endpoints", "/health,/metrics",
    ], words
