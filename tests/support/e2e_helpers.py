"""Helpers of the end-to-end tests over real sshd hosts (tests/e2e/ssh/test_e2e_ssh.py, tests/e2e/ssh/test_faults_ssh.py).

* :class:`Cli` runs the real ``k3launch`` CLI in a subprocess of its own session, always bounded
  (on timeout the whole group is killed and the test fails with the output so far).
* :func:`lib_up` / :func:`lib_down` drive the same lifecycle through the library API.
* :func:`leftovers` / :func:`busy_ports` look at *this machine's* ``/proc`` — the test hosts share
  its kernel — for anything of a deployment still alive: a process carrying its
  ``K3LAUNCH_DEPLOYMENT`` marker or running inside its run directory, a planned port still
  listening in the host's network namespace. :func:`engine_processes` / :func:`no_engine_left`
  look for anything of a real vLLM in a namespace by what runs (its process titles, its venv).
* :func:`cleanup` is the safety net of every test's ``finally``: ``k3launch down``, then SIGKILL
  for anything that survived, so one failing test never leaks processes into the next.
* :class:`CutOn` cuts a host's network at a chosen command (the command then meets a silent
  host on an open connection); :func:`ssh_fleet` reaches a plan's nodes with a given connect
  timeout through such a wrapper; :func:`wait_for_record` watches a record change.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sshhosts import Hosts

    from k3launch.models.record import DeploymentRecord

CLI = [sys.executable, "-m", "k3launch"]
# Short loads and latencies; rendezvous that give up within seconds if a rank is missing.
FAST_ENV = {"K3LAUNCH_SIM_LOAD_S": "0.5", "K3LAUNCH_SIM_TTFT_MS": "5", "K3LAUNCH_SIM_ITL_MS": "1",
            "K3LAUNCH_SIM_RENDEZVOUS_TIMEOUT_S": "30"}
MODEL = "moonshotai/Kimi-K3"


def session(hosts: Hosts) -> tuple[str, int]:
    """(name suffix, port offset) of this set of hosts: two test sessions on one machine use
    other slots of tests/infra (another host prefix), and must not share a deployment name (the
    login node's processes are found by name) or the login node's router port."""
    prefix = hosts.names[0].rstrip("0123456789")
    return prefix, (zlib.crc32(prefix.encode()) % 8) * 2000  # tests use 21000-22999 + offset


def inventory(hosts: Hosts, path: Path, env: Mapping[str, str] | None = None, names: Iterable[str] | None = None,
              extra: Mapping[str, Any] | None = None) -> Path:
    """An inventory of the test hosts whose engines get FAST_ENV (+ ``env``) through ``defaults.env``."""
    merged: dict[str, Any] = {"defaults": {"env": {**FAST_ENV, **(env or {})}}}
    for k, v in (extra or {}).items():
        merged[k] = {**merged.get(k, {}), **v} if isinstance(v, Mapping) else v
    return hosts.write_inventory(path, names=names, extra=merged)


def sel_args(sel: Mapping[str, Any]) -> list[str]:
    """Selection keyword arguments → the CLI's options."""
    out: list[str] = []
    for k, v in sel.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


@dataclass
class Cli:
    state_dir: Path

    def env(self) -> dict[str, str]:
        # wide lines: rich must not wrap the messages the tests look for
        return {**os.environ, "K3LAUNCH_STATE_DIR": str(self.state_dir), "COLUMNS": "250", "NO_COLOR": "1"}

    def run(self, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        p = self.start(*args)
        return self.wait(p, timeout, args)

    def start(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*CLI, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=self.env())

    @staticmethod
    def wait(p: subprocess.Popen[str], timeout: float, args: Iterable[str] = ()) -> subprocess.CompletedProcess[str]:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise AssertionError(f"k3launch {' '.join(args)} timed out after {timeout:g}s\nstdout:\n{out}\nstderr:\n{err}") from None
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def json(self, *args: str, timeout: float = 90.0) -> Any:
        r = self.run(*args, "--json", timeout=timeout)
        try:
            return json.loads(r.stdout)
        except json.JSONDecodeError:
            raise AssertionError(f"k3launch {' '.join(args)} --json: exit {r.returncode}, not JSON:\n{r.stdout}\n{r.stderr}") from None

    def records(self) -> dict[str, str]:
        """name → state of every deployment record in the state dir."""
        return {r["name"]: r["state"] for r in self.json("list")}

    def record(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.state_dir / "deployments" / f"{name}.json").read_text())
        return data

    def plan_of(self, *args: str) -> dict[str, Any]:
        """``k3launch plan ARGS --json`` shaped like a record (``name``, ``plan``) for leftovers()."""
        plan = self.json("plan", *args)
        assert "error" not in plan, plan
        return {"name": plan["name"], "plan": plan}

    def wait_started(self, name: str, count: int, proc: subprocess.Popen[str] | None = None, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until ``up`` recorded ``count`` started processes (it is then in its readiness wait)."""
        path = self.state_dir / "deployments" / f"{name}.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                rec = self.record(name)
                if len(rec["processes"]) >= count:
                    return rec
            if proc is not None and proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"up exited {proc.returncode} before starting {count} processes:\n{out}\n{err}")
            time.sleep(0.1)
        raise AssertionError(f"{name}: {count} processes not started within {timeout:g}s")


# ---- library API ---------------------------------------------------------------------------
@dataclass
class Recording:
    """A runner wrapper that records (node, command) of every call (to compare with --dry-run)."""

    inner: Any
    calls: list[tuple[str, str]] = field(default_factory=list)

    def run(self, target: Any, command: str, *, timeout: float = 60.0, env: Mapping[str, str] | None = None) -> Any:
        self.calls.append((target.name, command))
        return self.inner.run(target, command, timeout=timeout, **({} if env is None else {"env": env}))

    def close(self) -> None:
        self.inner.close()


def lib_fleet(inv_path: Path, port_base: int, wrap: Callable[[Any], Any] = lambda r: r, name: str | None = None, **sel: Any) -> Any:
    """plan + Fleet the way a library user builds them (no CLI code involved)."""
    from k3launch.models.selection import Selection
    from k3launch.planning.build import build_plan
    from k3launch.planning.inventory import load_inventory
    from k3launch.planning.recipes import RecipeTree
    from k3launch.transport.fleet import Fleet
    from k3launch.transport.runners import LocalRunner, SshRunner

    inv = load_inventory(inv_path)
    plan = build_plan(RecipeTree(), Selection(**sel), inventory=inv, port_base=port_base, name=name)
    ssh = SshRunner(known_hosts=inv.known_hosts, ssh_config=inv.ssh_config, connect_timeout=5)
    return inv, Fleet.for_plan(plan, wrap(ssh), wrap(LocalRunner()))


def lib_up(inv_path: Path, state_dir: Path, port_base: int, wrap: Callable[[Any], Any] = lambda r: r, name: str | None = None,
           **sel: Any) -> tuple[DeploymentRecord, list[str], Any]:
    """doctor + Launch.up through the library; (record, stages seen, fleet — closed)."""
    from k3launch.deploy.ssh.doctor import doctor
    from k3launch.deploy.ssh.launch import Launch
    from k3launch.deploy.state import StateStore

    inv, fleet = lib_fleet(inv_path, port_base, wrap, name, **sel)
    store = StateStore(state_dir)
    stages: list[str] = []
    try:
        report = doctor(fleet.plan, fleet, [r.name for r in store.list()])
        assert report.ok, report.failures()
        launch = Launch(fleet.plan, fleet, store, inventory=str(inv_path), ssh_config=inv.ssh_config, known_hosts=inv.known_hosts,
                        on_stage=lambda s, m: stages.append(f"{s}: {m}"))
        rec = launch.up(timeout=60)
    finally:
        fleet.close()
    return rec, stages, fleet


def lib_down(name: str, state_dir: Path) -> Any:
    from k3launch.deploy.ssh.teardown import teardown
    from k3launch.deploy.state import StateStore
    from k3launch.transport.fleet import Fleet
    from k3launch.transport.runners import LocalRunner, SshRunner

    store = StateStore(state_dir)
    rec = store.load(name)
    fleet = Fleet.for_plan(rec.plan, SshRunner(known_hosts=rec.known_hosts, ssh_config=rec.ssh_config, connect_timeout=5), LocalRunner())
    try:
        report = teardown(rec, fleet, store)
    finally:
        fleet.close()
    if report.clean:
        store.delete(name)
    return report


# ---- what runs, seen from this machine ------------------------------------------------------
def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def processes(name: str) -> dict[int, str]:
    """pid → process id of every live process of deployment ``name`` on this machine (all test
    hosts share its kernel): by the environment marker, or by a cwd inside its run directory."""
    found: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or _state(d.name) in ("Z", "X"):
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        proc = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"K3LAUNCH_PROCESS=")), "?")
        if f"K3LAUNCH_DEPLOYMENT={name}".encode() in env:
            found[int(d.name)] = proc
            continue
        try:
            cwd = os.readlink(d / "cwd")
        except OSError:
            continue
        if f"/k3launch/{name}/" in cwd + "/" or f"/k3launch/{name}." in cwd:  # <name>.<deployment id>; before ids <name>
            found[int(d.name)] = cwd.rstrip("/").rsplit("/", 1)[-1]
    return found


def netns(pid: int | str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def host_netns(hosts: Hosts, name: str) -> str:
    """The network namespace of test host ``name`` (its sshd's)."""
    pid = (hosts.dir / "run" / f"{name}.pid").read_text().split()[0]
    return netns(pid)


def engine_processes(ns: str) -> dict[int, str]:
    """pid → command line of every live process of vLLM in network namespace ``ns`` (a test host's
    or a Slurm node's), found by what runs, not by k3launch's markers: anything started from the
    engine's venv or renamed by vLLM (``VLLM::EngineCore``, ``VLLM::Worker_TP1``, its API servers,
    the multiprocessing resource tracker). vLLM's setproctitle overwrites the environment that
    carries the markers, and Slurm steps run in the log directory, not in a run directory."""
    found: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or netns(d.name) != ns or _state(d.name) in ("Z", "X"):
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if "vllm" in cmdline.lower():
            found[int(d.name)] = cmdline
    return found


def no_engine_left(namespaces: Iterable[str], wait_s: float = 15.0) -> dict[int, str]:
    """engine_processes of every namespace, polled until none is left or ``wait_s`` passed (this VM
    reaps vLLM's workers a few seconds late)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {pid: cmd for ns in namespaces for pid, cmd in engine_processes(ns).items()}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _listening(pid: int | str) -> set[tuple[str, int]]:
    out: set[tuple[str, int]] = set()
    for f in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{f}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A":
                continue
            addr, port = cols[1].rsplit(":", 1)
            ip = ".".join(str(b) for b in bytes.fromhex(addr)[::-1]) if len(addr) == 8 else ("0.0.0.0" if set(addr) == {"0"} else addr)
            out.add((ip, int(port, 16)))
    return out


def busy_ports(hosts: Hosts, rec: Mapping[str, Any]) -> list[str]:
    """Planned ports of the record's plan that something still listens on (in the host's netns)."""
    busy = []
    for use in rec["plan"]["ports"]:
        node = use["node"]
        pid: int | str = os.getpid() if node not in hosts.addresses else (hosts.dir / "run" / f"{node}.pid").read_text().split()[0]
        socks = _listening(pid)
        if any(p == use["port"] and a in (use["address"], "0.0.0.0") for a, p in socks):
            busy.append(f"{node} {use['address']}:{use['port']} ({use['purpose']})")
    return busy


def leftovers(hosts: Hosts, rec: Mapping[str, Any], wait_s: float = 5.0) -> tuple[dict[int, str], list[str]]:
    """(processes, busy ports) still there after ``wait_s`` (ports may take a moment to close)."""
    deadline = time.monotonic() + wait_s
    while True:
        procs, ports = processes(rec["name"]), busy_ports(hosts, rec)
        if (not procs and not ports) or time.monotonic() > deadline:
            return procs, ports
        time.sleep(0.2)


def kill_all(name: str) -> None:
    for pid in processes(name):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cleanup(cli: Cli, names: Iterable[str]) -> None:
    """finally-block safety net: `k3launch down` every record, then SIGKILL whatever survived."""
    for name in names:
        if (cli.state_dir / "deployments" / f"{name}.json").exists():
            try:
                cli.run("down", name, "--grace", "2", "--connect-timeout", "3", timeout=60)
            except AssertionError:
                pass
        kill_all(name)


# ---- the public endpoint ---------------------------------------------------------------------
def up_copies(cli: Cli, local_inventory: Path, tmp_path: Path, name: str, port_base: int, copies: int,
              defaults: Mapping[str, Any]) -> tuple[str, str]:
    """``copies`` copies of the tiny simulated engine (``single_node_tp``) on the local inventory
    with ``defaults`` over its own (e.g. ``{"env": {"K3LAUNCH_SIM_LOAD_S": "1"}}``), behind the real
    router: (endpoint, model)."""
    import yaml

    inv = yaml.safe_load(local_inventory.read_text())
    inv["defaults"].update(defaults)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(inv))
    r = cli.run("up", "-i", str(path), "--recipe", "k3launch/tiny-llama", "--strategy", "single_node_tp", "--replicas", str(copies),
                "--name", name, "--port-base", str(port_base), "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)["endpoint"], cli.record(name)["plan"]["model"]


def complete(endpoint: str, prompt: str = "Hello from the e2e test", max_tokens: int = 8) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(endpoint.rstrip("/") + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        data: dict[str, Any] = json.loads(r.read())
    return data


def log_sections(text: str) -> dict[str, list[str]]:
    """`k3launch logs` output → process id → its lines."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("==> ") and line.endswith(" <=="):
            cur = line[4:].split()[0]
            out[cur] = []
        elif cur is not None and line.strip():
            out[cur].append(line)
    return out


def local_leftovers(rec: Mapping[str, Any], wait_s: float = 5.0) -> tuple[dict[int, str], list[str]]:
    """:func:`leftovers` of a deployment on the ``local`` backend (every node is this machine)."""
    deadline = time.monotonic() + wait_s
    while True:
        socks = _listening(os.getpid())
        ports = [f"{u['address']}:{u['port']} ({u['purpose']})" for u in rec["plan"]["ports"]
                 if any(p == u["port"] and a in (u["address"], "0.0.0.0") for a, p in socks)]
        procs = processes(rec["name"])
        if (not procs and not ports) or time.monotonic() > deadline:
            return procs, ports
        time.sleep(0.2)


# ---- a host's network cut at a chosen moment -------------------------------------------------
@dataclass
class CutOn:
    """A runner wrapper that cuts ``node``'s network (``Hosts.isolate``) just before it passes on a
    command to that node: the first one ``match`` accepts after ``skip`` accepted ones. That
    command then meets a silent host on an open connection, the moment a real cut is hardest to
    notice. ``cut_at``: ``time.monotonic()`` when the cut began (None: not cut yet). The test heals."""

    inner: Any
    hosts: Hosts
    node: str
    match: Callable[[str], bool] = lambda command: True
    skip: int = 0
    cut_at: float | None = None
    seen: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, target: Any, command: str, *, timeout: float = 60.0, env: Mapping[str, str] | None = None) -> Any:
        if target.name == self.node and self.match(command):
            with self._lock:
                if self.cut_at is None and self.seen >= self.skip:
                    self.cut_at = time.monotonic()
                    self.hosts.isolate(self.node)
                self.seen += 1
        return self.inner.run(target, command, timeout=timeout, **({} if env is None else {"env": env}))

    def close(self) -> None:
        self.inner.close()


def ssh_fleet(plan: Any, ssh_config: str | None, known_hosts: str | None, connect_timeout: float,
              wrap: Callable[[Any], Any] = lambda r: r) -> Any:
    """A Fleet reaching ``plan``'s nodes as ``k3launch --connect-timeout CONNECT_TIMEOUT`` does,
    its SSH runner wrapped by ``wrap`` (e.g. a :class:`CutOn`)."""
    from k3launch.transport.fleet import Fleet
    from k3launch.transport.runners import LocalRunner, SshRunner

    ssh = SshRunner(known_hosts=known_hosts, ssh_config=ssh_config, connect_timeout=connect_timeout)
    return Fleet.for_plan(plan, wrap(ssh), LocalRunner())


def wait_for_record(cli: Cli, name: str, pred: Callable[[dict[str, Any]], bool], within: float,
                    proc: subprocess.Popen[str] | None = None) -> tuple[float, dict[str, Any]]:
    """(time.monotonic() when first seen, the record) once deployment ``name``'s record satisfies
    ``pred``, polled every 20 ms; fails after ``within`` s, or when ``proc`` exits first."""
    path = cli.state_dir / "deployments" / f"{name}.json"
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            rec: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):  # not there (yet), or another writer's moment
            rec = {}
        if rec and pred(rec):
            return time.monotonic(), rec
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before the record changed as expected:\n{out}\n{err}")
        time.sleep(0.02)
    raise AssertionError(f"{name}: the record did not change as expected within {within:g}s")


# ---- supervision: events, and a steady bounded client load ----------------------------------
def events(cli: Cli, name: str) -> list[dict[str, Any]]:
    """The deployment's event log (k3launch events --json), read from the state directory."""
    path = cli.state_dir / "events" / f"{name}.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def wait_event(cli: Cli, name: str, kind: str, unit: str | None = None, after: float = 0.0, within: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for e in events(cli, name):
            if e["kind"] == kind and (unit is None or e.get("unit") == unit) and e["time"] >= after:
                return e
        time.sleep(0.1)
    raise AssertionError(f"no {kind} event for {unit or name} within {within:g}s: {events(cli, name)}")


def try_complete(endpoint: str, model: str, timeout: float = 60.0) -> str | None:
    """One small completion: None when it came back with a choice, else what went wrong."""
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(endpoint + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return None if json.loads(r.read())["choices"] else "no choices"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:200]!r}"
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        return f"{type(exc).__name__}: {exc}"


def openai_completer(endpoint: str, model: str, timeout: float = 60.0) -> Callable[[], str | None]:
    """One small completion at a time through the official OpenAI client (no retries of its own:
    every failure the deployment lets through is counted); None when a choice came back."""
    from openai import OpenAI, OpenAIError

    client = OpenAI(base_url=endpoint + "/v1", api_key="k3launch-tests", max_retries=0, timeout=timeout)

    def ask() -> str | None:
        try:
            return None if client.completions.create(model=model, prompt="hello", max_tokens=4).choices else "no choices"
        except OpenAIError as exc:
            return f"{type(exc).__name__}: {exc}"[:300]

    return ask


@dataclass
class Load:
    """A steady, bounded client load: ``workers`` clients one request after another, at most ``limit`` requests."""

    endpoint: str
    model: str
    workers: int = 4
    limit: int = 3000
    pause: float = 0.02  # seconds each client waits between two requests
    client: str = "urllib"  # or "openai": the official OpenAI client, as applications call a deployment
    ok: int = 0
    failed: int = 0
    failures: list[tuple[float, str]] = field(default_factory=list)  # (time, what went wrong) of each failed request
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _work(self) -> None:
        ask = openai_completer(self.endpoint, self.model) if self.client == "openai" else lambda: try_complete(self.endpoint, self.model)
        while not self.stop.is_set():
            with self._lock:
                if self.ok + self.failed >= self.limit:
                    return
            why = ask()
            with self._lock:
                self.ok += why is None
                self.failed += why is not None
                if why is not None:
                    self.failures.append((time.time(), why))
            self.stop.wait(self.pause)

    def __enter__(self) -> Load:
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(self.workers)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=60)
