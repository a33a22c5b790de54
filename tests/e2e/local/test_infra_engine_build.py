"""The engine build (tests/infra/vllm-cpu-up.sh) is safe to share: keyed on what it depends on, swapped, never deleted in use.

Runs the script's stand-in build (``K3LAUNCH_VLLM_CPU_FAKE=1``: the same key, layout, swap and
clean-up, a venv without pip whose ``vllm`` answers ``--version`` and sleeps on ``serve``), so it
costs seconds, not the real build's minutes and 3.5 GB. What is checked: a run from a venv of the
same Python reuses the build, a venv of another Python version gets its own; a rebuild under a
running "engine" swaps DIR/current, keeps the old build while the process lives and names its pid,
and removes it once the process is gone; a build of the old layout (DIR/venv a directory) is moved
aside, not deleted, while a process works in it. Every process started here is killed here.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from infrahelpers import INFRA, pid_alive, wait_until

pytestmark = [pytest.mark.e2e]

SCRIPT = INFRA / "vllm-cpu-up.sh"


def _up(d: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the script on D with the fake build; PATH and PYTHON as the caller gives them."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("K3LAUNCH_VLLM_CPU_") and k != "PYTHON"}
    full.update({"K3LAUNCH_VLLM_CPU_FAKE": "1", **env})
    r = subprocess.run(["bash", str(SCRIPT), str(d)], capture_output=True, text=True, timeout=120, env=full)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(d / "env.sh")
    return r


def _current(d: Path) -> Path:
    return (d / "current").resolve()


def _venv(python: str, where: Path) -> Path:
    subprocess.run([python, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    return where


def _version(python: str) -> str:
    """Its version, or "" when it does not run (a pyenv shim of a version not selected here)."""
    r = subprocess.run([python, "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True, timeout=60)
    return r.stdout.strip() if r.returncode == 0 else ""


@pytest.fixture
def build_users() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts to hold a build in use (an engine, a process working in it); killed after it."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait(10)


def test_the_key_is_the_interpreter_not_its_path(tmp_path: Path) -> None:
    d = tmp_path / "vcpu"
    first = _up(d, PYTHON=sys.executable)
    assert "building in" in first.stderr
    marker = (d / "current" / ".built").read_text()
    impl_ver = subprocess.run([sys.executable, "-c", "import platform, sys; print(platform.python_implementation() + '-' + platform.python_version() + sys.abiflags)"],
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert f"python={impl_ver} " in marker
    assert "base=" not in marker and "/" not in marker  # no path in the key
    build = _current(d)
    # the same interpreter seen from another venv: through PATH (python3) and through PYTHON
    x = _venv(sys.executable, tmp_path / "x")
    for env in ({"PATH": f"{x / 'bin'}:{os.environ['PATH']}"}, {"PYTHON": str(x / "bin" / "python")}):
        r = _up(d, **env)
        assert "up to date" in r.stderr and "building" not in r.stderr, (env, r.stderr)
        assert _current(d) == build


def test_a_venv_of_another_python_version_gets_its_own_build(tmp_path: Path) -> None:
    mine = _version(sys.executable)
    others = [p for p in [*(shutil.which(f"python3.{n}") for n in range(11, 15)),
                          *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[1-4]*/bin/python3")))]
              if p and _version(p) not in (mine, "")]
    if not others:
        pytest.skip(f"no Python 3.11..3.14 other than {mine} on this machine")
    d = tmp_path / "vcpu"
    _up(d, PYTHON=sys.executable)
    old = _current(d)
    y = _venv(others[0], tmp_path / "y")
    r = _up(d, PATH=f"{y / 'bin'}:{os.environ['PATH']}")
    assert "building in" in r.stderr, r.stderr
    assert f"-{_version(others[0])}" in (d / "current" / ".built").read_text()
    assert _current(d) != old and not old.exists()  # nothing used the old build: removed
    assert f"version = {_version(others[0])}" in (d / "venv" / "pyvenv.cfg").read_text()


def test_a_rebuild_swaps_under_a_running_engine_and_removes_the_old_build_once_it_stopped(tmp_path: Path,
                                                                                           build_users: list[subprocess.Popen[bytes]]) -> None:
    d = tmp_path / "vcpu"
    _up(d, PYTHON=sys.executable)
    old = _current(d)
    # started as k3launch starts an engine: `vllm` found on PATH=<venv>/bin (the symlinked DIR/venv)
    engine = subprocess.Popen(["vllm", "serve", "m"], env={**os.environ, "PATH": f"{d / 'venv' / 'bin'}:{os.environ['PATH']}"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    build_users.append(engine)
    assert wait_until(lambda: str(old) in Path(f"/proc/{engine.pid}/cmdline").read_text(), 10)  # its shebang: the build's own python

    r = _up(d, PYTHON=sys.executable, K3LAUNCH_VLLM_CPU_REBUILD="1")
    new = _current(d)
    assert new != old and new.parent == d / "builds"
    assert old.is_dir(), "a build in use was removed"
    assert f"in use by pid {engine.pid} " in r.stderr and "k3launch down" in r.stderr, r.stderr
    assert engine.poll() is None  # the swap did not disturb it
    # the console script through the unchanged path runs the new build, its shebang an existing python of it
    vllm = d / "venv" / "bin" / "vllm"
    assert vllm.read_text().splitlines()[0] == f"#!{new}/venv/bin/python"
    out = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "0.32.0+cpu", out
    assert (d / "env.sh").read_text().count(f"{d}/venv/bin") == 2  # env.sh names the stable path, not a build

    # still in use: an up-to-date run keeps it too
    r = _up(d, PYTHON=sys.executable)
    assert "up to date" in r.stderr and old.is_dir()
    engine.kill()
    engine.wait(10)
    assert wait_until(lambda: not pid_alive(engine.pid), 10)
    r = _up(d, PYTHON=sys.executable)
    assert f"removed the previous build {old}" in r.stderr, r.stderr
    assert not old.exists() and _current(d) == new
    assert sorted(p.name for p in (d / "builds").iterdir()) == [new.name]


def test_a_build_of_the_old_layout_is_moved_aside_not_deleted_while_a_process_works_in_it(tmp_path: Path,
                                                                                           build_users: list[subprocess.Popen[bytes]]) -> None:
    d = tmp_path / "vcpu"
    legacy = _venv(sys.executable, d / "venv")  # the old layout: DIR/venv, DIR/tiny-llama, DIR/.built
    (d / "tiny-llama").mkdir()
    (d / ".built").write_text(f"rev=1 vllm-cpu=0.32.0 python=3.11.7 base={sys.executable} machine=x86_64\n")
    (legacy / "keep").write_text("still here")
    user = subprocess.Popen(["sleep", "600"], cwd=legacy)
    build_users.append(user)

    r = _up(d, PYTHON=sys.executable)
    assert "building in" in r.stderr
    assert (d / "venv").is_symlink() and os.readlink(d / "venv") == "current/venv"
    assert not (d / ".built").exists()
    moved = [p for p in (d / "builds").iterdir() if p.name.startswith("legacy-")]
    assert len(moved) == 1 and (moved[0] / "venv" / "keep").read_text() == "still here", r.stderr
    assert f"in use by pid {user.pid} " in r.stderr, r.stderr
    assert Path(f"/proc/{user.pid}/cwd").resolve() == moved[0] / "venv"  # renamed, not deleted, under it

    user.kill()
    user.wait(10)
    r = _up(d, PYTHON=sys.executable)
    assert "up to date" in r.stderr and not moved[0].exists(), r.stderr
