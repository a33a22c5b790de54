"""``doctor``'s engine checks against a fake runner: the vLLM found (in the node's venv) and its
version against the plan's vllm_version, no GPU check on a CPU profile, the image's version for
containers only when the image is there."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from inventory_helpers import example, write_yaml

from k3launch import api
from k3launch.deploy.ssh.doctor import VERSION_TIMEOUT_S, doctor
from k3launch.models.plan import Plan
from k3launch.models.reports import DoctorReport
from k3launch.testing import FakeRunner
from k3launch.transport.fleet import Fleet
from k3launch.transport.runners import Target

VENV = "/var/cache/k3launch/vllm-cpu/venv"
TRITON = "Triton is installed, but doesn't include CPU backend. Disabling Triton."


def cpu_plan() -> Plan:
    return api.plan(example("local-cpu"), recipe="k3launch/tiny-llama")


def answer(runtime: str = "ok", version: list[str] | None = None, image: str | None = None) -> Callable[[Target, str], tuple[int, str, str]]:
    """The probe's answer: free ports, no leftovers, then the runtime/image/version sections."""
    def handler(t: Target, cmd: str) -> tuple[int, str, str]:
        out = f"@@listening\n@@procs\n@@runtime\n{runtime}\n"
        if image is not None:
            out += f"@@image\n{image}\n@@containers\n"
        if version is not None:
            out += "@@version\n" + "".join(f"{ln}\n" for ln in version)
        return 0, out + "@@shm\n", ""
    return handler


def run(plan: Plan, handler: Callable[[Target, str], tuple[int, str, str]]) -> tuple[DoctorReport, FakeRunner]:
    runner = FakeRunner(handler)  # nodes and login node alike (a local inventory's nodes are this machine)
    return doctor(plan, Fleet.for_plan(plan, runner, runner), live_deployments=[]), runner


def checks(report: DoctorReport, node: str = "cpu-1") -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.detail) for c in report.checks if c.node == node}


def test_the_venv_vllm_of_the_planned_version_passes() -> None:
    plan = cpu_plan()
    report, runner = run(plan, answer(version=["rc 0", TRITON, "0.32.0+cpu"]))
    got = checks(report)
    assert report.ok, report.checks
    assert got["runtime"] == ("pass", f"vllm found in {VENV}/bin")
    assert got["vllm-version"] == ("pass", "vLLM 0.32.0+cpu, the version the plan is for")
    assert got["gpus"][0] == "skip" and "CPU profile" in got["gpus"][1]
    (cmd,) = runner.assert_ran(r"vllm --version", node="cpu-1", times=1)  # one call, inside the one probe
    assert f"[ -x {VENV}/bin/vllm ]" in cmd and f'PATH={VENV}/bin:"$PATH"' in cmd and f"timeout {VERSION_TIMEOUT_S} bash -c" in cmd
    assert "importlib.metadata" in cmd  # the version without importing vLLM (~7 s); `vllm --version` is the fallback
    assert "nvidia-smi" not in cmd and "rocm-smi" not in cmd
    assert runner.calls[0].timeout > VERSION_TIMEOUT_S


def test_another_version_refuses_the_node_naming_the_fix() -> None:
    report, _ = run(cpu_plan(), answer(version=["rc 0", TRITON, "0.33.0+cpu"]))
    assert checks(report)["vllm-version"] == ("fail", "vLLM 0.33.0+cpu runs here; the plan is for vLLM 0.32.0")
    err = report.error()
    assert err.code == "doctor-failed" and "vllm-version" in err.message
    assert "--vllm-version 0.33.0" in err.hint and "vllm_version: 0.33.0" in err.hint and "schema dump" not in err.hint


def test_a_version_without_a_schema_says_how_to_dump_one() -> None:
    report, _ = run(cpu_plan(), answer(version=["rc 0", "0.40.1"]))
    hint = report.error().hint
    assert f"k3launch schema dump --python {VENV}/bin/python" in hint and "--vllm-version 0.40.1" in hint


@pytest.mark.parametrize(("lines", "why"), [
    (["rc 1", TRITON, "importlib.metadata.PackageNotFoundError: No package metadata was found for vllm"], "exit 1"),
    (["rc 124"], "timed out"),
])
def test_a_failing_version_command_fails_the_check(lines: list[str], why: str) -> None:
    report, _ = run(cpu_plan(), answer(version=lines))
    status, detail = checks(report)["vllm-version"]
    assert status == "fail" and why in detail and detail.endswith(lines[-1][:160] if len(lines) > 1 else "no output")


def test_no_vllm_in_the_venv_fails_the_runtime_and_skips_the_version() -> None:
    report, _ = run(cpu_plan(), answer(runtime="missing", version=[]))
    got = checks(report)
    assert got["runtime"] == ("fail", f"vllm not found in {VENV}/bin") and "vllm-version" not in got


def test_containers_report_the_image_version_only_when_the_image_is_there(tmp_path: Path) -> None:
    inv = write_yaml(tmp_path, """name: cpu-docker
backend: ssh
hardware: cpu-x86
vllm_version: "0.32.0"
defaults: {runtime: docker, image: "reg.example/vllm-cpu:0.32.0"}
nodes: [{name: c1, address: 10.1.0.1}]
""")
    plan = api.plan(inv, recipe="k3launch/tiny-llama")
    report, runner = run(plan, answer(image="ok", version=["rc 0", "0.32.0"]))
    assert checks(report, "c1")["vllm-version"][0] == "pass"
    (cmd,) = runner.commands("c1")
    assert ("if docker image inspect reg.example/vllm-cpu:0.32.0 >/dev/null 2>&1; then"
            in cmd and "docker run --rm --entrypoint vllm reg.example/vllm-cpu:0.32.0 --version" in cmd)
    report, _ = run(plan, answer(image="missing", version=[]))  # not pulled: no version, the image check fails
    assert "vllm-version" not in checks(report, "c1") and checks(report, "c1")["image"][0] == "fail"


def test_the_simulated_engine_gets_no_version_probe() -> None:
    plan = api.plan(example("local"))
    _, runner = run(plan, answer())
    runner.assert_not_ran(r"--version")
    assert runner.calls[0].timeout < VERSION_TIMEOUT_S
