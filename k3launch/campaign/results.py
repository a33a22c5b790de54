"""The results file of a campaign: one JSON line per cell attempt, appended, never rewritten.

``DIR/results.jsonl`` is shared by every process working on the campaign (a resumed run, the
tasks of a Slurm job array), so an append takes an exclusive ``flock``, writes one whole line
and ``fsync``s before releasing it: a reader sees complete rows, and a writer killed mid-line
(SIGKILL) leaves at most one torn last line, which readers skip and the next append closes.
``results.csv`` is a flat export, rewritten from the JSON lines whenever asked.
"""

from __future__ import annotations

import csv
import os
import socket
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from k3launch.campaign.energy import Energy
from k3launch.errors import K3Error
from k3launch.models.bench import BenchMetrics, LoadPoint
from k3launch.models.phases import Timeline
from k3launch.models.supervise import Event
from k3launch.util.locks import locked

RESULTS = "results.jsonl"
CSV = "results.csv"


class Provenance(BaseModel):
    """Where a row's numbers come from: enough to rebuild or distrust the deployment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan_hash: str
    deployment: str  # the deployment name the cell ran on
    recipe: str
    recipe_file: str
    recipe_sha256: str | None
    campaign_sha256: str
    k3launch_version: str
    vllm_version: str | None  # the engine's /version; None if it did not say
    vllm_schema: str  # the flag schema the plan was checked against
    runtime: str
    image: str | None
    image_id: str | None  # the runtime's image id (digest) where it can tell
    inventory: str
    nodes: list[str]
    client: str | None  # local | engine | None (nothing was run)
    started: str
    ended: str
    timeline: Timeline | None = None  # the deployment's bring-up (`k3launch timeline`), when it had one
    events: list[Event] = []  # what a supervisor saw and did while the row ran (a restart mid-run explains a dip)


class PointStats(BaseModel):
    """On a point's summary row (never in results.jsonl): how its runs spread."""

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="strings")

    runs: int  # valid runs summed up
    confidence: float
    ci: dict[str, tuple[float, float]]  # vLLM result key -> the interval of the runs' mean


class ResultRow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="strings")

    campaign: str
    cell: str  # <plan hash prefix>/<load key>: what resume matches on
    group: int
    deployment: str  # axis values of the deployment, e.g. "strategy=multi_node_tep nodes=2"
    axes: dict[str, str]
    load: LoadPoint
    valid: bool
    reason: str | None = None  # why not valid
    metrics: BenchMetrics | None = None  # only on valid rows: invalid cells never carry numbers
    result_file: str | None = None  # the raw vLLM result JSON, relative to the campaign directory
    provenance: Provenance | None = None
    run: int = 0  # which of the point's `repeats` runs (0-based); one row per run
    slo: dict[str, float] = {}  # an SLA search's figures by vLLM's key (p90_ttft_ms, ...), valid rows only
    stats: PointStats | None = None  # only on a point's summary row (campaign.repeats.points)
    energy: Energy | None = None  # GPU energy of the run (k3launch.campaign.power), valid rows only


def append_row(out: Path, row: ResultRow) -> None:
    """Append one row durably and atomically with respect to other appenders."""
    out.mkdir(parents=True, exist_ok=True)
    line = (row.model_dump_json() + "\n").encode()
    with locked(out / RESULTS, flags=os.O_WRONLY | os.O_CREAT | os.O_APPEND) as fd:
        assert fd is not None  # waits for its turn
        size = os.fstat(fd).st_size
        if size:
            with open(out / RESULTS, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":  # a writer died mid-line: close its torn line first
                    line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)


def read_rows(out: Path) -> list[ResultRow]:
    """Every complete row; torn or foreign lines are skipped."""
    path = out / RESULTS
    if not path.is_file():
        return []
    rows = []
    # line by line from bytes: a writer killed inside a multi-byte character tears only its own line
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            rows.append(ResultRow.model_validate_json(line.decode("utf-8")))
        except (ValidationError, ValueError):  # UnicodeDecodeError is a ValueError
            continue
    return rows


def done_cells(rows: Iterable[ResultRow], campaign: str, still_valid: Callable[[ResultRow], bool] = lambda r: True) -> set[str]:
    """Cells that already have a valid row (by the campaign's gates as they are now, when
    ``still_valid`` checks them): a resumed run skips them."""
    return {r.cell for r in rows if r.campaign == campaign and r.valid and still_valid(r)}


def done_runs(rows: Iterable[ResultRow], campaign: str, still_valid: Callable[[ResultRow], bool] = lambda r: True) -> dict[str, set[int]]:
    """Cell -> the runs of it that have a valid row (``repeats``: a resumed run adds the others)."""
    out: dict[str, set[int]] = {}
    for r in rows:
        if r.campaign == campaign and r.valid and still_valid(r):
            out.setdefault(r.cell, set()).add(r.run)
    return out


def latest(rows: Iterable[ResultRow], campaign: str) -> list[ResultRow]:
    """One row per run of a cell: the last valid one, else the last attempt; in first-seen order."""
    best: dict[tuple[str, int], ResultRow] = {}
    for r in rows:
        if r.campaign != campaign:
            continue
        have = best.get((r.cell, r.run))
        if have is None or r.valid or not have.valid:
            best[(r.cell, r.run)] = r
    return list(best.values())


CSV_FIELDS = ["campaign", "cell", "run", "group", "deployment", "max_concurrency", "input_len", "output_len", "request_rate", "num_prompts",
              "valid", "reason", *(f for f in BenchMetrics.model_fields if f != "max_concurrency"), "plan_hash", "deployment_name", "recipe_sha256", "k3launch_version",
              "vllm_version", "image", "image_id", "nodes", "client", "started", "ended", "result_file"]


def csv_record(r: ResultRow) -> dict[str, object]:
    rec: dict[str, object] = {"campaign": r.campaign, "cell": r.cell, "run": r.run, "group": r.group, "deployment": r.deployment,
                              "valid": r.valid, "reason": r.reason or "", "result_file": r.result_file or ""}
    if r.metrics is not None:
        rec.update(r.metrics.model_dump())
    rec.update(r.load.model_dump())  # the load point's own axes win (max_concurrency is in both)
    p = r.provenance
    if p is not None:
        rec.update({"plan_hash": p.plan_hash, "deployment_name": p.deployment, "recipe_sha256": p.recipe_sha256 or "",
                    "k3launch_version": p.k3launch_version, "vllm_version": p.vllm_version or "", "image": p.image or "",
                    "image_id": p.image_id or "", "nodes": " ".join(p.nodes), "client": p.client or "", "started": p.started,
                    "ended": p.ended})
    return rec


def write_csv(out: Path, rows: Iterable[ResultRow]) -> Path:
    path = out / CSV
    # array tasks on several hosts may export at the same moment
    tmp = path.with_suffix(f".csv.{socket.gethostname()}.{os.getpid()}.tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(csv_record(r))
    tmp.replace(path)
    return path


def make_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise K3Error("bad-out", f"--out {out}: {exc.strerror or exc}", "choose a directory you can write (created if missing)") from None


def group_lock(out: Path, plan_hash: str) -> AbstractContextManager[int | None]:
    """An exclusive lock on a group's lock file while the block runs (None: another process holds it)."""
    return locked(out / f".group-{plan_hash[:16]}.lock", wait=False, remove=True)
