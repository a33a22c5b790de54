"""The energy of a load point: a sampler of the deployment's GPU power runs beside the benchmark,
and its readings are integrated over the benchmark's own window.

The sampler comes from the deployment's backend (:func:`k3launch.api.power_sampler`; how each
backend reads power: :mod:`k3launch.deploy.power`). A sampler never fails a load point: whatever
goes wrong (no tool, a node that stops answering) ends up as the reason its
:class:`~k3launch.campaign.energy.Energy` is not valid.
"""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch.campaign.energy import Energy, energy
from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.models.bench import BenchMetrics
    from k3launch.models.power import Sampler, Trace
    from k3launch.models.record import DeploymentRecord


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
    from k3launch import api

    try:
        s = api.power_sampler(rec)
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
