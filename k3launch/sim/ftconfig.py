"""The fault-tolerance flags of ``vllm serve`` 0.33.0 as the sim reads and checks them.

``--enable-fault-tolerance`` turns it on; ``--fault-tolerance-config`` (JSON, or dotted
``--fault-tolerance-config.engine_recovery_timeout_sec N``) only sizes it: from the command line
it does not enable anything, because argparse hands vLLM a ``FaultToleranceConfig`` and the
auto-enable in ``EngineArgs.__post_init__`` only fires for a dict (vllm/engine/arg_utils.py:
369-376, 906-915). The checks are vLLM's own, in its words: fault tolerance needs external load
balancing (arg_utils.py:2447-2455), a single API server (vllm/config/parallel.py:530-535) and an
FT-capable all-to-all backend, which the worker checks as it starts
(vllm/v1/worker/sentinel/gpu_worker_sentinel.py:26, 41-46).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from k3launch.planning.schema import Arg
from k3launch.sim.apierror import Invalid, as_int

DEFAULT_RECOVERY_TIMEOUT_S = 120  # FaultToleranceConfig.engine_recovery_timeout_sec (vllm/config/fault_tolerance.py:12)
GLOO_DEFAULT_TIMEOUT_S = 1800.0  # --cpu-distributed-timeout-seconds unset: PyTorch's gloo default (parallel.py:370-372)
FT_BACKENDS = ("deepep_low_latency", "nixl_ep")  # gpu_worker_sentinel.py: FT_BACKEND_SET
DEFAULT_ALL2ALL = "allgather_reducescatter"  # ParallelConfig.all2all_backend
_CONFIG = "fault_tolerance_config"
_FIELD = "engine_recovery_timeout_sec"


class FTConfigError(Exception):
    """A ``--fault-tolerance-config`` value argparse refuses (pydantic's error, roughly worded)."""


@dataclass(frozen=True)
class FTOptions:
    """What the sim needs of the fault-tolerance flags and their neighbours."""

    enabled: bool = False
    recovery_timeout_s: int = DEFAULT_RECOVERY_TIMEOUT_S
    cpu_timeout_s: float = GLOO_DEFAULT_TIMEOUT_S  # how long a retry's new DP group waits for every rank
    all2all_backend: str = DEFAULT_ALL2ALL
    api_server_count: int | None = None


def build(args: Sequence[Arg]) -> FTOptions:
    """The FT settings of parsed flags (last occurrence wins; dotted keys apply over the JSON)."""
    enabled = False
    raw: str | None = None
    dotted: list[tuple[str, str]] = []
    vals: dict[str, str] = {}
    for a in args:
        dest = a.spec.dest
        if dest == "enable_fault_tolerance" and a.polarity is not None:
            enabled = a.polarity
        elif dest == _CONFIG and a.value is not None:
            if a.path:
                dotted.append((a.path, a.value))
            else:
                raw, dotted = a.value, []  # a later whole value replaces earlier dotted keys
        elif a.value is not None and not a.path:
            vals[dest] = a.value
    cpu = vals.get("cpu_distributed_timeout_seconds")
    count = vals.get("api_server_count")
    return FTOptions(
        enabled=enabled,
        recovery_timeout_s=_recovery_timeout(raw, dotted),
        cpu_timeout_s=float(cpu) if cpu else GLOO_DEFAULT_TIMEOUT_S,
        all2all_backend=vals.get("all2all_backend") or DEFAULT_ALL2ALL,
        api_server_count=int(count) if count else None,
    )


def _recovery_timeout(raw: str | None, dotted: list[tuple[str, str]]) -> int:
    data: dict[str, object] = {}
    if raw is not None:
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise FTConfigError(_pydantic(f"Invalid JSON: {exc.msg}", "json_invalid", raw)) from None
        if not isinstance(parsed, dict):
            raise FTConfigError(_pydantic("Input should be a dictionary or an instance of FaultToleranceConfig",
                                          "dataclass_type", raw))
        data.update(parsed)
    for key, value in dotted:
        try:
            data[key] = json.loads(value)  # vLLM reads a dotted value as JSON when it can, else as a string
        except json.JSONDecodeError:
            data[key] = value
    for key in data:
        if key != _FIELD:
            raise FTConfigError(_pydantic("Unexpected keyword argument", "unexpected_keyword_argument", data[key], key))
    if _FIELD not in data:
        return DEFAULT_RECOVERY_TIMEOUT_S
    try:
        return as_int(data[_FIELD])
    except Invalid as exc:
        raise FTConfigError(_pydantic(exc.msg, exc.kind, data[_FIELD], _FIELD)) from None


def _pydantic(msg: str, kind: str, value: object, loc: str = "") -> str:
    where = f"{loc}\n" if loc else ""
    return (f"1 validation error for FaultToleranceConfig\n{where}  {msg} "
            f"[type={kind}, input_value={value!r}, input_type={type(value).__name__}]")


def problems(ft: FTOptions, external_lb: bool) -> list[str]:
    """vLLM's startup refusals for these settings, in the order it makes them (empty: it starts)."""
    if not ft.enabled:
        return []
    out = []
    if not external_lb:  # create_engine_config checks this before it builds the ParallelConfig
        out.append("Fault tolerance requires external load balancer mode "
                   "(--data-parallel-external-lb or --data-parallel-rank). "
                   "Internal LB mode is not supported.")
    if ft.api_server_count is not None and ft.api_server_count > 1:
        out.append("Fault tolerance requires a single API server process "
                   f"(--api-server-count=1), but got {ft.api_server_count}. "
                   "The FT system assumes one AsyncMPClient manages all engines.")
    if ft.all2all_backend not in FT_BACKENDS:
        out.append(f"Fault tolerance requires an FT-capable all2all backend "
                   f"(one of {sorted(FT_BACKENDS)}), but got '{ft.all2all_backend}'.")
    return out
