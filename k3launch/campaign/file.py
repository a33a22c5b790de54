"""The campaign file (``campaigns/*.yaml``): what to deploy, what load to put on it, what counts.

Unknown keys are errors with file and line (the same loader as recipes and inventories)::

    name: tep-vs-dep                 # results and deployment names derive from it
    inventory: local                 # a bundled inventory name, or a path relative to this file
    port_base: 9000                  # optional: every deployment's port block (docs/inventories.md ("Placement rules"))
    engine_env: {K3LAUNCH_SIM_LOAD_S: "0.2"}   # extra engine env, checked like an inventory's env
    base: {strategy: multi_node_tep, nodes: 2} # selection fields every deployment starts from
    deployments:                     # axes: the product of every listed value
      strategy: [multi_node_tep, multi_node_dep]
      set: {max-num-seqs: [64, 256]} # one axis per flag (--set FLAG=VALUE)
    load:                            # axes of `vllm bench serve`; a scalar is a one-value axis
      max_concurrency: [1, 8, 64]
      input_len: 1024
      output_len: 128
    exclude:                         # drop cells matching every key of one entry
      - {strategy: multi_node_dep, max_concurrency: 1}
    validity: {max_error_rate: 0.01}
    repeats: 3                       # each point 3 times after an unrecorded warm-up: median and CI
    sla:                             # instead of fixed values of one load axis: the highest that meets every SLO
      variable: max_concurrency
      slo: {p99_ttft_ms: 2000, p99_tpot_ms: 50}
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from k3launch.errors import K3Error
from k3launch.models.selection import Selection
from k3launch.planning.inventory import NodeSettings
from k3launch.util import bounds
from k3launch.util.bounds import MAX_CELLS, MAX_DEPLOYMENTS
from k3launch.util.yamlio import load_yaml_model

Scalar = str | int | float | bool | None
NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,40}$"  # + "-<8 hex>" stays a valid deployment name (≤ 63)

# Selection fields a deployment axis may vary: every field, ``sets`` as one axis per flag (``set``).
LIST_AXES = tuple(n for n in Selection.list_fields() if n != "sets")
SCALAR_AXES = tuple(n for n in Selection.model_fields if n not in Selection.list_fields())
LOAD_AXES = ("max_concurrency", "input_len", "output_len", "request_rate", "num_prompts")
# vLLM's result keys an SLO may bound: a mean, the median or any percentile of the four latencies
SLO_KEY = re.compile(r"^(mean|median|p(\d{1,2}(\.\d+)?))_(ttft|tpot|itl|e2el)_ms$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _as_list(v: object) -> object:
    """A scalar where a list of values is expected is a one-value axis."""
    return v if isinstance(v, list) or v is None else [v]


def _as_lists(v: object) -> object:
    """A list axis takes lists; a flat list of strings is one value per string."""
    if isinstance(v, list):
        return [x if isinstance(x, list) else [x] for x in v]
    return v if v is None else [[v]]


class _Axes(Strict):
    """Each listed field is an axis of the deployment matrix (in this order); ``null`` is the default."""

    set: dict[str, list[str | int | float | bool]] = {}

    @field_validator(*SCALAR_AXES, mode="before", check_fields=False)
    @classmethod
    def _scalar_axes(cls, v: object) -> object:
        return _as_list(v)

    @field_validator(*LIST_AXES, mode="before", check_fields=False)
    @classmethod
    def _list_axes(cls, v: object) -> object:
        return _as_lists(v)

    @field_validator("set", mode="before")
    @classmethod
    def _set(cls, v: object) -> object:
        return {k: _as_list(x) for k, x in v.items()} if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _non_empty(self) -> _Axes:
        for name in (*SCALAR_AXES, *LIST_AXES):
            if getattr(self, name) == []:
                raise ValueError(f"deployment axis {name!r} has no values")
        for flag, values in self.set.items():
            if not values:
                raise ValueError(f"deployment axis set.{flag} has no values")
            if "=" in flag or not flag.strip("-"):
                raise ValueError(f"set: {flag!r} is not a flag name (write `set: {{max-num-seqs: [64, 256]}}`)")
        return self


def _axis_type(name: str) -> Any:
    """A deployment axis of Selection field ``name``: a list of its values (a list of lists for list
    fields), each in the field's bounds (``nodes: [2, 0]`` is refused at its line, not at planning)."""
    if name in LIST_AXES:
        return list[list[str]] | None
    scalar: Any = Selection.model_fields[name].annotation
    bound = Selection.bound(name)
    if bound is not None:
        scalar = Annotated[int, Field(**bound.field())]
    return list[scalar | None] | None


# One axis per Selection field (``set`` replaces ``sets``: one axis per flag), derived from the model.
if TYPE_CHECKING:
    DeploymentAxes = _Axes
else:
    DeploymentAxes = create_model(
        "DeploymentAxes",
        __base__=_Axes,
        __doc__=_Axes.__doc__,
        **{name: (_axis_type(name), None) for name in Selection.model_fields if name != "sets"},
    )


def _rate(v: object) -> object:
    return float("inf") if isinstance(v, str) and v.strip().lower() in ("inf", "infinity") else v


def _at_most(bound: bounds.Bound) -> Any:
    """The upper end of ``bound`` (the lower one is ``LoadAxes._positive``'s, with the axis's line)."""
    return Field(le=bound.hi)


def _rate_in_bounds(v: float) -> float:
    """A request rate is a number of requests per second in its bounds, or inf (all at once)."""
    if v > 0 and v != math.inf and bounds.REQUEST_RATE.why_not(v) is not None:  # 0, negatives, NaN: _positive says it
        raise ValueError(f"request rate {v:g}: use {bounds.REQUEST_RATE.describe()}, or inf")
    return v


Rate = Annotated[float, AfterValidator(_rate_in_bounds)]


class LoadAxes(Strict):
    """``vllm bench serve`` load axes (random dataset); every combination is a load point."""

    max_concurrency: list[Annotated[int, _at_most(bounds.CONCURRENCY)] | None] = [None]
    input_len: list[Annotated[int, _at_most(bounds.TOKENS)]] = [1024]
    output_len: list[Annotated[int, _at_most(bounds.TOKENS)]] = [128]
    request_rate: list[Rate] = [math.inf]
    num_prompts: list[Annotated[int, _at_most(bounds.PROMPTS)]] = [200]

    @field_validator(*LOAD_AXES, mode="before")
    @classmethod
    def _load_axes(cls, v: object) -> object:
        v = _as_list(v)
        return [_rate(x) for x in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _positive(self) -> LoadAxes:
        for name in LOAD_AXES:
            values = getattr(self, name)
            if not values:
                raise ValueError(f"load axis {name!r} has no values")
            if any(x is not None and not x > 0 for x in values):
                raise ValueError(f"load axis {name!r}: values must be positive")
        return self


class Validity(Strict):
    """When a cell's numbers count; a cell failing any gate is recorded invalid with the reason."""

    min_completed: int = Field(default=1, **bounds.PROMPTS.field())
    max_error_rate: float = Field(default=0.01, ge=0.0, le=1.0)  # failed / (completed + failed)
    min_output_tokens: int = Field(default=1, ge=1, le=bounds.PROMPTS.hi * bounds.TOKENS.hi)
    # a repeated point whose confidence interval is wider than this share of its median, either side
    # (output throughput, and each SLO metric of an SLA search), is flagged invalid: too noisy to compare
    max_spread: float = Field(default=0.1, gt=0.0, le=10.0)


class Repeats(Strict):
    """``repeats: N`` (or this mapping): each load point N times, one row per run, after a warm-up run."""

    runs: int = Field(default=1, ge=1, le=100)
    warmup: bool | None = None  # one unrecorded run of the point first; None: when runs > 1
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0)  # of the interval reported around each median

    def warms_up(self) -> bool:
        return self.runs > 1 if self.warmup is None else self.warmup


class Sla(Strict):
    """Search each deployment (and each point of the other load axes) for the highest ``variable``
    whose point meets every SLO: bracketing by doubling from ``start``, then bisection, until the
    highest passing and the lowest failing probe are within ``tolerance`` (relative; for
    concurrency at least 1 request), in at most ``max_probes`` probes."""

    variable: Literal["max_concurrency", "request_rate"] = "request_rate"
    slo: dict[str, float]  # vLLM result key -> upper bound in ms: {p99_ttft_ms: 2000, mean_tpot_ms: 50}
    start: float = Field(default=1.0, gt=0.0, le=bounds.CONCURRENCY.hi)
    max: float = Field(default=1024.0, gt=0.0, le=bounds.CONCURRENCY.hi)  # never probed above
    tolerance: float = Field(default=0.1, gt=0.0, le=1.0)
    max_probes: int = Field(default=16, ge=2, le=100)

    @field_validator("slo")
    @classmethod
    def _slo(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("sla.slo has no objective (write `slo: {p99_ttft_ms: 2000, p99_tpot_ms: 50}`)")
        for key, bound in v.items():
            m = SLO_KEY.match(key)
            if m is None or (m.group(2) is not None and not 0 < float(m.group(2)) < 100):
                raise ValueError(
                    f"sla.slo: {key!r} is not a latency statistic of vLLM's result "
                    "(mean_, median_ or p<N>_ with ttft, tpot, itl or e2el, then _ms: p99_tpot_ms)"
                )
            if not (math.isfinite(bound) and bound > 0):
                raise ValueError(f"sla.slo.{key}: {bound} is not a positive number of milliseconds")
        return v

    @model_validator(mode="after")
    def _range(self) -> Sla:
        if self.max <= self.start:
            raise ValueError(f"sla: max ({self.max:g}) must be above start ({self.start:g})")
        if self.variable == "max_concurrency" and not (self.start.is_integer() and self.max.is_integer()):
            raise ValueError("sla: start and max of a concurrency search are whole numbers of requests")
        return self

    def percentiles(self) -> list[float]:
        """The percentiles the client must compute besides its default 50 and 99."""
        out = {float(m.group(2)) for k in self.slo if (m := SLO_KEY.match(k)) and m.group(2)}
        return sorted(out - {50.0, 99.0})


class Reference(Strict):
    """A published figure drawn on the report's plots: ``y`` output tokens/s per GPU at ``x`` ms of
    ``metric`` (a vendor's throughput at an interactivity level, say)."""

    label: str = Field(min_length=1, max_length=80, pattern=r"^[^\n\r]+$")
    metric: Literal["p99_tpot_ms", "p99_itl_ms", "p99_ttft_ms"] = "p99_tpot_ms"
    x: float = Field(gt=0, le=3_600_000, allow_inf_nan=False)  # ms: an hour
    y: float = Field(ge=0, le=10_000_000, allow_inf_nan=False)  # tokens/s per GPU


class BenchSettings(Strict):
    client: Literal["auto", "local", "engine"] = "auto"  # engine: `vllm bench serve` in the head's container
    seed: int = Field(default=0, **bounds.SEED.field())
    random_range_ratio: float = Field(default=0.0, ge=0.0, lt=1.0)
    num_warmups: int = Field(default=0, **bounds.WARMUPS.field())
    timeout_s: float = Field(default=3600.0, **bounds.BENCH_TIMEOUT.field())  # one load point, end to end


class Campaign(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    inventory: str | None = None  # None: the bundled local inventory
    port_base: int | None = None  # a block of ports: planning's rule (_port_base)
    ready_timeout: float | None = Field(default=None, **bounds.READY_TIMEOUT.field())
    engine_env: dict[str, str] = {}
    base: Selection = Selection()
    deployments: DeploymentAxes = DeploymentAxes()
    load: LoadAxes = LoadAxes()
    exclude: list[dict[str, Scalar | list[Scalar]]] = []
    validity: Validity = Validity()
    bench: BenchSettings = BenchSettings()
    repeats: Repeats = Repeats()
    sla: Sla | None = None
    references: list[Reference] = Field(default=[], max_length=100)

    @field_validator("repeats", mode="before")
    @classmethod
    def _repeats(cls, v: object) -> object:
        return {"runs": v} if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _sla_axis(self) -> Campaign:
        if self.sla is not None and self.sla.variable in self.load.model_fields_set:
            raise ValueError(f"load.{self.sla.variable}: the SLA search chooses it; drop it from load (or drop sla)")
        return self

    @field_validator("port_base")
    @classmethod
    def _port_base(cls, v: int | None) -> int | None:
        from k3launch.planning.placement import Ports

        if v is not None:
            try:
                Ports.shifted(v)  # planning's rule, here so the file's line is given
            except K3Error as exc:
                raise ValueError(f"{exc.message.removeprefix('--port-base ')}; {exc.hint}") from None
        return v

    @field_validator("engine_env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        NodeSettings(env=v)  # the inventory's checks: no secrets, no placement-owned names
        return v

    @field_validator("base")
    @classmethod
    def _base_sets(cls, v: Selection) -> Selection:
        for s in v.sets:
            if "=" not in s:
                raise ValueError(f"sets entry {s!r}: use FLAG=VALUE")
        return v

    @model_validator(mode="after")
    def _exclude_keys(self) -> Campaign:
        known = set(self.axis_names())
        for i, entry in enumerate(self.exclude):
            unknown = sorted(set(entry) - known)
            if unknown:
                raise ValueError(f"exclude[{i}]: {unknown[0]!r} is not an axis of this campaign (axes: {', '.join(sorted(known))})")
        return self

    def deployment_axis_names(self) -> list[str]:
        d = self.deployments
        names = [n for n in (*SCALAR_AXES, *LIST_AXES) if getattr(d, n) is not None]
        return names + [f"set.{flag}" for flag in d.set]

    def axis_names(self) -> list[str]:
        return [*self.deployment_axis_names(), *LOAD_AXES]

    def deployment_points(self) -> int:
        """How many deployment points the axes make (before ``exclude``), counted, not built."""
        d = self.deployments
        return math.prod(len(getattr(d, n)) for n in (*SCALAR_AXES, *LIST_AXES) if getattr(d, n) is not None) * math.prod(
            len(v) for v in d.set.values()
        )

    def load_points(self) -> int:
        return math.prod(len(getattr(self.load, n)) for n in LOAD_AXES)

    def check_size(self, where: str) -> None:
        """Refuse a matrix past the documented limits before anything is expanded or planned."""
        deployments, loads = self.deployment_points(), self.load_points()
        cells = deployments * loads
        if cells > MAX_CELLS or deployments > MAX_DEPLOYMENTS:
            raise K3Error(
                "campaign-too-large",
                f"{where}: {cells} cells ({deployments} deployment points x {loads} load points); "
                f"a campaign has at most {MAX_CELLS} cells and {MAX_DEPLOYMENTS} deployment points",
                'split it into several campaign files, or use fewer axis values (docs/campaigns.md ("Limits"))',
            )


def load_campaign(path: Path) -> Campaign:
    """Parse a campaign file; every problem is one ``file:line`` K3Error (exit 2)."""
    c = load_yaml_model(path, Campaign, doc='docs/campaigns.md ("Campaign files")', code="bad-campaign")
    c.check_size(str(path))
    return c
