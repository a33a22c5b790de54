"""The Plan: a frozen, JSON-serialisable description of every process of a deployment.

Executors consume Plans only (never recipes). The JSON shape is the contract of docs/design.md ("The plan JSON contract"):
``recipe, variant, hardware, strategy, nodes, gpus_per_node, verified, capacity, notices,
processes[{id, role, node, address, head, http_port, argv, env, image, provenance}]``; the other
keys are additive.
"""

# No ``from __future__ import annotations`` here (as in models.recipe): pydantic takes annotation
# objects as they are, while it compiles and evaluates every string one at each start. So a model
# is defined before the models that use it.
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

Role = Literal["serve", "prefill", "decode", "router"]
EngineRole = Literal["serve", "prefill", "decode"]  # a pool's role: what its engines do
Parallelism = Literal["tp", "tep", "dep", "tp_pp", "tp_dp", "replicas"]  # replicas: independent engines, one per node  # how a pool lays out its GPUs
PlanBackend = str  # a registered backend (k3launch.models.backends), or "none": planned without an inventory
Engine = Literal["vllm", "sim"]
Platform = Literal["cuda", "rocm", "cpu"]  # cpu: vLLM's CPU backend, no GPU devices
Runtime = Literal["docker", "podman", "apptainer", "bare"]
CONTAINER_RUNTIMES: tuple[Runtime, ...] = ("docker", "podman")


def is_container(runtime: str) -> bool:
    """Whether ``runtime`` runs a process as a container it manages: started detached (``run -d``),
    found by its labels, its log read with ``<runtime> logs``. apptainer and bare processes run in
    the background with a log file, as the host's own processes."""
    return runtime in CONTAINER_RUNTIMES


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)  # validators built on first use, not at import


class NoticeOut(Frozen):
    code: str
    message: str


class ProvenanceEntry(Frozen):
    layer: str
    value: str
    origin: str


class Process(Frozen):
    id: str
    role: Role
    node: str
    address: str
    head: bool
    http_port: int | None
    argv: list[str]
    env: dict[str, str]
    image: str | None
    provenance: dict[str, list[ProvenanceEntry]]
    pool: str | None = None
    node_rank: int | None = None
    dp_start_rank: int | None = None
    gpus: int = 0
    cpus: str | None = None  # the CPUs it and all it starts run on (a CPU list; planning.cpusets); None: where the OS puts them

    @model_serializer(mode="wrap")
    def _omit_unset_cpus(self, handler: SerializerFunctionWrapHandler) -> Any:
        """``cpus`` came after the plan contract froze: it appears only when set (plans without stay byte-identical)."""
        data = handler(self)
        if isinstance(data, dict) and data.get("cpus") is None:
            data.pop("cpus", None)
        return data

    def rank_label(self) -> str:
        """``prefill, node rank 2`` / ``decode, DP ranks 8-15`` / ``router``: how people name the rank."""
        if self.node_rank is not None:
            return f"{self.role}, node rank {self.node_rank}"
        if self.dp_start_rank is not None:
            local = max(self.gpus, 1)  # one DP rank per GPU (a CPU node runs one)
            if local == 1:  # one rank: a process of a fault-tolerant pool (one API server per DP rank)
                return f"{self.role}, DP rank {self.dp_start_rank}"
            return f"{self.role}, DP ranks {self.dp_start_rank}-{self.dp_start_rank + local - 1}"
        return self.role


class PoolCapacity(Frozen):
    role: EngineRole
    parallelism: Parallelism
    nodes: int
    gpus: int
    gpu_memory_gb: float
    weights_gb: float
    fits: bool
    tp: int
    dp: int
    pp: int


class KvOffloadCapacity(Frozen):
    option: str
    host_gib_per_rank: float
    ranks_per_node: int
    host_gib_per_node: float


class Capacity(Frozen):
    weights_gb: float
    formula: str
    checkpoint_gb: float | None = None  # the checkpoint's GB (parameters x bytes/param, no headroom): what a load reads
    gpu_memory_gb: float
    fits: bool
    pools: list[PoolCapacity]
    kv_offload: KvOffloadCapacity | None = None


class Host(Frozen):
    """A machine of the plan and how to reach and run on it (inventory settings merged)."""

    name: str
    address: str
    role: Role
    gpus: int
    placeholder: bool
    hardware: str | None = None
    runtime: Runtime = "docker"
    iface: str | None = None
    user: str | None = None
    ssh_port: int | None = None
    identity_file: str | None = None
    cpu_memory_gb: float | None = None
    hf_cache: str | None = None
    shm_size: str | None = None
    workdir: str | None = None
    python: str | None = None
    ssh_host: str | None = None  # what ssh connects to (an ~/.ssh/config alias), when not the address
    venv: str | None = None  # a virtualenv whose bin/ holds the engine's `vllm` (bare runtimes); None: `vllm` on PATH
    compile_cache: str | None = None  # the node's compile/JIT cache root (None: the default; "off"; models.caches)

    @model_serializer(mode="wrap")
    def _omit_unset_additions(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Settings added after the plan contract froze appear only when set, so plans of inventories
        that do not use them stay byte-identical."""
        data = handler(self)
        if isinstance(data, dict):
            for key in OMIT_WHEN_UNSET:
                if data.get(key) is None:
                    data.pop(key, None)
        return data


OMIT_WHEN_UNSET = ("venv", "compile_cache")  # Host keys left out of a plan's JSON while None


class FaultTolerancePool(Frozen):
    """vLLM's engine fault tolerance on one DEP pool (``--fault-tolerance``): what a supervisor needs.

    Every DP rank of the pool is its own process with its own API server. When a collective stalls
    with every process alive, the engines turn ``unhealthy`` at ``status`` (``/health`` stays 200);
    a ``{"instruction": "retry", "params": {}}`` POSTed to ``apply`` on *every* listed process's
    API server (``http://address:http_port``) recovers them, unless ``recovery_timeout_s`` passed
    since the fault (the engine then dies). A dead rank process cannot rejoin: restart the pool.
    """

    pool: str  # the processes' ``pool`` (serve, prefill or decode)
    processes: list[str]  # one per DP rank, in rank order (process ``dp_start_rank`` is its rank)
    recovery_timeout_s: int  # engine_recovery_timeout_sec as the engines run it
    status: str = "/fault_tolerance/status"  # GET: {"engines": [{"id": rank, "status": "healthy" | "unhealthy" | ...}]}
    apply: str = "/fault_tolerance/apply"  # POST {"instruction": "retry", "params": {}} -> 202
    origin: str = ""  # who asked for it: --fault-tolerance, or the inventory's restart.fault_tolerance


class PortUse(Frozen):
    """One planned listening port: (address, port) is unique across the plan."""

    node: str
    address: str
    port: int
    purpose: str
    process: str


class PlanOrigin(Frozen):
    """How the plan was asked for: enough to plan it again on the same inventory (a supervisor
    re-placing a unit off a lost node, a rollout changing a flag)."""

    selection: dict[str, Any]  # Selection fields as given (JSON)
    exclude: list[str] = []  # the caller's own --exclude (cordons are read again when re-planning)
    port_base: int | None = None
    recipes_dir: str | None = None


class WeightStage(Frozen):
    """The model staged onto node-local disk before the engines start (the inventory's
    ``weights.stage``): ``up`` copies the hub cache's model from ``source`` (a directory every node
    sees) into ``dir`` on each engine node whose copy is not complete, and the engines read it
    there (``dir`` is their Hugging Face home: the hub cache is ``dir/hub``)."""

    source: str
    dir: str


class Plan(Frozen):
    name: str
    recipe: str
    recipe_file: str
    model: str
    variant: str
    hardware: str
    strategy: str
    nodes: int
    gpus_per_node: int
    verified: bool
    vllm_version: str
    features: list[str]
    kv_offload: str
    advanced: list[str]
    sets: list[str]
    capacity: Capacity
    notices: list[NoticeOut]
    hosts: list[Host]
    endpoint: str
    processes: list[Process]
    ports: list[PortUse] = []
    inventory: str | None = None
    backend: PlanBackend = "none"
    engine: Engine = "vllm"
    port_base: int = 8000
    platform: Platform = "cuda"  # which container device flags the engines need
    exclude: list[str] = []  # nodes the selection excluded, then those cordoned (Slurm: passed on as sbatch --exclude)
    fault_tolerance: list[FaultTolerancePool] = []  # DEP pools run with vLLM's fault tolerance (none: the key is left out)
    origin: PlanOrigin | None = None  # set by k3launch.api.plan on an inventory; absent from the JSON otherwise
    replicas: int = 1  # independent copies of the engine (process ids r<k>-<role>-<i>); 1: the key is left out
    stage: WeightStage | None = None  # weights staged to node-local disk by `up` (inventory weights.stage); None: the key is left out

    @model_serializer(mode="wrap")
    def _omit_unused_additions(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Keys added after the plan contract froze appear only when used, so plans that do not use
        them (and planning's own goldens, which have no origin) stay byte-identical."""
        data = handler(self)
        if isinstance(data, dict):
            if not data.get("fault_tolerance"):
                data.pop("fault_tolerance", None)
            if data.get("origin") is None:
                data.pop("origin", None)
            if data.get("replicas") == 1:
                data.pop("replicas", None)
            if data.get("stage") is None:
                data.pop("stage", None)
        return data

    def replica_of(self, proc: Process) -> int | None:
        """The copy (``--replicas``) ``proc`` belongs to: k of its pool ``r<k>-<role>``; None in a
        one-copy plan and for the router, which fronts every copy."""
        m = _COPY_POOL.fullmatch(proc.pool or "") if self.replicas > 1 else None
        return int(m.group(1)) if m else None

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


_COPY_POOL = re.compile(r"r(\d+)-[a-z]+(?:-g\d+)?")  # a copy's pool, as planning names it (planning.build; -g<n>: planning.surge)
