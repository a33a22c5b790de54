"""What one sim process was told: the ``vllm serve`` flags it acts on, its env, and its knobs.

The flags arrive already tokenized by the vendored schema (:mod:`k3launch.planning.schema`), so the sim
accepts exactly the flags of the selected vLLM version; here they become typed settings and
go through the consistency checks vLLM itself makes before it touches a GPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from k3launch.defaults import DEFAULT_VLLM_VERSION
from k3launch.planning.schema import Arg
from k3launch.sim import ftconfig
from k3launch.sim.ftconfig import FTOptions

FAULTS = ("exit-during-load", "hang", "zero-tokens", "crash-after-ready", "empty-after-ready", "collective-timeout", "corrupt-pd", "other-weights", "latch")

# vLLM's defaults for the settings below when the flag is absent (ParallelConfig, envs.py).
DEFAULT_PORT = 8000
DEFAULT_MASTER_PORT = 29501
DEFAULT_DP_RPC_PORT = 29550
DEFAULT_NIXL_PORT = 5600
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_N_SEQUENCES = 16384
DEFAULT_READY_TIMEOUT_S = 600.0


class SimConfigError(Exception):
    """A setting vLLM would refuse at startup (it raises ``ValueError``; exit code 1)."""


class FlagValueError(SimConfigError):
    """A flag value argparse itself refuses (a bad JSON config): a usage error, exit code 2."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


class KnobError(Exception):
    """A ``K3LAUNCH_SIM_*`` variable the sim cannot use (a test-harness mistake; exit code 2)."""


@dataclass(frozen=True)
class KVConfig:
    """The parts of ``--kv-transfer-config`` the sim acts on."""

    connector: str
    role: str  # kv_producer | kv_consumer | kv_both
    load_failure_policy: str

    @property
    def nixl(self) -> bool:
        return self.connector == "NixlConnector"

    @property
    def producer(self) -> bool:
        return self.nixl and self.role in ("kv_producer", "kv_both")

    @property
    def consumer(self) -> bool:
        return self.nixl and self.role in ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class Knobs:
    """The sim's own settings (``K3LAUNCH_SIM_*``) and the process marker it was started with."""

    version: str
    load_s: float
    ttft_ms: float
    itl_ms: float
    batch_cost: float  # each further running request of a rank stretches a decode step by this share
    gpus: int
    rendezvous_timeout_s: float
    fault: str | None  # the fault that applies to *this* process, after FAIL_PROCESS filtering
    fail_after_s: float
    process: str | None
    idle_w: float = 100.0  # what a simulated GPU draws with nothing to decode (k3launch.sim.power)
    per_seq_w: float = 15.0  # and what each request its rank decodes adds
    power_dir: str | None = None  # K3LAUNCH_SIM_POWER_DIR (None: k3launch.sim.power's default)
    ft_detect_s: float = 2.0  # fault tolerance: from a lost peer / stalled collective to "unhealthy" (k3launch.sim.ft)
    ft_retry_s: float = 0.5  # and how long a retry takes once every DP rank has joined it

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Knobs:
        load_s = _num(env, "K3LAUNCH_SIM_LOAD_S", 2.0)
        ready = _num(env, "VLLM_ENGINE_READY_TIMEOUT_S", DEFAULT_READY_TIMEOUT_S)
        fault = env.get("K3LAUNCH_SIM_FAIL") or None
        if fault is not None and fault not in FAULTS:
            raise KnobError(f"K3LAUNCH_SIM_FAIL={fault!r} is not one of: {', '.join(FAULTS)}")
        process = env.get("K3LAUNCH_PROCESS") or None
        target = env.get("K3LAUNCH_SIM_FAIL_PROCESS") or None
        if target is not None and target != process:
            fault = None  # one env for every rank, one process hit
        return cls(
            version=env.get("K3LAUNCH_SIM_VLLM_VERSION") or DEFAULT_VLLM_VERSION,
            load_s=load_s,
            ttft_ms=_num(env, "K3LAUNCH_SIM_TTFT_MS", 20.0),
            itl_ms=_num(env, "K3LAUNCH_SIM_ITL_MS", 2.0),
            batch_cost=_num(env, "K3LAUNCH_SIM_BATCH_COST", 0.0),
            gpus=int(_num(env, "K3LAUNCH_SIM_GPUS", 8)),
            rendezvous_timeout_s=_num(env, "K3LAUNCH_SIM_RENDEZVOUS_TIMEOUT_S", ready),
            fault=fault,
            fail_after_s=_num(env, "K3LAUNCH_SIM_FAIL_AFTER_S", load_s / 2),
            process=process,
            idle_w=_num(env, "K3LAUNCH_SIM_IDLE_W", 100.0),
            per_seq_w=_num(env, "K3LAUNCH_SIM_WATTS_PER_SEQ", 15.0),
            power_dir=env.get("K3LAUNCH_SIM_POWER_DIR") or None,
            ft_detect_s=_num(env, "K3LAUNCH_SIM_FT_DETECT_S", 2.0),
            ft_retry_s=_num(env, "K3LAUNCH_SIM_FT_RETRY_S", 0.5),
        )


def _num(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise KnobError(f"{name}={raw!r} is not a number") from None
    if value < 0 or math.isnan(value):
        raise KnobError(f"{name}={raw!r} must be >= 0")
    return value


@dataclass(frozen=True)
class ServeOptions:
    """The flags and env of one ``vllm serve`` process that the sim acts on."""

    model: str
    served_names: tuple[str, ...]
    host: str | None
    port: int
    headless: bool
    tp: int
    pp: int
    dp: int
    dp_local: int
    dp_start: int
    dp_address: str
    dp_rpc_port: int
    hybrid_lb: bool
    external_lb: bool
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    kv: KVConfig | None
    max_num_seqs: int
    max_model_len: int | None
    host_ip: str | None  # VLLM_HOST_IP: how peers reach this node
    nixl_host: str
    nixl_port: int
    max_n_sequences: int  # VLLM_MAX_N_SEQUENCES: the most choices (n) one request may ask for
    dp_rank: int | None = None  # --data-parallel-rank: this process is that one external-LB rank
    ft: FTOptions = field(default_factory=FTOptions)
    lb_modes: int = 0  # how many data-parallel load-balancing modes the flags ask for (vLLM allows one)
    # --disable-access-log-for-endpoints: paths whose requests the access log leaves out (vLLM:
    # comma-separated, matched exactly, without the query); --disable-uvicorn-access-log: all of them
    quiet_paths: frozenset[str] = frozenset()
    access_log: bool = True
    omp_bind: str = "auto"  # VLLM_CPU_OMP_THREADS_BIND: the CPU backend's cores per rank (sim.cpubind)

    @property
    def name(self) -> str:
        """The model name the API reports (first ``--served-model-name``)."""
        return self.served_names[0]

    @property
    def multi_node_tp(self) -> bool:
        return self.nnodes > 1

    @property
    def multi_node_dp(self) -> bool:
        return self.dp > self.dp_local

    @property
    def dp_head(self) -> bool:
        return self.dp_start == 0

    @property
    def local_dp_ranks(self) -> range:
        return range(self.dp_start, self.dp_start + self.dp_local)

    @property
    def gpus_needed(self) -> int:
        """GPUs this node's processes occupy: its share of TP x PP, times its local DP ranks."""
        return (self.tp * self.pp) // self.nnodes * self.dp_local


def build(model: str, args: list[Arg], env: Mapping[str, str]) -> ServeOptions:
    """Typed settings from parsed flags (last occurrence wins, as with argparse)."""
    vals: dict[str, str] = {}
    flags: dict[str, bool] = {}
    for a in args:
        if a.path:
            continue  # dotted sub-keys of JSON configs do not change what the sim does
        if a.polarity is not None:
            flags[a.spec.dest] = a.polarity
        elif a.value is not None:
            vals[a.spec.dest] = a.value

    def num(dest: str, default: int) -> int:
        return int(vals[dest]) if dest in vals else default

    dp = num("data_parallel_size", 1)
    names = tuple(vals["served_model_name"].split()) if vals.get("served_model_name") else (model,)
    # --data-parallel-rank N: one engine, DP rank N, balanced from outside (vLLM's external LB:
    # it implies --data-parallel-external-lb and a local size of 1, arg_utils.py:2447, 2470-2485).
    rank = int(vals["data_parallel_rank"]) if "data_parallel_rank" in vals else None
    # vLLM's `serve` command counts the load-balancing modes asked for (vllm/entrypoints/cli/serve.py:
    # 79-105): external (--data-parallel-external-lb or --data-parallel-rank), hybrid (the flag, else
    # implied by --data-parallel-start-rank), multi-port external.
    multi = flags.get("data_parallel_multi_port_external_lb", False)
    hybrid = flags.get("data_parallel_hybrid_lb", False)
    implied_hybrid = hybrid if hybrid or multi else "data_parallel_start_rank" in vals
    external = flags.get("data_parallel_external_lb", False) or rank is not None
    try:
        ft = ftconfig.build(args)
    except ftconfig.FTConfigError as exc:
        raise FlagValueError("--fault-tolerance-config", str(exc)) from None
    return ServeOptions(
        model=model,
        served_names=names,
        host=vals.get("host") or None,
        port=num("port", DEFAULT_PORT),
        headless=flags.get("headless", False),
        tp=num("tensor_parallel_size", 1),
        pp=num("pipeline_parallel_size", 1),
        dp=dp,
        dp_local=num("data_parallel_size_local", 1 if rank is not None or flags.get("data_parallel_external_lb") else dp),
        dp_start=rank if rank is not None else num("data_parallel_start_rank", 0),
        dp_address=vals.get("data_parallel_address") or "127.0.0.1",
        dp_rpc_port=num("data_parallel_rpc_port", DEFAULT_DP_RPC_PORT),
        hybrid_lb=flags.get("data_parallel_hybrid_lb", False),
        external_lb=flags.get("data_parallel_external_lb", False) or rank is not None,
        nnodes=num("nnodes", 1),
        node_rank=num("node_rank", 0),
        master_addr=vals.get("master_addr") or "127.0.0.1",
        master_port=num("master_port", DEFAULT_MASTER_PORT),
        kv=_kv_config(vals.get("kv_transfer_config")),
        max_num_seqs=num("max_num_seqs", DEFAULT_MAX_NUM_SEQS),
        max_model_len=_model_len(vals.get("max_model_len")),
        host_ip=env.get("VLLM_HOST_IP") or None,
        nixl_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "localhost",
        nixl_port=int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or DEFAULT_NIXL_PORT),
        max_n_sequences=_env_int(env, "VLLM_MAX_N_SEQUENCES", DEFAULT_MAX_N_SEQUENCES),
        dp_rank=rank,
        ft=ft,
        lb_modes=sum((multi, external, implied_hybrid)),
        quiet_paths=frozenset(p.strip() for p in (vals.get("disable_access_log_for_endpoints") or "").split(",") if p.strip()),
        access_log=not flags.get("disable_uvicorn_access_log", False),
        omp_bind=env.get("VLLM_CPU_OMP_THREADS_BIND") or "auto",
    )


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    """An integer setting of vLLM's environment; one the sim cannot read keeps vLLM's default."""
    try:
        return int(env.get(name) or default)
    except ValueError:
        return default


def _kv_config(raw: str | None) -> KVConfig | None:
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        raise FlagValueError("--kv-transfer-config", f"invalid loads value: {raw!r}") from None
    if not isinstance(data, dict):
        raise FlagValueError("--kv-transfer-config", f"invalid parse_dataclass value: {raw!r} (a JSON object is required)")
    role = str(data.get("kv_role") or "")
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise FlagValueError("--kv-transfer-config", f"Unsupported kv_role: {role!r}. Supported roles are ['kv_producer', 'kv_consumer', 'kv_both']")
    return KVConfig(str(data.get("kv_connector") or ""), role, str(data.get("kv_load_failure_policy") or "recompute"))


def _model_len(raw: str | None) -> int | None:
    """``--max-model-len``: an int, ``128k``/``1m`` (decimal) or ``128K`` (binary), or auto/-1."""
    if raw is None or raw.strip().lower() in ("auto", "-1"):
        return None
    v = raw.strip()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    if v[-1] in scale:
        return int(float(v[:-1]) * scale[v[-1]])
    return int(v)


def check(opts: ServeOptions, knobs: Knobs) -> None:
    """The startup checks vLLM makes on these settings; raises :class:`SimConfigError`."""
    if opts.lb_modes > 1:  # the serve command's own check, before any engine setting
        raise SimConfigError("Cannot use more than one data parallel load balancing mode. Choose one of: "
                             "--data-parallel-multi-port-external-lb, --data-parallel-external-lb (or --data-parallel-rank), "
                             "--data-parallel-hybrid-lb (or --data-parallel-start-rank).")
    for what, value in (
        ("tensor_parallel_size", opts.tp),
        ("pipeline_parallel_size", opts.pp),
        ("data_parallel_size", opts.dp),
        ("nnodes", opts.nnodes),
        ("max_num_seqs", opts.max_num_seqs),
    ):
        if value < 1:
            raise SimConfigError(f"{what} must be >= 1, got {value}")
    if not 0 <= opts.node_rank < opts.nnodes:
        raise SimConfigError(f"node_rank ({opts.node_rank}) must be in [0, nnodes) with nnodes={opts.nnodes}")
    if opts.multi_node_tp and (opts.tp * opts.pp) % opts.nnodes:
        raise SimConfigError(
            f"world_size (tensor_parallel_size {opts.tp} x pipeline_parallel_size {opts.pp}) must be divisible by nnodes ({opts.nnodes})"
        )
    if opts.headless and opts.multi_node_tp and opts.node_rank == 0:
        raise SimConfigError(
            "--headless is not allowed on node_rank 0: node 0 runs the API server of the TP/PP group "
            "(drop --headless there, or give this node its --node-rank)"
        )
    if opts.multi_node_tp and opts.node_rank > 0 and not opts.headless:
        raise SimConfigError(f"node_rank {opts.node_rank} > 0 requires --headless: only node_rank 0 serves the API")
    if opts.dp_local > opts.dp:
        raise SimConfigError(f"data_parallel_size_local ({opts.dp_local}) must be <= data_parallel_size ({opts.dp})")
    if opts.dp_local < 1:
        raise SimConfigError(f"data_parallel_size_local must be >= 1, got {opts.dp_local}")
    if opts.dp_start < 0 or opts.dp_start + opts.dp_local > opts.dp:
        raise SimConfigError(
            f"data_parallel_start_rank ({opts.dp_start}) + data_parallel_size_local ({opts.dp_local}) "
            f"must be <= data_parallel_size ({opts.dp})"
        )
    _check_external_lb(opts)
    if opts.dp_start > 0 and not (opts.headless or opts.hybrid_lb or opts.external_lb):
        raise SimConfigError(
            "data_parallel_start_rank is only applicable in headless or hybrid/external LB mode; "
            "add --headless (or --data-parallel-hybrid-lb) on this node"
        )
    if opts.gpus_needed > knobs.gpus:
        raise SimConfigError(
            f"this node needs {opts.gpus_needed} GPUs (tp {opts.tp} x pp {opts.pp} / nnodes {opts.nnodes} "
            f"x data_parallel_size_local {opts.dp_local}) but only {knobs.gpus} are available "
            "(the world size is greater than the number of available GPUs)"
        )
    if opts.kv is not None and opts.kv.nixl and not 0 < opts.nixl_port + opts.dp_start + opts.dp_local <= 65535:
        raise SimConfigError(f"VLLM_NIXL_SIDE_CHANNEL_PORT {opts.nixl_port} + DP rank is not a valid port")


def _check_external_lb(opts: ServeOptions) -> None:
    """vLLM's rules for an external-LB rank (arg_utils.py:2447-2485), then fault tolerance's."""
    if opts.external_lb and opts.dp_rank is None and not (opts.nnodes > 1 and opts.dp > 1):
        raise SimConfigError("Invalid data-parallel launch options: `--data-parallel-external-lb` requires a data-parallel "
                             "rank. Set `--data-parallel-rank`, or set `--data-parallel-size` greater than 1 and use "
                             "`--nnodes` with `--node-rank` so the rank can be inferred.")
    if opts.external_lb and opts.dp_local != 1:
        raise SimConfigError("Invalid data-parallel launch options: an external data-parallel rank requires "
                             f"`--data-parallel-size-local 1`; got {opts.dp_local}. Set it to 1 or omit it.")
    for problem in ftconfig.problems(opts.ft, opts.external_lb):
        raise SimConfigError(problem)
