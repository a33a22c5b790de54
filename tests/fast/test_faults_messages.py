"""Messages a user meets after a fault, and k3launch installed the way users install tools.

* a foreign process on a planned port is a note of the teardown, never a leftover of ours;
* a failed ``up`` keeps the failing processes' last log lines in the state directory and names
  them (``k3launch logs`` no longer works once the teardown removed the deployment);
* the doctor's hints fix what it refused (a login node cannot be ``--exclude``d);
* ``bench`` writes into ``<state-dir>/bench/<deployment>/`` (or ``--out``), never the cwd;
* launch scripts carry only what their runtime uses;
* ``up`` on this machine runs the simulated engine with k3launch's own interpreter and finds
  ``vllm-router`` beside it, whatever PATH says (pipx, a venv that is not activated).

The cases that need local deployments of the simulated engine: test_faults_messages_e2e.py.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from paths import ROOT

from k3launch import api
from k3launch.deploy.ssh import teardown as teardown_mod
from k3launch.deploy.ssh.doctor import doctor
from k3launch.deploy.ssh.launch import Launch
from k3launch.deploy.ssh.observe import Poll
from k3launch.deploy.ssh.teardown import teardown
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import ProcessRecord, SshRecord, Stage
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import load_inventory
from k3launch.planning.recipes import RecipeTree
from k3launch.render.sbatch import make_sbatch_string
from k3launch.render.scripts import script
from k3launch.testing import FakeRunner
from k3launch.transport.fleet import Fleet
from k3launch.transport.runners import Target

INVENTORIES = ROOT / "inventories"
HELPER = "k3launch_background() {"


def _plan(inv: Path | str = INVENTORIES / "local.yaml", **sel: object) -> Plan:
    return build_plan(RecipeTree(), Selection(**sel), inventory=load_inventory(inv))  # type: ignore[arg-type]


def _hex(address: str, port: int) -> str:
    """An IPv4 address and port as /proc/net/tcp prints them."""
    return "".join(f"{int(x):02X}" for x in reversed(address.split("."))) + f":{port:04X}"


def _sections(cmd_out: dict[str, str]) -> str:
    return "".join(f"@@{k}\n{v}" for k, v in cmd_out.items())


# ------------------------------------------------------------------ scripts carry only their runtime's pieces
def test_container_scripts_carry_neither_the_background_helper_nor_apptainer_variables(tmp_path: Path) -> None:
    plan = _plan(INVENTORIES / "gb300-nvl4x4.yaml", strategy="multi_node_dep", nodes=4)  # docker engines, a bare router on login
    for h in plan.hosts:
        text = script(plan, h.name, hf_token_file="~/.hf_token")
        bare = h.name == "login"
        assert (HELPER in text) is bare and ("k3launch_background " in text) is bare, h.name
        assert "APPTAINERENV" not in text, h.name
        assert "HF_TOKEN=$(cat" in text, h.name  # the token file is still read: docker passes HF_TOKEN by name
    # what `up` hands to bash on each node (`up --dry-run`) is as clean
    for step in api.dry_run(plan).steps:
        assert (HELPER in step.script) is (step.node == "login") and "APPTAINERENV" not in step.script, step.node
    # apptainer needs its variable (its --cleanenv passes only APPTAINERENV_*), and the helper
    inv = tmp_path / "apptainer.yaml"
    inv.write_text((INVENTORIES / "h200-pair.yaml").read_text().replace("runtime: docker", "runtime: apptainer"))
    plan = _plan(inv, strategy="multi_node_tp", nodes=2)
    assert {h.runtime for h in plan.hosts} == {"apptainer"}
    for h in plan.hosts:
        text = script(plan, h.name)
        assert 'export APPTAINERENV_HF_TOKEN="${HF_TOKEN:-}"' in text and HELPER in text, h.name


def test_sbatch_scripts_carry_apptainer_variables_only_for_apptainer() -> None:
    inv = load_inventory(INVENTORIES / "slurm-b200.yaml")
    plan = build_plan(RecipeTree(), Selection(strategy="multi_node_tp", nodes=2), inventory=inv)
    assert inv.slurm.container == "pyxis"
    assert "APPTAINERENV" not in make_sbatch_string(plan, inv.slurm, "/shared/logs")
    apptainer = inv.slurm.model_copy(update={"container": "apptainer"})
    assert 'export APPTAINERENV_HF_TOKEN="${HF_TOKEN:-}"' in make_sbatch_string(plan, apptainer, "/shared/logs")


# ------------------------------------------------------------------ teardown: only what is ours is left over
def _router_record(pids: dict[str, str]) -> tuple[Plan, SshRecord]:
    plan = _plan(strategy="multi_node_dep", nodes=2)  # two engines behind a router on the login node
    rec = SshRecord(name=plan.name, state="ready", created=0, updated=0, endpoint=plan.endpoint, plan=plan)
    for p in plan.processes:
        rec.processes[p.id] = ProcessRecord(id=p.id, node=p.node, runtime="bare", handle=pids[p.id], log=f"/tmp/{p.id}.log", started=True)
    return plan, rec


@pytest.mark.parametrize(
    ("holder", "left", "ours"),
    [
        ("4242 4242 nc", "", False),  # a foreign process: a note, not a leftover
        ("4243 1002 python3", "", True),  # in the session of our router (pid 1002): ours
        ("? ? ?", "", False),  # invisible holder, nothing of ours on the node: not ours
        ("? ? ?", "1003 router\n", True),  # invisible holder while a process of ours remains: counted
    ],
)
def test_a_planned_port_is_left_over_only_when_ours_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holder: str, left: str, ours: bool
) -> None:
    monkeypatch.setattr(teardown_mod, "VERIFY_S", 0.5)  # a busy port stays busy: do not wait the full verification time
    plan, rec = _router_record({"serve-0": "1000", "serve-1": "1001", "router": "1002"})
    router = next(p for p in plan.processes if p.role == "router")
    assert router.http_port is not None
    busy = _hex(router.address, router.http_port)

    def handler(t: Target, cmd: str) -> tuple[int, str, str]:
        if "echo @@procs" in cmd:  # verify
            procs = left if t.name == "login" else ""
            holders = f"{busy} {holder}\n" if t.name == "login" else ""
            return 0, _sections({"procs": procs, "listening": busy + "\n", "holders": holders}), ""
        return 0, "", ""  # every signal round: nothing of ours found

    report = teardown(rec, Fleet.for_plan(plan, FakeRunner(handler), FakeRunner(handler)), StateStore(tmp_path), grace_s=0.1)
    what = f"{router.address}:{router.http_port}"
    if ours:
        assert any(b.startswith(what) for b in report.busy_ports) and not report.clean, report
    else:
        assert report.clean and not report.busy_ports, report
        assert what in report.verified and f"not by {plan.name}" in report.verified
        assert ("pid 4242 (nc)" if holder[0] != "?" else "cannot see") in report.verified


# ------------------------------------------------------------------ doctor hints fix what was refused
def _doctor_on_login(runtime: str, holders: str) -> K3Error:
    plan = _plan(strategy="multi_node_dep", nodes=2)
    router = next(p for p in plan.processes if p.role == "router")
    assert router.http_port is not None
    busy = _hex(router.address, router.http_port)

    def handler(t: Target, cmd: str) -> tuple[int, str, str]:
        if t.name == "login":
            return (
                0,
                _sections({"listening": busy + "\n" if holders else "", "procs": "", "holders": holders, "runtime": runtime + "\n"}),
                "",
            )
        return 0, _sections({"listening": "", "procs": "", "runtime": "ok\n", "shm": ""}), ""

    report = doctor(plan, Fleet.for_plan(plan, FakeRunner(handler), FakeRunner(handler)), live_deployments=[])
    assert not report.ok and report.failed_nodes() == ["login"], report.checks
    err = report.error()
    assert "--exclude" not in err.hint and "--skip-doctor" not in err.hint, err.hint  # a login node cannot be excluded
    return err


def test_a_login_node_refused_for_its_router_port_gets_a_hint_that_frees_or_moves_it() -> None:
    plan = _plan(strategy="multi_node_dep", nodes=2)
    router = next(p for p in plan.processes if p.role == "router")
    assert router.http_port is not None
    err = _doctor_on_login("ok", f"{_hex(router.address, router.http_port)} 4242 4242 nc\n")
    assert "pid 4242 (nc)" in err.message and str(router.http_port) in err.message
    assert "stop pid 4242 (nc) on login" in err.hint and "router.port" in err.hint and "--port-base" in err.hint


def test_a_missing_vllm_router_is_refused_with_the_install_command() -> None:
    err = _doctor_on_login("missing", "")
    assert "vllm-router not found" in err.message
    assert f"{sys.executable} -m pip install vllm-router" in err.hint and "pipx inject k3launch vllm-router" in err.hint


def test_a_router_that_is_not_installed_fails_up_with_the_install_command(tmp_path: Path) -> None:
    """With --skip-doctor the missing program shows at start: env(1) exits 127."""
    plan = _plan(strategy="multi_node_dep", nodes=2)
    launch = Launch(plan, Fleet.for_plan(plan, FakeRunner(), FakeRunner()), StateStore(tmp_path))
    pl = Poll(dead=["router"], codes={"router": "127"}, tails={"router": "env: 'vllm-router': No such file or directory\n"})
    exc = launch._died(launch.record, pl, "alive")
    assert exc.message.endswith("exited with code 127 during alive: vllm-router not found"), exc.message
    assert f"{sys.executable} -m pip install vllm-router" in exc.hint


# ------------------------------------------------------------------ a failed up keeps the failing logs
def test_a_failed_up_keeps_the_logs_of_what_failed_and_names_them(tmp_path: Path) -> None:
    plan = _plan()
    serve = plan.processes[0]
    log_lines = "".join(f"line {i}\n" for i in range(3)) + "ValueError: the model does not fit\n"

    def handler(t: Target, cmd: str) -> tuple[int, str, str]:
        if "@@log serve-0" in cmd:
            return 0, f"@@log serve-0\n{log_lines}", ""
        if "tail -n" in cmd:
            return 0, log_lines, ""
        return 0, "", ""

    store = StateStore(tmp_path / "state")
    launch = Launch(plan, Fleet.for_plan(plan, FakeRunner(handler), FakeRunner(handler)), store)
    launch.record.processes[serve.id] = ProcessRecord(
        id=serve.id, node=serve.node, runtime="bare", handle="999", log=f"/tmp/k3launch/{plan.name}/{serve.id}/{serve.id}.log", started=True
    )
    exc = launch.not_ready(5, Stage.HEALTH, [serve.id])
    launch.failed(exc)
    kept = tmp_path / "state" / "logs" / plan.name / f"{serve.id}.log"
    assert kept.read_text() == log_lines
    assert str(kept) in exc.message and str(kept) in exc.hint  # printed with the failure; readable after the teardown
    assert "k3launch logs" not in exc.hint
    # a later failure of the same name replaces the files of the earlier one
    (kept.parent / "router.log").write_text("stale")
    launch.failed(launch.not_ready(5, Stage.HEALTH, [serve.id]))
    assert sorted(p.name for p in kept.parent.iterdir()) == [f"{serve.id}.log"]
    # nothing can be kept (here: the logs directory is a file): the error names the log on its node
    shutil.rmtree(tmp_path / "state" / "logs")
    (tmp_path / "state" / "logs").write_text("")
    exc = launch.not_ready(5, Stage.HEALTH, [serve.id])
    launch.failed(exc)
    on_node = f"{serve.node}:/tmp/k3launch/{plan.name}/{serve.id}/{serve.id}.log"
    assert f"logs on the nodes: {on_node}" in exc.message and on_node in exc.hint, (exc.message, exc.hint)


def test_output_off_a_terminal_is_never_wrapped_at_80_columns(tmp_path: Path) -> None:
    """A pipe (CI logs, nohup, Slurm output) gets whole lines: the messages and table rows scripts
    grep for are never folded at rich's default 80 columns."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["K3LAUNCH_STATE_DIR"] = str(tmp_path / "state")
    r = subprocess.run([sys.executable, "-m", "k3launch", "down", "never-was-here-with-a-long-name"], capture_output=True, text=True,
                       env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stdout + r.stderr  # a name never held here, nothing of it running: unknown-deployment
    line = next(ln for ln in (r.stdout + r.stderr).splitlines() if "no deployment named" in ln)
    assert len(line) > 80 and line.rstrip().endswith("this machine [unknown-deployment]"), r.stdout + r.stderr  # one line, not folded
    r = subprocess.run([sys.executable, "-m", "k3launch", "plan", "--strategy", "pd_cluster"], capture_output=True, text=True, env=env,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert max(len(ln) for ln in r.stdout.splitlines()) > 80  # the plan's table keeps its rows whole
