"""The doctor's GPU rows of a node: ``gpus`` (count, model, memory per GPU), ``gpu-procs`` (no
process holds a GPU), ``ecc`` (no uncorrected errors) and ``persistence`` (a warning when off),
from ``nvidia-smi --query-gpu/--query-compute-apps`` on CUDA and ``rocm-smi`` on ROCm (parsed by
:mod:`k3launch.deploy.ssh.fabric`)."""

from __future__ import annotations

from collections.abc import Mapping

from k3launch.deploy.ssh import fabric
from k3launch.models.plan import Plan
from k3launch.models.reports import Check
from k3launch.models.selection import copy_nodes

PASS, FAIL, WARN, SKIP = "pass", "fail", "warn", "skip"  # a check's status (doctor, preflight)
GPU_MEMORY_SLACK = 0.9  # tools report usable memory, a little under the marketing figure
QUERY_GPU = (
    "nvidia-smi --query-gpu=index,name,memory.total,uuid,persistence_mode,ecc.errors.uncorrected.volatile.total "
    "--format=csv,noheader,nounits"
)
QUERY_APPS = "nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits"


def gpu_memory_gb(plan: Plan) -> float:
    """The memory of one GPU of the plan's hardware (a pool's figure is that of the nodes holding one copy)."""
    return min(p.gpu_memory_gb / (copy_nodes(p.parallelism, p.nodes) * max(1, p.gpus // p.nodes)) for p in plan.capacity.pools)


def gpu_checks(plan: Plan, n: str, sec: Mapping[str, list[str]], expected: int) -> list[Check]:
    info = sec.get("gpuinfo", [])
    tool = "rocm-smi" if plan.platform == "rocm" else "nvidia-smi"
    if any(ln.startswith("k3: ") for ln in info):
        return [
            Check(
                n,
                "gpus",
                FAIL,
                f"{tool} not found: no {plan.platform.upper()} driver here",
                hint=f"install the GPU driver on {n} (it brings {tool}), or --exclude {n}",
            )
        ]
    gpus = fabric.rocm_gpus("\n".join(info)) if plan.platform == "rocm" else fabric.nvidia_gpus("\n".join(info))
    want = (plan.hardware or "").replace("gb", "").upper()
    names = sorted({g.name for g in gpus})
    model_ok = bool(gpus) and all(want[-4:] in g.name.upper().replace(" ", "") for g in gpus)
    per_gpu = gpu_memory_gb(plan)
    need_mib = per_gpu * GPU_MEMORY_SLACK * 1024
    small = [g for g in gpus if g.memory_mib is not None and g.memory_mib < need_mib]
    mem = sorted({g.memory_mib for g in gpus if g.memory_mib is not None})
    detail = (
        f"{len(gpus)} GPU(s): {', '.join(names)[:120] or 'none found'}"
        + (f" ({'/'.join(str(m) for m in mem)} MiB)" if mem else "")
        + f"; plan needs {expected} x {plan.hardware}"
    )
    if not gpus and info:
        detail += f"; {tool}: {info[-1][:120]}"
    ok = len(gpus) == expected and model_ok and not small
    hint = (
        ""
        if ok
        else (
            f"GPUs {', '.join(g.index for g in small)} have less than {per_gpu:g} GB: another model"
            if small and len(gpus) == expected and model_ok
            else f"plan for the GPUs {n} has (--hardware), or --exclude {n}"
        )
    )
    checks = [Check(n, "gpus", PASS if ok else FAIL, detail, hint=hint)]
    procs = (fabric.rocm_processes if plan.platform == "rocm" else fabric.nvidia_processes)("\n".join(sec.get("gpuprocs", [])))
    if procs:
        held = ", ".join(f"pid {p.pid} ({p.name}{f', {p.memory_mib} MiB' if p.memory_mib else ''})" for p in procs[:4])
        checks.append(
            Check(
                n,
                "gpu-procs",
                FAIL,
                f"{len(procs)} process(es) hold GPUs: {held}",
                hint=f"stop them on {n} (a k3launch deployment: `k3launch down NAME`), or --exclude {n}",
            )
        )
    else:
        checks.append(Check(n, "gpu-procs", PASS, "no process holds a GPU"))
    if plan.platform == "rocm":
        return [*checks, Check(n, "ecc", SKIP, "ROCm: ECC and persistence are not checked (rocm-smi --showrasinfo by hand)")]
    return [*checks, _ecc(n, gpus), _persistence(n, gpus)]


def _ecc(n: str, gpus: list[fabric.Gpu]) -> Check:
    bad = [g for g in gpus if g.ecc_uncorrected]
    if bad:
        return Check(
            n,
            "ecc",
            FAIL,
            "uncorrected ECC errors: " + ", ".join(f"GPU {g.index}: {g.ecc_uncorrected}" for g in bad),
            hint=f"reset the GPU (`nvidia-smi -r -i {bad[0].index}`) or have the node serviced; --exclude {n} meanwhile",
        )
    if gpus and all(g.ecc_uncorrected is None for g in gpus):
        return Check(n, "ecc", SKIP, "ECC not reported (off, or not supported by these GPUs)")
    return Check(n, "ecc", PASS, "no uncorrected ECC errors")


def _persistence(n: str, gpus: list[fabric.Gpu]) -> Check:
    off = [g.index for g in gpus if g.persistence == "Disabled"]
    if off:
        return Check(
            n,
            "persistence",
            WARN,
            f"persistence mode off on GPU(s) {', '.join(off)}: each start re-initialises the driver",
            hint="`nvidia-smi -pm 1`, or run nvidia-persistenced",
        )
    return Check(n, "persistence", PASS if gpus else SKIP, "persistence mode on" if gpus else "no GPU reported")
