"""The doctor's hardware, fabric and host checks: what to ask each node, and how to judge the answers.

:mod:`k3launch.deploy.ssh.doctor` puts these sections into its one shell round trip per node and
hands the answers back here. Each check is a named row that refuses the node with a reason and
a hint, or says why it was skipped:

* ``gpus`` (count, model, memory per GPU), ``gpu-procs`` (no foreign process holds a GPU),
  ``ecc`` (no uncorrected errors) and ``persistence`` (a warning when off): ``nvidia-smi
  --query-gpu/--query-compute-apps`` on CUDA, ``rocm-smi`` on ROCm (:mod:`k3launch.deploy.ssh.gpus`);
  skipped for the simulated engine and CPU profiles;
* on nodes whose ranks talk to other nodes (``--nnodes``, ``--data-parallel-address``, a KV
  transfer): ``hcas`` (RDMA ports present and ACTIVE, ``ibstat`` else ``ibv_devinfo``),
  ``peermem`` (``nvidia_peermem``; ``amdgpu`` on ROCm, whose peer memory goes through dma-buf),
  ``memlock`` (``ulimit -l`` unlimited, bare runtimes), ``nic`` (the planned NIC up with an
  address), ``mtu`` (the same on every node) and ``clock`` (skew against this machine);
* ``shm-size``: ``/dev/shm`` big enough (engines share memory through it: containers run with
  ``--ipc=host``).
"""

from __future__ import annotations

import shlex
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from k3launch.deploy.ssh import fabric
from k3launch.deploy.ssh.gpus import FAIL, PASS, QUERY_APPS, QUERY_GPU, SKIP, WARN, gpu_checks
from k3launch.models.plan import Host, Plan
from k3launch.models.reports import Check

FABRIC_FLAGS = ("--nnodes", "--data-parallel-address", "--kv-transfer-config")
SHM_FLOOR = 1 << 30  # below 1 GiB (docker's default is 64 MB) NCCL and vLLM's shared-memory queues fail
CLOCK_SKEW_S = 1.0  # more than this between nodes and their logs, timelines and TLS/Kerberos tickets disagree


@dataclass(frozen=True)
class Scope:
    """Which checks apply to one engine node, and why the others do not."""

    gpu: str  # '' when the GPU checks apply, else the reason they are skipped
    fabric: bool  # its ranks talk to other nodes

    @property
    def rdma(self) -> bool:
        return self.fabric and not self.gpu


def scope(plan: Plan, node: str) -> Scope:
    gpu = ""
    if plan.engine == "sim":
        gpu = "simulated engine: no GPU check"
    elif plan.platform == "cpu":
        gpu = f"{plan.hardware} is a CPU profile (vLLM's CPU build): no GPU check"
    fab = any(p.node == node and any(f in p.argv for f in FABRIC_FLAGS) for p in plan.processes)
    return Scope(gpu, fab)


def section(name: str, body: str) -> str:
    return f"echo '@@{name}'\n{body}\n"


def _tool(name: str, cmd: str) -> str:
    return f"if command -v {name} >/dev/null 2>&1; then {cmd} 2>&1; else echo 'k3: {name} not found'; fi"


def probe(plan: Plan, host: Host) -> str:
    """The sections of an engine node's probe (after the doctor's own)."""
    sc = scope(plan, host.name)
    parts = []
    if not sc.gpu:
        if plan.platform == "rocm":
            parts += [
                section("gpuinfo", _tool("rocm-smi", "rocm-smi --showproductname --showmeminfo vram --json")),
                section("gpuprocs", _tool("rocm-smi", "rocm-smi --showpids")),
            ]
        else:
            parts += [section("gpuinfo", _tool("nvidia-smi", QUERY_GPU)), section("gpuprocs", _tool("nvidia-smi", QUERY_APPS))]
    if plan.engine != "sim":
        parts.append(section("shmsize", "df -Pk /dev/shm 2>&1"))
    if sc.rdma:
        parts.append(
            section(
                "hcas",
                "if command -v ibstat >/dev/null 2>&1; then echo 'tool ibstat'; ibstat 2>&1; "
                "elif command -v ibv_devinfo >/dev/null 2>&1; then echo 'tool ibv_devinfo'; ibv_devinfo 2>&1; "
                "else echo 'tool none'; fi",
            )
        )
        parts.append(
            section(
                "lsmod", "if command -v lsmod >/dev/null 2>&1; then lsmod; else echo 'Module Size Used by'; cat /proc/modules; fi 2>&1"
            )
        )
        parts.append(section("memlock", "ulimit -l"))
    if sc.fabric and host.iface:
        q = shlex.quote(host.iface)
        parts.append(
            section(
                "nic",
                f"if command -v ip >/dev/null 2>&1; then echo 'tool ip'; ip -o link show dev {q} 2>&1; "
                f"echo '@@nicaddr'; ip -o addr show dev {q} 2>&1; "
                f"else test -e /sys/class/net/{q} && echo ok || echo missing; fi",
            )
        )
    return "".join(parts)


def clock_section(plan: Plan, host: Host) -> str:
    """The node's clock, first in its probe (compared with this machine's around the round trip)."""
    return section("clock", "date +%s.%N") if plan.engine != "sim" and scope(plan, host.name).fabric else ""


def judge(plan: Plan, host: Host, sec: Mapping[str, list[str]], gpus_expected: int) -> list[Check]:
    n = host.name
    sc = scope(plan, n)
    checks = gpu_checks(plan, n, sec, gpus_expected) if not sc.gpu else [Check(n, "gpus", SKIP, sc.gpu)]
    if "shmsize" in sec:
        checks.append(_shm(plan, host, sec["shmsize"]))
    if sc.fabric and sc.gpu:
        why = sc.gpu.split(":")[0]
        checks.append(Check(n, "rdma", SKIP, f"{why}: no RDMA checks (HCAs, peer memory, memlock)"))
    if sc.rdma:
        checks += [_hcas(n, sec.get("hcas", [])), _peermem(plan, n, sec.get("lsmod")), _memlock(host, sec.get("memlock", []))]
    if "nic" in sec:
        checks.append(_nic(host, sec["nic"], sec.get("nicaddr", [])))
    return checks


def _shm(plan: Plan, host: Host, lines: list[str]) -> Check:
    n = host.name
    got = fabric.df_free_kib("\n".join(lines))
    if got is None:
        return Check(n, "shm-size", SKIP, f"df /dev/shm: {(lines or ['no output'])[-1][:120]}")
    size = got[0] * 1024
    want = fabric.size_bytes(host.shm_size or "") if plan.platform != "cpu" else None
    gib = f"/dev/shm is {size / (1 << 30):,.1f} GiB"
    if size < SHM_FLOOR:
        return Check(
            n,
            "shm-size",
            FAIL,
            f"{gib}: engines exchange tensors through it (NCCL, vLLM's queues)",
            hint=f"`mount -o remount,size=64g /dev/shm` on {n} (and in /etc/fstab)",
        )
    if want and size < want:
        return Check(
            n,
            "shm-size",
            WARN,
            f"{gib}, under the node's shm_size {host.shm_size}",
            hint=f"`mount -o remount,size={host.shm_size} /dev/shm` on {n}",
        )
    return Check(n, "shm-size", PASS, gib)


def _hcas(n: str, lines: list[str]) -> Check:
    tool = lines[0].split()[-1] if lines and lines[0].startswith("tool ") else "none"
    if tool == "none":
        return Check(n, "hcas", SKIP, "neither ibstat nor ibv_devinfo here: RDMA HCAs not checked (install infiniband-diags)")
    text = "\n".join(lines[1:])
    ports = fabric.ibstat_ports(text) if tool == "ibstat" else fabric.ibv_devinfo_ports(text)
    if not ports:
        return Check(
            n,
            "hcas",
            FAIL,
            f"no RDMA HCA found ({tool})",
            hint="ranks on other nodes talk over RDMA (InfiniBand/RoCE): check the HCA driver (mlx5_core), or --exclude the node",
        )
    active = [p for p in ports if p.state.lower() == "active"]
    desc = ", ".join(f"{p.hca} port {p.port} {p.state}" for p in ports[:6])
    if not active:
        return Check(
            n,
            "hcas",
            FAIL,
            f"no HCA port ACTIVE: {desc}",
            hint="check the cable and the subnet manager (ibstat should say State: Active, Physical state: LinkUp)",
        )
    if len(active) < len(ports):
        return Check(
            n,
            "hcas",
            WARN,
            f"{len(active)} of {len(ports)} HCA ports ACTIVE: {desc}",
            hint="NCCL uses the ACTIVE ones; check the others' cables",
        )
    return Check(n, "hcas", PASS, f"{len(ports)} HCA port(s) ACTIVE: {', '.join(sorted({p.hca for p in ports}))}")


def _peermem(plan: Plan, n: str, lines: list[str] | None) -> Check:
    if not lines:
        return Check(n, "peermem", SKIP, "lsmod printed nothing: kernel modules not checked")
    mods = fabric.modules("\n".join(lines))
    if plan.platform == "rocm":
        ok = "amdgpu" in mods
        return Check(
            n,
            "peermem",
            PASS if ok else FAIL,
            "amdgpu loaded (peer memory through dma-buf)" if ok else "amdgpu not loaded",
            hint="" if ok else "load the amdgpu driver (`modprobe amdgpu`), or --exclude the node",
        )
    found = next((m for m in ("nvidia_peermem", "nv_peer_mem") if m in mods), None)
    if found:
        return Check(n, "peermem", PASS, f"{found} loaded (GPUDirect RDMA)")
    return Check(
        n,
        "peermem",
        FAIL,
        "nvidia_peermem not loaded: no GPUDirect RDMA, NCCL stages through host memory or fails",
        hint="`modprobe nvidia_peermem` (and list it in /etc/modules-load.d/)",
    )


def _memlock(host: Host, lines: list[str]) -> Check:
    n = host.name
    if host.runtime != "bare":
        return Check(n, "memlock", SKIP, f"{host.runtime} containers get the runtime's limit (--ulimit memlock=-1), not the login shell's")
    try:
        kib = fabric.memlock_kib("\n".join(lines))
    except ValueError as exc:
        return Check(n, "memlock", SKIP, str(exc))
    if kib is None:
        return Check(n, "memlock", PASS, "memlock unlimited")
    return Check(
        n,
        "memlock",
        FAIL,
        f"memlock limit {kib} KiB: RDMA pins the engines' buffers",
        hint="set `* - memlock unlimited` in /etc/security/limits.conf (or LimitMEMLOCK=infinity) and log in again",
    )


def _nic(host: Host, lines: list[str], addr_lines: list[str]) -> Check:
    n, iface = host.name, host.iface or ""
    if not lines or lines[0] != "tool ip":
        ok = lines == ["ok"]
        return Check(
            n,
            "nic",
            PASS if ok else FAIL,
            f"{iface} {'present' if ok else 'missing'}",
            hint="" if ok else f"set the node's iface to the fabric NIC of {n} (`ip link`)",
        )
    text = "\n".join(lines[1:])
    lk = fabric.link(text)
    addrs = fabric.addresses("\n".join(addr_lines))
    if lk.mtu is None:
        return Check(n, "nic", FAIL, f"{iface} missing: {text[:120]}", hint=f"set the node's iface to the fabric NIC of {n} (`ip link`)")
    up = lk.state == "UP" or (lk.state == "UNKNOWN" and lk.up_flag)
    if not up:
        return Check(n, "nic", FAIL, f"{iface} is {lk.state or 'down'}", hint=f"`ip link set {iface} up` on {n}, and check its cable")
    if not addrs:
        return Check(n, "nic", FAIL, f"{iface} is up but has no address", hint=f"give {iface} an address on {n} (the ranks bind to it)")
    return Check(n, "nic", PASS, f"{iface} up, {', '.join(addrs[:2])}, mtu {lk.mtu}")


def fleet_checks(sections: Mapping[str, Mapping[str, list[str]]], window: tuple[float, float]) -> list[Check]:
    """Checks across nodes: the same MTU everywhere, and clocks that agree. ``window``: this
    machine's clock before and after the round trip in which every node read its own."""
    return _mtus(sections) + _clocks(sections, window)


def _mtus(sections: Mapping[str, Mapping[str, list[str]]]) -> list[Check]:
    """The fabric NIC's MTU, the same on every node: a node off the majority fails (with no
    majority, every node does: which one is wrong is the operator's call)."""
    mtu = {}
    for node, sec in sections.items():
        nic = sec.get("nic", [])
        if nic[:1] == ["tool ip"] and (m := fabric.link("\n".join(nic[1:])).mtu) is not None:
            mtu[node] = m
    if len(mtu) < 2:
        return []
    if len(set(mtu.values())) == 1:
        return [Check(node, "mtu", PASS, f"mtu {m}, as on every node") for node, m in sorted(mtu.items())]
    counts = Counter(mtu.values()).most_common()
    common = counts[0][0] if counts[0][1] > counts[1][1] else None
    seen = ", ".join(f"{k} {v}" for k, v in sorted(mtu.items()))
    rows = []
    for node, m in sorted(mtu.items()):
        ok = m == common
        fix = f"`ip link set IFACE mtu {common}` on {node}" if common else "one MTU on every node's fabric NIC (`ip link set IFACE mtu N`)"
        rows.append(Check(node, "mtu", PASS if ok else FAIL, f"mtu {m}; the nodes differ: {seen}", hint="" if ok else fix))
    return rows


def _clocks(sections: Mapping[str, Mapping[str, list[str]]], window: tuple[float, float]) -> list[Check]:
    """Each node's offset from this machine, 0 when its reading falls inside the round trip (its
    uncertainty); a node further than CLOCK_SKEW_S from the median offset of the nodes and this
    machine fails (with two nodes, this machine's clock decides which of them is off)."""
    t0, t1 = window
    offsets = {}
    for node, sec in sections.items():
        try:
            t = float(sec.get("clock", [""])[0])
        except (ValueError, IndexError):
            continue
        offsets[node] = t - t0 if t < t0 else (t - t1 if t > t1 else 0.0)
    if len(offsets) < 2:
        return []
    mid = statistics.median([0.0, *offsets.values()])
    rows = []
    for node, off in sorted(offsets.items()):
        skew = off - mid
        detail = f"{skew:+.1f} s from the other nodes (±{t1 - t0:.1f} s round trip)"
        bad = abs(skew) > CLOCK_SKEW_S
        rows.append(
            Check(node, "clock", FAIL if bad else PASS, detail, hint=f"synchronise the clocks (chrony or ntpd) on {node}" if bad else "")
        )
    return rows
