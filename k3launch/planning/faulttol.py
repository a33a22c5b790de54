"""vLLM's engine fault tolerance on DEP pools (``--fault-tolerance``): the opt-in, its refusals,
and what it adds to each process of a pool.

vLLM (0.27 and later; read at 0.33.0) recovers a data + expert parallel engine whose collective
stalled while every process lives: the survivors turn ``unhealthy`` at ``GET
/fault_tolerance/status`` (``/health`` stays 200), and a ``retry`` POSTed to
``/fault_tolerance/apply`` of *every* rank's API server rebuilds the DP group. It starts only with
``--enable-fault-tolerance`` (``--fault-tolerance-config`` alone enables nothing), external load
balancing (one engine per API server: ``--data-parallel-rank R``, local size 1; vLLM refuses
a second load-balancing mode next to it, so the strategy's ``--data-parallel-hybrid-lb`` is turned
off), one API server per engine and an all-to-all that can time out and mask ranks
(``deepep_low_latency`` or ``nixl_ep``; the default ``allgather_reducescatter`` is refused as the
workers start). vLLM 0.33.0's Rust front end (``VLLM_USE_RUST_FRONTEND=1``, the K3 recipe's
choice on Blackwell) serves no ``/fault_tolerance`` routes, so the opt-in turns it off.

So, opted in (``--fault-tolerance``, else the inventory's ``restart.fault_tolerance``), every DP
rank of each DEP pool becomes one process (its GPU its own: ``CUDA_VISIBLE_DEVICES``) with its own
HTTP port, and the router fronts every rank. The plan says which pools run so, with their recovery
timeout (:class:`~k3launch.models.plan.FaultTolerancePool`), for a supervisor to act on.
docs/planning.md ("Fault tolerance") has the rules and the refusals.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from k3launch.errors import K3Error
from k3launch.models.selection import Notice, Pool, Resolved, Selection
from k3launch.planning.compose import Composed, Source
from k3launch.planning.placement import NodeSpec, Ports
from k3launch.planning.schema import FlagSchema, available_versions, load_schema
from k3launch.util.records import record

if TYPE_CHECKING:
    from k3launch.planning.inventory import Inventory

FLAG = "--enable-fault-tolerance"
CONFIG = "--fault-tolerance-config"
ALL2ALL = "--all2all-backend"
FT_ALL2ALL = ("deepep_low_latency", "nixl_ep")  # vllm/v1/worker/sentinel/gpu_worker_sentinel.py: FT_BACKEND_SET
DEFAULT_FT_ALL2ALL = "deepep_low_latency"
RUST_FRONTEND = "VLLM_USE_RUST_FRONTEND"
DEFAULT_RECOVERY_TIMEOUT_S = 120  # FaultToleranceConfig.engine_recovery_timeout_sec, when the schema does not say
_OFF = ("", "0", "false", "no", "off")


@record
class FaultTolerance:
    """The opt-in as a plan applies it."""

    origin: str  # who asked: "--fault-tolerance" or "inventory NAME restart.fault_tolerance"
    roles: frozenset[str]  # the pools it applies to: those laid out as DEP

    def placement_origin(self) -> str:
        return f"k3launch placement, one process per DP rank for fault tolerance ({self.origin})"

    def source_origin(self) -> str:
        return f"k3launch fault tolerance ({self.origin})"


class Rank(NamedTuple):
    """One DP rank's own process in a fault-tolerant pool, as placement composes it."""

    ft: FaultTolerance
    schema: FlagSchema
    rank: int
    local: int  # its index on its node (its GPU)
    platform: str


def requested(sel: Selection, inventory: Inventory | None) -> str | None:
    """Who asked for fault tolerance, or None: ``--fault-tolerance``/``--no-fault-tolerance`` (the
    selection's ``fault_tolerance``) wins over the inventory's ``restart.fault_tolerance``."""
    if sel.fault_tolerance is not None:
        return "--fault-tolerance" if sel.fault_tolerance else None
    if inventory is not None and inventory.restart is not None and inventory.restart.fault_tolerance:
        return f"inventory {inventory.name} restart.fault_tolerance"
    return None


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def _has_flag(version: str) -> bool:
    try:
        return load_schema(version).lookup(FLAG) is not None
    except K3Error:
        return False


def check(r: Resolved, schema: FlagSchema, origin: str, engine: str) -> tuple[FaultTolerance, list[Notice]]:
    """The opt-in applied to ``r``, or its refusal: a vLLM without the flag, no DEP pool, a model
    that is not a MoE, a platform without an FT-capable all-to-all (the simulated engine runs it
    on any)."""
    if schema.lookup(FLAG) is None:
        have = sorted((v for v in available_versions() if _has_flag(v)), key=_version_key)
        hint = (f"plan for a vLLM that has it (--vllm-version): the earliest whose flag schema k3launch has with it is {have[0]}"
                if have else "dump the schema of a vLLM 0.27 or later (`k3launch schema dump`) and plan for it")
        raise K3Error("ft-unsupported-version", f"fault tolerance ({origin}): vLLM {schema.version} has no {FLAG} "
                      "(engine fault tolerance came with vLLM 0.27)", hint + "; or drop the opt-in (--no-fault-tolerance)")
    dep = [p for p in r.pools if p.parallelism == "dep"]
    if not dep:
        layouts = ", ".join(f"{p.role} {p.parallelism}" for p in r.pools)
        raise K3Error("ft-not-dep", f"fault tolerance ({origin}) is for DEP pools; {r.strategy.name} runs {layouts}",
                      "choose --strategy multi_node_dep (or a P/D pool with --decode-strategy dep), or drop the opt-in (--no-fault-tolerance)")
    if r.recipe.model.architecture != "moe":
        raise K3Error("ft-not-moe", f"fault tolerance ({origin}): {r.recipe_id} is not a MoE model (architecture "
                      f"{r.recipe.model.architecture}); vLLM refuses the one API server per DP rank fault tolerance needs for it",
                      "serve a dense model as independent replicas (--strategy multi_node_replicas), or drop the opt-in (--no-fault-tolerance)")
    platform = r.hardware.vendor_platform
    if engine != "sim" and platform != "cuda":
        why = {"cpu": "vLLM's CPU build has neither FT-capable all-to-all (deepep_low_latency, nixl_ep: GPU kernels)",
               "rocm": "k3launch composes it on CUDA only: the rank masking fault tolerance needs from deepep_low_latency "
                       "is not verified with ROCm's DeepEP port, and the recipes run ROCm's own MoE path"}.get(
            platform, f"no FT-capable all-to-all is known for platform {platform}")
        raise K3Error("ft-platform", f"fault tolerance ({origin}) on {r.hardware_id}: {why}",
                      "plan it on NVIDIA hardware (the simulated engine, an inventory with engine: sim, runs it anywhere), "
                      "or drop the opt-in (--no-fault-tolerance)")
    ft = FaultTolerance(origin, frozenset(p.role for p in dep))
    notices = [Notice("fault-tolerance", f"{p.role} pool: vLLM engine fault tolerance ({origin}): {p.gpus} DP ranks, each its own "
                      f"process and API server with its own HTTP port (external load balancing); a collective that stalls is "
                      f"recovered by a retry to every rank")
               for p in dep]
    notices += [Notice("fault-tolerance", f"{p.role} pool ({p.parallelism}) runs without fault tolerance: it is for DEP pools only")
                for p in r.pools if p.parallelism != "dep"]
    return ft, notices


def rank_flags(schema: FlagSchema, pool: Pool, rank: int, head: NodeSpec, ports: Ports, hybrid: bool) -> list[str]:
    """The layout flags of DP rank ``rank``'s own process: external load balancing (the rank given,
    local size 1), the head's address and RPC port for the DP handshake, and the strategy's hybrid
    load balancing off (vLLM refuses two load-balancing modes)."""
    toks = ["--tensor-parallel-size", "1", "--data-parallel-size", str(pool.gpus), "--data-parallel-size-local", "1",
            "--data-parallel-rank", str(rank), "--data-parallel-address", head.address, "--data-parallel-rpc-port", str(ports.dp_rpc)]
    if hybrid:
        found = schema.lookup("--data-parallel-hybrid-lb")
        if found is not None:
            toks.append(found[0].bool_form(False))
    return toks


def rank_env(platform: str, local: int) -> list[tuple[str, str]]:
    """The rank's own GPU: an external-LB engine uses the first device it sees (vLLM's docs run
    each rank with ``CUDA_VISIBLE_DEVICES``)."""
    return [("CUDA_VISIBLE_DEVICES", str(local))] if platform == "cuda" else []


def without_port_overrides(notices: list[Notice]) -> list[Notice]:
    """A rank's notices without the one saying its own HTTP port replaced the pool's (a P/D role's
    ``--port 8002``): one API server per rank is what the opt-in asked for."""
    return [n for n in notices if not (n.code == "overridden" and n.message.startswith("--port: "))]


def _parsed(schema: FlagSchema, src: Source) -> list[tuple[str, str | None, bool | None]]:
    args, _ = schema.parse(list(src.args))  # the sources' own problems are compose's to refuse
    return [(a.key, a.value, a.polarity) for a in args]


def source(ft: FaultTolerance, schema: FlagSchema, before: Sequence[Source]) -> Source:
    """What fault tolerance adds after the hardware layer (so a hardware block's all-to-all never
    undoes it, and ``--set all2all-backend=nixl_ep`` may still pick the other FT-capable one):
    ``--enable-fault-tolerance``, ``--all2all-backend deepep_low_latency`` unless ``before`` already
    chose an FT-capable one, and the Rust front end off where ``before`` turned it on."""
    all2all: str | None = None
    rust: str | None = None
    for src in before:
        for key, value, _ in _parsed(schema, src):
            if key == ALL2ALL:
                all2all = value
        for name, value in src.env:
            if name == RUST_FRONTEND:
                rust = value
    args = [FLAG] + ([] if all2all in FT_ALL2ALL else [ALL2ALL, DEFAULT_FT_ALL2ALL])
    env = [(RUST_FRONTEND, "0")] if rust is not None and rust.strip().lower() not in _OFF else []
    return Source("hardware", ft.source_origin(), tuple(args), tuple(env))


def _refuse(ft: FaultTolerance, role: str, c: Composed, key: str, what: str, hint: str) -> K3Error:
    last = c.provenance[key][-1] if c.provenance.get(key) else None
    who = f" ({last.layer}: {last.origin})" if last is not None else ""
    return K3Error("ft-conflict", f"{role} pool: {what}{who}, which vLLM's fault tolerance ({ft.origin}) cannot run with", hint)


def verify(ft: FaultTolerance, role: str, c: Composed, schema: FlagSchema) -> int:
    """A composed rank process still has what fault tolerance needs after every later layer (a
    ``--set``, a feature), else a refusal naming who undid it; its recovery timeout in seconds."""
    if c.value(FLAG) != "true":
        raise _refuse(ft, role, c, FLAG, f"{FLAG} is off", "drop what turns it off")
    backend = c.value(ALL2ALL)
    if backend not in FT_ALL2ALL:
        raise _refuse(ft, role, c, ALL2ALL, f"--all2all-backend is {backend}",
                      f"drop that setting, or choose one of {', '.join(FT_ALL2ALL)} (--set all2all-backend=nixl_ep)")
    servers = c.value("--api-server-count")
    if servers is not None and int(servers) > 1:
        raise _refuse(ft, role, c, "--api-server-count", f"--api-server-count is {servers}", "drop that setting: each DP rank runs one API server")
    if c.env.get(RUST_FRONTEND, "").strip().lower() not in _OFF:
        raise _refuse(ft, role, c, RUST_FRONTEND, f"{RUST_FRONTEND} is {c.env[RUST_FRONTEND]} (the Rust front end serves no /fault_tolerance routes)",
                      f"drop that setting of {RUST_FRONTEND}")
    return recovery_timeout(c, schema)


def recovery_timeout(c: Composed, schema: FlagSchema) -> int:
    """``engine_recovery_timeout_sec`` as the process runs it: a dotted sub-key, the whole JSON, else
    the schema's default (vLLM's FaultToleranceConfig)."""
    field = "engine_recovery_timeout_sec"
    raw: object = None
    dotted = c.value(f"{CONFIG}.{field}")
    if dotted is not None:
        raw = dotted
    elif (whole := c.value(CONFIG)) is not None:
        try:
            doc = json.loads(whole)
        except json.JSONDecodeError:
            doc = None
        raw = doc.get(field) if isinstance(doc, dict) else None
    if raw is None:
        found = schema.lookup(CONFIG)
        m = re.search(rf"{field}=(\d+)", found[0].default) if found is not None else None
        return int(m.group(1)) if m else DEFAULT_RECOVERY_TIMEOUT_S
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 0:
            raise ValueError(value)
        return int(value)
    except (ValueError, TypeError):
        raise K3Error("bad-value", f"{CONFIG} {field}={raw!r}: not a whole number of seconds",
                      f"write --set {CONFIG[2:]}.{field}=300") from None
