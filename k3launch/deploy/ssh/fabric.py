"""Parsers of what the node tools print, for the doctor's fabric and GPU checks (pure: text in, data out).

Each parser takes the exact output of one tool, as the tools print it on real nodes:

* ``nvidia-smi --query-gpu=index,name,memory.total,uuid,persistence_mode,ecc.errors.uncorrected.volatile.total
  --format=csv,noheader,nounits`` (one GPU per line; ``[N/A]`` where a field does not apply, e.g. ECC off);
* ``nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits``;
* ``rocm-smi --showproductname --showmeminfo vram --json`` and ``rocm-smi --showpids``;
* ``ibstat`` (``CA 'mlx5_0'`` blocks, ``State: Active``), else ``ibv_devinfo`` (``hca_id:``, ``state: PORT_ACTIVE (4)``);
* ``lsmod``; ``ip -o link show dev IFACE`` and ``ip -o addr show dev IFACE``; ``df -Pk PATH``;
  ``ulimit -l`` (KiB or ``unlimited``);
* nccl-tests / rccl-tests (``all_reduce_perf``): the ``# Avg bus bandwidth    : 220.921`` line.

Unparseable output is never a pass: parsers return what they found, and the judges in
:mod:`k3launch.deploy.ssh.preflight` say what was missing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Gpu:
    index: str
    name: str
    memory_mib: int | None  # total memory; None when the tool did not say
    uuid: str = ""
    persistence: str = ""  # Enabled | Disabled | "" (not reported)
    ecc_uncorrected: int | None = None  # volatile uncorrected ECC errors; None: ECC off or not reported


@dataclass(frozen=True)
class GpuProcess:
    gpu: str  # the GPU's uuid (NVIDIA) or index list (ROCm)
    pid: str
    name: str
    memory_mib: int | None


@dataclass(frozen=True)
class HcaPort:
    hca: str
    port: str
    state: str  # Active | Down | Initializing | Armed ... (ibstat's words; ibv_devinfo's PORT_ACTIVE -> Active)
    link_layer: str = ""


@dataclass(frozen=True)
class Link:
    state: str  # UP | DOWN | UNKNOWN (a loopback or a tunnel) | "" (not parsed)
    mtu: int | None
    up_flag: bool  # the <...,UP,...> administrative flag


def _int(text: str) -> int | None:
    text = text.strip()
    try:
        return int(float(text))
    except ValueError:
        return None


def nvidia_gpus(out: str) -> list[Gpu]:
    gpus = []
    for line in out.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 3 or not f[0].isdigit():
            continue  # a header, an error line ("NVIDIA-SMI has failed ...")
        f += [""] * (6 - len(f))
        ecc = _int(f[5]) if f[5] and not f[5].startswith("[") else None
        gpus.append(Gpu(f[0], f[1], _int(f[2]), f[3], f[4] if not f[4].startswith("[") else "", ecc))
    return gpus


def nvidia_processes(out: str) -> list[GpuProcess]:
    procs = []
    for line in out.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 3 and f[1].isdigit():
            procs.append(GpuProcess(f[0], f[1], f[2], _int(f[3]) if len(f) > 3 else None))
    return procs


def rocm_gpus(out: str) -> list[Gpu]:
    """``rocm-smi --showproductname --showmeminfo vram --json``: ``{"card0": {"Card series": ...,
    "VRAM Total Memory (B)": "..."}, ...}`` (``system`` and other keys are not cards)."""
    start = out.find("{")
    try:
        data = json.loads(out[start:]) if start >= 0 else {}
    except ValueError:
        return []
    gpus = []
    for key, info in sorted(data.items(), key=lambda kv: int(re.sub(r"\D", "", kv[0]) or 0)):
        if not key.startswith("card") or not isinstance(info, dict):
            continue
        name = str(info.get("Card series") or info.get("Card SKU") or info.get("Card model") or "AMD GPU")
        total = _int(str(info.get("VRAM Total Memory (B)", "")))
        gpus.append(Gpu(key[4:], name, None if total is None else total // MIB))
    return gpus


def rocm_processes(out: str) -> list[GpuProcess]:
    """``rocm-smi --showpids``: after the ``PID  PROCESS NAME  GPU(s)  VRAM USED ...`` header, one
    line per KFD process; "No KFD PIDs currently running" when there is none."""
    procs = []
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 3 and f[0].isdigit():
            used = _int(f[3]) if len(f) > 3 else None  # bytes
            procs.append(GpuProcess(f[2], f[0], f[1], None if used is None else used // MIB))
    return procs


def ibstat_ports(out: str) -> list[HcaPort]:
    ports: list[HcaPort] = []
    hca = port = state = ""

    def flush() -> None:
        if hca and port:
            ports.append(HcaPort(hca, port, state, layer))

    layer = ""
    for raw in out.splitlines():
        line = raw.strip()
        if m := re.match(r"CA '([^']+)'", line):
            flush()
            hca, port, state, layer = m.group(1), "", "", ""
        elif m := re.match(r"Port (\d+):", line):
            flush()
            port, state, layer = m.group(1), "", ""
        elif line.startswith("State:"):
            state = line.split(":", 1)[1].strip()
        elif line.startswith("Link layer:"):
            layer = line.split(":", 1)[1].strip()
    flush()
    return ports


def ibv_devinfo_ports(out: str) -> list[HcaPort]:
    ports: list[HcaPort] = []
    hca = port = state = ""
    for raw in out.splitlines():
        line = raw.strip()
        if line.startswith("hca_id:"):
            hca, port = line.split(":", 1)[1].strip(), ""
        elif re.match(r"port:\s*\d+", line):
            port = line.split(":", 1)[1].strip()
        elif line.startswith("state:") and hca and port:
            word = line.split(":", 1)[1].split()[0]  # PORT_ACTIVE (4) -> PORT_ACTIVE
            state = word.removeprefix("PORT_").capitalize()
            ports.append(HcaPort(hca, port, state))
        elif line.startswith("link_layer:") and ports and ports[-1].hca == hca and ports[-1].port == port:
            ports[-1] = HcaPort(hca, port, ports[-1].state, line.split(":", 1)[1].strip())
    return ports


def modules(out: str) -> set[str]:
    """``lsmod``: the module names (its first column, under the ``Module Size Used by`` header)."""
    return {ln.split()[0] for ln in out.splitlines()[1:] if ln.split()}


def link(out: str) -> Link:
    """``ip -o link show dev IFACE``: ``2: eth0@if5: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 ... state UP ...``."""
    flags = re.search(r"<([^>]*)>", out)
    mtu = re.search(r"\bmtu (\d+)", out)
    state = re.search(r"\bstate (\S+)", out)
    return Link(
        state.group(1) if state else "",
        int(mtu.group(1)) if mtu else None,
        bool(flags) and "UP" in (flags.group(1).split(",") if flags else []),
    )


def addresses(out: str) -> list[str]:
    """``ip -o addr show dev IFACE``: ``2: eth0    inet 10.213.0.11/24 brd ... scope global eth0 ...``."""
    return re.findall(r"\binet6? (\S+)", out)


def df_free_kib(out: str) -> tuple[int, int] | None:
    """``df -Pk PATH``: (size, available) in KiB of the filesystem holding PATH (its last line)."""
    for line in reversed(out.splitlines()):
        f = line.split()
        if len(f) >= 6 and f[1].isdigit() and f[3].isdigit():
            return int(f[1]), int(f[3])
    return None


def memlock_kib(out: str) -> int | None:
    """``ulimit -l``: KiB, or None for ``unlimited`` (raises ValueError for anything else)."""
    word = out.strip().splitlines()[-1].strip() if out.strip() else ""
    if word == "unlimited":
        return None
    if word.isdigit():
        return int(word)
    raise ValueError(f"ulimit -l printed {word!r}")


def busbw(out: str) -> float | None:
    """nccl-tests/rccl-tests: the ``# Avg bus bandwidth : X`` figure (GB/s), None when the run printed none."""
    m = re.findall(r"#\s*Avg bus bandwidth\s*:\s*([0-9.]+)", out)
    return float(m[-1]) if m else None


def size_bytes(text: str) -> int | None:
    """``64g``, ``512m``, ``1t``, ``16G`` (docker's --shm-size units, powers of 1024) → bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        return None
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))
