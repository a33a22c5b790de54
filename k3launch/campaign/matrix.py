"""The pure core of campaigns: matrix expansion, deployment groups, plan hashes, validity gates.

No I/O, no clock. A campaign's cells are the product of its deployment axes and its load axes,
less the excluded ones; the product is counted before it is built and refused past the limits
of :mod:`k3launch.util.bounds` (``Campaign.check_size``). Cells are grouped by the hash of the Plan their deployment produces, so
two axis values that compose to the same deployment share one engine start; groups keep the
order in which the matrix first names them, so ``--group N`` means the same group on every
machine that expands the same file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from k3launch.campaign.file import LIST_AXES, LOAD_AXES, SCALAR_AXES, Campaign, Scalar, Validity
from k3launch.models.bench import BenchMetrics, LoadPoint
from k3launch.models.plan import Plan

SelValue = str | int | None | tuple[str, ...]


@dataclass(frozen=True)
class DeploymentSpec:
    """One point of the deployment matrix: its axis values (for people) and selection (for plan)."""

    axes: tuple[tuple[str, str], ...]
    selection: tuple[tuple[str, SelValue], ...]

    @property
    def key(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.axes) or "base"

    def fields(self) -> dict[str, SelValue]:
        return dict(self.selection)


@dataclass(frozen=True)
class Cell:
    spec: DeploymentSpec
    load: LoadPoint


@dataclass(frozen=True)
class Group:
    """The cells of one distinct deployment (one engine start)."""

    index: int
    plan_hash: str
    specs: tuple[DeploymentSpec, ...]
    loads: tuple[LoadPoint, ...]
    workload: str = ""  # the campaign's dataset settings when not the defaults (see workload_key)

    def cell_id(self, load: LoadPoint) -> str:
        return cell_id(self.plan_hash, load, self.workload)


def cell_id(plan_hash: str, load: LoadPoint, workload: str = "") -> str:
    return f"{plan_hash[:12]}/{load.key}{workload}"


def workload_key(seed: int, range_ratio: float) -> str:
    """The random dataset's own settings are part of what a cell measures: another seed or range
    ratio is another cell (the defaults add nothing, so their cell ids stay short)."""
    return "" if (seed, range_ratio) == (0, 0.0) else f"-s{seed}-rr{range_ratio:g}"


def show(v: Scalar | Sequence[str]) -> str:
    """An axis value as people (and exclude matchers) write it."""
    if isinstance(v, (list, tuple)):
        return ",".join(v) or "none"
    if v is None:
        return "default"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:g}"
    return str(v)


def _set_flag(sets: list[str], flag: str, value: str) -> list[str]:
    """Replace ``flag``'s entry (any spelling of its dashes) or add it."""
    bare = flag.lstrip("-")
    kept = [s for s in sets if s.split("=", 1)[0].lstrip("-") != bare]
    return [*kept, f"{bare}={value}"]


def deployment_specs(c: Campaign) -> list[DeploymentSpec]:
    base = c.base
    fields: dict[str, SelValue] = {n: getattr(base, n) for n in SCALAR_AXES}
    fields.update({n: tuple(getattr(base, n)) for n in LIST_AXES})
    fields["sets"] = tuple(base.sets)
    d = c.deployments
    axes: list[tuple[str, Sequence[Scalar | list[str]]]] = [
        (n, getattr(d, n)) for n in (*SCALAR_AXES, *LIST_AXES) if getattr(d, n) is not None
    ]
    axes += [(f"set.{flag}", list(values)) for flag, values in d.set.items()]
    out = []
    for combo in itertools.product(*(values for _, values in axes)):
        sel = dict(fields)
        shown = []
        for (name, _), value in zip(axes, combo, strict=True):
            shown.append((name, show(value)))
            if name.startswith("set."):
                sel["sets"] = tuple(_set_flag(list(sel["sets"] or ()), name[4:], show(value)))  # type: ignore[arg-type]
            elif name in LIST_AXES:
                sel[name] = tuple(value)  # type: ignore[arg-type]
            else:
                sel[name] = value  # type: ignore[assignment]
        out.append(DeploymentSpec(tuple(shown), tuple(sorted(sel.items()))))
    return out


def load_points(c: Campaign) -> list[LoadPoint]:
    ld = c.load
    return [
        LoadPoint(max_concurrency=mc, input_len=i, output_len=o, request_rate=r, num_prompts=n)
        for mc, i, o, r, n in itertools.product(ld.max_concurrency, ld.input_len, ld.output_len, ld.request_rate, ld.num_prompts)
    ]


def coordinates(cell: Cell) -> dict[str, str]:
    out = dict(cell.spec.axes)
    out.update({name: show(getattr(cell.load, name)) for name in LOAD_AXES})
    return out


def _matches(coords: Mapping[str, str], entry: Mapping[str, Scalar | list[Scalar]]) -> bool:
    for key, want in entry.items():
        options = want if isinstance(want, list) else [want]
        if coords.get(key) not in {show(o) for o in options}:
            return False
    return True


def expand(c: Campaign) -> list[Cell]:
    """Every (deployment, load) cell of the matrix, minus those an ``exclude`` entry matches."""
    c.check_size(f"campaign {c.name}")  # load_campaign checked a file; a Campaign built in code is checked here
    loads = load_points(c)
    cells = [Cell(s, ld) for s in deployment_specs(c) for ld in loads]
    return [cell for cell in cells if not any(_matches(coordinates(cell), e) for e in c.exclude)]


def plan_hash(plan: Plan) -> str:
    """What runs and where: the plan without its name (unique per deployment), its notices, the
    per-flag provenance (how values were chosen, not what they are) and the echo of the
    selection (``sets``, ``advanced``, ``features``, ``kv_offload``, ``exclude``, and ``origin``,
    the selection as asked: their effect is in the argv and env) — so ``--set
    gpu-memory-utilization=0.95``, the recipe's own value, is the same deployment as no ``--set`` at all."""
    data = plan.model_dump(mode="json", exclude={"name", "notices", "sets", "advanced", "features", "kv_offload", "exclude", "origin"})
    for proc in data.get("processes", []):
        proc.pop("provenance", None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def group(cells: Sequence[Cell], hashes: Mapping[str, str], workload: str = "") -> list[Group]:
    """Cells by deployment plan hash (``hashes``: spec key → hash; specs missing are refused)."""
    # dicts as ordered sets: a list's `in` made this quadratic (minutes for 100,000 cells)
    order: dict[str, tuple[dict[DeploymentSpec, None], dict[LoadPoint, None]]] = {}
    for cell in cells:
        h = hashes.get(cell.spec.key)
        if h is None:
            continue
        specs, loads = order.setdefault(h, ({}, {}))
        specs.setdefault(cell.spec, None)
        loads.setdefault(cell.load, None)
    return [Group(i, h, tuple(specs), tuple(loads), workload) for i, (h, (specs, loads)) in enumerate(order.items())]


def deployment_name(campaign: str, plan_hash: str) -> str:
    """Stable across runs, so a resumed campaign recognises a deployment an earlier run left."""
    return f"{campaign}-{plan_hash[:8]}"


def invalid_reason(m: BenchMetrics, v: Validity) -> str | None:
    """Why a load point's numbers do not count, or None when they do."""
    total = m.completed + m.failed
    if m.completed < v.min_completed:
        return f"completed {m.completed} of {total} requests (need at least {v.min_completed})"
    rate = m.failed / total if total else 1.0
    if rate > v.max_error_rate:
        return f"error rate {rate:.1%} ({m.failed} of {total} failed) is above {v.max_error_rate:.1%}"
    if m.total_output_tokens < v.min_output_tokens:
        return f"{m.total_output_tokens} output tokens from {m.completed} completed requests (need at least {v.min_output_tokens})"
    return None


def label(spec: DeploymentSpec, varying: Sequence[str]) -> str:
    """A short name for plots and tables: the axes that vary across the campaign."""
    parts = [f"{k.removeprefix('set.')}={v}" for k, v in spec.axes if k in varying]
    return " ".join(parts) or spec.key


def varying_axes(specs: Sequence[DeploymentSpec]) -> list[str]:
    names: dict[str, set[str]] = {}
    for s in specs:
        for k, v in s.axes:
            names.setdefault(k, set()).add(v)
    return [k for k, vs in names.items() if len(vs) > 1]
