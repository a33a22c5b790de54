"""A campaign's results in the output layout of ``vllm bench sweep``, and back.

vLLM's sweep (``vllm/benchmarks/sweep/serve.py``) writes, under its experiment directory, one
directory per combination of serve and bench parameters, named
``SERVE--<k=v-...>-BENCH--<k=v-...>`` (``sanitize_filename`` of it), holding ``run=N.json`` per
run — the ``vllm bench serve`` result JSON updated with ``run_number`` and the serve and bench
parameters — and ``summary.json``, the list of those; ``summary.csv`` at the top joins them all.
Its ``plot`` and ``plot_pareto`` read every ``**/summary.json`` below a directory.

:func:`export` writes a campaign's runs that way: the serve parameters are the deployment axes
(``set.max-num-seqs`` as ``max_num_seqs``), the bench parameters the load point in
``vllm bench serve``'s names, plus ``num_gpus`` (``plot_pareto --gpu-count-var num_gpus``) and
``k3launch_*`` keys that let :func:`read` recover the cells exactly. :func:`read` takes any such
layout (``serve``, ``serve_sla`` and ``serve_workload`` nest their runs one level deeper: the
top directory still names the serve parameters) and gives one result row per run.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import ValidationError

from k3launch.campaign.file import SLO_KEY, Validity
from k3launch.campaign.matrix import cell_id, invalid_reason
from k3launch.campaign.results import ResultRow
from k3launch.errors import K3Error
from k3launch.models.bench import BenchMetrics, LoadPoint

BENCH_NAMES = {
    "max_concurrency": "max_concurrency",
    "input_len": "random_input_len",
    "output_len": "random_output_len",
    "request_rate": "request_rate",
    "num_prompts": "num_prompts",
}  # LoadPoint field -> vllm bench serve's


def sanitize_filename(name: str) -> str:
    """vLLM's own rule for its sweep directory names (``vllm.benchmarks.sweep.utils``)."""
    return name.replace("/", "_").replace("..", "__").strip("'").strip('"')


def _value(text: str) -> object:
    """An axis value as vLLM's parameter JSON would hold it."""
    for conv in (int, float):
        try:
            v = conv(text)
        except ValueError:
            continue
        return v if math.isfinite(v) else text
    return {"true": True, "false": False}.get(text, text)


def serve_params(axes: Mapping[str, str]) -> dict[str, object]:
    return {k.removeprefix("set.").replace("-", "_"): _value(v) for k, v in axes.items()}


def bench_params(load: LoadPoint) -> dict[str, object]:
    out: dict[str, object] = {}
    for field, name in BENCH_NAMES.items():
        v = getattr(load, field)
        if v is None:
            continue
        out[name] = "inf" if isinstance(v, float) and math.isinf(v) else (int(v) if isinstance(v, float) and v.is_integer() else v)
    return out


def _text(params: Mapping[str, object]) -> str:
    return "-".join(f"{k}={v}" for k, v in params.items())  # ParameterSweepItem.as_text(sep="-")


def comb_dir(serve: Mapping[str, object], bench: Mapping[str, object]) -> str:
    """``_get_comb_base_path``'s directory name."""
    parts: list[str] = []
    if serve:
        parts += ["SERVE-", _text(serve)]
    if bench:
        parts += ["BENCH-", _text(bench)]
    return sanitize_filename("-".join(parts)) or "default"


def _run_data(out: Path, row: ResultRow) -> dict[str, object]:
    """The run's raw result JSON (vLLM's format, every key it wrote), else its figures."""
    if row.result_file:
        try:
            data = json.loads((out / row.result_file).read_text(encoding="utf-8"))
            if isinstance(data, dict):
                return data
        except (OSError, ValueError):
            pass
    return row.metrics.model_dump(mode="json") if row.metrics is not None else {}


def export(out: Path, rows: Iterable[ResultRow], dest: Path, gpus: Mapping[str, int]) -> list[Path]:
    """Write ``rows`` (one per run) under ``dest`` in vLLM's sweep layout; ``gpus``: plan hash prefix ->
    the deployment's GPU count. Returns the ``summary.json`` files written."""
    combs: dict[Path, list[dict[str, object]]] = {}
    for row in rows:
        serve, bench = serve_params(row.axes), bench_params(row.load)
        where = dest / comb_dir(serve, bench)
        where.mkdir(parents=True, exist_ok=True)
        combs.setdefault(where, [])
        if not row.valid or row.metrics is None:  # as `--continue-on-error` records a failed run
            failure = {
                "run_number": row.run,
                "error_type": "InvalidRun",
                "error": row.reason or "no figures",
                "serve_overrides": serve,
                "bench_overrides": bench,
            }
            (where / f"run={row.run}.failure.json").write_text(json.dumps(failure, indent=2) + "\n", encoding="utf-8")
            continue
        data = {
            **_run_data(out, row),
            "run_number": row.run,
            **serve,
            **bench,
            "num_gpus": gpus.get(row.cell.split("/", 1)[0], 1),
            "k3launch_campaign": row.campaign,
            "k3launch_cell": row.cell,
            "k3launch_deployment": row.deployment,
        }
        (where / f"run={row.run}.json").write_text(json.dumps(data, indent=4), encoding="utf-8")
        combs[where].append(data)
    written = []
    for where, runs in combs.items():
        if runs:
            runs.sort(key=lambda d: int(str(d["run_number"])))
            (where / "summary.json").write_text(json.dumps(runs, indent=4), encoding="utf-8")
            written.append(where / "summary.json")
    _summary_csv(dest, [d for runs in combs.values() for d in runs])
    return written


def _summary_csv(dest: Path, records: list[dict[str, object]]) -> None:
    """pandas' ``DataFrame.from_records(...).to_csv``: an unnamed index column, the union of keys."""
    keys = list(dict.fromkeys(k for d in records for k in d))
    with (dest / "summary.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["", *keys])
        for i, d in enumerate(records):
            w.writerow([i, *("" if d.get(k) is None else d[k] for k in keys)])


# ---- reading a sweep's layout ------------------------------------------------------------------

_SEGMENT = re.compile(r"^SERVE--(.*?)(?:-BENCH-.*|-WL-.*)?$")


def _serve_axes(comb: str, run: Mapping[str, object]) -> dict[str, str]:
    """The serve parameters of a run: its keys whose ``k=v`` the directory's SERVE part names."""
    m = _SEGMENT.match(comb)
    if m is None:
        return {}
    seg = m.group(1)
    out = {}
    for k, v in run.items():
        token = f"{k}={v}"
        if re.search(rf"(^|-){re.escape(token)}(-|$)", seg):
            out[k] = str(v)
    if not out and seg:  # named combinations (`_benchmark_name`): the name is the deployment
        out["name"] = seg
    return out


def _int(run: Mapping[str, object], key: str) -> int | None:
    v = run.get(key)
    try:
        return int(str(v)) if v not in (None, "") else None
    except ValueError:
        return None


def _per_request(run: Mapping[str, object], total: str) -> int:
    done = _int(run, "completed") or 0
    tokens = _int(run, total) or 0
    return max(1, round(tokens / done)) if done else 1


def load_of(run: Mapping[str, object]) -> LoadPoint:
    rate = run.get("request_rate", "inf")
    try:
        r = float(str(rate))
    except ValueError:
        r = math.inf
    conc = _int(run, "max_concurrency")
    return LoadPoint(
        max_concurrency=conc if conc and conc > 0 else None,
        input_len=_int(run, "random_input_len") or _per_request(run, "total_input_tokens"),
        output_len=_int(run, "random_output_len") or _per_request(run, "total_output_tokens"),
        request_rate=r if r > 0 else math.inf,
        num_prompts=max(1, _int(run, "num_prompts") or _int(run, "completed") or 1),
    )


def read(src: Path, campaign: str, validity: Validity | None = None) -> tuple[list[ResultRow], list[dict[str, object]]]:
    """One row per run of every ``summary.json`` under ``src`` (a sweep's experiment directory), and
    the raw run data of each row (same order). A run k3launch exported keeps its cell and label."""
    files = sorted(src.rglob("summary.json"))
    if not files:
        raise K3Error(
            "no-sweep-results",
            f"{src}: no summary.json below it",
            "point at a `vllm bench sweep` experiment directory (-o/-e of the sweep)",
        )
    gates = validity or Validity()
    rows: list[ResultRow] = []
    raw: list[dict[str, object]] = []
    labels: dict[str, int] = {}
    for f in files:
        try:
            runs = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise K3Error(
                "bad-sweep-results", f"{f}: not a sweep summary ({str(exc).splitlines()[0]})", "is it the directory you meant?"
            ) from None
        comb = f.relative_to(src).parts[0] if f.parent != src else ""
        for run in runs if isinstance(runs, list) else []:
            if isinstance(run, dict) and (row := _row(run, comb, campaign, gates, labels)) is not None:
                rows.append(row)
                raw.append(run)
    return rows, raw


def _row(run: dict[str, object], comb: str, campaign: str, gates: Validity, labels: dict[str, int]) -> ResultRow | None:
    number = _int(run, "run_number") or 0
    if number < 0:  # a warm-up run
        return None
    try:
        metrics = BenchMetrics.model_validate(run)
        load = load_of(run)
    except ValidationError:
        return None
    axes = _serve_axes(comb, run)
    label = str(run.get("k3launch_deployment") or " ".join(f"{k}={v}" for k, v in axes.items()) or "default")
    cell = str(run.get("k3launch_cell") or cell_id("vllm-" + hashlib.sha256(label.encode()).hexdigest(), load))
    reason = invalid_reason(metrics, gates)
    slo = {k: float(v) for k, v in run.items() if SLO_KEY.match(k) and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return ResultRow(
        campaign=campaign,
        cell=cell,
        group=labels.setdefault(label, len(labels)),
        deployment=label,
        axes=axes,
        load=load,
        valid=reason is None,
        reason=reason,
        metrics=metrics if reason is None else None,
        run=number,
        slo=slo if reason is None else {},
    )
