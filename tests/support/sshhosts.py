"""Real OpenSSH "hosts" on this machine for k3launch's end-to-end tests.

A thin pytest-side wrapper of ``tests/infra/sshd-{up,down,ctl}.sh`` (read sshd-up.sh for what a
host is: one sshd per network namespace, its own address and hostname, key-only root login,
strict host keys). Root is needed.

    def test_something(ssh_hosts, tmp_path):
        inv = ssh_hosts.write_inventory(tmp_path / "inv.yaml")     # k3launch inventory of the hosts
        ssh_hosts.ssh(ssh_hosts.names[0], "hostname")              # -> CompletedProcess
        ssh_hosts.stop_host("k3h2"); ssh_hosts.start_host("k3h2")  # sshd killed / back
        ssh_hosts.isolate("k3h3"); ssh_hosts.heal("k3h3")          # host silent / back

The root ``tests/conftest.py`` registers this module as a plugin (``pytest_plugins``), so the
``ssh_hosts`` fixture is one for the whole session, whichever tier folders use it; it is loaded
before any test module, so tests may import its names at module level.

CI may own the hosts instead: ``bash tests/infra/sshd-up.sh DIR && . DIR/env.sh`` exports
``K3LAUNCH_TEST_SSH_DIR``; the helpers then reuse those hosts and never stop them. With
``K3LAUNCH_TEST_SSH_REQUIRED=1`` the fixture fails instead of skipping when hosts cannot start
(so CI cannot go green by skipping). ``K3LAUNCH_TEST_SSH_HOSTS`` raises the fixture's host
count above its default of 4. sshd-up.sh knobs in the environment (SSH_MODE=loopback, ...) apply.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from infrahelpers import InfraError as InfraError
from infrahelpers import SessionInfra, in_first_free_slot, run_script, up_or_clean_up

ENV_DIR = "K3LAUNCH_TEST_SSH_DIR"
ENV_REQUIRED = "K3LAUNCH_TEST_SSH_REQUIRED"
ENV_COUNT = "K3LAUNCH_TEST_SSH_HOSTS"
NEEDS_ROOT = "sshd test hosts need root (sshd for root logins, network namespaces)"


def run_infra(script: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120.0) -> str:
    """Run ``tests/infra/SCRIPT ARGS`` (this process's environment plus ``env``) and return its stdout;
    raise InfraError on failure or timeout (then its whole process group is killed: infrahelpers.run_script)."""
    return run_script(script, *args, env={**os.environ, **(env or {})}, timeout=timeout)


@dataclass(frozen=True)
class Hosts:
    """Running sshd hosts, as described by ``DIR/hosts.json``."""

    dir: Path
    mode: str  # "netns" or "loopback"
    names: list[str]
    addresses: dict[str, str]  # name -> address (the engines' address too)
    port: int
    user: str
    key: str  # client private key
    ssh_config: str
    known_hosts: str
    iface: str  # the hosts' NIC: eth0 in their namespace (netns), lo (loopback)
    login_address: str  # how the hosts reach this (login) machine
    bridge: str  # the private bridge (netns mode), "" in loopback mode
    owned: bool  # started by us (and so stopped by us), not by CI

    @classmethod
    def load(cls, dir: Path | str, *, owned: bool) -> Hosts:
        d = Path(dir)
        info = json.loads((d / "hosts.json").read_text())
        hosts = info["hosts"]
        return cls(dir=d, mode=info["mode"], names=[h["name"] for h in hosts],
                   addresses={h["name"]: h["address"] for h in hosts}, port=int(hosts[0]["port"]), user=hosts[0]["user"],
                   key=info["key"], ssh_config=info["ssh_config"], known_hosts=info["known_hosts"],
                   iface=info.get("iface", "eth0" if info["mode"] == "netns" else "lo"),
                   login_address=info.get("login_address", "127.0.0.1"), bridge=info.get("bridge", ""), owned=owned)

    def first(self, n: int) -> Hosts:
        names = self.names[:n]
        return replace(self, names=names, addresses={k: self.addresses[k] for k in names})

    # ---- use ----------------------------------------------------------------------------
    def ssh(self, name: str, command: str, *, timeout: float = 20.0, options: Iterable[str] = ()) -> subprocess.CompletedProcess[str]:
        """``ssh -F ssh_config [OPTIONS] NAME COMMAND`` (stdin closed); never raises on a non-zero exit."""
        try:
            return subprocess.run(["ssh", "-n", "-F", self.ssh_config, *options, name, command], capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, 124, str(exc.stdout or ""), f"timed out after {timeout:g}s")

    @contextmanager
    def own_cores(self, names: Iterable[str]) -> Iterator[dict[str, int]]:
        """Each of ``names`` on a core of its own while the block runs (the i-th on core i modulo
        the cores this process may use), as separate machines would be: everything its sshd starts
        inherits the listener's CPU mask. Yields name -> core; the masks are restored after.

        The hosts share one kernel, and on this machine kind that kernel can leave a process
        that moves itself onto a core kept busy by another host's pinned engine (torch's MKL
        pins itself to each core in turn at import) stuck for good: state R, no CPU time, in
        ``affine_move_task`` (docs/development.md, the real-engine tier). A one-core mask
        means no such move."""
        cores = sorted(os.sched_getaffinity(0))
        pinned: dict[str, tuple[int, set[int]]] = {}
        try:
            for i, name in enumerate(names):
                pid = int((self.dir / "run" / f"{self._known(name)}.pid").read_text().split()[0])
                pinned[name] = (pid, os.sched_getaffinity(pid))
                os.sched_setaffinity(pid, {cores[i % len(cores)]})
            yield {n: cores[i % len(cores)] for i, n in enumerate(pinned)}
        finally:
            for pid, mask in pinned.values():
                try:
                    os.sched_setaffinity(pid, mask)
                except OSError:  # the host was stopped meanwhile
                    pass

    # ---- faults (sshd-ctl.sh) -----------------------------------------------------------
    def stop_host(self, name: str) -> None:
        """Kill NAME's sshd (listener and sessions): connections are refused until start_host."""
        run_infra("sshd-ctl.sh", str(self.dir), "stop", self._known(name), timeout=30)

    def start_host(self, name: str) -> None:
        """Start NAME's sshd again; returns once it answers a login (unless isolated)."""
        run_infra("sshd-ctl.sh", str(self.dir), "start", self._known(name), timeout=60)

    def isolate(self, name: str) -> None:
        """Make NAME silent: connections hang until the client's timeout, nothing is refused."""
        run_infra("sshd-ctl.sh", str(self.dir), "isolate", self._known(name), timeout=30)

    def heal(self, name: str) -> None:
        """Undo isolate; returns once NAME answers a login again (if its sshd runs)."""
        run_infra("sshd-ctl.sh", str(self.dir), "heal", self._known(name), timeout=60)

    def status(self) -> dict[str, str]:
        """name -> "up" / "down" / "up isolated" / ... for every host of DIR."""
        out = run_infra("sshd-ctl.sh", str(self.dir), "status", timeout=30)
        return {parts[0]: " ".join(parts[2:]) for parts in (line.split() for line in out.splitlines()) if parts}

    def down(self) -> None:
        """Stop every host of DIR (sshd-down.sh) -- only if we started them; CI stops its own."""
        if self.owned:
            run_infra("sshd-down.sh", str(self.dir), timeout=120)

    def _known(self, name: str) -> str:
        if name not in self.addresses:
            raise ValueError(f"{name!r} is not one of {self.names}")
        return name

    # ---- k3launch inventory -------------------------------------------------------------
    def write_inventory(self, path: Path | str, hardware: str = "b300", engine: str = "sim", runtime: str = "bare",
                        names: Iterable[str] | None = None, extra: Mapping[str, Any] | None = None) -> Path:
        """Write a k3launch inventory (backend ssh) of these hosts (or of ``names``, in that order).

        ``iface`` is the NIC inside a host (eth0 / lo); ``python`` is this interpreter, which the
        hosts can run because they share this machine's filesystem. ``extra`` is merged in last
        (nested mappings key by key), e.g. ``{"router": {"node": "k3h1"}}``.
        """
        chosen = [self._known(n) for n in (self.names if names is None else names)]
        inv: dict[str, Any] = {
            "name": f"ssh-test-{self.mode}",
            "backend": "ssh",
            "hardware": hardware,
            "engine": engine,
            "description": f"{len(chosen)} sshd test hosts ({self.mode} mode) from tests/infra/sshd-up.sh {self.dir}",
            "defaults": {
                "user": self.user,
                "port": self.port,
                "identity_file": self.key,
                "runtime": runtime,
                "iface": self.iface,
                "cpu_memory_gb": 4096,
                "python": sys.executable,
            },
            "nodes": [{"name": n, "address": self.addresses[n]} for n in chosen],
            "ssh_config": self.ssh_config,
            "known_hosts": self.known_hosts,
        }
        _merge(inv, extra or {})
        out = Path(path)
        out.write_text(yaml.safe_dump(inv, sort_keys=False))
        return out


def _merge(into: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def start_hosts(n: int = 4, dir: Path | str | None = None, *, reuse: bool = True, env: Mapping[str, str] | None = None,
                timeout: float | None = None) -> Hosts:
    """Start ``n`` hosts with state in ``dir`` (sshd-up.sh; idempotent) and describe them.

    With ``reuse`` and ``K3LAUNCH_TEST_SSH_DIR`` set to a directory holding hosts.json, those
    running hosts are used instead (grown to ``n`` if CI started fewer) and ``owned`` is False.
    ``env`` passes sshd-up.sh knobs (SSH_MODE, SSH_HOST_PREFIX, SSH_SUBNET, SSH_BRIDGE, SSH_PORT).
    """
    ci_dir = os.environ.get(ENV_DIR)
    if reuse and ci_dir and (Path(ci_dir) / "hosts.json").is_file():
        hosts = Hosts.load(ci_dir, owned=False)
        if len(hosts.names) < n:
            run_infra("sshd-up.sh", ci_dir, env={"SSH_HOSTS": str(n)}, timeout=timeout or 120 + 3 * n)
            hosts = Hosts.load(ci_dir, owned=False)
        return hosts.first(n)
    if dir is None:
        raise ValueError("start_hosts needs a state directory (or K3LAUNCH_TEST_SSH_DIR)")
    if os.geteuid() != 0:
        raise InfraError(NEEDS_ROOT)
    # generous: the first run may apt-get install openssh-server; a failed up is cleaned up (sshd-down.sh)
    up_or_clean_up(run_infra, "sshd-up.sh", "sshd-down.sh", dir, env={**(env or {}), "SSH_HOSTS": str(n)}, timeout=timeout or 300 + 3 * n)
    return Hosts.load(dir, owned=True)


# ---- several sets on one machine ---------------------------------------------------------
# Developers and CI jobs may run the suite at the same time on one box. Host names, bridge,
# subnet and loopback port are machine-wide, and sshd-up.sh refuses those another DIR owns, so
# each set takes the first free "slot". Slot 0 of kind "h" is sshd-up.sh's plain default (k3h*,
# 10.213.0.0/24, k3lbr0, port 22 / 2222); other kinds are for sets a test makes of its own.
_SLOT_KNOBS = ("SSH_HOST_PREFIX", "SSH_SUBNET", "SSH_BRIDGE", "SSH_PORT")
_TAKEN = ("belongs to", "already in use", "something else listens")  # sshd-up.sh's refusals


def slot_env(slot: int, kind: str = "h") -> dict[str, str]:
    """sshd-up.sh knobs of slot ``slot`` (0..7) for sets of kind ``kind`` (one letter)."""
    idx = 2 * slot + (0 if kind == "h" else 1)
    env = {"SSH_HOST_PREFIX": f"k3{kind}{'' if slot == 0 else 'abcdefg'[slot - 1]}", "SSH_SUBNET": f"10.213.{idx}",
           "SSH_BRIDGE": f"k3lbr{idx}"}
    if idx:
        env["SSH_PORT"] = str(2222 + idx)
    return env


def start_hosts_in_free_slot(n: int, dir: Path | str, kind: str = "h", slots: int = 8) -> Hosts:
    """start_hosts (never reusing CI's) in the first slot no other running set holds.

    Knobs set explicitly in the environment (SSH_HOST_PREFIX, ...) win and disable the search.
    """
    return in_first_free_slot(lambda env: start_hosts(n, dir, reuse=False, env=env), lambda slot: slot_env(slot, kind),
                              slot_knobs=_SLOT_KNOBS, taken=_TAKEN, slots=slots)


# ---- pytest fixture ---------------------------------------------------------------------
_SESSION: SessionInfra[Hosts] = SessionInfra(ENV_REQUIRED, NEEDS_ROOT, "sshd test hosts could not start")


@pytest.fixture(scope="session")
def ssh_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    """The session's sshd hosts (4, or K3LAUNCH_TEST_SSH_HOSTS if more).

    Skips the test (with the reason) when not root or when the hosts cannot start (fails instead
    with K3LAUNCH_TEST_SSH_REQUIRED=1). Stops them at the end of the session, unless they came
    from K3LAUNCH_TEST_SSH_DIR (then CI owns them).
    """
    n = max(4, int(os.environ.get(ENV_COUNT, "4")))

    def start() -> Hosts:
        if os.environ.get(ENV_DIR):
            return start_hosts(n)
        return start_hosts_in_free_slot(n, tmp_path_factory.mktemp("sshd"))

    yield from _SESSION.provide(start)
