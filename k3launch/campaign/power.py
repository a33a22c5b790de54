"""GPU power samples from every node of a deployment while a load point runs.

Each node is read with the first tool it has: ``nvidia-smi --query-gpu=power.draw`` (NVIDIA),
else ``amd-smi metric --power --csv``, else ``rocm-smi --showpower --csv`` (ROCm). Where the
reading goes through:

* ssh and local deployments: the deployment's fleet (:func:`k3launch.api.fleet`: the SSH
  connections k3launch holds, or this machine), one reading of every node in parallel every
  :data:`PERIOD_S`, stamped with the login node's clock at the middle of the round trip, so
  the nodes' clocks never matter;
* Slurm deployments: one ``srun --overlap`` step over the job's nodes, each task printing a
  stamped reading every :data:`PERIOD_S` until it is stopped (Slurm nodes keep their clocks
  in step).

A sampler never fails a load point: whatever goes wrong (no tool, a node that stops answering)
ends up as the reason its :class:`~k3launch.campaign.energy.Energy` is not valid.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from k3launch.campaign.energy import Energy, Sample, energy
from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.models.bench import BenchMetrics
    from k3launch.models.record import DeploymentRecord
    from k3launch.transport.fleet import Fleet

PERIOD_S = 0.5  # two readings a second: the floor is one
READ_TIMEOUT_S = 5.0
SETTLE_S = 15.0  # how long a Slurm step may take to print its first readings
TOOLS = ("nvidia-smi", "amd-smi", "rocm-smi")
NO_TOOL = "none"
MARK = "K3POWER"

_READ = {
    "nvidia-smi": "nvidia-smi --query-gpu=power.draw --format=csv,noheader,nounits",
    "amd-smi": "amd-smi metric --power --csv",
    "rocm-smi": "rocm-smi --showpower --csv",
}


def probe(address: str | None = None) -> str:
    """A shell command printing ``#<tool>`` and then the tool's reading (``#none`` without one).
    ``K3LAUNCH_NODE_ADDRESS`` tells the simulated nodes' stand-in which node it reads."""
    branches = " el".join(f"if command -v {t} >/dev/null 2>&1; then echo '#{t}'; {_READ[t]}; " for t in TOOLS)
    env = f"K3LAUNCH_NODE_ADDRESS={shlex.quote(address)}; export K3LAUNCH_NODE_ADDRESS; " if address else ""
    return f"({env}{branches}else echo '#{NO_TOOL}'; fi)"


def parse(text: str) -> tuple[str, tuple[float, ...]]:
    """(tool, watts per GPU) from :func:`probe`'s output; GPUs that say N/A are left out."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("#"):
        return NO_TOOL, ()
    tool, body = lines[0][1:], lines[1:]
    if tool == "nvidia-smi":
        return tool, tuple(w for w in (_number(ln) for ln in body) if w is not None)
    return tool, _csv_power(body)


def _number(raw: str) -> float | None:
    try:
        v = float(raw.strip().removesuffix("W").strip())
    except ValueError:
        return None  # "[N/A]", "N/A": a GPU that does not report power
    return v if v >= 0 else None


def _csv_power(lines: list[str]) -> tuple[float, ...]:
    """amd-smi/rocm-smi CSV: the first column whose header names a power (not a cap or limit)."""
    rows = list(csv.reader(io.StringIO("\n".join(ln for ln in lines if "," in ln))))
    if len(rows) < 2:
        return ()
    cols = [i for i, h in enumerate(rows[0]) if "power" in h.lower() and not any(w in h.lower() for w in ("cap", "limit", "management"))]
    out = []
    for row in rows[1:]:
        for i in cols:
            w = _number(row[i]) if i < len(row) else None
            if w is not None:
                out.append(w)
                break
    return tuple(out)


@dataclass
class Trace:
    """What a sampler collected: readings per node, the tools read, the first problem met."""

    nodes: list[str]
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    tools: set[str] = field(default_factory=set)
    problem: str | None = None  # why nothing can be measured (no tool, no step)
    errors: list[str] = field(default_factory=list)  # readings that failed (a gap, if they last)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, node: str, t: float, tool: str, watts: tuple[float, ...]) -> None:
        with self.lock:
            if tool == NO_TOOL or not watts:
                why = f"none of {', '.join(TOOLS)} there" if tool == NO_TOOL else f"{tool} printed no figure"
                self.problem = self.problem or f"{node}: no GPU power reading ({why})"
                return
            self.samples.setdefault(node, []).append(Sample(t, watts))
            self.tools.add(tool)

    def fail(self, why: str, fatal: bool = False) -> None:
        with self.lock:
            if fatal:
                self.problem = self.problem or why
            else:
                self.errors.append(why)

    @property
    def source(self) -> str:
        return "+".join(sorted(self.tools)) or NO_TOOL

    @property
    def measured(self) -> bool:
        """Whether anything was read at all (a deployment without any power tool is not measured)."""
        return bool(self.samples)


class Sampler(Protocol):
    def start(self) -> None: ...

    def stop(self) -> Trace: ...


class FleetSampler:
    """Reads every node through the fleet, in parallel, every ``period`` seconds."""

    def __init__(self, fleet: Fleet, addresses: Mapping[str, str], period: float = PERIOD_S) -> None:
        self.fleet = fleet
        self.commands = {node: probe(addr) for node, addr in addresses.items()}
        self.period = period
        self.trace = Trace(list(addresses))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="power-sampler", daemon=True)

    def _round(self) -> None:
        t0 = time.time()
        try:
            outcomes = self.fleet.run_many(self.commands, timeout=READ_TIMEOUT_S)
        except K3Error as exc:
            self.trace.fail(f"power readings: {exc.message}", fatal=True)
            return
        t = (t0 + time.time()) / 2  # the reading happened somewhere in the round trip: its middle
        for node, out in outcomes.items():
            if isinstance(out, K3Error):  # unreachable: a gap, and the reason if it lasts
                self.trace.fail(f"{node}: power reading failed: {out.message}")
            elif not out.ok:
                self.trace.fail(f"{node}: power reading exited {out.exit_code}: {(out.stderr or out.stdout).strip()[-200:]}")
            else:
                self.trace.add(node, t, *parse(out.stdout))

    def _loop(self) -> None:
        while True:
            t0 = time.monotonic()
            self._round()
            if self.trace.problem:
                return  # a node without a tool: the figures cannot count, stop asking
            if self._stop.wait(max(0.0, self.period - (time.monotonic() - t0))):
                return

    def start(self) -> None:
        self._round()  # a reading before the client starts: the window's start is covered
        if self.trace.problem is None:
            self._thread.start()

    def stop(self) -> Trace:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=READ_TIMEOUT_S + self.period)
        if self.trace.problem is None:
            self._round()  # and one after the client ended: the window's end is covered
        with contextlib.suppress(Exception):
            self.fleet.close()
        return self.trace


class SrunSampler:
    """One ``srun --overlap`` step in the deployment's job, a task per node printing stamped readings."""

    def __init__(self, job_id: str, hosts: Mapping[str, str], period: float = PERIOD_S, srun: str = "srun") -> None:
        self.job_id = job_id
        self.node_of = {host: node for node, host in hosts.items()}
        self.period = period
        self.srun = srun
        self.trace = Trace(list(hosts))
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._seen = threading.Condition()
        self._last: dict[str, float] = {}

    def argv(self) -> list[str]:
        loop = (
            f'while :; do r=$({probe()} 2>/dev/null | tr "\\n" "|"); '
            f'echo "{MARK} ${{SLURMD_NODENAME:-$(hostname -s)}} $(date +%s.%N) $r"; sleep {self.period:g}; done'
        )
        hosts = sorted(self.node_of)
        return [
            self.srun,
            "--overlap",
            f"--jobid={self.job_id}",
            f"--nodelist={','.join(hosts)}",
            f"--nodes={len(hosts)}",
            "--ntasks-per-node=1",
            "--kill-on-bad-exit=0",
            "bash",
            "-c",
            loop,
        ]

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            parts = line.rstrip("\n").split(" ", 3)
            if len(parts) < 4 or parts[0] != MARK:
                continue
            try:
                t = float(parts[2])
            except ValueError:
                continue
            node = self.node_of.get(parts[1], parts[1])
            self.trace.add(node, t, *parse(parts[3].replace("|", "\n")))
            with self._seen:
                self._last[node] = t
                self._seen.notify_all()

    def _wait(self, until: float, deadline_s: float) -> bool:
        """Until every node has a reading stamped at ``until`` or later (False: not in time)."""
        end = time.monotonic() + deadline_s
        with self._seen:
            while not all(self._last.get(n, -1.0) >= until for n in self.trace.nodes):
                left = end - time.monotonic()
                if left <= 0 or (self._proc is not None and self._proc.poll() is not None):
                    return False
                self._seen.wait(min(left, 0.2))
        return True

    def start(self) -> None:
        try:
            self._proc = subprocess.Popen(
                self.argv(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True, start_new_session=True
            )
        except OSError as exc:
            self.trace.fail(f"cannot start the power step ({self.srun}): {exc.strerror or exc}", fatal=True)
            return
        self._reader = threading.Thread(target=self._read, args=(self._proc,), name="power-srun", daemon=True)
        self._reader.start()
        if not self._wait(0.0, SETTLE_S):
            self.trace.fail(
                f"the power step printed no reading of every node within {SETTLE_S:g} s (srun --overlap in job {self.job_id})", fatal=True
            )

    def stop(self) -> Trace:
        if self._proc is None:
            return self.trace
        if self._proc.poll() is None:
            self._wait(time.time(), READ_TIMEOUT_S)  # a reading stamped after the client ended
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)  # srun forwards it to its tasks and ends
        try:
            self._proc.wait(timeout=READ_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=READ_TIMEOUT_S)
        return self.trace


def engine_nodes(rec: DeploymentRecord) -> dict[str, str]:
    """The nodes that run engines (not the login node's router) and their addresses."""
    nodes = {p.node for p in rec.plan.processes if p.role != "router"}
    return {h.name: h.address for h in rec.plan.hosts if h.name in nodes}


def sampler_for(rec: DeploymentRecord) -> Sampler:
    """How to read the power of ``rec``'s nodes: over its fleet, or a step of its Slurm job."""
    from k3launch import api
    from k3launch.models.record import SlurmRecord

    nodes = engine_nodes(rec)
    if isinstance(rec, SlurmRecord):
        hosts = {n: rec.slurm.hosts.get(n) or n for n in nodes}
        return SrunSampler(rec.slurm.job_id, hosts)
    return FleetSampler(api.fleet(rec), nodes)


def write_samples(path: Path, trace: Trace) -> None:
    """Every reading as CSV (time, node, GPU index, watts): what the energy was integrated from."""
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["time", "node", "gpu", "watts"])
        for node, samples in trace.samples.items():
            for s in samples:
                for i, watts in enumerate(s.watts):
                    w.writerow([f"{s.t:.3f}", node, i, f"{watts:.2f}"])


def summarize(trace: Trace, start: float, end: float, *, output_tokens: int, total_tokens: int, samples_file: str | None) -> Energy:
    """The energy of the window ``[start, end]`` from what ``trace`` collected."""
    e = energy(
        trace.samples,
        trace.nodes,
        start,
        end,
        output_tokens=output_tokens,
        total_tokens=total_tokens,
        source=trace.source,
        problem=trace.problem,
        samples_file=samples_file if trace.measured else None,
    )
    if not e.valid and trace.problem is None and trace.errors:
        e = e.model_copy(update={"reason": f"{e.reason} (last failed reading: {trace.errors[-1]})"})
    return e


def start(rec: DeploymentRecord) -> Sampler | None:
    """A running sampler of ``rec``'s GPU power (None when the deployment cannot be reached for it)."""
    try:
        s = sampler_for(rec)
        s.start()
    except K3Error:
        return None  # e.g. an ssh deployment whose nodes refuse a second connection: no figures, the run goes on
    return s


def finish(sampler: Sampler | None, started: float, ended: float, metrics: BenchMetrics | None, samples: Path) -> Energy | None:
    """Stop ``sampler`` and integrate the benchmark's own window: its measured ``duration``, ending
    when the client ended (the client's start-up and its initial test request are left out).
    The readings go to ``samples`` (CSV); the Energy names the file."""
    if sampler is None:
        return None
    trace = sampler.stop()
    if metrics is None:
        return None
    start_s = max(started, ended - metrics.duration) if metrics.duration > 0 else started
    if trace.measured:
        with contextlib.suppress(OSError):
            write_samples(samples, trace)
    return summarize(
        trace,
        start_s,
        ended,
        output_tokens=metrics.total_output_tokens,
        total_tokens=metrics.total_output_tokens + metrics.total_input_tokens,
        samples_file=samples.name,
    )
