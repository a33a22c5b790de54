"""Fault corpus: deployment names, lock files, state corruption, a full state disk, a killed `up`.

These cases drive the CLI in-process; the end-to-end ones, which corrupt, delete or orphan the
record of real simulated deployments and check that `down` still stops everything, are in
test_faults_state_e2e.py.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from inventory_helpers import run_cli
from paths import ROOT

from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.util.locks import locked

HOSTILE = ["../../x", "../x", "..", ".hidden", "-rf", "a/b", "Upper", "x" * 64, "a b", "$(id)", "a;b", "é", "a\nb"]


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


# ------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("name", HOSTILE)
@pytest.mark.parametrize("command", ["down", "status", "logs", "chat", "up"])
def test_hostile_names_are_refused_and_create_nothing(tmp_path: Path, name: str, command: str) -> None:
    sandbox = tmp_path / "a" / "b"
    state = sandbox / "state"
    state.mkdir(parents=True)
    opts = [command, "--state-dir", str(state), *([] if command == "logs" else ["--json"])]
    # after `--` a name such as "-rf" is the argument it is meant to be, not an option
    args = [*opts, f"--name={name}"] if command == "up" else [*opts, "--", name, *(["hi"] if command == "chat" else [])]
    before = files_under(tmp_path)
    r = run_cli(args, tmp_path / "home")
    if command == "logs":  # text only
        assert r.code == 2 and "deployment name" in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr, r
    else:
        err = r.error()
        assert err["code"] == "bad-name", err
    created = files_under(tmp_path) - before
    assert all(str(p).startswith(str(tmp_path / "home")) for p in created), created  # nothing in or beside the state dir


def test_one_check_for_names() -> None:
    from k3launch.util.names import check_name, is_name

    assert check_name("k3-tep-lab") == "k3-tep-lab"
    assert all(not is_name(n) for n in HOSTILE)
    with pytest.raises(K3Error) as exc:
        check_name("x" * 500)
    assert len(exc.value.message) < 200  # a hostile name does not flood the terminal


# -------------------------------------------------------------------------------------- lock files
def test_down_of_an_unknown_name_says_so_and_leaves_no_lock(tmp_path: Path) -> None:
    """A name the state directory never held, with nothing of it running: a refusal (a typo is
    likelier than a deployment), every time, and no lock file or state id left behind."""
    state = tmp_path / "state"
    for _ in range(2):
        r = run_cli(["down", "never-was", "--state-dir", str(state), "--json"], tmp_path / "home")
        err = r.error()
        assert r.code == 2 and err["code"] == "unknown-deployment" and "this machine" in err["message"], err
    assert sorted(p.name for p in state.rglob("*")) == ["deployments"]  # no never-was.lock


def test_down_is_idempotent_for_a_name_this_state_directory_took_down(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    _sample_record(store, "dep")  # nothing of it runs: the teardown finds nothing, cleanly
    for _ in range(2):
        r = run_cli(["down", "dep", "--state-dir", str(tmp_path), "--grace", "1", "--json"], tmp_path / "home")
        assert r.code == 0, r.stdout + r.stderr
        assert r.json()["clean"], r.stdout
    assert not store.exists("dep") and store.gone_path("dep").is_file()


def test_failed_up_leaves_no_lock(tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"name": "unreach", "backend": "ssh", "hardware": "b300", "engine": "sim",
                                   "defaults": {"runtime": "bare", "iface": "lo"}, "known_hosts": str(tmp_path / "kh"),
                                   "nodes": [{"name": "n1", "address": "127.0.0.1", "port": 1}]}))
    (tmp_path / "kh").write_text("")
    state = tmp_path / "state"
    r = run_cli(["up", "-i", str(inv), "--state-dir", str(state), "--connect-timeout", "2", "--json"], tmp_path / "home")
    assert r.code == 2, r.stdout + r.stderr
    assert not list(state.rglob("*.lock")), list(state.rglob("*"))


def test_lock_file_removed_by_its_holder_and_never_two_holders(tmp_path: Path) -> None:
    """A waiter that opened the file before the holder removed it must not lock the dead inode
    while a newcomer locks a new file: at most one holder at any time, and no file left."""
    path = tmp_path / "x.lock"
    holders: list[int] = []
    most = [0]
    guard = threading.Lock()

    def work() -> None:
        for _ in range(30):
            with locked(path, remove=True):
                with guard:
                    holders.append(1)
                    most[0] = max(most[0], len(holders))
                time.sleep(0.0005)
                with guard:
                    holders.pop()

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most[0] == 1
    assert not path.exists()


def test_busy_lock_refuses_and_is_kept_for_its_holder(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    with store.lock("dep"):
        with pytest.raises(K3Error) as exc, store.lock("dep"):
            pass
        assert exc.value.code == "deployment-busy"
        assert (tmp_path / "deployments" / "dep.lock").exists()  # the refused command did not remove the holder's file
    assert not (tmp_path / "deployments" / "dep.lock").exists()


# -------------------------------------------------------------------------------- full state disk
@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, filled to the last block (root only: mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "state" / "deployments").mkdir(parents=True)
        with open(mnt / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_state_disk_is_one_line_naming_the_path(tmp_path: Path, full_fs: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text()),
                                   "nodes": [{"name": "l1", "address": "127.0.78.91"}], "router": {"node": "login", "address": "127.0.78.90"}}))
    r = run_cli(["up", "-i", str(inv), "--state-dir", str(full_fs / "state"), "--port-base", "23100", "--json"], tmp_path / "home")
    err = r.error()
    assert err["code"] == "state-dir" and str(full_fs / "state") in err["message"], err  # its id, or its deployments
    assert "No space left" in err["message"] and "free space" in err["hint"], err
    assert not [p for p in (full_fs / "state").rglob("*") if p.name != "deployments"]  # no temp file, no lock


# ------------------------------------------------------------------------------ corruption, unit
def _sample_record(store: StateStore, name: str) -> None:
    from k3launch import api
    from k3launch.models.record import SshRecord

    plan = api.plan(name=name)
    store.save(SshRecord(name=name, state="ready", created=1.0, updated=1.0, inventory=str(ROOT / "inventories" / "local.yaml"),
                         endpoint="http://127.0.0.1:8000", plan=plan, backend="local"))


def test_unreadable_record_is_kept_aside_never_deleted(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    _sample_record(store, "dep")
    text = store.path("dep").read_text()
    store.path("dep").write_text(text[: len(text) // 2])  # truncated mid-plan
    with pytest.raises(K3Error) as exc:
        store.load("dep")
    assert exc.value.code == "bad-state" and "down dep --inventory" in exc.value.hint
    r = run_cli(["down", "dep", "--state-dir", str(tmp_path), "--json"], tmp_path / "home")
    assert r.code == 0, r.stdout + r.stderr  # the record still named its inventory: searched there
    aside = r.json()["set_aside"]
    assert aside and Path(aside).read_text() == text[: len(text) // 2]
    assert Path(aside).name.startswith("dep.json.corrupt-")
    assert not store.exists("dep") and not list(tmp_path.rglob("*.lock"))


@pytest.mark.parametrize("content", [b"\x00\xff garbage", b"", b"[1, 2, 3]", b'{"name": "dep"}'])
def test_an_unreadable_record_without_inventory_is_kept_aside_and_this_machine_is_swept(tmp_path: Path, content: bytes) -> None:
    """Like a missing record: the file is kept aside (never deleted), this machine is searched, and
    the user is told how to search an inventory's nodes instead of being refused."""
    store = StateStore(tmp_path)
    store.dir.mkdir(parents=True)
    store.path("dep").write_bytes(content)
    r = run_cli(["down", "dep", "--state-dir", str(tmp_path), "--json"], tmp_path / "home")
    assert r.code == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["clean"] and "this machine" in out["verified"], out
    assert "--inventory" in out["hint"]
    assert not store.path("dep").exists()
    assert Path(out["set_aside"]).read_bytes() == content


def test_record_of_a_killed_command_reads_interrupted(tmp_path: Path) -> None:
    from k3launch.models.record import Owner

    store = StateStore(tmp_path)
    _sample_record(store, "dep")
    rec = store.load("dep")
    rec.state = "starting"
    store.save(rec)
    assert store.load("dep").state == "starting"  # its owner (this process) runs
    data: dict[str, Any] = json.loads(store.path("dep").read_text())
    child = subprocess.Popen(["sleep", "0"])
    child.wait()
    data["owner"] = Owner(host=data["owner"]["host"], pid=child.pid, started="1").model_dump()
    store.path("dep").write_text(json.dumps(data))
    assert store.load("dep").state == "interrupted"
    assert [r.state for r in store.list()] == ["interrupted"]
    rec = store.load("dep")
    rec.state = "ready"
    store.save(rec)
    assert json.loads(store.path("dep").read_text())["owner"] is None  # stable states name no owner


# ------------------------------------------------------------------------------ Slurm, no record
def test_slurm_down_without_record_cancels_the_jobs_named_after_it() -> None:
    from k3launch.deploy.slurm.ops import cancel_named
    from k3launch.testing import FakeSlurm

    slurm = FakeSlurm(named={"k3-lost": ["41", "43"], "k3-other": ["44"]})
    report = cancel_named("lost", client=slurm)
    assert report.clean and report.stopped == ["job 41", "job 43"], report
    assert slurm.calls_to("scancel") == [["scancel", "41"], ["scancel", "43"]]  # never another deployment's job
    assert cancel_named("lost", client=slurm).stopped == []  # idempotent
    stuck = FakeSlurm(named={"k3-lost": ["41"]}, stuck=True)
    report = cancel_named("lost", client=stuck, wait_s=0.6)
    assert not report.clean and report.leftovers == {"slurm": ["job 41 still queued or running"]}


def test_ssh_down_without_record_searches_every_machine_of_the_inventory(tmp_path: Path) -> None:
    """Every node (a drained one too) and the router's login node are searched for the name's
    processes, with no process-id filter; what is found is signalled, the rest left alone."""
    from k3launch.deploy.ssh.teardown import sweep
    from k3launch.planning.build import inventory_hosts
    from k3launch.planning.inventory import load_inventory
    from k3launch.testing import FakeRunner
    from k3launch.transport.fleet import Fleet
    from k3launch.transport.runners import Target

    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text(yaml.safe_dump({"name": "lab", "backend": "ssh", "hardware": "b300", "known_hosts": str(tmp_path / "kh"),
                                        "nodes": [{"name": "n1", "address": "10.0.0.1"}, {"name": "n2", "address": "10.0.0.2", "drain": True}]}))
    alive = {"n2": {"7001": "serve-1"}, "login": {"7002": "router"}}
    scanned: list[str] = []

    def handler(t: Target, cmd: str) -> tuple[int, str, str]:
        if cmd.startswith("docker ps"):  # the labelled containers: none
            assert "label=k3launch.deployment=lost" in cmd
            return 0, "", ""
        assert "K3_NAME=lost" in cmd  # only this deployment's processes
        if "echo @@procs" in cmd:
            return 0, "@@procs\n" + "".join(f"{p} {i}\n" for p, i in alive[t.name].items()) + "@@containers\n" if t.name in alive else "@@procs\n@@containers\n", ""
        scanned.append(t.name)
        assert 'case "' not in cmd.split("k3_scan | while")[-1].split("echo")[0]  # no process-id filter
        found = alive.get(t.name, {})
        out = "".join(f"{p} {i}\n" for p, i in found.items())
        if "kill -s TERM" in cmd:
            alive.pop(t.name, None)
        return 0, out, ""

    inv = load_inventory(inv_path)
    fleet = Fleet.for_hosts("ssh", inventory_hosts(inv), FakeRunner(handler), FakeRunner(handler))
    report = sweep("lost", fleet, "the machines of lab", grace_s=1)
    assert {"n1", "n2", "login"} <= set(scanned)
    assert report.clean and sorted(report.stopped) == ["router on login", "serve-1 on n2"], report


@pytest.mark.parametrize(("call", "kwargs"), [
    ("status", {"access": {"connect_timeout": float("nan")}}),
    ("status", {"access": {"connect_timeout": -1}}),
    ("down", {"grace": float("inf")}),
    ("logs", {"access": {"connect_timeout": 0}}),
])
def test_the_api_refuses_the_numbers_the_cli_refuses(tmp_path: Path, call: str, kwargs: dict[str, Any]) -> None:
    from k3launch import api

    store = StateStore(tmp_path)
    _sample_record(store, "dep")
    fn = getattr(api, call)
    args = (lambda line: None,) if call == "logs" else ()
    with pytest.raises(K3Error) as exc:  # an Access is checked when made: a script's NaN timeout never reaches a node
        fn("dep", *args, state_dir=tmp_path, **{k: api.Access(**v) if k == "access" else v for k, v in kwargs.items()})
    assert exc.value.code == "bad-value", exc.value
    assert store.exists("dep")  # nothing was done
