"""SLA search and repeats: the pure search against brute force, the statistics of repeated points,
resume, the campaign file's keys (end to end on the simulated engine: test_campaign_sla_e2e.py)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import yaml

from k3launch.campaign import repeats, sla
from k3launch.campaign.file import Sla, load_campaign
from k3launch.campaign.results import ResultRow, append_row, latest, read_rows
from k3launch.campaign.run import prepare
from k3launch.errors import K3Error
from k3launch.models.bench import BenchMetrics, LoadPoint


def search(s: Sla, passes: object) -> sla.Capacity:
    """Run a search against ``passes(value) -> bool`` (a deployment whose latency grows with load)."""
    found = sla.Search(s)
    while (v := found.next()) is not None:
        found.record(v, bool(passes(v)), "")  # type: ignore[operator]
    return found.result()


@pytest.mark.parametrize("variable", ["request_rate", "max_concurrency"])
def test_the_search_brackets_then_bisects_to_the_brute_force_capacity_within_its_tolerance(variable: str) -> None:
    rng = random.Random(7)
    integer = variable == "max_concurrency"
    for _ in range(300):
        s = Sla(variable=variable, slo={"p99_tpot_ms": 50}, start=1, max=512, tolerance=rng.choice([0.02, 0.1, 0.25]), max_probes=40)
        true_cap = rng.randint(1, 511) if integer else rng.uniform(1.0, 511.0)
        found = search(s, lambda v, c=true_cap: v <= c)
        # brute force: every whole concurrency tried; a rate's capacity is the threshold itself
        brute = max(v for v in range(1, 513) if v <= true_cap) if integer else true_cap
        assert found.status == "found" and found.capacity is not None and found.failing is not None
        assert found.capacity <= true_cap < found.failing.value  # the probes that bound it
        gap = found.failing.value - found.capacity
        assert gap <= (max(1.0, math.floor(s.tolerance * found.capacity)) if integer else s.tolerance * found.capacity)
        assert 0 <= brute - found.capacity <= (gap if integer else s.tolerance * found.capacity)
        assert len(found.probes) <= s.max_probes and len({p.value for p in found.probes}) == len(found.probes)
        if integer and s.tolerance * found.capacity < 2:
            assert found.capacity == brute  # a bracket one request wide: exactly the brute-force answer


def test_a_search_says_when_no_load_passes_when_max_passes_and_when_it_ran_out_of_probes() -> None:
    s = Sla(variable="max_concurrency", slo={"mean_ttft_ms": 10}, start=1, max=64, max_probes=16)
    low = search(s, lambda v: False)
    assert (low.status, low.capacity, [p.value for p in low.probes]) == ("below-start", None, [1.0])
    high = search(s, lambda v: True)
    assert (high.status, high.capacity, high.failing) == ("at-max", 64.0, None)
    assert [p.value for p in high.probes] == [1, 2, 4, 8, 16, 32, 64]
    short = search(s.model_copy(update={"max_probes": 4}), lambda v: v <= 37)
    assert short.status == "probe-limit" and short.capacity == 8 and len(short.probes) == 4


def test_judge_names_the_missed_objective_with_its_figure() -> None:
    ok, why = sla.judge({"p99_ttft_ms": 2000, "p90_tpot_ms": 50}, {"p99_ttft_ms": 1500.0, "p90_tpot_ms": 61.25})
    assert not ok and why == "p90_tpot_ms 61.25 > 50"
    ok, why = sla.judge({"p99_ttft_ms": 2000}, {"p99_ttft_ms": 1500.0})
    assert ok and why == "p99_ttft_ms 1500 <= 2000"
    assert sla.judge({"mean_itl_ms": 5}, {})[0] is False


@pytest.mark.parametrize(
    ("confidence", "df", "t"),
    [(0.95, 1, 12.706), (0.95, 2, 4.303), (0.95, 4, 2.776), (0.95, 10, 2.228), (0.99, 5, 4.032), (0.90, 3, 2.353), (0.95, 60, 2.000)],
)
def test_t_quantiles_match_the_tables(confidence: float, df: int, t: float) -> None:
    assert repeats.t_quantile(confidence, df) == pytest.approx(t, abs=1.5e-3)


def run_row(cell: str, run: int, tput: float, tpot: float = 10.0, valid: bool = True) -> ResultRow:
    m = BenchMetrics(
        completed=10,
        failed=0,
        duration=1.0,
        total_input_tokens=100,
        total_output_tokens=160,
        request_throughput=10.0,
        output_throughput=tput,
        total_token_throughput=tput + 100,
        mean_tpot_ms=tpot,
        p99_tpot_ms=tpot * 1.5,
    )
    return ResultRow(
        campaign="c",
        cell=cell,
        group=0,
        deployment="d",
        axes={},
        load=LoadPoint(max_concurrency=4),
        valid=valid,
        reason=None if valid else "boom",
        metrics=m if valid else None,
        run=run,
        slo={"mean_tpot_ms": tpot} if valid else {},
    )


def test_a_repeated_point_is_the_median_of_its_runs_with_the_interval_of_their_mean() -> None:
    rows = [run_row("x", 0, 100.0, 10.0), run_row("x", 1, 104.0, 10.4), run_row("x", 2, 101.0, 10.2)]
    pt = repeats.point(rows, 0.95, 0.1, {"mean_tpot_ms": 10.3})
    assert pt.valid and pt.metrics is not None and pt.stats is not None
    assert (pt.metrics.output_throughput, pt.metrics.mean_tpot_ms, pt.slo["mean_tpot_ms"], pt.stats.runs) == (101.0, 10.2, 10.2, 3)
    lo, hi = pt.stats.ci["output_throughput"]
    half = 4.303 * math.sqrt(((100 - 101.6667) ** 2 + (104 - 101.6667) ** 2 + (101 - 101.6667) ** 2) / 2) / math.sqrt(3)
    assert (lo, hi) == pytest.approx((101.6667 - half, 101.6667 + half), abs=1e-3)
    # an invalid run is left out of the figures; the others still make the point
    assert repeats.point([*rows[:2], run_row("x", 2, 0.0, valid=False)], 0.95, 1.0).stats.runs == 2  # type: ignore[union-attr]


def test_a_repeated_points_energy_is_the_median_of_its_runs() -> None:
    from k3launch.campaign.energy import Energy

    def with_energy(row: ResultRow, j_per_tok: float, valid: bool = True) -> ResultRow:
        e = Energy(source="nvidia-smi", nodes=1, gpus=8, samples=10, window_s=1.0, joules=j_per_tok * 160, mean_watts=j_per_tok * 160,
                   j_per_output_token=j_per_tok, j_per_total_token=j_per_tok * 160 / 260, valid=valid, reason=None if valid else "gap")
        return row.model_copy(update={"energy": e})

    rows = [with_energy(run_row("x", i, 100.0 + i, 10.0), j) for i, j in enumerate((2.0, 9.0, 3.0))]
    pt = repeats.point(rows, 0.95, 1.0)
    assert pt.energy is not None and pt.energy.valid and pt.energy.j_per_output_token == 3.0  # the median, not the last run's
    rows[1] = with_energy(rows[1], 9.0, valid=False)
    pt = repeats.point(rows, 0.95, 1.0)
    assert pt.energy is not None and not pt.energy.valid and pt.energy.reason == "gap"  # one uncovered run: the point's energy is not valid


def test_the_spread_gate_flags_a_point_too_noisy_to_compare() -> None:
    noisy = [run_row("x", 0, 50.0), run_row("x", 1, 150.0), run_row("x", 2, 100.0)]
    pt = repeats.point(noisy, 0.95, 0.1)
    assert not pt.valid and pt.metrics is None and pt.reason is not None
    assert "spread too wide over 3 runs at 95% confidence: output_throughput" in pt.reason and "(max ±10%)" in pt.reason
    # an SLO statistic of a search is gated where it decides nothing: a wide interval holding the bound
    tpot_noise = [run_row("x", 0, 100.0, 5.0), run_row("x", 1, 100.0, 20.0), run_row("x", 2, 100.0, 9.0)]
    assert repeats.point(tpot_noise, 0.95, 0.1).valid
    unsure = repeats.point(tpot_noise, 0.95, 0.1, {"mean_tpot_ms": 10.0})
    assert not unsure.valid and "mean_tpot_ms ±" in (unsure.reason or "") and "around its bound 10" in (unsure.reason or "")
    assert repeats.point(tpot_noise, 0.95, 0.1, {"mean_tpot_ms": 500.0}).valid  # far below its bound: it meets it anyway
    single = run_row("y", 0, 77.0)
    assert repeats.point([single], 0.95, 0.1) is single  # one run: the point is its run


def campaign_file(tmp: Path, **extra: object) -> Path:
    body: dict[str, object] = {
        "name": "sla-unit",
        "base": {"strategy": "single_node_tp"},
        "deployments": {"set": {"max-num-seqs": [4, 16]}},
        "load": {"input_len": 32, "output_len": 8, "num_prompts": 8},
        **extra,
    }
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"sla": {"slo": {"p99_tpot": 50}}}, "'p99_tpot' is not a latency statistic"),
        ({"sla": {"slo": {"p100_ttft_ms": 50}}}, "'p100_ttft_ms' is not a latency statistic"),
        ({"sla": {"slo": {}}}, "sla.slo has no objective"),
        ({"sla": {"slo": {"p99_ttft_ms": -1}}}, "not a positive number of milliseconds"),
        ({"sla": {"slo": {"p99_ttft_ms": 50}, "start": 8, "max": 4}}, "max (4) must be above start (8)"),
        ({"sla": {"variable": "max_concurrency", "slo": {"p99_ttft_ms": 50}, "max": 10.5}}, "whole numbers"),
        ({"sla": {"variable": "request_rate", "slo": {"p99_ttft_ms": 50}}, "load": {"request_rate": [1, 2]}}, "the SLA search chooses it"),
        ({"repeats": 0}, "repeats"),
        ({"repeats": {"runs": 3, "confidence": 1.5}}, "confidence"),
    ],
)
def test_sla_and_repeats_mistakes_are_one_line_errors_with_file_and_line(tmp_path: Path, extra: dict[str, object], words: str) -> None:
    with pytest.raises(K3Error) as exc:
        load_campaign(campaign_file(tmp_path, **extra))
    assert exc.value.code == "bad-campaign" and f"{tmp_path / 'c.yaml'}:" in exc.value.message and words in exc.value.message
    assert "\n" not in exc.value.message


def test_sla_keys_and_the_repeats_shorthand(tmp_path: Path) -> None:
    c = load_campaign(campaign_file(tmp_path, repeats=3, sla={"slo": {"p90_ttft_ms": 2000, "p99.9_tpot_ms": 50, "mean_itl_ms": 9}}))
    assert (c.repeats.runs, c.repeats.warms_up(), c.repeats.confidence) == (3, True, 0.95)
    assert c.sla is not None and c.sla.variable == "request_rate" and c.sla.percentiles() == [90.0, 99.9]
    assert load_campaign(campaign_file(tmp_path)).repeats.warms_up() is False  # no repeats: no warm-up, as before


def probe_rows(
    prep: object, g: object, base: LoadPoint, values: dict[float, float], runs: int, variable: str = "max_concurrency"
) -> list[ResultRow]:
    """Rows of probes ``value -> mean TPOT`` (all runs alike), as a run would have appended them."""
    out = []
    for v, tpot in values.items():
        ld = sla.probe_load(base, variable, v)
        for i in range(runs):
            r = run_row(g.cell_id(ld), i, 100.0, tpot)  # type: ignore[attr-defined]
            out.append(r.model_copy(update={"campaign": prep.campaign.name, "load": ld}))  # type: ignore[attr-defined]
    return out


def test_a_resumed_search_measures_only_the_probe_it_still_needs(tmp_path: Path) -> None:
    path = campaign_file(tmp_path, repeats=2, sla={"variable": "max_concurrency", "slo": {"mean_tpot_ms": 15}, "max": 16})
    prep = prepare(path)
    g = prep.groups[0]
    base = g.loads[0]
    assert base.max_concurrency is None and prep.todo(g, []) == [base]
    # TPOT = 2 ms per request in flight: 1, 2, 4 pass; 8 fails; 6 passes; 7 is still to measure
    done = probe_rows(prep, g, base, {1: 2.0, 2: 4.0, 4: 8.0, 8: 16.0, 6: 12.0}, runs=2)
    s = prep.search(g, base, prep.by_cell(done))
    assert (s.next_probe, s.capacity.status, s.capacity.capacity) == (7.0, "incomplete", 6.0)
    one_run = probe_rows(prep, g, base, {7: 14.0}, runs=1)  # one of its two runs: still to measure
    assert prep.search(g, base, prep.by_cell(done + one_run)).next_probe == 7.0
    full = done + probe_rows(prep, g, base, {7: 14.0}, runs=2)
    s = prep.search(g, base, prep.by_cell(full))
    assert (s.next_probe, s.capacity.status, s.capacity.capacity, s.capacity.bracket()) == (None, "found", 7.0, "[7, 8)")
    assert prep.todo(g, full) == [] and prep.todo(prep.groups[1], full) == [prep.groups[1].loads[0]]
    assert len(prep.current(full)) == len(full)  # probes belong to the matrix, though it never listed them
    # the probes' runs, rows in a results file: resume counts them (and a report finds the search's outcome)
    out = tmp_path / "out"
    for r in full:
        append_row(out, r)
    [found] = [x for x in prep.searches(latest(read_rows(out), prep.campaign.name)) if x.group == 0]
    assert found.as_json()["capacity"] == 7.0 and found.as_json()["bracket"] == [7.0, 8.0]


def test_repeats_resume_adds_the_missing_runs_only(tmp_path: Path) -> None:
    prep = prepare(campaign_file(tmp_path, repeats=3, load={"max_concurrency": [1, 2], "input_len": 32, "output_len": 8, "num_prompts": 8}))
    g = prep.groups[0]
    first = g.cell_id(g.loads[0])
    rows = [
        run_row(first, 0, 100.0).model_copy(update={"campaign": "sla-unit"}),
        run_row(first, 1, 100.0).model_copy(update={"campaign": "sla-unit"}),
    ]
    assert prep.missing_runs(first, prep.by_cell(rows)) == [2]
    assert prep.todo(g, rows) == list(g.loads)
    rows.append(run_row(first, 2, 100.0).model_copy(update={"campaign": "sla-unit"}))
    assert prep.todo(g, rows) == [g.loads[1]]
    # an invalid run is measured again
    rows[1] = run_row(first, 1, 0.0, valid=False).model_copy(update={"campaign": "sla-unit"})
    assert prep.missing_runs(first, prep.by_cell(rows)) == [1]
