"""Energy and cost per token: integration and coverage of power samples, the readers of
nvidia-smi/amd-smi/rocm-smi, the samplers (over a fleet, over an ``srun --overlap`` step), the
simulated GPUs' stand-in power source and the inventory's price per GPU-hour (a campaign on a
local simulated deployment whose rows carry the energy of every load point: test_campaign_energy_e2e.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from paths import ROOT

from k3launch.campaign import power
from k3launch.campaign.energy import MAX_GAP_S, cost_per_million, coverage, energy, node_joules
from k3launch.deploy import power as sampling
from k3launch.deploy.slurm.power import SrunSampler
from k3launch.errors import K3Error
from k3launch.models.bench import Sample
from k3launch.models.plan import Host
from k3launch.planning.inventory import load_inventory
from k3launch.sim import power as simpower
from k3launch.testing import FakeRunner
from k3launch.transport.fleet import Fleet


def ramp(t0: float, t1: float, w0: float, w1: float, every: float, gpus: int = 2) -> list[Sample]:
    """Samples of a node whose GPUs' total power goes linearly from w0 to w1 watts."""
    n = round((t1 - t0) / every)
    return [Sample(t0 + i * every, ((w0 + (w1 - w0) * i / n) / gpus,) * gpus) for i in range(n + 1)]


# ----------------------------------------------------------------- integration and coverage
def test_trapezoid_of_a_linear_ramp_is_exact_and_clipped_to_the_window() -> None:
    s = ramp(0.0, 10.0, 100.0, 300.0, 0.5)
    assert node_joules(s, 0.0, 10.0) == pytest.approx((100 + 300) / 2 * 10)

    # a window inside the samples: the ends are interpolated between the readings either side
    def w_at(t: float) -> float:
        return 100 + 20 * t

    assert node_joules(s, 2.25, 7.75) == pytest.approx((w_at(2.25) + w_at(7.75)) / 2 * 5.5)


def test_energy_sums_nodes_and_divides_by_tokens() -> None:
    by_node = {"a": ramp(0, 4, 200, 200, 0.5), "b": ramp(0, 4, 100, 100, 0.5)}
    e = energy(by_node, ["a", "b"], 1.0, 3.0, output_tokens=100, total_tokens=500, source="nvidia-smi")
    assert e.valid and e.reason is None and e.nodes == 2 and e.gpus == 4
    assert e.joules == pytest.approx(300 * 2) and e.mean_watts == pytest.approx(300)
    assert e.j_per_output_token == pytest.approx(6.0) and e.j_per_total_token == pytest.approx(1.2)


@pytest.mark.parametrize(
    ("samples", "words"),
    [
        ({"a": ramp(1.5, 10, 100, 100, 0.5)}, "first power sample 0.50 s after the run started"),
        ({"a": ramp(0, 8, 100, 100, 0.5)}, "last power sample 1.00 s before the run ended"),
        ({"a": [*ramp(0, 3, 100, 100, 0.5), *ramp(3 + MAX_GAP_S + 0.5, 10, 100, 100, 0.5)]}, "2.5 s without a power sample"),
        ({}, "no power sample from a"),
    ],
)
def test_samples_that_do_not_cover_the_run_make_the_figures_invalid(samples: dict[str, list[Sample]], words: str) -> None:
    assert coverage(samples, ["a"], 1.0, 9.0) is not None and words in (coverage(samples, ["a"], 1.0, 9.0) or "")
    e = energy(samples, ["a"], 1.0, 9.0, output_tokens=10, total_tokens=20, source="nvidia-smi")
    assert not e.valid and e.joules is None and e.j_per_output_token is None and words in (e.reason or "")


def test_cost_per_million_tokens() -> None:
    # 8 GPUs at 2.5 per hour for 90 s produced 45,000 tokens
    assert cost_per_million(8, 2.5, 45_000, 90.0) == pytest.approx(8 * 2.5 * 90 / 3600 / 45_000 * 1e6)
    assert cost_per_million(8, 2.5, 0, 90.0) is None and cost_per_million(0, 2.5, 10, 1.0) is None


# ----------------------------------------------------------------- reading the tools
@pytest.mark.parametrize(
    ("out", "tool", "watts"),
    [
        ("#nvidia-smi\n312.45\n[N/A]\n98.10\n", "nvidia-smi", (312.45, 98.10)),
        ("#rocm-smi\ndevice,Average Graphics Package Power (W)\ncard0,35.0\ncard1,N/A\ncard2,41.5\n", "rocm-smi", (35.0, 41.5)),
        ("#amd-smi\ngpu,socket_power,gfx_voltage,power_management\n0,520,N/A,ENABLED\n1,498,N/A,ENABLED\n", "amd-smi", (520.0, 498.0)),
        ("#none\n", "none", ()),
        ("bash: garbage\n", "none", ()),
    ],
)
def test_probe_output_is_parsed_per_tool(out: str, tool: str, watts: tuple[float, ...]) -> None:
    assert sampling.parse(out) == (tool, watts)


def test_the_probe_prefers_nvidia_smi_and_runs_in_a_shell(tmp_path: Path) -> None:
    for name, text in (("nvidia-smi", "echo 250.5; echo 249.5"), ("rocm-smi", "echo never")):
        (tmp_path / name).write_text(f"#!/bin/sh\n{text}\n")
        (tmp_path / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    r = subprocess.run(["bash", "-c", sampling.probe("10.0.0.1")], capture_output=True, text=True, env=env, check=True)
    assert sampling.parse(r.stdout) == ("nvidia-smi", (250.5, 249.5))
    r = subprocess.run(["/bin/bash", "-c", sampling.probe()], capture_output=True, text=True, env={"PATH": "/nonexistent"}, check=True)
    assert sampling.parse(r.stdout) == ("none", ())


# ----------------------------------------------------------------- samplers
def hosts(*names: str) -> list[Host]:
    return [Host(name=n, address=f"10.0.0.{i + 1}", role="serve", gpus=8, placeholder=False) for i, n in enumerate(names)]


def test_fleet_sampler_reads_every_node_before_and_after_the_run() -> None:
    fake = FakeRunner((0, "#nvidia-smi\n400\n400\n", ""))
    fleet = Fleet.for_hosts("ssh", hosts("n1", "n2"), remote=fake)
    s = sampling.FleetSampler(fleet, {"n1": "10.0.0.1", "n2": "10.0.0.2"}, period=0.05)
    s.start()
    t0 = time.time()
    while len(fake.calls) < 8:  # a few rounds of both nodes while "the client runs"
        time.sleep(0.01)
    t1 = time.time()
    trace = s.stop()
    assert set(trace.samples) == {"n1", "n2"} and trace.source == "nvidia-smi" and fake.closed
    assert {c.node for c in fake.calls} == {"n1", "n2"} and all("K3LAUNCH_NODE_ADDRESS=10.0.0." in c.command for c in fake.calls)
    e = power.summarize(trace, t0, t1, output_tokens=10, total_tokens=10, samples_file=None)
    assert e.valid, e.reason
    assert e.mean_watts == pytest.approx(2 * 800)  # two nodes, two GPUs of 400 W each


def test_fleet_sampler_on_nodes_without_a_tool_stops_and_says_why() -> None:
    fake = FakeRunner((0, "#none\n", ""))
    s = sampling.FleetSampler(Fleet.for_hosts("ssh", hosts("n1"), remote=fake), {"n1": "10.0.0.1"}, period=0.05)
    s.start()
    time.sleep(0.2)
    trace = s.stop()
    assert len(fake.calls) == 1 and not trace.measured  # asked once, not every period
    e = power.summarize(trace, 0.0, 1.0, output_tokens=1, total_tokens=1, samples_file="x.csv")
    assert not e.valid and "n1: no GPU power reading (none of nvidia-smi, amd-smi, rocm-smi there)" in (e.reason or "")
    assert e.samples_file is None


def test_a_node_that_stops_answering_leaves_a_gap_and_the_reason() -> None:
    fake = FakeRunner((0, "#nvidia-smi\n300\n", ""))
    s = sampling.FleetSampler(Fleet.for_hosts("ssh", hosts("n1"), remote=fake), {"n1": "10.0.0.1"}, period=0.05)
    s.start()
    t0 = time.time()
    fake.fail_on.append("n1")  # unreachable from now on
    time.sleep(0.3)
    trace = s.stop()
    e = power.summarize(trace, t0, t0 + MAX_GAP_S + 1, output_tokens=1, total_tokens=1, samples_file=None)
    assert not e.valid and "last power sample" in (e.reason or "") and "n1: power reading failed" in (e.reason or "")


def fake_srun(bin_dir: Path) -> None:
    """An ``srun`` that runs its command here, once per --nodelist host, as Slurm's tasks would
    (SLURMD_NODENAME set), and stops them on SIGTERM."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "srun"
    script.write_text(
        "#!/bin/bash\n"
        'for a in "$@"; do case "$a" in --nodelist=*) nodes="${a#--nodelist=}";; esac; done\n'
        'while [[ "$1" == --* ]]; do shift; done\n'
        'pids=(); for n in ${nodes//,/ }; do SLURMD_NODENAME=$n "$@" & pids+=($!); done\n'
        "trap 'kill \"${pids[@]}\" 2>/dev/null; exit 0' TERM\n"
        "wait\n"
    )
    script.chmod(0o755)
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho 700; echo "$SLURMD_NODENAME" >/dev/null\n')
    (bin_dir / "nvidia-smi").chmod(0o755)


def test_srun_sampler_reads_every_node_of_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_srun(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    s = SrunSampler("4242", {"node-a": "gpu-01", "node-b": "gpu-02"}, period=0.1)
    assert s.argv()[:4] == ["srun", "--overlap", "--jobid=4242", "--nodelist=gpu-01,gpu-02"]
    s.start()
    t0 = time.time()
    time.sleep(0.4)
    t1 = time.time()
    trace = s.stop()
    assert trace.problem is None and set(trace.samples) == {"node-a", "node-b"}  # hosts mapped back to plan nodes
    e = power.summarize(trace, t0, t1, output_tokens=5, total_tokens=5, samples_file=None)
    assert e.valid, e.reason
    assert e.mean_watts == pytest.approx(2 * 700)


def test_srun_sampler_without_srun_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    s = SrunSampler("1", {"n": "h"}, period=0.1)
    s.start()
    trace = s.stop()
    assert not trace.measured and "cannot start the power step (srun)" in (trace.problem or "")


# ----------------------------------------------------------------- the simulated GPUs
def test_sim_power_file_grows_with_the_batch_and_the_stand_in_reads_one_node(tmp_path: Path) -> None:
    batch = [0.0]
    pf = simpower.PowerFile(tmp_path, "127.0.9.1", 4, 100.0, 15.0, lambda: batch[0])
    pf.start()
    other = simpower.PowerFile(tmp_path, "127.0.9.2", 2, 100.0, 15.0, lambda: 3.0)
    other.start()
    stand_in = simpower.install(tmp_path / "bin")
    env = {**os.environ, "K3LAUNCH_SIM_POWER_DIR": str(tmp_path), "K3LAUNCH_SIM_GPUS": "8", "K3LAUNCH_SIM_IDLE_W": "100"}

    def read(address: str) -> list[float]:
        r = subprocess.run(
            [str(stand_in), *simpower.QUERY], capture_output=True, text=True, env={**env, "K3LAUNCH_NODE_ADDRESS": address}, check=True
        )
        return [float(x) for x in r.stdout.split()]

    try:
        time.sleep(2 * simpower.PERIOD_S)
        assert read("127.0.9.1") == [100.0] * 8  # idle: the engine's 4 GPUs and 4 unused
        batch[0] = 6.0
        time.sleep(2 * simpower.PERIOD_S)
        assert read("127.0.9.1") == [100.0 + 15.0 * 6] * 4 + [100.0] * 4
        assert read("127.0.9.2") == [100.0 + 15.0 * 3] * 2 + [100.0] * 6  # another node's draw stays its own
    finally:
        pf.close()
        other.close()
    assert not pf.path.exists()
    assert read("127.0.9.1") == [100.0] * 8
    r = subprocess.run([str(stand_in), "-q"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "answers only" in r.stderr


# ----------------------------------------------------------------- the price per GPU-hour
def inventory(tmp_path: Path, price: object) -> Path:
    data = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    data["gpu_hour_price"] = price
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_inventory_price_per_gpu_hour(tmp_path: Path) -> None:
    inv = load_inventory(inventory(tmp_path, {"amount": 2.75, "currency": "EUR"}))
    assert inv.gpu_hour_price is not None and (inv.gpu_hour_price.amount, inv.gpu_hour_price.currency) == (2.75, "EUR")
    assert load_inventory(inventory(tmp_path, {"amount": 3})).gpu_hour_price.currency == "USD"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("price", "words"),
    [
        ({"amount": 0}, "greater than 0"),
        ({"amount": 1e9}, "less than or equal to 100000"),
        ({"amount": 2, "currency": "dollars"}, "three-letter"),
        ({"amount": ".nan"}, "finite"),
        ({"amount": 2, "per": "hour"}, "unknown key"),
    ],
)
def test_bad_prices_are_refused_with_file_and_line(tmp_path: Path, price: object, words: str) -> None:
    path = inventory(tmp_path, price)
    if price == {"amount": ".nan"}:
        path.write_text(path.read_text().replace("'.nan'", ".nan"))
    with pytest.raises(K3Error) as exc:
        load_inventory(path)
    assert f"{path}:" in exc.value.message and words in exc.value.message, exc.value.message
