"""``k3launch bench`` and ``k3launch campaign run / report / export / import``.

Exit codes: 0 success; 1 ``campaign run`` finished but some cells are invalid (each recorded
with its reason) or a group's deployment was refused before it started (its cells not run; the
summary says why), or ``bench`` gave invalid figures; 2 refused (bad campaign file with
file:line, unknown deployment, bad option); 130 interrupted (Ctrl-C or SIGTERM: the deployment
in use is taken down first).
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

from k3launch.cli.common import INTERRUPTED, STATE, JsonOut, app, console, fail, number_option, port_base_option
from k3launch.errors import K3Error
from k3launch.util import bounds

if TYPE_CHECKING:
    from k3launch.campaign.held import Held
    from k3launch.campaign.results import ResultRow
    from k3launch.cli.show_progress import BenchView

StateDir = Annotated[Path | None, typer.Option("--state-dir", help="Deployment records (default ~/.k3launch or $K3LAUNCH_STATE_DIR).")]
Client = Annotated[str | None, typer.Option("--client", help="auto, local (k3launch's client here) or engine (`vllm bench serve` in the head container).")]
CampaignFile = Annotated[Path, typer.Argument(help="Campaign YAML, or the name of a bundled one (local-demo).")]
OutDir = Annotated[Path, typer.Option("--out", "-o", help="Campaign directory: results.jsonl/.csv, bench/ (raw result JSON and logs), plots/.")]

campaign_app = typer.Typer(help="Benchmark campaigns: deployments × load points, results, plots.", no_args_is_help=True)
app.add_typer(campaign_app, name="campaign")


def _client(value: str | None) -> str | None:
    if value is not None and value not in ("auto", "local", "engine"):
        raise K3Error("bad-client", f"--client {value!r}: use auto, local or engine", "auto picks engine for container deployments")
    return value


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help="Deployment name (see `k3launch list`).")],
    num_prompts: Annotated[int, number_option("--num-prompts", bounds.PROMPTS, "Requests to send.")] = 200,
    input_len: Annotated[int, number_option("--random-input-len", bounds.TOKENS, "Prompt tokens per request.")] = 1024,
    output_len: Annotated[int, number_option("--random-output-len", bounds.TOKENS, "Output tokens per request (ignore_eos).")] = 128,
    max_concurrency: Annotated[int | None, number_option("--max-concurrency", bounds.CONCURRENCY,
                                                         "Requests in flight at most (default: unbounded).")] = None,
    request_rate: Annotated[str, typer.Option("--request-rate", help="Requests per second (Poisson arrivals), or inf: all at once.")] = "inf",
    seed: Annotated[int, number_option("--seed", bounds.SEED, "Random dataset seed.")] = 0,
    client: Client = "auto",
    result_dir: Annotated[Path | None, typer.Option("--out", "-o", "--result-dir",
                                                    help="Where the result JSON (vLLM's format) and the client log go (default <state-dir>/bench/NAME).")] = None,
    result_filename: Annotated[str | None, typer.Option("--result-filename", help="Result file name (default bench-<deployment>-<load>.json).")] = None,
    state_dir: StateDir = None,
    json_out: JsonOut = False,
) -> None:
    """Run one `vllm bench serve` load point against a live deployment's public endpoint."""
    STATE.json = json_out
    from k3launch.campaign import bench as benchmod
    from k3launch.campaign.file import Validity
    from k3launch.campaign.matrix import invalid_reason
    from k3launch.models.bench import LoadPoint

    try:
        rate = math.inf if request_rate.strip().lower() in ("inf", "infinity") else bounds.REQUEST_RATE.parse("--request-rate", request_rate)
    except K3Error as err:
        fail(K3Error("bad-rate", err.message, f"{err.hint}, or inf (all at once); e.g. --request-rate 4"))
    rec = benchmod.record(name, state_dir)
    load = LoadPoint(max_concurrency=max_concurrency, input_len=input_len, output_len=output_len, request_rate=rate, num_prompts=num_prompts)
    tag = (result_filename or f"bench-{name}-{load.key}.json").removesuffix(".json")
    run = benchmod.run(rec, load, out_dir=benchmod.result_dir(name, state_dir, result_dir), tag=tag, client=_client(client) or "auto", seed=seed,
                       on_progress=_bench_view(json_out))
    reason = run.error or (invalid_reason(run.metrics, Validity()) if run.metrics else "no figures")
    if json_out:
        body = json.loads(run.result_file.read_text(encoding="utf-8")) if run.result_file and run.result_file.is_file() else None
        typer.echo(json.dumps({"deployment": name, "client": run.client, "result_file": str(run.result_file) if run.result_file else None,
                               "valid": reason is None, "reason": reason, "result": body}))
    else:
        from k3launch.cli import show_campaign

        if run.metrics is not None:
            show_campaign.metrics(console(), run.metrics, load, run.result_file, run.client)
        if reason:
            typer.echo(f"invalid: {reason} (client log: {run.log_file})", err=True)
    if reason:
        raise typer.Exit(1)


def _bench_view(quiet: bool) -> BenchView:
    """Requests done of total, elapsed and ETA of each load point, on stderr (stdout keeps the results)."""
    from k3launch.cli.show_progress import BenchView

    return BenchView(console(stderr=True), quiet=quiet)


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # scancel / a time limit: stop like Ctrl-C, taking the deployment down


@campaign_app.command("run")
def campaign_run(
    file: CampaignFile,
    out: OutDir,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the matrix, the deployment groups and the engine starts it would cost.")] = False,
    group: Annotated[int | None, number_option("--group", bounds.CAMPAIGN_GROUP,
                                               "Run only deployment group N (a Slurm array task: $SLURM_ARRAY_TASK_ID).")] = None,
    port_base: Annotated[int | None, port_base_option("--port-base", "Port block of every deployment (overrides the campaign's port_base).")] = None,
    client: Client = None,
    slurm_array: Annotated[bool, typer.Option("--slurm-array", help="Slurm inventory: one job array task per deployment group, each in its own allocation; waits for all.")] = False,
    array_limit: Annotated[int | None, number_option("--array-limit", bounds.ARRAY_LIMIT,
                                                     "--slurm-array: at most this many tasks at once (--array=0-N%K).")] = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="--slurm-array: submit and return.")] = False,
    attached: Annotated[bool, typer.Option("--attached", hidden=True, help="Inside an array task: use the deployment the task's job started.")] = False,
    state_dir: StateDir = None,
    json_out: JsonOut = False,
) -> None:
    """Bring each distinct deployment up once, run all its load points, take it down; resumable."""
    STATE.json = json_out
    from k3launch.campaign import run as cr
    from k3launch.cli import show_campaign

    con = console()
    try:
        _client(client)
        prep = cr.prepare(file, port_base=port_base, state_dir=state_dir)  # plans skip the nodes cordoned there
        if attached and group is None:
            raise K3Error("bad-option", "--attached needs --group", "it is how a job array task names its group")
        if slurm_array and group is not None:
            raise K3Error("bad-option", "--slurm-array submits every pending group; --group runs one", "drop one of them")
        if slurm_array and (prep.campaign.sla is not None or prep.campaign.repeats.runs > 1):
            raise K3Error("bad-option", "--slurm-array does not run SLA searches or repeats",
                          'submit `campaign run FILE --out DIR --group N` per group yourself (docs/campaigns.md ("Without a slurm inventory"))')
        if slurm_array and not dry_run:
            from k3launch.campaign import slurm as campaign_slurm

            emit = (lambda m: None) if json_out else (lambda m: typer.echo(f"campaign: {m}", err=True))
            try:
                arr = campaign_slurm.submit(prep, out, limit=array_limit, client=client, wait=not no_wait, on_event=emit)
            except campaign_slurm.ArrayInterrupted as stop:
                ids = " ".join(stop.jobs)
                typer.echo(f"interrupted: array job(s) {ids} keep running and still append their rows; `scancel {ids}` stops them, "
                           "running this command again collects what is missing", err=True)
                raise typer.Exit(INTERRUPTED) from None
            if json_out:
                typer.echo(json.dumps(dataclasses.asdict(arr)))
            else:
                con.print(f"{len(arr.submitted)} group(s) submitted as job(s) {', '.join(arr.jobs) or '-'}; {len(arr.skipped)} already done; "
                          f"cells valid {arr.valid}, invalid {arr.invalid}; results {arr.results}")
            if any(not r.get("ok") for r in arr.tasks.values()) or arr.invalid:
                raise typer.Exit(1)
            return
        if dry_run:
            from k3launch.campaign.held import held

            todo = cr.pending(prep, out)
            holds = held(prep, todo, state_dir)  # read-only: what would make `up` refuse a group now
            if json_out:
                typer.echo(json.dumps(_dry_json(prep, todo, holds)))
            else:
                show_campaign.dry_run(con, prep, todo, holds)
            return
        # SIGTERM (scancel, a time limit) and SIGHUP (the ssh session is gone) stop like Ctrl-C
        old = signal.signal(signal.SIGTERM, _sigterm)
        old_hup = signal.signal(signal.SIGHUP, _sigterm)
        try:
            opts = cr.Options(out=out, state_dir=state_dir, only_group=group, client=client, attached=attached,
                              on_event=(lambda m: None) if json_out else (lambda m: typer.echo(f"campaign: {m}", err=True)),
                              on_progress=_bench_view(json_out))
            summary = cr.run(prep, opts)
        finally:
            signal.signal(signal.SIGTERM, old)
            signal.signal(signal.SIGHUP, old_hup)
    except KeyboardInterrupt:
        typer.echo("interrupted: the deployment in use was taken down; rows written so far are kept (run again to resume)", err=True)
        raise typer.Exit(INTERRUPTED) from None
    if json_out:
        typer.echo(json.dumps(dataclasses.asdict(summary)))
    else:
        show_campaign.summary(con, summary)
    if summary.invalid or summary.refused:
        raise typer.Exit(1)


def _dry_json(prep: object, todo: dict[int, int], holds: list[Held]) -> dict[str, object]:
    from k3launch.campaign.held import refused_groups
    from k3launch.campaign.run import Prepared

    assert isinstance(prep, Prepared)
    return {"campaign": prep.campaign.name, "cells": len(prep.cells), "excluded": prep.excluded,
            "deployments": [{"label": prep.spec_label(s), "axes": dict(s.axes), "plan_hash": h.plan_hash, "group": h.index}
                            for h in prep.groups for s in h.specs],
            "refused": {k: e.as_dict() for k, e in prep.refused.items()},
            "load_points": [ld.key for ld in dict.fromkeys(c.load for c in prep.cells)],
            "groups": [{"group": g.index, "plan_hash": g.plan_hash, "name": f"{prep.campaign.name}-{g.plan_hash[:8]}",
                        "cells": len(g.loads), "pending": todo.get(g.index, 0)} for g in prep.groups],
            "engine_starts": sum(1 for n in todo.values() if n),
            "held": [dataclasses.asdict(h) for h in holds], "would_refuse": refused_groups(holds)}


@campaign_app.command("report")
def campaign_report(file: CampaignFile, out: OutDir, json_out: JsonOut = False) -> None:
    """Tables per load axis, CSV, PNG plots (throughput per GPU vs TPOT/ITL/TTFT p99 with Pareto fronts, TTFT vs concurrency) and report.html."""
    STATE.json = json_out
    from k3launch import __version__
    from k3launch.campaign import report as rep
    from k3launch.campaign.bench import now_iso
    from k3launch.campaign.html import write_report
    from k3launch.campaign.plots import plot_all
    from k3launch.campaign.results import latest, read_rows, write_csv
    from k3launch.campaign.run import campaign_path, prepare
    from k3launch.cli import show_campaign

    prep = prepare(campaign_path(file))
    c = prep.campaign
    every = latest(read_rows(out), c.name)
    runs = [prep.rejudge(r) for r in prep.current(every)]  # rows of an earlier version of the matrix stay out
    if not runs:
        raise K3Error("no-results", f"{out}: no results of campaign {c.name!r}", f"run `k3launch campaign run {file} --out {out}` first")
    rows = prep.points(runs)  # one per point: the medians of its runs (repeats), judged by the spread gate
    searches = prep.searches(runs)
    csv_path = write_csv(out, runs)  # one line per run
    ctx = rep.Context({g.index: prep.plans[g.specs[0].key] for g in prep.groups}, prep.inventory.gpu_hour_price, c.references)
    plots = plot_all(rows, out / "plots", c.name, ctx)
    html = write_report(out, c.name, rows, ctx, description=c.description, generated=f"k3launch {__version__}, {now_iso()}")
    tables = rep.tables(rows, ctx)
    bad = rep.invalid_table(rows)
    if json_out:
        fronts = {m: [r.cell for r in rep.front_rows(rows, m)] for m in ("tpot", "itl")}
        typer.echo(json.dumps({"campaign": c.name, "cells": len(rows), "valid": sum(r.valid for r in rows), "stale": len(every) - len(runs),
                               "csv": str(csv_path), "points": [_point_json(r) for r in rows], "sla": [x.as_json() for x in searches],
                               "plots": [str(p) for p in plots], "html": str(html), "pareto": fronts,
                               "invalid": [{"cell": r.cell, "reason": r.reason} for r in rows if not r.valid]}))
        return
    con = console()
    show_campaign.tables(con, [*tables, *([bad] if bad else [])])
    show_campaign.repeated(con, rows)
    show_campaign.searches(con, searches)
    if len(every) > len(runs):
        con.print(f"{len(every) - len(runs)} row(s) in {out} belong to an earlier version of the matrix and are left out")
    con.print(f"csv: {csv_path}")
    for p in plots:
        con.print(f"plot: {p}")
    con.print(f"report: {html}")


def _point_json(r: ResultRow) -> dict[str, object]:
    """A point of the report: its figures (medians over its runs) and how they spread."""
    return {"cell": r.cell, "deployment": r.deployment, "load": r.load.key, "valid": r.valid, "reason": r.reason,
            "runs": r.stats.runs if r.stats else 1, "confidence": r.stats.confidence if r.stats else None,
            "median": r.metrics.model_dump() if r.metrics else None, "slo": r.slo, "ci": r.stats.ci if r.stats else {}}


@campaign_app.command("export")
def campaign_export(file: CampaignFile, out: OutDir,
                    to: Annotated[Path, typer.Option("--to", help="The experiment directory to write, in `vllm bench sweep`'s layout.")],
                    json_out: JsonOut = False) -> None:
    """Write the campaign's runs in `vllm bench sweep`'s output layout (run=N.json, summary.json, summary.csv)."""
    STATE.json = json_out
    from k3launch.campaign import sweepio
    from k3launch.campaign.results import latest, read_rows
    from k3launch.campaign.run import campaign_path, prepare

    prep = prepare(campaign_path(file))
    runs = [prep.rejudge(r) for r in prep.current(latest(read_rows(out), prep.campaign.name))]
    if not runs:
        raise K3Error("no-results", f"{out}: no results of campaign {prep.campaign.name!r}", f"run `k3launch campaign run {file} --out {out}` first")
    gpus = {g.plan_hash[:12]: sum(pool.gpus for pool in prep.plans[g.specs[0].key].capacity.pools) for g in prep.groups}
    try:
        written = sweepio.export(out, runs, to, gpus)
    except OSError as exc:
        raise K3Error("bad-out", f"--to {to}: {exc.strerror or exc}", "choose a directory you can write (created if missing)") from None
    if json_out:
        typer.echo(json.dumps({"campaign": prep.campaign.name, "experiment": str(to), "runs": len(runs), "summaries": [str(p) for p in written]}))
    else:
        console().print(f"{len(runs)} run(s) of {len(written)} point(s) written to {to} (`vllm bench sweep plot {to}` reads them; "
                        "`plot_pareto` with --gpu-count-var num_gpus)")


@campaign_app.command("import")
def campaign_import(src: Annotated[Path, typer.Argument(help="A `vllm bench sweep` experiment directory (its summary.json files).")],
                    out: OutDir,
                    name: Annotated[str | None, typer.Option("--name", help="Campaign name of the rows (default: the directory's name).")] = None,
                    json_out: JsonOut = False) -> None:
    """Read a `vllm bench sweep` experiment into DIR/results.jsonl, then report it: tables, CSV, plots."""
    STATE.json = json_out
    import re

    from k3launch.campaign import repeats, sweepio
    from k3launch.campaign import report as rep
    from k3launch.campaign.file import Repeats, Validity
    from k3launch.campaign.plots import plot_all
    from k3launch.campaign.results import append_row, latest, make_out, read_rows, write_csv
    from k3launch.cli import show_campaign

    campaign = name or re.sub(r"[^a-z0-9-]+", "-", src.resolve().name.lower()).strip("-") or "imported"
    rows, raw = sweepio.read(src, campaign)
    make_out(out)
    (out / "bench").mkdir(exist_ok=True)
    for i, (row, data) in enumerate(zip(rows, raw, strict=True)):
        copy = out / "bench" / f"imported-{i}.json"  # the run's own JSON, every key vLLM wrote
        copy.write_text(json.dumps(data), encoding="utf-8")
        append_row(out, row.model_copy(update={"result_file": str(copy.relative_to(out))}))
    runs = latest(read_rows(out), campaign)
    csv_path = write_csv(out, runs)
    points = repeats.points(runs, Repeats().confidence, Validity().max_spread)  # a sweep's --num-runs: medians and intervals
    plots = plot_all(points, out / "plots", campaign)
    if json_out:
        typer.echo(json.dumps({"campaign": campaign, "runs": len(rows), "results": str(out / "results.jsonl"), "csv": str(csv_path),
                               "plots": [str(p) for p in plots]}))
        return
    con = console()
    show_campaign.tables(con, rep.tables(points))
    show_campaign.repeated(con, points)
    con.print(f"{len(rows)} run(s) imported from {src} as campaign {campaign}; results {out / 'results.jsonl'}; csv: {csv_path}")
    for p in plots:
        con.print(f"plot: {p}")
