"""GPU power on Slurm: one ``srun --overlap`` step in the deployment's job, a task per node
printing stamped readings every :data:`~k3launch.deploy.power.PERIOD_S` (Slurm nodes keep their
clocks in step, so the nodes' own stamps are used)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping

from k3launch.deploy.power import MARK, PERIOD_S, READ_TIMEOUT_S, SETTLE_S, parse, probe
from k3launch.models.power import Trace


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
