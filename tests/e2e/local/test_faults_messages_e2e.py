"""Messages a user meets after a fault, end to end on local deployments of the simulated engine:

* the doctor names the holder of a login node's port, with a fix that applies there;
* a foreign process on the router's port is a note of the teardown, never a leftover of ours;
* ``bench`` writes into ``<state-dir>/bench/<deployment>/`` (or ``--out``), never the cwd;
* ``up`` on this machine runs the simulated engine with k3launch's own interpreter and finds
  ``vllm-router`` beside it, whatever PATH says (pipx, a venv that is not activated).

They run on the suite's loopback range (``local_inventory``, tests/conftest.py), each on a port
block of its own, and count what is left of them afterwards (processes, listening ports): the
figure that matters is 0. The cases without processes: test_faults_messages.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import processes
from paths import ROOT

from k3launch import api

FAST = {"K3LAUNCH_SIM_LOAD_S": "0.3", "K3LAUNCH_SIM_TTFT_MS": "5", "K3LAUNCH_SIM_ITL_MS": "1", "K3LAUNCH_SIM_RENDEZVOUS_TIMEOUT_S": "30"}


# ------------------------------------------------------------------ end to end: local deployments
def _k3(
    tmp: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    base = {
        **os.environ,
        "K3LAUNCH_STATE_DIR": str(tmp / "state"),
        "COLUMNS": "250",
        "NO_COLOR": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "k3launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
        cwd=cwd or tmp,
        stdin=subprocess.DEVNULL,
    )


def _listening() -> set[tuple[str, int]]:
    from k3launch.render.snippets import parse_listening

    text = "".join(
        " ".join(ln.split()[1] for ln in Path(f).read_text().splitlines()[1:] if ln.split()[3] == "0A") + " "
        for f in ("/proc/net/tcp", "/proc/net/tcp6")
    )
    return parse_listening(text)


def _left(plan: dict[str, object], name: str, foreign: tuple[str, int] | None = None) -> tuple[dict[int, str], list[str]]:
    """What is left of deployment ``name``: its processes, and its planned ports still listening."""
    now = _listening()
    ports = [
        f"{u['address']}:{u['port']}"
        for u in plan["ports"]  # type: ignore[attr-defined]
        if (u["address"], u["port"]) != foreign and ((u["address"], u["port"]) in now or ("0.0.0.0", u["port"]) in now)
    ]
    return processes(name), ports


def _down_all(tmp: Path) -> None:
    for rec in api.deployments(tmp / "state"):
        _k3(tmp, "down", rec.name, "--grace", "2")


def _name(tmp: Path, prefix: str) -> str:
    """A deployment name of this test's own, remembered so that its run directories go afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    with (tmp / "names").open("a") as f:
        f.write(name + "\n")
    return name


@pytest.fixture
def e2e_tmp(tmp_path: Path, local_inventory: Path) -> Iterator[Path]:
    """A directory of the test's own: its state dir (``state``) and ``inv.yaml``, the bundled local
    inventory on the suite's loopback range with fast simulated engines. Whatever is still
    recorded there is taken down afterwards, and the run directories of its deployments (which
    teardown leaves, logs included) are removed."""
    data = yaml.safe_load(local_inventory.read_text())
    data["defaults"]["env"] = FAST
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    yield tmp_path
    _down_all(tmp_path)
    names = (tmp_path / "names").read_text().split() if (tmp_path / "names").is_file() else []
    for name in names:
        shutil.rmtree(Path("/tmp/k3launch") / name, ignore_errors=True)


def _router() -> None:
    if shutil.which("vllm-router", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])) is None:
        pytest.skip("vllm-router is not installed (pip install '.[router]')")


@contextlib.contextmanager
def _router_port_taken(tmp: Path, port_base: int) -> Iterator[tuple[list[str], dict[str, Any], dict[str, Any]]]:
    """A DEP deployment's selection, its plan and router, while a foreign process (this test)
    listens on the router's address and port."""
    _router()
    name = _name(tmp, "fm")
    sel = ["-i", str(tmp / "inv.yaml"), "--strategy", "multi_node_dep", "--nodes", "2", "--port-base", str(port_base), "--name", name]
    plan = json.loads(_k3(tmp, "plan", *sel, "--json").stdout)
    router = next(p for p in plan["processes"] if p["role"] == "router")
    with socket.socket() as foreign:
        foreign.bind((router["address"], router["http_port"]))
        foreign.listen()
        yield sel, plan, router
        assert (router["address"], router["http_port"]) in _listening()  # the foreign listener was left alone


@pytest.mark.e2e
def test_the_doctor_names_the_holder_of_a_login_node_port_and_a_fix_that_applies_there(e2e_tmp: Path) -> None:
    with _router_port_taken(e2e_tmp, 41000) as (sel, plan, router):
        r = _k3(e2e_tmp, "up", *sel)
        assert r.returncode == 2 and "error: pre-flight checks failed on login: ports" in r.stderr, r.stdout + r.stderr
        assert f"{router['http_port']} (router http) by pid {os.getpid()}" in r.stderr, r.stderr
        hint = r.stderr.split("hint: ", 1)[1]
        assert f"stop pid {os.getpid()}" in hint and "router.port" in hint and "--exclude" not in hint and "--skip-doctor" not in hint
        assert api.deployments(e2e_tmp / "state") == [] and _left(plan, plan["name"], (router["address"], router["http_port"])) == ({}, [])


@pytest.mark.e2e
def test_a_foreign_listener_on_the_router_port_is_a_note_not_a_leftover(e2e_tmp: Path) -> None:
    tmp = e2e_tmp
    with _router_port_taken(tmp, 41512) as (sel, plan, router):
        name = plan["name"]
        # launched anyway: the router cannot bind, up fails and tears down; the port is not ours
        r = _k3(tmp, "up", *sel, "--skip-doctor")
        out = r.stdout + r.stderr
        assert r.returncode == 2 and "error: router (router) on login exited" in r.stderr, out
        assert "incomplete" not in out and "once the nodes answer" not in out, out
        taken = f"{router['address']}:{router['http_port']}"
        assert f"teardown   done: no process or container left; planned ports free, except {taken}" in out, out
        assert f"held by pid {os.getpid()}" in out and f"not by {name}" in out, out
        # the router's log, kept where it can be read after the teardown, named in the error
        kept = tmp / "state" / "logs" / name / "router.log"
        assert f"log kept in {kept}" in r.stderr and "Address already in use" in kept.read_text(), r.stderr
        assert api.deployments(tmp / "state") == []  # nothing left to remember
        assert _left(plan, name, (router["address"], router["http_port"])) == ({}, [])


@pytest.mark.e2e
def test_bench_writes_into_the_state_dir_never_the_cwd(e2e_tmp: Path) -> None:
    tmp = e2e_tmp
    inv = tmp / "inv.yaml"
    name = _name(tmp, "fb")
    up = _k3(tmp, "up", "-i", str(inv), "--name", name, "--port-base", "42024", "--strategy", "single_node_tp", "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    cwd = tmp / "cwd"
    cwd.mkdir()
    b = _k3(tmp, "bench", name, "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2", "--json", cwd=cwd)
    assert b.returncode == 0, b.stdout + b.stderr
    result = Path(json.loads(b.stdout)["result_file"])
    assert result.parent == tmp / "state" / "bench" / name and result.is_file()
    assert sorted(p.name for p in result.parent.iterdir()) == sorted([result.name, result.with_suffix(".log").name])
    assert list(cwd.iterdir()) == []
    b = _k3(
        tmp, "bench", name, "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2", "--out", "mine", "--json", cwd=cwd
    )
    assert b.returncode == 0 and Path(json.loads(b.stdout)["result_file"]).parent == Path("mine"), b.stdout + b.stderr
    assert (cwd / "mine" / result.name).is_file()
    plan = json.loads((tmp / "state" / "deployments" / f"{name}.json").read_text())["plan"]
    assert _k3(tmp, "down", name).returncode == 0
    assert _left(plan, name) == ({}, [])


@pytest.mark.e2e
def test_up_runs_with_k3launch_s_own_interpreter_and_tools_whatever_path_says(e2e_tmp: Path) -> None:
    """As installed by pipx, or called by full path from a venv that is not activated: neither the
    interpreter's directory nor vllm-router is on PATH, and the ``python3`` there lacks k3launch."""
    tmp = e2e_tmp
    here = Path(sys.executable).parent
    if not (here / "vllm-router").is_file():
        pytest.skip(f"vllm-router is not installed beside {sys.executable} (pip install '.[router]')")
    fake = tmp / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\necho "python3: No module named k3launch" >&2\nexit 1\n')
    (fake / "python3").chmod(0o755)
    path = os.pathsep.join([str(fake), "/usr/bin", "/bin"])
    assert str(here) not in path.split(os.pathsep) and shutil.which("vllm-router", path=path) is None
    inv = tmp / "inv.yaml"
    name = _name(tmp, "fi")
    up = _k3(
        tmp,
        "up",
        "-i",
        str(inv),
        "--name",
        name,
        "--port-base",
        "42536",
        "--strategy",
        "multi_node_dep",
        "--nodes",
        "2",
        env={"PATH": path},
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert "serving at" in up.stdout
    rec = json.loads((tmp / "state" / "deployments" / f"{name}.json").read_text())
    chat = _k3(tmp, "chat", name, "Hello", env={"PATH": path})
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stdout + chat.stderr
    down = _k3(tmp, "down", name, env={"PATH": path})
    assert down.returncode == 0, down.stdout + down.stderr
    assert _left(rec["plan"], name) == ({}, [])
