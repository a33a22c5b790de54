"""``down`` stops only what is its own (issue 30): a deployment's identity goes beyond its name.

Two state directories may each run a deployment of one name. Processes carry the deployment id
(``K3LAUNCH_ID``, made from the state directory's id) beside the name marker, so a ``down`` from
a state directory without a record of the name stops only processes started from *that* state
directory; ``--any-owner`` stops every process of the name; an unknown name is refused with the
close names. The fast tests start stand-in processes (``sleep``) carrying the markers and let the
real sweep find them on this machine; test_down_identity_e2e.py runs the issue's own scenario
with ``up``.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from inventory_helpers import run_cli

from k3launch.deploy.state import StateStore
from k3launch.models.identity import ANY, Owned
from k3launch.render.snippets import find_processes


def _alive(p: subprocess.Popen[bytes]) -> bool:
    return p.poll() is None


class Standins:
    """Processes that look like a deployment's to the sweep: ``sleep`` with the markers."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, ident: str = "", process: str = "serve-0", cwd: Path | None = None, bare_env: bool = False) -> subprocess.Popen[bytes]:
        marks = {"K3LAUNCH_DEPLOYMENT": name, "K3LAUNCH_PROCESS": process, **({"K3LAUNCH_ID": ident} if ident else {})}
        env = {} if bare_env else {**os.environ, **marks}  # bare_env: an environment a title overwrote (found by cwd)
        p = subprocess.Popen(["sleep", "300"], env=env, cwd=cwd, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if _alive(p):
                p.kill()
            p.wait()


@pytest.fixture
def standins() -> Iterator[Standins]:
    s = Standins()
    try:
        yield s
    finally:
        s.stop()


def _name() -> str:
    return f"k3-x{uuid.uuid4().hex[:8]}"


def _down(state: Path, home: Path, *args: str) -> tuple[int, dict[str, object]]:
    r = run_cli(["down", *args, "--state-dir", str(state), "--grace", "1", "--json"], home)
    return r.code, r.json()


def _gone(p: subprocess.Popen[bytes], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(p) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(p)


# ------------------------------------------------------------------ two state directories, one name
def test_down_without_a_record_leaves_another_state_directorys_deployment_alone(tmp_path: Path, standins: Standins) -> None:
    """The issue: `K3LAUNCH_STATE_DIR=A up --name k3-x`, then `K3LAUNCH_STATE_DIR=B down k3-x`
    stopped A's process. Now B has no such deployment: it says so (exit 2), names what it left
    alone, and A's process runs on."""
    name = _name()
    a, b = tmp_path / "A", tmp_path / "B"
    theirs = standins.start(name, StateStore(a).new_deployment_id())
    code, out = _down(b, tmp_path / "home", name)
    assert code == 2, out
    err = out["error"]
    assert isinstance(err, dict) and err["code"] == "unknown-deployment", err
    assert "another state directory" in err["message"] and "--any-owner" in err["hint"], err
    time.sleep(0.3)
    assert _alive(theirs), "down from B stopped A's process"


def test_down_without_a_record_stops_what_this_state_directory_started(tmp_path: Path, standins: Standins) -> None:
    """A lost record (deleted, another machine's copy gone): the state directory's id still
    says which processes of the name are its own -- those stop, another's of the name do not."""
    name = _name()
    a, b = tmp_path / "A", tmp_path / "B"
    ours = standins.start(name, StateStore(a).new_deployment_id(), "serve-0")
    theirs = standins.start(name, StateStore(b).new_deployment_id(), "serve-0")
    code, out = _down(a, tmp_path / "home", name)
    assert code == 0 and out["clean"] and len(out["stopped"]) == 1, out  # type: ignore[arg-type]
    assert _gone(ours)
    assert _alive(theirs)
    others = out["others"]
    assert isinstance(others, dict) and any(f"pid {theirs.pid} " in item for items in others.values() for item in items), out
    assert "--any-owner" in str(out["hint"]), out


def test_any_owner_stops_every_process_of_the_name(tmp_path: Path, standins: Standins) -> None:
    """--any-owner: whoever started them -- another state directory, or a k3launch older than
    deployment ids (no K3LAUNCH_ID at all)."""
    name = _name()
    theirs = standins.start(name, StateStore(tmp_path / "A").new_deployment_id(), "serve-0")
    older = standins.start(name, "", "serve-1")
    code, out = _down(tmp_path / "B", tmp_path / "home", name)
    assert code == 2 and _alive(theirs) and _alive(older), out  # without the flag: neither
    code, out = _down(tmp_path / "B", tmp_path / "home", name, "--any-owner")
    assert code == 0 and out["clean"] and len(out["stopped"]) == 2, out  # type: ignore[arg-type]
    assert _gone(theirs) and _gone(older)


# ------------------------------------------------------------------ unknown names
def test_down_of_a_typo_exits_2_and_suggests_the_near_name(tmp_path: Path) -> None:
    from k3launch import api
    from k3launch.models.record import SshRecord

    store = StateStore(tmp_path)
    plan = api.plan(name="k3-demo")
    store.save(SshRecord(name="k3-demo", state="ready", created=1.0, updated=1.0, endpoint="http://127.0.0.1:8000", plan=plan,
                         backend="local", deployment_id=store.new_deployment_id()))
    r = run_cli(["down", "k3-dmeo", "--state-dir", str(tmp_path)], tmp_path / "home")
    assert r.code == 2, r.stdout + r.stderr
    said = r.stdout + r.stderr
    lines = [ln for ln in said.splitlines() if ln.strip()]
    assert len(lines) == 2 and "k3-dmeo" in lines[0] and "did you mean k3-demo?" in lines[1], said
    assert "nothing was running" not in said and "Traceback" not in said
    assert store.exists("k3-demo")  # and the near deployment is untouched


# ------------------------------------------------------------------ the marker match itself
def _scan(name: str, owned: Owned) -> set[str]:
    out = subprocess.run(["bash", "-c", find_processes(name, owned)], capture_output=True, text=True, check=True, timeout=30).stdout
    return {ln.split()[0] for ln in out.splitlines() if ln.strip()}


def test_the_scan_matches_the_id_exactly_or_the_state_directorys_ids(tmp_path: Path, standins: Standins) -> None:
    name = _name()
    one, two, other = "0a0b0c0d-000001", "0a0b0c0d-000002", "9f9f9f9f-000001"
    p1, p2, p3 = (standins.start(name, i) for i in (one, two, other))
    old = standins.start(name)  # before ids
    # an environment a title overwrote: found by its run directory, <workdir>/k3launch/<name>.<id>/<process>
    run = tmp_path / "k3launch" / f"{name}.{one}" / "serve-9"
    run.mkdir(parents=True)
    blind = standins.start(name, cwd=run, bare_env=True)
    time.sleep(0.2)
    pids = {p: str(p.pid) for p in (p1, p2, p3, old, blind)}
    assert _scan(name, Owned(id=one)) == {pids[p1], pids[blind]}
    assert _scan(name, Owned(owner="0a0b0c0d")) == {pids[p1], pids[p2], pids[blind]}
    assert _scan(name, Owned.from_state(None)) == set()  # a state directory without an id started nothing
    assert _scan(name, ANY) == set(pids.values())


# ------------------------------------------------------------------ Slurm: the job's --comment says whose it is
def test_slurm_down_without_a_record_cancels_only_this_state_directorys_jobs() -> None:
    from k3launch.deploy.slurm.ops import cancel_named
    from k3launch.testing import FakeSlurm

    slurm = FakeSlurm(named={"k3-lost": ["41 k3launch-id=0a0b0c0d-000001", "42 k3launch-id=9f9f9f9f-000001", "43"]})
    report = cancel_named("lost", client=slurm, owned=Owned(owner="0a0b0c0d"))
    assert report.clean and report.stopped == ["job 41"], report
    assert report.others == {"slurm": ["job 42", "job 43"]}, report
    assert [c for c in slurm.calls if c[0] == "scancel"] == [["scancel", "41"]]
    assert cancel_named("lost", client=slurm).stopped == ["job 42", "job 43"]  # any owner's (--any-owner)
