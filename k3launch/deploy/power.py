"""GPU power readings of a deployment's nodes: the probe, its parser, and the sampler over a fleet.

Each node is read with the first tool it has: ``nvidia-smi --query-gpu=power.draw`` (NVIDIA),
else ``amd-smi metric --power --csv``, else ``rocm-smi --showpower --csv`` (ROCm). A backend
that supports power (:class:`~k3launch.models.backends.Feature`) hands out a :class:`Sampler`:

* ssh and local deployments: :class:`FleetSampler` over the deployment's fleet (the SSH
  connections k3launch holds, or this machine), one reading of every node in parallel every
  :data:`PERIOD_S`, stamped with the login node's clock at the middle of the round trip, so the
  nodes' clocks never matter;
* Slurm deployments: one ``srun --overlap`` step over the job's nodes
  (:mod:`k3launch.deploy.slurm.power`).

A sampler never fails a load point: whatever goes wrong (no tool, a node that stops answering)
ends up in its :class:`Trace` as the reason the energy is not valid.
"""

from __future__ import annotations

import contextlib
import csv
import io
import shlex
import threading
import time
from collections.abc import Mapping

from k3launch.errors import K3Error
from k3launch.models.power import NO_TOOL, TOOLS, Trace
from k3launch.models.record import DeploymentRecord
from k3launch.transport.fleet import Fleet

PERIOD_S = 0.5  # two readings a second: the floor is one
READ_TIMEOUT_S = 5.0
SETTLE_S = 15.0  # how long a Slurm step may take to print its first readings
MARK = "K3POWER"  # the Slurm step's reading lines start with it

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


def engine_nodes(rec: DeploymentRecord) -> dict[str, str]:
    """The nodes that run engines (not the login node's router) and their addresses."""
    nodes = {p.node for p in rec.plan.processes if p.role != "router"}
    return {h.name: h.address for h in rec.plan.hosts if h.name in nodes}
