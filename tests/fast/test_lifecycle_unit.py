"""Launch, teardown and doctor logic against a fake runner (no processes, no network)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from paths import ROOT

from k3launch.deploy.ssh.doctor import doctor
from k3launch.deploy.ssh.launch import Launch
from k3launch.deploy.ssh.teardown import teardown
from k3launch.deploy.state import StateStore
from k3launch.models.record import ProcessRecord, SshRecord
from k3launch.models.reports import LaunchFailed
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import load_inventory
from k3launch.planning.recipes import RecipeTree
from k3launch.render import snippets as remote
from k3launch.testing import FakeRunner
from k3launch.transport.fleet import Fleet
from k3launch.transport.runners import Target


def _plan(**kw):  # type: ignore[no-untyped-def]
    return build_plan(RecipeTree(), Selection(**kw), inventory=load_inventory(ROOT / "inventories" / "local.yaml"))


def _record(plan, procs):  # type: ignore[no-untyped-def]
    rec = SshRecord(name=plan.name, state="ready", created=0, updated=0, endpoint=plan.endpoint, plan=plan)
    for p in plan.processes:
        rec.processes[p.id] = ProcessRecord(id=p.id, node=p.node, runtime="bare", handle=procs[p.id], log=f"/tmp/{p.id}.log", started=True)
    return rec


def _signal_step(cmd: str) -> tuple[list[str], str | None, set[str]] | None:
    """Parse remote.find_and_signal: (process ids of the phase, signal or None, pids skipped)."""
    m = re.search(r'case " (.*?) " in \*" \$p "\*\)', cmd)
    if m is None:
        return None
    sig = re.search(r"kill -s (\w+) -- ", cmd)
    skip = re.search(r'case " (.*?) " in \*" \$pid "\*\) continue', cmd)
    return m.group(1).split(), sig.group(1) if sig else None, set(skip.group(1).split()) if skip else set()


def test_teardown_stops_router_then_heads_then_headless(tmp_path: Path) -> None:
    plan = _plan(strategy="pd_cluster", prefill_nodes=2)  # prefill TEP on 2 nodes: one headless rank
    pids = {p.id: str(1000 + i) for i, p in enumerate(plan.processes)}
    alive = set(pids.values())
    order: list[list[str]] = []

    def handler(t: Target, cmd: str) -> tuple[int, str, str]:
        step = _signal_step(cmd)
        if step is not None:
            ids, sig, skip = step
            found = {p: pid for p, pid in pids.items() if p in ids and pid in alive}
            if sig == "TERM" and found:
                order.append(sorted(found))
                alive.difference_update(pid for pid in found.values() if pid not in skip)
            return 0, "".join(f"{pid} {p}\n" for p, pid in found.items()), ""
        if "echo @@procs" in cmd:  # verify: whatever is still alive
            return 0, "@@procs\n" + "".join(f"{pid} {p}\n" for p, pid in pids.items() if pid in alive) + "@@listening\n", ""
        return 0, "", ""

    store = StateStore(tmp_path)
    rec = _record(plan, pids)
    report = teardown(rec, Fleet.for_plan(plan, FakeRunner(handler), FakeRunner(handler)), store, grace_s=1)
    assert report.clean, report
    flat = [p for grp in order for p in grp]
    assert flat.index("router") < flat.index("prefill-0") < flat.index("prefill-1")
    assert flat.index("decode-0") < flat.index("prefill-1")  # heads before any headless rank
    assert set(flat) == set(pids)


def test_teardown_escalates_to_sigkill_and_signals_each_pid_once(tmp_path: Path) -> None:
    plan = _plan()
    pids = {p.id: str(2000 + i) for i, p in enumerate(plan.processes)}
    signals: list[tuple[str, frozenset[str]]] = []
    killed: set[str] = set()

    def handler(t: Target, cmd: str) -> tuple[int, str, str]:
        step = _signal_step(cmd)
        if step is not None:
            ids, sig, skip = step
            found = {p: pid for p, pid in pids.items() if p in ids and pid not in killed}
            if sig:
                signals.append((sig, frozenset(skip)))
            if sig == "KILL":  # SIGTERM is ignored: the process traps it
                killed.update(found.values())
            return 0, "".join(f"{pid} {p}\n" for p, pid in found.items()), ""
        if "echo @@procs" in cmd:
            return 0, "@@procs\n@@listening\n", ""
        return 0, "", ""

    store = StateStore(tmp_path)
    report = teardown(_record(plan, pids), Fleet.for_plan(plan, FakeRunner(handler), FakeRunner(handler)), store, grace_s=0.3)
    kinds = [k for k, _ in signals]
    assert "TERM" in kinds and "KILL" in kinds and kinds.index("TERM") < kinds.index("KILL")
    # after the first SIGTERM every later one skips the pids already signalled (vLLM treats a
    # second SIGTERM as "exit now")
    assert signals[0][1] == frozenset() and all(skip >= set(pids.values()) for k, skip in signals[1:] if k == "TERM")
    assert report.clean


def test_dead_processes_and_unreachable_node(tmp_path: Path) -> None:
    plan = _plan(strategy="multi_node_tp", nodes=2)
    pids = {p.id: str(3000 + i) for i, p in enumerate(plan.processes)}

    def handler(t: Target, cmd: str) -> tuple[int, str, str]:
        return 0, "".join(f"{pid} {'down' if p == 'serve-1' else 'up'}\n" for p, pid in pids.items()), ""

    launch = Launch(plan, Fleet.for_plan(plan, FakeRunner(handler), FakeRunner(handler)), StateStore(tmp_path))
    assert launch.dead_processes(_record(plan, pids)) == ["serve-1"]

    def broken() -> FakeRunner:  # every node stopped answering
        return FakeRunner(handler, fail_on=[h.name for h in plan.hosts])

    launch = Launch(plan, Fleet.for_plan(plan, broken(), broken()), StateStore(tmp_path))
    with pytest.raises(LaunchFailed) as e:
        launch.dead_processes(_record(plan, pids))
    assert "stopped answering" in e.value.message


def test_doctor_judges_ports_leftovers_and_skips_gpus_for_sim() -> None:
    plan = _plan().model_copy(update={"backend": "ssh"})  # nodes of their own (local: tests/fast/test_faults_isolation.py)
    node = plan.processes[0].node
    addr = plan.processes[0].address
    port = plan.processes[0].http_port
    # a foreign listener on the planned HTTP port of that address, and an engine of a dead deployment
    hex_addr = "".join(f"{int(x):02X}" for x in reversed(addr.split(".")))
    listening = f"{hex_addr}:{port:04X}\n"

    def handler(t: Target, cmd: str) -> tuple[int, str, str]:
        out = f"@@listening\n{listening}@@procs\n4242 old-deployment serve-0\n@@runtime\nok\n@@shm\n"
        return 0, out, ""

    report = doctor(plan, Fleet.for_plan(plan, FakeRunner(handler), FakeRunner(handler)), live_deployments=[])
    by = {(c.node, c.name): c for c in report.checks}
    assert by[(node, "ports")].status == "fail" and str(port) in by[(node, "ports")].detail
    assert by[(node, "leftovers")].status == "fail" and "old-deployment" in by[(node, "leftovers")].detail
    assert by[(node, "gpus")].status == "skip"
    assert not report.ok and node in report.failed_nodes()


def test_parse_listening_ipv4_and_wildcard() -> None:
    got = remote.parse_listening("0B00007F:1F40 00000000:0050 00000000000000000000000000000000:1F90")
    assert ("127.0.0.11", 8000) in got and ("0.0.0.0", 80) in got and ("0.0.0.0", 8080) in got
    assert remote.port_busy(got, "10.0.0.1", 80) and not remote.port_busy(got, "127.0.0.12", 8000)


def test_an_orphan_of_a_killed_engine_is_found_by_its_session_and_stopped(tmp_path: Path) -> None:
    """A worker whose engine was SIGKILLed leaves the engine's process group alive without its
    leader; when setproctitle left pieces of its environment (no marker, but '=' in it) neither
    the marker nor the run directory finds it: the recorded engine pid, its session id, does."""
    import os
    import signal
    import subprocess
    import time

    from k3launch.render.snippets import find_and_signal

    run = tmp_path / "k3launch" / "orph" / "serve-1"
    run.mkdir(parents=True)
    leader = subprocess.Popen(["setsid", "bash", "-c", f"cd {run} && env -i LEFT=over sleep 300 & echo $! > {run}/child; wait"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child_file = run / "child"
    deadline = time.monotonic() + 10
    while not (child_file.exists() and child_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    child = int(child_file.read_text())
    # setsid forks when it is a group leader already: the session id is the one bash got
    sid = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[3]
    try:
        os.killpg(int(sid), 0)
        os.kill(int(sid), signal.SIGKILL)  # the engine dies; its worker stays, orphaned
        leader.wait(timeout=10)
        blind = subprocess.run(["bash", "-c", find_and_signal("orph", ["serve-1"], None)], capture_output=True, text=True, check=True)
        assert str(child) not in blind.stdout  # the marker scan alone misses it
        got = subprocess.run(["bash", "-c", find_and_signal("orph", ["serve-1"], "KILL", (), {sid: "serve-1"})],
                             capture_output=True, text=True, check=True)
        assert f"{child} serve-1" in got.stdout.splitlines()
        deadline = time.monotonic() + 5
        while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the orphan was not killed"
            time.sleep(0.05)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass


def test_stale_shared_memory_goes_and_what_a_process_maps_stays() -> None:
    """A SIGKILLed engine leaves its psm_* segments; a restart removes those nobody maps."""
    import subprocess
    from multiprocessing import resource_tracker, shared_memory

    from k3launch.render.snippets import STALE_SHM

    left = shared_memory.SharedMemory(create=True, size=4096, name=f"psm_k3left{os.getpid()}")
    left.close()  # nobody maps it now: a killed engine's
    resource_tracker.unregister(left._name, "shared_memory")  # type: ignore[attr-defined]  # removed below, not at exit
    held = shared_memory.SharedMemory(create=True, size=4096, name=f"psm_k3held{os.getpid()}")
    # named semaphores: one left by a process gone, one a live process maps (under glibc's temporary name)
    sem = "import _multiprocessing, sys, time; s = _multiprocessing.SemLock(1, 1, 1, sys.argv[1], False); print(flush=True); time.sleep(float(sys.argv[2]))"
    sem_left, sem_held = Path(f"/dev/shm/sem.mp-k3l{os.getpid()}"), Path(f"/dev/shm/sem.mp-k3h{os.getpid()}")
    subprocess.run([sys.executable, "-c", sem, f"/mp-k3l{os.getpid()}", "0"], check=True, capture_output=True)
    holder = subprocess.Popen([sys.executable, "-c", sem, f"/mp-k3h{os.getpid()}", "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "\n"  # made and mapped
        assert sem_left.exists() and sem_held.exists()
        out = subprocess.run(["bash", "-c", STALE_SHM], capture_output=True, text=True, check=True).stdout.split()
        assert f"/dev/shm/{left.name}" in out and not Path(f"/dev/shm/{left.name}").exists()
        assert f"/dev/shm/{held.name}" not in out and Path(f"/dev/shm/{held.name}").exists()
        assert str(sem_left) in out and not sem_left.exists()
        assert str(sem_held) not in out and sem_held.exists()  # its holder maps it: only the inode says so
    finally:
        holder.kill()
        holder.wait()
        held.close()
        held.unlink()
        for f in (Path(f"/dev/shm/{left.name}"), sem_left, sem_held):
            f.unlink(missing_ok=True)


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_session_cpu_counts_every_member_and_stands_still_when_stopped(shell: str) -> None:
    """A session's CPU ticks (the busy member is a child: the leader itself only waits) grow while
    it works and stand still while it is stopped; the leader's state and wait channel come along;
    a comm with spaces and parentheses does not shift the fields; an unknown session prints nothing."""
    import signal
    import subprocess
    import time

    from k3launch.render.snippets import parse_session_cpu, session_cpu

    busy = "exec -a 'odd (name) x' python3 -c 'while 1: pass'"
    leader = subprocess.Popen(["bash", "-c", f"({busy}) & wait"], start_new_session=True)
    sid = str(leader.pid)

    def look() -> dict[str, tuple[int, str]]:
        out = subprocess.run([shell, "-c", session_cpu([sid, "999999999", "x;rm"])], capture_output=True, text=True, check=True)
        return parse_session_cpu(out.stdout)

    try:
        time.sleep(0.5)
        first = look()
        time.sleep(0.5)
        second = look()
        assert set(first) == {sid} and second[sid][0] > first[sid][0] > 0, (first, second)
        assert second[sid][1].startswith("state S"), second  # bash waits for its child
        os.killpg(leader.pid, signal.SIGSTOP)
        time.sleep(0.2)
        stopped = look()
        time.sleep(0.6)
        assert look()[sid][0] == stopped[sid][0] and look()[sid][1].startswith("state T"), stopped
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)
    assert parse_session_cpu(subprocess.run(["sh", "-c", session_cpu([sid])], capture_output=True, text=True).stdout) == {}
    assert session_cpu(["x;rm -rf /"]) == "true"  # nothing but digits ever reaches the script
