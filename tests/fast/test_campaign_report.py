"""``campaign report``: labelled tables, per-deployment Pareto fronts drawn forwards with labels
that never overlap, throughput per GPU and cost from the plan and the inventory's price,
published reference points, and the one self-contained HTML file."""

from __future__ import annotations

import itertools
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from k3launch import api
from k3launch.campaign import html, plots
from k3launch.campaign.energy import Energy
from k3launch.campaign.file import Reference, load_campaign
from k3launch.campaign.report import Context, cells_table, plan_gpus, series, tables
from k3launch.campaign.results import Provenance, ResultRow
from k3launch.errors import K3Error
from k3launch.models.bench import BenchMetrics, LoadPoint
from k3launch.planning.inventory import GpuHourPrice


def metrics(**kw: float) -> BenchMetrics:
    base = {
        "completed": 10,
        "failed": 0,
        "duration": 10.0,
        "total_input_tokens": 1000,
        "total_output_tokens": 5000,
        "request_throughput": 1.0,
        "output_throughput": 500.0,
        "total_token_throughput": 600.0,
        "p99_tpot_ms": 5.0,
        "p99_itl_ms": 5.0,
        "p99_ttft_ms": 20.0,
    }
    return BenchMetrics.model_validate({**base, **kw})


def row(dep: str, conc: int, group: int = 0, energy: Energy | None = None, **kw: float) -> ResultRow:
    return ResultRow(
        campaign="t",
        cell=f"{dep}/{conc}",
        group=group,
        deployment=dep,
        axes={},
        load=LoadPoint(max_concurrency=conc),
        valid=True,
        metrics=metrics(**kw),
        energy=energy,
    )


def itl_rows() -> list[ResultRow]:
    """The shape of the demo's ITL plot: c4 and c16 land on almost the same point, and the ITL
    p99 of c16 is *lower* than that of c4 (concurrency order is not latency order)."""
    return [
        row("tep", 1, p99_itl_ms=4.0, output_throughput=100.0),
        row("tep", 4, p99_itl_ms=9.0, output_throughput=380.0),
        row("tep", 16, p99_itl_ms=8.9, output_throughput=381.0),
        row("tep", 64, p99_itl_ms=30.0, output_throughput=900.0),
    ]


def label_boxes(fig: object) -> list[tuple[str, tuple[float, float, float, float]]]:
    fig.canvas.draw()  # type: ignore[attr-defined]
    r = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    ax = fig.axes[0]  # type: ignore[attr-defined]
    return [(t.get_text(), tuple(t.get_window_extent(r).extents)) for t in ax.texts]


# ----------------------------------------------------------------- plots
def test_label_placement_keeps_every_box_apart() -> None:
    # twelve labels on four spots, markers to avoid: the crowded case of a plot's corner
    anchors = [(100.0 + (i % 4) * 2, 100.0 + (i % 2) * 3) for i in range(12)]
    sizes = [(18.0 + i, 8.0) for i in range(12)]
    markers = [(x - 3.5, y - 3.5, x + 3.5, y + 3.5) for x, y in anchors]
    offs = plots.place_labels(anchors, sizes, markers)
    boxes = [(x + dx, y + dy, x + dx + w, y + dy + h) for (x, y), (dx, dy), (w, h) in zip(anchors, offs, sizes, strict=True)]
    assert not any(plots.overlaps(a, b) for a, b in itertools.combinations(boxes, 2))
    assert not any(plots.overlaps(a, m) for a in boxes for m in markers)


def test_itl_front_runs_forwards_and_its_labels_do_not_overlap() -> None:
    fig = plots.throughput_vs_latency(series(itl_rows()), "itl", "t: throughput vs ITL p99")
    try:
        line = fig.axes[0].lines[0]
        xs = list(line.get_xdata())
        assert xs == sorted(xs)  # the front is drawn in latency order: no zig-zag backwards
        boxes = label_boxes(fig)
        assert sorted(t for t, _ in boxes) == ["c1", "c16", "c4", "c64"]
        for (ta, a), (tb, b) in itertools.combinations(boxes, 2):
            assert not plots.overlaps(a, b), f"labels {ta} and {tb} overlap"
    finally:
        plots.close([("x", fig)])


def test_dominated_points_stay_off_the_line() -> None:
    fig = plots.throughput_vs_latency(series(itl_rows()), "itl", "t")
    try:
        # c4 (9.0 ms, 380) is beaten by c16 (8.9 ms, 381): not on the front, drawn hollow
        assert 9.0 not in list(fig.axes[0].lines[0].get_xdata())
        assert any(9.0 in [p[0] for p in c.get_offsets()] for c in fig.axes[0].collections)
    finally:
        plots.close([("x", fig)])


def plan_ctx(price: GpuHourPrice | None = None, references: tuple[Reference, ...] = ()) -> tuple[Context, int]:
    plan = api.plan(api.bundled_inventory("local"), selection={"strategy": "single_node_tp"})
    return Context({0: plan}, price, references), plan_gpus(plan)


def test_per_gpu_axis_and_reference_points_share_the_axes() -> None:
    ref = Reference(label="vendor X", metric="p99_itl_ms", x=12.0, y=33.0)
    other = Reference(label="TPOT only", metric="p99_tpot_ms", x=12.0, y=33.0)
    ctx, gpus = plan_ctx(references=(ref, other))
    assert gpus > 0
    fig = plots.throughput_vs_latency(series(itl_rows()), "itl", "t", ctx)
    try:
        ax = fig.axes[0]
        assert "per GPU" in ax.get_ylabel()
        assert list(ax.lines[0].get_ydata()) == [100.0 / gpus, 381.0 / gpus, 900.0 / gpus]
        texts = [t for t, _ in label_boxes(fig)]
        assert "vendor X" in texts and "TPOT only" not in texts  # a reference is drawn against its own metric only
        boxes = [b for _, b in label_boxes(fig)]
        assert not any(plots.overlaps(a, b) for a, b in itertools.combinations(boxes, 2))
    finally:
        plots.close([("x", fig)])


# ----------------------------------------------------------------- tables
def energy(j_out: float) -> Energy:
    return Energy(
        source="nvidia-smi",
        nodes=1,
        gpus=8,
        samples=20,
        window_s=10.0,
        joules=j_out * 5000,
        mean_watts=j_out * 500,
        j_per_output_token=j_out,
        j_per_total_token=j_out * 5000 / 6000,
        valid=True,
    )


def test_every_number_of_the_terminal_table_is_labelled_with_its_unit() -> None:
    ctx, gpus = plan_ctx(GpuHourPrice(amount=3.0, currency="EUR"))
    rows = [row("a", 1, energy=energy(0.5)), row("a", 4, energy=energy(0.25))]
    (t,) = tables(rows, ctx)
    assert t.headers[:2] == ["deployment", "figure (unit)"] and t.headers[2:] == ["1", "4"]
    labels = [r[1] for r in t.rows]
    assert all(re.search(r"\([^)]+\)$", label) for label in labels)  # every figure names its unit
    by = {r[1]: r[2:] for r in t.rows}
    assert by["output per GPU (tok/s)"] == [f"{500 / gpus:,.1f}"] * 2
    assert by["energy/output token (J)"] == ["0.5", "0.25"]
    cost = gpus * 3.0 * 10.0 / 3600 / 5000 * 1e6
    assert by["cost/M output tokens (EUR)"] == [format(cost, ",.3g")] * 2


def test_energy_and_cost_rows_appear_only_when_known() -> None:
    (t,) = tables([row("a", 1), row("a", 4)])
    assert [r[1] for r in t.rows] == ["output (tok/s)", "TPOT p99 (ms)", "ITL p99 (ms)", "TTFT p99 (ms)"]


# ----------------------------------------------------------------- HTML
class _Check(HTMLParser):
    """Collects tags, and anything that would fetch from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for k, v in attrs:
            if k in ("src", "href") and v and not v.startswith("#"):
                self.external.append(f"{tag} {k}={v}")


def test_html_report_is_one_self_contained_file(tmp_path: Path) -> None:
    ctx, _ = plan_ctx(GpuHourPrice(amount=2.0), (Reference(label="vendor <X>", x=6.0, y=20.0),))
    prov = Provenance(
        plan_hash="abc123",
        deployment="t-abc123",
        recipe="r",
        recipe_file="r.yaml",
        recipe_sha256=None,
        campaign_sha256="c",
        k3launch_version="0",
        vllm_version="0.33.0",
        vllm_schema="0.33.0",
        runtime="bare",
        image=None,
        image_id=None,
        inventory="local",
        nodes=["local-1"],
        client="local",
        started="s",
        ended="e",
    )
    rows = [r.model_copy(update={"provenance": prov}) for r in itl_rows()]
    rows.append(
        ResultRow(
            campaign="t",
            cell="tep/128",
            group=0,
            deployment="tep",
            axes={},
            load=LoadPoint(max_concurrency=128),
            valid=False,
            reason="0 output tokens <b>",
        )
    )
    path = html.write_report(tmp_path, "t", rows, ctx, description="TEP & friends")
    assert path == tmp_path / "report.html" and not list(tmp_path.glob(".*.tmp"))
    text = path.read_text()
    p = _Check()
    p.feed(text)
    assert p.external == []  # nothing fetched from elsewhere: plots inline, no scripts or styles linked
    assert p.tags.count("svg") == 4 and "table" in p.tags and "details" in p.tags and "script" in p.tags
    assert 'class="sortable"' in text and "addEventListener" in text
    assert "vendor &lt;X&gt;" in text and "0 output tokens &lt;b&gt;" in text and "TEP &amp; friends" in text  # user text escaped
    assert "t-abc123" in text and "&quot;strategy&quot;: &quot;single_node_tp&quot;" in text  # provenance and the plan, one click away
    assert "cost/M output tokens (USD)" in text and "output per GPU (tok/s)" in text
    cells = cells_table(rows, ctx)
    assert all(re.search(r"\([^)]+\)$", h) for h in cells.headers[2:])
    valid_part = text[text.index("<h2>Cells") : text.index("<h2>Invalid cells")]
    assert len(re.findall(r"<tr><td>tep</td>", valid_part)) == len(cells.rows) == 4  # the invalid cell is in its own table
    # numbers sort as numbers: each figure cell carries its value
    assert 'data-v="100.0"' in text and 'data-v="900.0"' in text


# ----------------------------------------------------------------- campaign file
@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ({"label": "v", "metric": "p99_e2e_ms", "x": 1, "y": 1}, "references.0.metric"),
        ({"label": "v", "x": -1, "y": 1}, "greater than 0"),
        ({"label": "", "x": 1, "y": 1}, "at least 1 character"),
        ({"label": "v", "x": 1, "y": 1, "z": 2}, "unknown key"),
    ],
)
def test_bad_reference_points_are_refused_with_file_and_line(tmp_path: Path, ref: dict[str, object], words: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"name": "refs", "references": [ref]}))
    with pytest.raises(K3Error) as exc:
        load_campaign(f)
    assert f"{f}:" in exc.value.message and words in exc.value.message, exc.value.message


def test_reference_points_load(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("name: refs\nreferences:\n  - {label: vendor X, metric: p99_ttft_ms, x: 200, y: 1500}\n")
    assert load_campaign(f).references == [Reference(label="vendor X", metric="p99_ttft_ms", x=200.0, y=1500.0)]
