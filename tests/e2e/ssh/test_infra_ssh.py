"""The SSH test infrastructure itself (tests/infra/*.sh, tests/support/sshhosts.py) works as promised.

Real sshd hosts (root needed; skipped otherwise): every host answers with its own name, host
keys are checked strictly, a server started over ssh lives inside its host's network, the fault
knobs (stop/start, isolate/heal) do what fault tests rely on, and down leaves nothing behind.
Every wait is bounded; everything started here is killed here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko
import pytest
from infrahelpers import pid_alive, wait_until

if TYPE_CHECKING:
    from sshhosts import Hosts

pytestmark = [pytest.mark.e2e, pytest.mark.ssh]


def _probe(address: str, port: int, timeout: float) -> str:
    """How a host answers a TCP connect to its sshd: banner, refused, or timeout (connect or banner)."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as s:
            s.settimeout(timeout)
            return "banner" if s.recv(64).startswith(b"SSH-") else "closed"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error: {exc}"


def _kill(pid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if wait_until(lambda: not pid_alive(pid), 3):
            return


def _daemonize_over_ssh(hosts: Hosts, name: str, command: str, pidfile: Path) -> int:
    """Start COMMAND on host NAME detached from the ssh session (as k3launch starts engines); its pid."""
    r = hosts.ssh(name, f"nohup setsid sh -c 'echo $$ > {pidfile}; exec {command}' >/dev/null 2>&1 </dev/null &")
    assert r.returncode == 0, r.stderr
    assert wait_until(lambda: pidfile.is_file() and pidfile.read_text().strip().isdigit(), 10), f"{command} did not start on {name}"
    return int(pidfile.read_text())


def test_every_host_answers_with_its_own_name(ssh_hosts: Hosts) -> None:
    assert len(ssh_hosts.names) >= 4
    assert len(set(ssh_hosts.addresses.values())) == len(ssh_hosts.names)
    info = json.loads((ssh_hosts.dir / "hosts.json").read_text())
    assert {"mode", "hosts", "key", "ssh_config", "known_hosts"} <= set(info)
    assert set(info["hosts"][0]) == {"name", "address", "port", "user"}
    with ThreadPoolExecutor(len(ssh_hosts.names)) as pool:
        results = list(pool.map(lambda n: ssh_hosts.ssh(n, "hostname; echo $K3LAUNCH_TEST_HOST"), ssh_hosts.names))
    for name, r in zip(ssh_hosts.names, results, strict=True):
        assert r.returncode == 0, (name, r.stderr)
        assert r.stdout.split() == [name, name]


def test_inventory_of_the_hosts_loads(ssh_hosts: Hosts, tmp_path: Path) -> None:
    from k3launch.planning.inventory import load_inventory

    inv = load_inventory(ssh_hosts.write_inventory(tmp_path / "all.yaml"))
    assert (inv.backend, inv.engine, inv.hardware) == ("ssh", "sim", "b300")
    assert [(n.name, n.address) for n in inv.nodes] == list(ssh_hosts.addresses.items())
    assert inv.defaults.iface == ("eth0" if ssh_hosts.mode == "netns" else "lo")
    assert inv.defaults.python == sys.executable
    assert (inv.ssh_config, inv.known_hosts) == (ssh_hosts.ssh_config, ssh_hosts.known_hosts)
    # the NIC and the interpreter the inventory names exist on the host itself
    a = ssh_hosts.names[0]
    r = ssh_hosts.ssh(a, f"test -e /sys/class/net/{inv.defaults.iface} && {inv.defaults.python} -c 'print(42)'")
    assert (r.returncode, r.stdout.strip()) == (0, "42"), r.stderr
    b = ssh_hosts.names[1]
    sub = load_inventory(ssh_hosts.write_inventory(tmp_path / "two.yaml", hardware="h200", names=[b, a],
                                                  extra={"router": {"node": b}, "defaults": {"workdir": "/tmp"}}))
    assert [n.name for n in sub.nodes] == [b, a]
    assert (sub.hardware, sub.router.node, sub.defaults.workdir, sub.defaults.runtime) == ("h200", b, "/tmp", "bare")


def test_host_keys_are_checked_strictly(ssh_hosts: Hosts, tmp_path: Path) -> None:
    a, b = ssh_hosts.names[:2]
    addr, port = ssh_hosts.addresses[a], ssh_hosts.port

    def connect(known_hosts: Path | str) -> str:
        client = paramiko.SSHClient()
        client.load_host_keys(str(known_hosts))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(addr, port=port, username=ssh_hosts.user, key_filename=ssh_hosts.key, look_for_keys=False,
                           allow_agent=False, timeout=5, banner_timeout=5, auth_timeout=5)
            _, out, _ = client.exec_command("hostname", timeout=10)
            return str(out.read().decode().strip())
        finally:
            client.close()

    assert connect(ssh_hosts.known_hosts) == a
    # a's entries carrying b's key (what a man in the middle with another host's key looks like)
    lines = Path(ssh_hosts.known_hosts).read_text().splitlines()
    key_of = {line.split()[0].split(",")[0]: line.split(None, 1)[1] for line in lines}
    wrong = tmp_path / "wrong_known_hosts"
    wrong.write_text("".join(f"{line.split()[0]} {key_of[b]}\n" for line in lines if line.startswith(f"{a},")))
    with pytest.raises(paramiko.BadHostKeyException):
        connect(wrong)
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        connect(empty)
    # OpenSSH, through the generated ssh_config, refuses the same way
    for known in (wrong, empty):
        r = subprocess.run(["ssh", "-n", "-F", ssh_hosts.ssh_config, "-o", f"UserKnownHostsFile={known}", a, "true"],
                           capture_output=True, text=True, timeout=20)
        assert r.returncode == 255 and "Host key verification failed" in r.stderr, r.stderr


def test_server_started_over_ssh_lives_in_the_host(ssh_hosts: Hosts, tmp_path: Path) -> None:
    if ssh_hosts.mode != "netns":
        pytest.skip("loopback hosts share this machine's network")
    a, b = ssh_hosts.names[:2]
    addr = ssh_hosts.addresses[a]
    with socket.socket() as s:  # a port nobody uses on this machine's own loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pid = _daemonize_over_ssh(ssh_hosts, a, f"{sys.executable} -m http.server --bind {addr} {port}", tmp_path / "http.pid")
    try:
        # it runs in a's network namespace (the pid namespace is shared, so its pid is valid here)
        assert os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{a}").st_ino
        url = f"http://{addr}:{port}/"
        assert wait_until(lambda: _probe(addr, port, 1) != "refused", 10), "http.server did not come up"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200
        assert _probe("127.0.0.1", port, 2) == "refused"
        # and another host reaches it over the bridge, by address
        r = ssh_hosts.ssh(b, f"{sys.executable} -c 'import urllib.request as u; print(u.urlopen(\"{url}\", timeout=5).status)'")
        assert (r.returncode, r.stdout.strip()) == (0, "200"), r.stderr
    finally:
        _kill(pid)
    assert not pid_alive(pid)


def test_stopped_sshd_refuses_and_comes_back(ssh_hosts: Hosts) -> None:
    name, other = ssh_hosts.names[-1], ssh_hosts.names[0]
    addr = ssh_hosts.addresses[name]
    ssh_hosts.stop_host(name)
    try:
        assert ssh_hosts.status()[name] == "down"
        assert wait_until(lambda: _probe(addr, ssh_hosts.port, 3) == "refused", 3)
        t0 = time.monotonic()
        r = ssh_hosts.ssh(name, "true", timeout=10)
        assert r.returncode == 255 and "refused" in r.stderr, r.stderr
        assert time.monotonic() - t0 < 5  # refused is immediate, unlike isolate
        assert ssh_hosts.ssh(other, "hostname").stdout.strip() == other  # the others are unaffected
    finally:
        ssh_hosts.start_host(name)
    assert ssh_hosts.ssh(name, "hostname").stdout.strip() == name


def test_isolated_host_times_out_instead_of_refusing(ssh_hosts: Hosts) -> None:
    name, other = ssh_hosts.names[1], ssh_hosts.names[0]
    addr = ssh_hosts.addresses[name]
    ssh_hosts.isolate(name)
    try:
        assert ssh_hosts.status()[name] == "up isolated"
        t0 = time.monotonic()
        assert _probe(addr, ssh_hosts.port, 3) == "timeout"
        assert 2.9 < time.monotonic() - t0 < 7
        r = ssh_hosts.ssh(name, "true", timeout=15, options=["-o", "ConnectTimeout=2"])
        assert r.returncode == 255 and "timed out" in r.stderr, r.stderr
        assert ssh_hosts.ssh(other, "hostname").stdout.strip() == other
    finally:
        ssh_hosts.heal(name)
    assert _probe(addr, ssh_hosts.port, 3) == "banner"
    assert ssh_hosts.ssh(name, "hostname").stdout.strip() == name


def test_up_again_keeps_the_running_hosts(ssh_hosts: Hosts) -> None:
    if not ssh_hosts.owned:
        pytest.skip("hosts owned by CI (K3LAUNCH_TEST_SSH_DIR)")
    total = len(json.loads((ssh_hosts.dir / "hosts.json").read_text())["hosts"])
    pids = {n: (ssh_hosts.dir / "run" / f"{n}.pid").read_text() for n in ssh_hosts.names}
    from sshhosts import run_infra

    out = run_infra("sshd-up.sh", str(ssh_hosts.dir), env={"SSH_HOSTS": str(total)}, timeout=120)
    assert "0 started now" in out
    assert pids == {n: (ssh_hosts.dir / "run" / f"{n}.pid").read_text() for n in ssh_hosts.names}


def test_down_leaves_nothing_behind(tmp_path: Path) -> None:
    """A set of its own (other names, subnet, bridge, port), so the session's hosts are untouched."""
    from sshhosts import start_hosts_in_free_slot

    if os.geteuid() != 0:
        pytest.skip("sshd test hosts need root")
    etc_hosts = Path("/etc/hosts").read_bytes()
    d = tmp_path / "sshd"
    hosts = start_hosts_in_free_slot(2, d, kind="d")
    try:
        assert hosts.owned and len(hosts.names) == 2
        sshd_pids = [int((d / "run" / f"{n}.pid").read_text()) for n in hosts.names]
        assert all(pid_alive(p) for p in sshd_pids)
        # an "engine" daemonized over ssh: not under sshd any more, down must still find it
        engine = _daemonize_over_ssh(hosts, hosts.names[0], "sleep 300", tmp_path / "engine.pid")
        assert pid_alive(engine)
    finally:
        hosts.down()
    hosts.down()  # twice is fine
    assert not any(pid_alive(p) for p in [*sshd_pids, engine])
    leftovers = [p for p in os.listdir("/proc") if p.isdigit() and str(d).encode() in _cmdline(int(p))]
    assert not leftovers
    assert not any(Path(f"/run/netns/{n}").exists() for n in hosts.names)
    assert not any(Path(f"/sys/class/net/{i}").exists() for i in [f"v-{n}" for n in hosts.names] + [hosts.bridge] if i)
    assert Path("/etc/hosts").read_bytes() == etc_hosts
    registry = Path("/run/k3launch-sshd")
    assert not [f for f in registry.glob("*") if f.is_file() and f.read_text().strip() == str(d)]
    assert not (d / "hosts.json").exists()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
