"""Campaigns without engines: file errors, matrix expansion, plan-hash groups, validity gates,
the results file under concurrent appenders and torn lines, report tables and Pareto fronts."""

from __future__ import annotations

import math
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from paths import ROOT

from k3launch import api
from k3launch.campaign.file import Campaign, DeploymentAxes, Validity, load_campaign
from k3launch.campaign.matrix import expand, group, invalid_reason, plan_hash
from k3launch.campaign.report import front_rows, pareto, series, tables
from k3launch.campaign.results import RESULTS, ResultRow, append_row, done_cells, latest, read_rows
from k3launch.campaign.run import build_plan, prepare
from k3launch.defaults import ADVANCED_ALL, DEFAULT_VLLM_VERSION
from k3launch.errors import K3Error
from k3launch.models.bench import BenchMetrics, LoadPoint
from k3launch.models.selection import Selection


def camp(**kw: object) -> Campaign:
    return Campaign.model_validate({"name": "t", **kw})


def k3(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "k3launch", *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          stdin=subprocess.DEVNULL)


# ----------------------------------------------------------------- campaign files
@pytest.mark.parametrize(("text", "line", "words"), [
    ("name: x\nload:\n  max_concurency: [1]\n", 3, "unknown key 'load.max_concurency'"),
    ("name: x\ndeployments:\n  strategy: [a]\n  nodez: [2]\n", 4, "unknown key 'deployments.nodez'"),
    ("name: x\nload:\n  max_concurrency: [1, 0]\n", 2, "must be positive"),
    ("name: Bad_Name\n", 1, "name"),
    ("name: x\nengine_env:\n  HF_TOKEN: abc\n", 2, "looks like a secret"),
    ("name: x\nexclude:\n  - {strategyy: tp}\n", 1, "not an axis of this campaign"),
    ("name: x\nload: [1, 2\n", 3, "malformed YAML"),
])
def test_campaign_file_errors_are_one_line_with_file_and_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(K3Error) as exc:
        load_campaign(f)
    assert f"{f}:{line}" in exc.value.message and words in exc.value.message
    r = k3("campaign", "run", str(f), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[0].startswith(f"error: {f}:") and r.stderr.splitlines()[1].startswith("hint: ")
    assert not (tmp_path / "out").exists()


def test_bundled_demo_is_two_deployments_by_three_loads() -> None:
    p = prepare(ROOT / "campaigns" / "local-demo.yaml")
    assert len(p.cells) == 6 and len(p.groups) == 2 and not p.refused
    assert all(len(g.loads) == 3 for g in p.groups)


@pytest.mark.parametrize("path", sorted((ROOT / "campaigns").glob("*.yaml")), ids=lambda p: p.stem)
def test_bundled_campaigns_plan_without_refusals(path: Path) -> None:
    p = prepare(path)
    assert p.campaign.name == path.stem and p.groups and not p.refused
    assert len(p.cells) + p.excluded == len(p.groups) * len(p.campaign.load.max_concurrency)


def test_port_base_override_keeps_the_cells() -> None:
    # a run (or an array task) may move the ports; the cells, and so resume, stay the same
    a, b = prepare(ROOT / "campaigns" / "local-demo.yaml"), prepare(ROOT / "campaigns" / "local-demo.yaml", port_base=30208)
    assert [g.plan_hash for g in a.groups] == [g.plan_hash for g in b.groups] and a.cell_ids() == b.cell_ids()
    assert (a.port_base, b.port_base) == (9000, 30208)


def test_base_and_axes_are_derived_from_selection() -> None:
    # one model of the user's choices: the campaign's base is a Selection, and every Selection
    # field is a deployment axis (``sets`` as one ``set.<flag>`` axis per flag)
    assert Campaign.model_fields["base"].annotation is Selection
    assert set(DeploymentAxes.model_fields) == (set(Selection.model_fields) - {"sets"}) | {"set"}
    c = camp(base={"advanced": ["all"], "vllm_version": None}, deployments={"nodes": [None, 4]})
    # vllm_version null: the inventory's vllm_version, else the default (decided where the plan is built)
    assert c.base.advanced == ADVANCED_ALL and c.base.vllm_version is None
    assert c.base.engine_version() == DEFAULT_VLLM_VERSION and c.base.engine_version("0.32.0") == "0.32.0"
    with pytest.raises(ValueError, match="use FLAG=VALUE"):
        camp(base={"sets": ["max-num-seqs"]})


# ----------------------------------------------------------------- expansion
def test_product_of_axes_minus_excludes() -> None:
    c = camp(deployments={"strategy": ["multi_node_tep", "multi_node_dep"], "set": {"max-num-seqs": [64, 256]}},
             load={"max_concurrency": [1, 8, 64], "input_len": 1024},
             exclude=[{"strategy": "multi_node_dep", "max_concurrency": [1, 8]}])
    cells = expand(c)
    assert len(cells) == 2 * 2 * 3 - 2 * 2
    dep = [x for x in cells if dict(x.spec.axes)["strategy"] == "multi_node_dep"]
    assert {x.load.max_concurrency for x in dep} == {64}
    sets = {x.spec.fields()["sets"] for x in cells}
    assert sets == {("max-num-seqs=64",), ("max-num-seqs=256",)}


def test_set_axis_replaces_the_base_value_of_the_same_flag() -> None:
    c = camp(base={"sets": ["--max-num-seqs=8", "max-model-len=4096"]}, deployments={"set": {"max-num-seqs": [16]}})
    (cell,) = expand(c)[:1]
    assert cell.spec.fields()["sets"] == ("max-model-len=4096", "max-num-seqs=16")


def test_identical_plans_share_one_group() -> None:
    # strategy null is the recipe's default: the same deployment as naming it, one engine start
    c = camp(deployments={"strategy": ["single_node_tp", None, "multi_node_tep"]}, load={"max_concurrency": [1, 2]})
    cells = expand(c)
    inv = api.load(None)[0]
    plans = {x.spec.key: build_plan(inv, x.spec, 30208) for x in cells}
    hashes = {k: plan_hash(p) for k, p in plans.items()}
    groups = group(cells, hashes)
    assert len(cells) == 6 and len(groups) == 2
    assert [len(g.specs) for g in groups] == [2, 1] and all(len(g.loads) == 2 for g in groups)


def test_plan_hash_ignores_the_name_but_not_what_runs() -> None:
    a = api.plan(None, name="h-a", port_base=30208, strategy="single_node_tp")
    b = api.plan(None, name="h-b", port_base=30208, strategy="single_node_tp")
    c = api.plan(None, name="h-a", port_base=30208, strategy="single_node_tp", sets=("max-num-seqs=4",))
    assert plan_hash(a) == plan_hash(b) != plan_hash(c)


def test_refused_deployment_is_reported_not_raised() -> None:
    p = prepare_text("name: r\ndeployments:\n  strategy: [single_node_tp, no_such_strategy]\nload: {max_concurrency: [1, 2]}\n")
    assert len(p.groups) == 1 and len(p.refused) == 1
    (err,) = p.refused.values()
    assert "no_such_strategy" in err.message


def prepare_text(text: str) -> object:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "c.yaml"
        f.write_text(text)
        return prepare(f)


# ----------------------------------------------------------------- validity
def metrics(**kw: float) -> BenchMetrics:
    base = {"completed": 10, "failed": 0, "duration": 1.0, "total_input_tokens": 100, "total_output_tokens": 50, "request_throughput": 10.0,
            "output_throughput": 50.0, "total_token_throughput": 150.0, "p99_tpot_ms": 5.0, "p99_itl_ms": 5.0, "p99_ttft_ms": 20.0}
    return BenchMetrics.model_validate({**base, **kw})


def test_validity_gates() -> None:
    v = Validity(max_error_rate=0.1)
    assert invalid_reason(metrics(), v) is None
    assert "completed 0 of 3" in (invalid_reason(metrics(completed=0, failed=3), v) or "")
    assert "error rate 16.7%" in (invalid_reason(metrics(completed=5, failed=1), v) or "")
    assert invalid_reason(metrics(completed=19, failed=1), v) is None  # 5% is under 10%
    assert "0 output tokens" in (invalid_reason(metrics(total_output_tokens=0), v) or "")


# ----------------------------------------------------------------- results file
def row(cell: str, valid: bool, tput: float = 50.0, dep: str = "d", conc: int = 1) -> ResultRow:
    return ResultRow(campaign="t", cell=cell, group=0, deployment=dep, axes={}, load=LoadPoint(max_concurrency=conc), valid=valid,
                     reason=None if valid else "x", metrics=metrics(output_throughput=tput) if valid else None)


def _appender(args: tuple[str, int]) -> None:
    out, i = args
    for j in range(50):
        append_row(Path(out), row(f"c{i}-{j}", True))


def test_concurrent_appenders_never_interleave(tmp_path: Path) -> None:
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.map(_appender, [(str(tmp_path), i) for i in range(4)])
    rows = read_rows(tmp_path)
    assert len(rows) == 200 and len({r.cell for r in rows}) == 200
    assert len((tmp_path / RESULTS).read_text().splitlines()) == 200


def test_torn_last_line_is_skipped_and_closed(tmp_path: Path) -> None:
    append_row(tmp_path, row("a", True))
    with (tmp_path / RESULTS).open("a") as f:
        f.write('{"campaign": "t", "cell": "b", "gro')  # a writer killed mid-line
    assert [r.cell for r in read_rows(tmp_path)] == ["a"]
    append_row(tmp_path, row("c", False))
    assert [r.cell for r in read_rows(tmp_path)] == ["a", "c"]
    assert done_cells(read_rows(tmp_path), "t") == {"a"}


def test_latest_prefers_a_valid_row() -> None:
    rows = [row("a", False), row("a", True, 10.0), row("a", False), row("b", False), row("b", False)]
    got = latest(rows, "t")
    assert [(r.cell, r.valid) for r in got] == [("a", True), ("b", False)]


def test_invalid_rows_never_carry_numbers() -> None:
    with pytest.raises(ValueError):
        ResultRow.model_validate({**row("a", True).model_dump(), "extra": 1})
    assert row("a", False).metrics is None


# ----------------------------------------------------------------- report
def test_pareto_front() -> None:
    pts = [(5.0, 100.0), (4.0, 90.0), (6.0, 95.0), (4.0, 80.0), (10.0, 200.0)]
    assert sorted(pareto(pts)) == [0, 1, 4]
    assert pareto([]) == []


def test_tables_and_series_by_deployment() -> None:
    rows = [row(f"{d}{c}", True, tput=c * (2 if d == "b" else 1), dep=d, conc=c) for d in "ab" for c in (1, 4, 16)]
    rows.append(row("x", False, dep="a", conc=64))
    (t,) = tables(rows)
    assert t.headers == ["deployment", "figure (unit)", "1", "4", "16", "64"] and t.title.startswith("by max_concurrency")
    b = [r[1:5] for r in t.rows[4:]]  # deployment b: a line per figure, each labelled with its unit
    assert b == [["output (tok/s)", "2", "8", "32"], ["TPOT p99 (ms)", "5.0", "5.0", "5.0"], ["ITL p99 (ms)", "5.0", "5.0", "5.0"],
                 ["TTFT p99 (ms)", "20", "20", "20"]]
    assert [r[0] for r in t.rows if r[0]] == ["a", "b"] and t.rows[0][-1] == "invalid" and t.rows[4][-1] == "-"
    ss = series(rows)
    assert [s.name for s in ss] == ["a", "b"] and [len(s.rows) for s in ss] == [3, 3]  # the invalid cell is in no series
    assert {r.cell for r in front_rows(rows, "tpot")} == {"b16"}  # same latency everywhere: the top throughput wins
    assert math.isinf(LoadPoint().request_rate)


def test_dry_run_counts_engine_starts(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"name": "dry", "port_base": 30208,
                                 "deployments": {"strategy": ["single_node_tp", None, "multi_node_tep"]},
                                 "load": {"max_concurrency": [1, 2]}}))
    r = k3("campaign", "run", str(f), "--out", str(tmp_path / "o"), "--dry-run", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    import json

    d = json.loads(r.stdout)
    assert d["cells"] == 6 and d["engine_starts"] == 2 and len(d["groups"]) == 2 and len(d["load_points"]) == 2 and d["excluded"] == 0
    r = k3("campaign", "run", str(f), "--out", str(tmp_path / "o"), "--group", "5", cwd=tmp_path)
    assert r.returncode == 2 and "has 2 deployment group(s)" in r.stderr
    r = k3("campaign", "run", str(f), "--out", str(tmp_path / "o"), "--slurm-array", cwd=tmp_path)
    # --slurm-array needs a slurm inventory; the hint says how to submit the groups by hand
    assert r.returncode == 2 and "needs a campaign on a slurm inventory" in r.stderr and "--group $SLURM_ARRAY_TASK_ID" in r.stderr


def test_a_line_torn_inside_a_multibyte_character_is_skipped_not_fatal(tmp_path: Path) -> None:
    from k3launch.campaign.results import RESULTS, append_row, read_rows

    bad = row("c2", False).model_copy(update={"reason": "client log: \u201cboom\u201d"})
    append_row(tmp_path, row("c1", True))
    append_row(tmp_path, bad)
    data = (tmp_path / RESULTS).read_bytes()
    cut = data[: data.index("\u201c".encode()) + 1]  # a writer killed inside the 3-byte character
    (tmp_path / RESULTS).write_bytes(cut)
    append_row(tmp_path, row("c3", True))  # the next run appends after the torn bytes
    assert [r.cell for r in read_rows(tmp_path)] == ["c1", "c3"]  # torn line skipped, not a UnicodeDecodeError


def test_a_set_that_repeats_the_recipe_default_is_the_same_deployment() -> None:
    from k3launch import api
    from k3launch.campaign.matrix import plan_hash

    plain = api.plan(None, strategy="single_node_tp", name="h-a")
    same = api.plan(None, strategy="single_node_tp", name="h-b", sets=("gpu-memory-utilization=0.95",))
    spelled = api.plan(None, strategy="single_node_tp", name="h-c", sets=("--max-num-seqs=8",))
    bare = api.plan(None, strategy="single_node_tp", name="h-d", sets=("max-num-seqs=8",))
    other = api.plan(None, strategy="single_node_tp", name="h-e", sets=("max-num-seqs=16",))
    assert [p.argv for p in same.processes] == [p.argv for p in plain.processes]  # the recipe already says 0.95
    assert plan_hash(same) == plan_hash(plain) and plan_hash(spelled) == plan_hash(bare)
    assert plan_hash(other) != plan_hash(bare)


def test_a_group_another_process_runs_is_skipped_or_refused_and_a_bad_out_is_a_user_error(tmp_path: Path) -> None:
    import json

    from k3launch.campaign.results import group_lock
    from k3launch.campaign.run import prepare

    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"name": "busy", "port_base": 40960, "base": {"strategy": "single_node_tp"},
                                 "load": {"max_concurrency": [1]}}))
    out = tmp_path / "o"
    out.mkdir()
    (g,) = prepare(f).groups
    with group_lock(out, g.plan_hash) as held:  # as another `campaign run` (or an array task) would
        with group_lock(out, g.plan_hash) as again:
            assert held is not None and again is None
        r = k3("campaign", "run", str(f), "--out", str(out), "--group", "0", cwd=tmp_path)
        assert r.returncode == 2 and "is being run by another process" in r.stderr, r.stderr
        r = k3("campaign", "run", str(f), "--out", str(out), "--json", "--state-dir", str(tmp_path / "st"), cwd=tmp_path)
        s = json.loads(r.stdout)
        assert r.returncode == 0 and s["engine_starts"] == 0 and s["ran"] == 0, r.stderr  # skipped, nothing started
        assert "another process is running it; skipped" in (out / "campaign.log").read_text()
    (tmp_path / "afile").write_text("x")
    r = k3("campaign", "run", str(f), "--out", str(tmp_path / "afile"), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --out ") and "Traceback" not in r.stderr and "internal error" not in r.stderr


def test_a_cell_without_inter_token_samples_is_not_on_the_latency_front() -> None:
    from k3launch.campaign.report import front_rows

    fast = row("fast", True, tput=80.0).model_copy(update={"metrics": metrics(output_throughput=80.0, p99_tpot_ms=4.0)})
    # one output token per request: vLLM reports TPOT 0 ms, which is no latency at all
    single = row("single", True, tput=90.0).model_copy(update={"metrics": metrics(output_throughput=90.0, p99_tpot_ms=0.0,
                                                                                    total_output_tokens=10)})
    assert [r.cell for r in front_rows([fast, single], "tpot")] == ["fast"]
    assert [r.cell for r in front_rows([fast], "tpot")] == ["fast"]


def test_the_random_datasets_seed_is_part_of_a_cell(tmp_path: Path) -> None:
    from k3launch.campaign.run import prepare

    def ids(bench: dict[str, object]) -> set[str]:
        f = tmp_path / "c.yaml"
        f.write_text(yaml.safe_dump({"name": "seed", "base": {"strategy": "single_node_tp"}, "load": {"max_concurrency": [1, 2]},
                                     **({"bench": bench} if bench else {})}))
        return prepare(f).cell_ids()

    default, seed0, seed7, ratio = ids({}), ids({"seed": 0}), ids({"seed": 7}), ids({"random_range_ratio": 0.5})
    assert default == seed0 and all("-s" not in c for c in default)  # the defaults keep the short ids
    assert len(seed7) == len(default) == 2 and not seed7 & default and not ratio & default and not ratio & seed7


def test_a_tighter_validity_gate_re_runs_cells_whose_figures_no_longer_pass(tmp_path: Path) -> None:
    from k3launch.campaign.results import append_row
    from k3launch.campaign.run import Prepared, pending, prepare

    f = tmp_path / "c.yaml"

    def prep(gate: float) -> Prepared:
        f.write_text(yaml.safe_dump({"name": "gate", "base": {"strategy": "single_node_tp"}, "load": {"max_concurrency": [1]},
                                     "validity": {"max_error_rate": gate}}))
        return prepare(f)

    p = prep(0.2)
    (g,) = p.groups
    (ld,) = g.loads
    out = tmp_path / "o"
    out.mkdir()
    failed_one = metrics(failed=1)  # 1 of 11 requests failed: 9 %
    append_row(out, row(g.cell_id(ld), True).model_copy(update={"campaign": "gate", "metrics": failed_one}))
    assert pending(p, out) == {0: 0}  # passes a 20 % gate: done
    assert pending(prep(0.05), out) == {0: 1}  # fails a 5 % gate: measured again


def test_report_judges_rows_by_the_current_gates(tmp_path: Path) -> None:
    from k3launch.campaign.results import append_row

    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"name": "gate", "base": {"strategy": "single_node_tp"}, "load": {"max_concurrency": [1]},
                                 "validity": {"max_error_rate": 0.05}}))
    (g,) = prepare_text(f.read_text()).groups  # type: ignore[attr-defined]
    out = tmp_path / "o"
    out.mkdir()
    append_row(out, row(g.cell_id(g.loads[0]), True).model_copy(update={"campaign": "gate", "metrics": metrics(failed=1)}))
    r = k3("campaign", "report", str(f), "--out", str(out), "--json", cwd=tmp_path)
    import json

    rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["valid"] == 0 and "by the current validity gates" in rep["invalid"][0]["reason"], r.stderr
