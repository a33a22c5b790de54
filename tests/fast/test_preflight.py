"""The doctor's hardware and fabric pre-flight checks (``k3launch doctor``, and ``up``'s doctor stage).

Fast tier: the parsers on real outputs of nvidia-smi, rocm-smi, ibstat, ibv_devinfo, lsmod, ip,
df, ulimit and nccl-tests; every check judged from a fake node's answers (passing, and each fault
with its reason and hint); skips that say why. End to end on the sshd test hosts:
test_preflight_e2e.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import pytest
from inventory_helpers import example

from k3launch import api
from k3launch.deploy.ssh import fabric
from k3launch.deploy.ssh.doctor import doctor
from k3launch.deploy.ssh.preflight import fleet_checks
from k3launch.models.plan import Plan
from k3launch.models.reports import Check, DoctorReport
from k3launch.testing import FakeRunner
from k3launch.transport.fleet import Fleet
from k3launch.transport.runners import Target

if TYPE_CHECKING:
    pass


# ---------------------------------------------------------------- real outputs of the tools
NVSMI = "".join(f"{i}, NVIDIA H200, 143771, GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f90{i}, Enabled, 0\n" for i in range(8))
NVSMI_ECC_OFF = "0, NVIDIA H200, 143771, GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f900, Disabled, [N/A]\n"
APPS = "GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f903, 31337, /usr/bin/python3, 81920\n"
ROCM_JSON = json.dumps(
    {
        f"card{i}": {
            "Card series": "AMD Instinct MI355X",
            "Card model": "0x75a3",
            "Card vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
            "Card SKU": "MI355X",
            "VRAM Total Memory (B)": "309220868096",
            "VRAM Total Used Memory (B)": "293482496",
        }
        for i in range(8)
    }
)
ROCM_PIDS = """============================ ROCm System Management Interface ============================
================================= KFD Processes ==========================================
KFD process information:
PID	PROCESS NAME	GPU(s)	VRAM USED	SDMA USED	CU OCCUPANCY
2951	python3	8	1234567890	0	0
==========================================================================================
"""
IBSTAT = """CA 'mlx5_0'
	CA type: MT4129
	Number of ports: 1
	Firmware version: 28.39.1002
	Port 1:
		State: Active
		Physical state: LinkUp
		Rate: 400
		Link layer: InfiniBand
CA 'mlx5_1'
	CA type: MT4129
	Number of ports: 1
	Port 1:
		State: Down
		Physical state: Polling
		Rate: 10
		Link layer: InfiniBand
"""
IBV_DEVINFO = """hca_id:	mlx5_0
	transport:			InfiniBand (0)
	fw_ver:				28.39.1002
	phys_port_cnt:			1
		port:	1
			state:			PORT_ACTIVE (4)
			max_mtu:		4096 (5)
			active_mtu:		4096 (5)
			link_layer:		Ethernet

hca_id:	mlx5_1
	transport:			InfiniBand (0)
	phys_port_cnt:			1
		port:	1
			state:			PORT_DOWN (1)
			link_layer:		InfiniBand
"""
LSMOD = """Module                  Size  Used by
nvidia_peermem         16384  0
nvidia              54865920  45 nvidia_uvm,nvidia_peermem
ib_core               487424  3 ib_uverbs,mlx5_ib,nvidia_peermem
"""
LINK_UP = "4: ib0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 4092 qdisc mq state UP mode DEFAULT group default qlen 256\\    link/infiniband 00:00:10:29:fe:80"
LINK_DOWN = (
    "4: ib0: <BROADCAST,MULTICAST> mtu 4092 qdisc mq state DOWN mode DEFAULT group default qlen 256\\    link/infiniband 00:00:10:29:fe:80"
)
LINK_LO = "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN mode DEFAULT group default qlen 1000\\    link/loopback 00:00:00:00:00:00"
ADDR = "4: ib0    inet 10.2.0.11/24 brd 10.2.0.255 scope global ib0\\       valid_lft forever preferred_lft forever"
DF_SHM = "Filesystem     1024-blocks  Used Available Capacity Mounted on\ntmpfs           1056858112   92 1056858020       1% /dev/shm\n"
DF_SHM_DOCKER = "Filesystem     1024-blocks  Used Available Capacity Mounted on\nshm                 65536     0     65536   0% /dev/shm\n"
NCCL = (
    """#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
 10737418240    2684354560     float     sum      -1    90330  118.87  222.88      0    91945  116.78  218.96      0
# Out of bounds values : 0 OK
"""
    + "# Avg bus bandwidth    : 220.921 \n#\n"
)  # nccl-tests ends the figure with a space


def test_parsers_read_the_real_formats() -> None:
    gpus = fabric.nvidia_gpus(NVSMI + "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")
    assert len(gpus) == 8 and gpus[0] == fabric.Gpu("0", "NVIDIA H200", 143771, "GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f900", "Enabled", 0)
    (off,) = fabric.nvidia_gpus(NVSMI_ECC_OFF)
    assert off.ecc_uncorrected is None and off.persistence == "Disabled"
    assert fabric.nvidia_processes(APPS) == [
        fabric.GpuProcess("GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f903", "31337", "/usr/bin/python3", 81920)
    ]
    assert fabric.nvidia_processes("") == []
    rocm = fabric.rocm_gpus(ROCM_JSON)
    assert len(rocm) == 8 and rocm[0].name == "AMD Instinct MI355X" and rocm[0].memory_mib == 309220868096 // (1 << 20)
    assert [(p.pid, p.name, p.memory_mib) for p in fabric.rocm_processes(ROCM_PIDS)] == [("2951", "python3", 1177)]
    assert fabric.rocm_processes("No KFD PIDs currently running") == []
    assert [(p.hca, p.port, p.state) for p in fabric.ibstat_ports(IBSTAT)] == [("mlx5_0", "1", "Active"), ("mlx5_1", "1", "Down")]
    assert [(p.hca, p.state, p.link_layer) for p in fabric.ibv_devinfo_ports(IBV_DEVINFO)] == [
        ("mlx5_0", "Active", "Ethernet"),
        ("mlx5_1", "Down", "InfiniBand"),
    ]
    assert {"nvidia_peermem", "nvidia", "ib_core"} == fabric.modules(LSMOD)
    assert fabric.link(LINK_UP) == fabric.Link("UP", 4092, True)
    assert fabric.link(LINK_DOWN) == fabric.Link("DOWN", 4092, False)
    assert fabric.link(LINK_LO) == fabric.Link("UNKNOWN", 65536, True)
    assert fabric.link('Device "ib9" does not exist.').mtu is None
    assert fabric.addresses(ADDR) == ["10.2.0.11/24"]
    assert fabric.df_free_kib(DF_SHM_DOCKER) == (65536, 65536)
    assert fabric.memlock_kib("unlimited") is None and fabric.memlock_kib("8192\n") == 8192
    with pytest.raises(ValueError):
        fabric.memlock_kib("bash: ulimit: error")
    assert fabric.busbw(NCCL) == pytest.approx(220.921) and fabric.busbw("# nThread 1 nGpus 8\n") is None
    assert fabric.size_bytes("64g") == 64 << 30 and fabric.size_bytes("512m") == 512 << 20 and fabric.size_bytes("x") is None


# ---------------------------------------------------------------- the judges, on a fake node
def cuda_plan() -> Plan:
    return api.plan(example("h200-pair"), strategy="multi_node_tp", nodes=2)


def good_weights(plan: Plan, **more: object) -> str:
    state = {
        "dir": "/data/hf-cache/hub/models--moonshotai--Kimi-K3/snapshots/" + "a" * 40,
        "commit": "a" * 40,
        "files": 64,
        "bytes": int(plan.capacity.weights_gb * 1e9),
        "missing": [],
        "bad": [],
        "free": 4 * 10**12,
        "error": "",
        **more,
    }
    return "K3W " + json.dumps(state)


def answers(plan: Plan, **faults: Mapping[str, str]) -> Callable[[Target, str], tuple[int, str, str]]:
    """A node's probe answered section by section: everything healthy, except ``faults[node]``."""

    def handler(t: Target, cmd: str) -> tuple[int, str, str]:
        sec = {
            "clock": f"{time.time():.6f}",
            "listening": "",
            "procs": "",
            "runtime": "ok",
            "image": "ok",
            "version": f"rc 0\n{plan.vllm_version}",
            "containers": "",
            "shm": "",
            "gpuinfo": NVSMI,
            "gpuprocs": "",
            "shmsize": DF_SHM,
            "hcas": "tool ibstat\n" + IBSTAT.split("CA 'mlx5_1'")[0],
            "lsmod": LSMOD,
            "memlock": "unlimited",
            "nic": "tool ip\n" + LINK_UP,
            "nicaddr": ADDR,
            "weights": good_weights(plan),
        }
        sec.update(faults.get(t.name, {}))
        asked = [s for s in sec if f"echo '@@{s}'" in cmd]  # answer only what the probe asks
        return 0, "".join(f"@@{s}\n{sec[s]}\n" for s in asked), ""

    return handler


def run(plan: Plan, handler: Callable[[Target, str], tuple[int, str, str]]) -> tuple[DoctorReport, FakeRunner]:
    runner = FakeRunner(handler)
    return doctor(plan, Fleet.for_plan(plan, runner, runner), live_deployments=[]), runner


def rows(report: DoctorReport, node: str) -> dict[str, Check]:
    return {c.name: c for c in report.checks if c.node == node}


def test_a_healthy_pair_of_gpu_nodes_passes_every_named_check() -> None:
    plan = cuda_plan()
    report, runner = run(plan, answers(plan))
    assert report.ok, [c for c in report.checks if c.status == "fail"]
    for node in ("h200-a", "h200-b"):
        got = rows(report, node)
        for name in ("gpus", "gpu-procs", "ecc", "persistence", "shm-size", "hcas", "peermem", "nic", "mtu", "clock", "weights", "disk"):
            assert got[name].status == "pass", (node, name, got[name])
        assert got["memlock"].status == "skip" and "container" in got["memlock"].detail  # docker: the runtime's limit
        assert "8 GPU(s): NVIDIA H200 (143771 MiB)" in got["gpus"].detail
    (probe,) = runner.assert_ran(r"nvidia-smi --query-gpu=", node="h200-a", times=1)  # all of it in the one round trip
    assert (
        "--query-compute-apps" in probe and "ibstat" in probe and "lsmod" in probe and "ulimit -l" in probe and "df -Pk /dev/shm" in probe
    )


FAULTS: list[tuple[str, dict[str, str], str, str, str]] = [
    # (check, the node's answer, status, in the detail, in the hint)
    ("gpus", {"gpuinfo": "".join(NVSMI.splitlines(keepends=True)[:7])}, "fail", "7 GPU(s)", "--exclude h200-b"),
    ("gpus", {"gpuinfo": NVSMI.replace("NVIDIA H200", "NVIDIA H100 80GB HBM3").replace("143771", "81559")}, "fail", "H100", "--hardware"),
    ("gpus", {"gpuinfo": NVSMI.replace("143771", "98304")}, "fail", "98304 MiB", "less than 141 GB"),
    ("gpus", {"gpuinfo": "k3: nvidia-smi not found"}, "fail", "nvidia-smi not found", "install the GPU driver"),
    ("gpu-procs", {"gpuprocs": APPS}, "fail", "pid 31337 (/usr/bin/python3, 81920 MiB)", "stop them on h200-b"),
    ("ecc", {"gpuinfo": NVSMI.replace(", Enabled, 0\n", ", Enabled, 3\n", 1)}, "fail", "GPU 0: 3", "nvidia-smi -r -i 0"),
    ("ecc", {"gpuinfo": NVSMI.replace(", 0\n", ", [N/A]\n")}, "skip", "ECC not reported", ""),
    ("persistence", {"gpuinfo": NVSMI.replace("Enabled", "Disabled")}, "warn", "persistence mode off", "nvidia-smi -pm 1"),
    ("shm-size", {"shmsize": DF_SHM_DOCKER}, "fail", "/dev/shm is 0.1 GiB", "remount,size=64g"),
    ("hcas", {"hcas": "tool ibstat\n" + IBSTAT.replace("State: Active", "State: Down")}, "fail", "no HCA port ACTIVE", "subnet manager"),
    ("hcas", {"hcas": "tool ibstat\n" + IBSTAT}, "warn", "1 of 2 HCA ports ACTIVE", "cables"),
    ("hcas", {"hcas": "tool ibv_devinfo\n" + IBV_DEVINFO.split("hca_id:\tmlx5_1")[0]}, "pass", "mlx5_0", ""),
    ("hcas", {"hcas": "tool ibstat\n"}, "fail", "no RDMA HCA found", "mlx5_core"),
    ("hcas", {"hcas": "tool none"}, "skip", "neither ibstat nor ibv_devinfo", ""),
    (
        "peermem",
        {"lsmod": LSMOD.replace("nvidia_peermem         16384  0\n", "")},
        "fail",
        "nvidia_peermem not loaded",
        "modprobe nvidia_peermem",
    ),
    ("nic", {"nic": "tool ip\n" + LINK_DOWN}, "fail", "ib0 is DOWN", "ip link set ib0 up"),
    ("nic", {"nic": "tool ip\n" + LINK_UP, "nicaddr": ""}, "fail", "no address", "give ib0 an address"),
    ("nic", {"nic": 'tool ip\nDevice "ib0" does not exist.', "nicaddr": ""}, "fail", "ib0 missing", "iface"),
    ("mtu", {"nic": "tool ip\n" + LINK_UP.replace("mtu 4092", "mtu 2044")}, "fail", "mtu 2044; the nodes differ", "one MTU on every node"),
    ("clock", {"clock": f"{time.time() + 42:.6f}"}, "fail", "+42", "chrony"),
    (
        "weights",
        {"weights": good_weights(cuda_plan()).replace('"missing": []', '"missing": ["model-00007-of-00064.safetensors"]')},
        "fail",
        "1 file(s) missing: model-00007-of-00064.safetensors",
        "k3launch weights fetch",
    ),
]


@pytest.mark.parametrize(("check", "answer", "status", "detail", "hint"), FAULTS, ids=[f"{f[0]}-{i}" for i, f in enumerate(FAULTS)])
def test_each_fault_is_a_named_row_with_its_reason_and_hint(
    check: str, answer: dict[str, str], status: str, detail: str, hint: str
) -> None:
    plan = cuda_plan()
    if check == "clock":  # the fault's time is taken now, not when FAULTS was built
        answer = {"clock": f"{time.time() + 42:.6f}"}
    report, _ = run(plan, answers(plan, **{"h200-b": answer}))
    got = rows(report, "h200-b")[check]
    assert got.status == status and detail in got.detail, got
    if check == "mtu":
        assert rows(report, "h200-a")["mtu"].status == "fail"  # two nodes, two MTUs: no majority to trust
    assert hint in got.hint, got
    if status == "fail":
        assert "h200-b" in report.error().message
    assert rows(report, "h200-a")["gpus"].status == "pass"  # the other node is judged on its own answers


def test_weights_missing_refuses_up_with_its_own_code_and_the_fetch_command() -> None:
    plan = cuda_plan()
    broken = {
        "weights": "K3W "
        + json.dumps(
            {
                "dir": "",
                "commit": "",
                "files": 0,
                "bytes": 0,
                "missing": [],
                "bad": [],
                "free": 10**12,
                "error": "no refs/main in /data/hf-cache/hub/models--moonshotai--Kimi-K3",
            }
        )
    }
    report, _ = run(plan, answers(plan, **{"h200-a": broken}))
    err = report.error()
    assert err.code == "weights-missing" and "h200-a" in err.message and "no refs/main" in err.message, err
    assert "k3launch weights fetch" in err.hint and "--from-path" in err.hint
    disk = rows(report, "h200-a")["disk"]
    assert disk.status == "fail" and "1,000 GB free" in disk.detail and "needs" in disk.detail  # 1 TB free < the model


def test_the_disk_row_and_the_doctors_report_take_the_checkpoints_own_size() -> None:
    """The disk must hold the checkpoint's bytes -- its index's total_size where the node has the
    index, else the recipe's parameters x bytes/param -- not the GPU memory (x 1.2) that holds it."""
    plan = cuda_plan()
    partial = {"dir": "/data/hf-cache/hub/models--moonshotai--Kimi-K3/snapshots/" + "a" * 40, "files": 1, "bytes": 0,
               "missing": ["model-00002-of-00064.safetensors"], "free": 1_500 * 10**9}
    report, _ = run(plan, answers(plan, **{"h200-a": {"weights": good_weights(plan, **partial)}}))
    disk = rows(report, "h200-a")["disk"]
    assert disk.status == "pass" and "needs 1,400 GB (the recipe's parameters x bytes/param" in disk.detail, disk  # 1,500 GB free
    assert report.checkpoint is None  # no node read an index
    measured = {**partial, "total": 1_561_000_000_000}  # K3's card: about 1.56 TB
    report, _ = run(plan, answers(plan, **{"h200-a": {"weights": good_weights(plan, **measured)}}))
    disk = rows(report, "h200-a")["disk"]
    assert disk.status == "fail" and "needs 1,561 GB (model.safetensors.index.json metadata.total_size, on h200-a)" in disk.detail, disk
    assert report.checkpoint is not None and report.checkpoint.gb == 1561.0 and report.checkpoint.measured


def test_the_simulated_engine_and_cpu_profiles_skip_with_the_reason() -> None:
    sim = api.plan(example("local"), strategy="multi_node_tp", nodes=2)
    report, runner = run(sim, answers(sim))
    node = sim.processes[0].node
    got = rows(report, node)
    assert got["gpus"].status == "skip" and "simulated engine" in got["gpus"].detail
    assert got["rdma"].status == "skip" and "no RDMA checks" in got["rdma"].detail
    assert got["weights"].status == "skip" and "K3LAUNCH_CHECK_WEIGHTS" in got["weights"].detail
    runner.assert_not_ran(r"nvidia-smi|ibstat|ulimit -l|K3W")
    cpu = api.plan(example("local-cpu"), recipe="k3launch/tiny-llama")
    report, _ = run(cpu, answers(cpu))
    assert rows(report, cpu.processes[0].node)["gpus"].detail.endswith("CPU profile (vLLM's CPU build): no GPU check")


def test_mtu_majority_and_clock_skew_across_nodes() -> None:
    def sec(mtu: int, clock: float) -> dict[str, list[str]]:
        return {"nic": ["tool ip", LINK_UP.replace("mtu 4092", f"mtu {mtu}")], "clock": [f"{clock:.3f}"]}

    t = 1000.0
    got = {(c.node, c.name): c for c in fleet_checks({"a": sec(4092, t), "b": sec(4092, t + 0.1), "c": sec(1500, t + 7.5)}, (t, t + 0.2))}
    assert got[("c", "mtu")].status == "fail" and "mtu 4092" in got[("c", "mtu")].hint and got[("a", "mtu")].status == "pass"
    assert got[("c", "clock")].status == "fail" and "+7.3 s" in got[("c", "clock")].detail
    assert got[("a", "clock")].status == got[("b", "clock")].status == "pass"
