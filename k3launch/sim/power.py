"""The simulated GPUs' power draw, and a stand-in ``nvidia-smi`` that reads it.

Every sim process writes what its GPUs draw to ``<power dir>/<node address>/<pid>`` four times
a second: ``K3LAUNCH_SIM_IDLE_W`` per GPU plus ``K3LAUNCH_SIM_WATTS_PER_SEQ`` for each request
its ranks decode (on average per rank), so a bigger batch draws more. Headless ranks, which the
sim gives no requests, draw the idle figure. The file goes when the process ends.

``python -m k3launch.sim.power nvidia-smi --query-gpu=power.draw --format=csv,noheader,nounits``
(the ``nvidia-smi`` script :func:`install` writes into a directory, for PATH) prints one line
per GPU of the node, as the real tool does: the GPUs of the node's live sim
processes, then idle ones up to ``K3LAUNCH_SIM_GPUS``. The node is the address in
``K3LAUNCH_NODE_ADDRESS`` (k3launch's power sampler sets it: the simulated nodes of a local
inventory share one machine); without it, every process of the machine counts. A file not
rewritten for :data:`STALE_S` (a process killed with SIGKILL) is ignored.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

PERIOD_S = 0.25
STALE_S = 2.0
QUERY = ("--query-gpu=power.draw", "--format=csv,noheader,nounits")


def power_dir(configured: str | None) -> Path:
    """``K3LAUNCH_SIM_POWER_DIR``, else one directory per user under /tmp (the engines and the
    stand-in must agree without being told, whatever TMPDIR each of them has)."""
    return Path(configured or f"/tmp/k3launch-sim-power-{os.getuid()}")


class PowerFile:
    """Keeps one process's draw in its file while it runs."""

    def __init__(self, root: Path, address: str, gpus: int, idle_w: float, per_seq_w: float, batch: Callable[[], float]) -> None:
        self.path = root / _safe(address) / str(os.getpid())
        self.gpus = gpus
        self.idle_w = idle_w
        self.per_seq_w = per_seq_w
        self.batch = batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="power", daemon=True)

    def watts(self) -> float:
        return self.idle_w + self.per_seq_w * self.batch()

    def start(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            return  # no power figures: the sampler says so; serving is unaffected
        self._thread.start()

    def _loop(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        while True:
            with contextlib.suppress(OSError):
                tmp.write_text(f"{self.gpus} {self.watts():.1f}\n", encoding="utf-8")
                tmp.replace(self.path)  # a reader sees a whole figure, never a half-written one
            if self._stop.wait(PERIOD_S):
                return

    def close(self, graceful: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        with contextlib.suppress(OSError):
            self.path.unlink()


def _safe(address: str) -> str:
    return "".join(c if c.isalnum() or c in ".-_:" else "_" for c in address) or "_"


def readings(root: Path, address: str | None, now: float) -> list[float]:
    """Watts of each GPU of the live processes of ``address`` (every address when None)."""
    dirs = [root / _safe(address)] if address else sorted(p for p in root.glob("*") if p.is_dir())
    out: list[float] = []
    for d in dirs:
        for f in sorted(d.glob("[0-9]*")):
            try:
                if now - f.stat().st_mtime > STALE_S:
                    continue
                gpus, watts = f.read_text(encoding="utf-8").split()
                out += [float(watts)] * int(gpus)
            except (OSError, ValueError):
                continue  # gone between the listing and the read, or torn: the next sample has it
    return out


def nvidia_smi(argv: list[str], env: Mapping[str, str]) -> int:
    """The stand-in: only the power query k3launch's sampler asks for."""
    if tuple(argv) != QUERY:
        sys.stderr.write(f"k3launch's simulated nvidia-smi answers only `nvidia-smi {' '.join(QUERY)}`\n")
        return 2
    try:
        idle = float(env.get("K3LAUNCH_SIM_IDLE_W") or 100.0)
        total = int(float(env.get("K3LAUNCH_SIM_GPUS") or 8))
    except ValueError:
        sys.stderr.write("K3LAUNCH_SIM_IDLE_W and K3LAUNCH_SIM_GPUS must be numbers\n")
        return 2
    gpus = readings(power_dir(env.get("K3LAUNCH_SIM_POWER_DIR")), env.get("K3LAUNCH_NODE_ADDRESS") or None, time.time())
    gpus += [idle] * max(0, total - len(gpus))
    sys.stdout.write("".join(f"{w:.2f}\n" for w in gpus))
    return 0


def install(bin_dir: Path) -> Path:
    """Write the stand-in as ``bin_dir/nvidia-smi`` (this interpreter, no import of the engine)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m k3launch.sim.power nvidia-smi "$@"\n', encoding="utf-8")
    script.chmod(0o755)
    return script


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["nvidia-smi"]:
        return nvidia_smi(args[1:], os.environ)
    if args[:1] == ["install"] and len(args) == 2:
        print(install(Path(args[1])))
        return 0
    sys.stderr.write("usage: python -m k3launch.sim.power {nvidia-smi QUERY | install BIN_DIR}\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
