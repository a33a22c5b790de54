"""Campaign results in `vllm bench sweep`'s output layout, and back: the layout, the round trip, the
import command (vLLM's own sweep code reading an export and writing a layout k3launch imports:
test_campaign_sweep_engine.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sweeprows import campaign_rows, result_json

from k3launch.campaign import sweepio
from k3launch.campaign.results import ResultRow, read_rows

if TYPE_CHECKING:
    pass


def test_export_writes_vllm_sweeps_layout_and_read_gives_the_same_runs_back(tmp_path: Path) -> None:
    out, dest = tmp_path / "campaign", tmp_path / "sweep"
    rows = campaign_rows(out)
    written = sweepio.export(out, rows, dest, {"0aaaaaaaaaaa": 8, "1aaaaaaaaaaa": 16})
    comb = dest / "SERVE--max_num_seqs=4-BENCH--max_concurrency=1-random_input_len=32-random_output_len=8-request_rate=inf-num_prompts=8"
    assert comb / "summary.json" in written and len(written) == 4
    summary = json.loads((comb / "summary.json").read_text())
    assert [d["run_number"] for d in summary] == [0, 1]
    run0 = json.loads((comb / "run=0.json").read_text())
    assert run0 == summary[0]
    raw = json.loads((out / "bench" / "h0-c1-run0.json").read_text())
    assert {k: run0[k] for k in raw if k != "max_concurrency"} == {
        k: v for k, v in raw.items() if k != "max_concurrency"
    }  # every key vLLM wrote
    assert (run0["max_num_seqs"], run0["max_concurrency"], run0["random_input_len"], run0["num_gpus"]) == (4, 1, 32, 8)
    bad = dest / "SERVE--max_num_seqs=16-BENCH--max_concurrency=4-random_input_len=32-random_output_len=8-request_rate=inf-num_prompts=8"
    assert json.loads((bad / "run=1.failure.json").read_text())["error"] == "error rate 50%"
    assert [d["run_number"] for d in json.loads((bad / "summary.json").read_text())] == [0]
    header = (dest / "summary.csv").read_text().splitlines()[0].split(",")
    assert header[0] == "" and "output_throughput" in header and "max_num_seqs" in header  # pandas' to_csv shape

    back, _ = sweepio.read(dest, "demo")
    want = {(r.cell, r.run): r for r in rows if r.valid}
    assert {(r.cell, r.run) for r in back} == set(want)
    for r in back:
        w = want[(r.cell, r.run)]
        assert (r.deployment, r.load, r.metrics, r.valid) == (w.deployment, w.load, w.metrics, True)
        assert r.slo["p90_ttft_ms"] == 23.0 and r.axes == {"max_num_seqs": w.axes["set.max-num-seqs"]}


def write_layout(root: Path) -> None:
    """What `vllm bench sweep serve` and `serve_sla` leave: comb dirs, run=N.json, summary.json (and a warm-up)."""

    def comb(name: str, runs: list[dict[str, object]]) -> None:
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for r in runs:
            (d / f"run={r['run_number']}.json").write_text(json.dumps(r))
        (d / "summary.json").write_text(json.dumps(runs))

    serve = {"max_num_seqs": 32, "max_num_batched_tokens": 1024}
    for conc in (2, 8):
        bench = {"max_concurrency": conc, "random_input_len": 128}
        runs = [{**result_json(conc, 50.0 * conc + i, 5.0 + conc, in_len=128), "run_number": i, **serve, **bench} for i in range(3)]
        comb(f"SERVE--max_num_seqs=32-max_num_batched_tokens=1024-BENCH--max_concurrency={conc}-random_input_len=128", runs)
    # serve_sla nests each probe one level deeper: SERVE-...-BENCH-.../request_rate=N/summary.json
    for rate in (2, 4):
        runs = [{**result_json(None, 40.0 * rate, 6.0, rate=rate), "run_number": 0, "_benchmark_name": "fast", "request_rate": rate}]
        comb(f"SERVE--fast/request_rate={rate}", runs)
    warm = root / "SERVE--fast" / "request_rate=2"
    (warm / "warmup.json").write_text(json.dumps({**result_json(None, 1.0, 1.0), "run_number": -1}))


def test_read_takes_a_layout_vllm_wrote(tmp_path: Path) -> None:
    write_layout(tmp_path)
    rows, raw = sweepio.read(tmp_path, "imported")
    assert len(rows) == len(raw) == 3 * 2 + 2
    by_dep: dict[str, list[ResultRow]] = {}
    for r in rows:
        by_dep.setdefault(r.deployment, []).append(r)
    assert set(by_dep) == {"max_num_seqs=32 max_num_batched_tokens=1024", "name=fast"}
    big = by_dep["max_num_seqs=32 max_num_batched_tokens=1024"]
    assert {(r.load.max_concurrency, r.load.input_len, r.load.output_len, r.run) for r in big} == {
        (c, 128, 8, i) for c in (2, 8) for i in range(3)
    }
    assert len({r.cell for r in big}) == 2 and all(r.valid and r.metrics is not None for r in big)
    fast = sorted(by_dep["name=fast"], key=lambda r: r.load.request_rate)
    assert [r.load.request_rate for r in fast] == [2.0, 4.0] and all(r.load.max_concurrency is None for r in fast)
    assert fast[1].metrics is not None and fast[1].metrics.output_throughput == 160.0


def test_import_command_reads_a_sweep_and_reports_it(tmp_path: Path) -> None:
    src, out = tmp_path / "exp-2025", tmp_path / "out"
    write_layout(src)
    r = subprocess.run(
        [sys.executable, "-m", "k3launch", "campaign", "import", str(src), "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    body = json.loads(r.stdout)
    assert body["campaign"] == "exp-2025" and body["runs"] == 8 and Path(body["csv"]).is_file() and body["plots"]
    rows = read_rows(out)
    assert len(rows) == 8 and all(r.result_file and json.loads((out / r.result_file).read_text())["completed"] == 8 for r in rows)
    empty = subprocess.run(
        [sys.executable, "-m", "k3launch", "campaign", "import", str(tmp_path / "nothing"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert empty.returncode == 2 and "no summary.json below it" in empty.stderr and "Traceback" not in empty.stderr

