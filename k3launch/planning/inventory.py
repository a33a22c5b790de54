"""Inventories: the machines a deployment may use (``inventories/*.yaml``).

An inventory names a backend (``ssh``, ``slurm`` or ``local``), the hardware of its nodes, and
the nodes themselves in the order they are taken. ``defaults`` apply to every node and each node
may override them. Unknown keys are errors with file and line; node names and addresses must be
plain host names or IP addresses (they reach ssh and shell command lines, so anything else is
refused here instead of being quoted later). Free-form values (paths, images, NIC names) are
data and are quoted wherever they reach a shell.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from k3launch.errors import K3Error, plain
from k3launch.models.backends import Feature
from k3launch.models.backends import names as backend_names
from k3launch.models.backends import spec as backend_spec
from k3launch.models.monitoring import Monitoring
from k3launch.models.plan import Runtime
from k3launch.models.recipe import Strict
from k3launch.models.selection import ENV_NAME, check_image, env_refusal
from k3launch.models.supervise import RestartPolicy
from k3launch.util.bounds import MEMORY_GB, READ_GBPS
from k3launch.util.cpulist import canonical
from k3launch.util.hosts import check_host, expand_hostlist
from k3launch.util.yamlio import load_yaml_model

_IFACE = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")
GPU_HOUR_PRICE_MAX = 100_000.0  # per GPU and hour, in any currency (yen included): a typo like 1e9 is caught



class NodeSettings(Strict):
    """Per-node settings; every one may be given in ``defaults`` or on a node."""

    user: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    identity_file: str | None = None
    runtime: Runtime | None = None
    iface: str | None = None
    cpu_memory_gb: float | None = Field(default=None, **MEMORY_GB.field())
    cpus: str | None = None  # vLLM's CPU backend: the CPUs engines may use ("0-15", "0-7,16-23", or a count); planning.cpusets
    hf_cache: str | None = None
    shm_size: str | None = None
    image: str | None = None
    workdir: str | None = None
    python: str | None = None  # interpreter for the simulated engine on bare runtimes
    venv: str | None = None  # bare runtimes: a virtualenv whose bin/ holds the engine's `vllm` (first on PATH); None: `vllm` on PATH
    compile_cache: str | None = None  # where engines keep compile/JIT caches on the node (models.caches); "off": nowhere
    env: dict[str, str] | None = None  # extra environment of every engine process (e.g. NCCL_DEBUG)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for k in v or {}:
            if not ENV_NAME.fullmatch(k):
                raise ValueError(f"env name {k!r} is not a valid variable name")
            why = env_refusal(k, "an inventory")
            if why:
                raise ValueError(why)
        return v

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpus(cls, v: object) -> str | None:
        if v is None:
            return None
        if not isinstance(v, str | int):
            raise ValueError(f"cpus {v!r} must be a CPU list (like \"0-15\") or a count of CPUs")
        return canonical(v)

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}\$?", v):
            raise ValueError(f"user {v!r} is not a valid login name")
        return v

    @field_validator("hf_cache", "compile_cache")
    @classmethod
    def _mounted(cls, v: str | None, info: ValidationInfo) -> str | None:
        # docker -v, pyxis --container-mounts and apptainer --bind split on ':' and ','
        if v is not None and ("," in v or ":" in v or "\n" in v):
            raise ValueError(f"{info.field_name} {v!r} contains ',' or ':' (container mount lists split on them)")
        if info.field_name == "compile_cache" and v is not None and v != "off" and not (v.startswith("/") or v == "~" or v.startswith("~/")):
            raise ValueError(f"compile_cache {v!r} must be an absolute path (or ~/...), or off")
        return v

    @field_validator("venv")
    @classmethod
    def _venv(cls, v: str | None) -> str | None:
        # it becomes "<venv>/bin" at the front of PATH, which ':' splits; relative to what would it be?
        if v is not None and (":" in v or "\n" in v or not (v.startswith("/") or v == "~" or v.startswith("~/"))):
            raise ValueError(f"venv {v!r} must be an absolute path (or ~/...) without ':' (it goes on PATH)")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        return check_image(v)

    @field_validator("iface")
    @classmethod
    def _iface(cls, v: str | None) -> str | None:
        if v is not None and not _IFACE.match(v):
            raise ValueError(f"iface {v!r} is not a network interface name")
        return v


class InventoryNode(NodeSettings):
    name: str
    address: str | None = None  # engines' address; default: ~/.ssh/config HostName of the name, else the name
    ssh_host: str | None = None  # what ssh connects to; default: the name when it is an ssh alias, else address
    hardware: str | None = None
    drain: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_host(v, "node name")

    @field_validator("address", "ssh_host")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        return None if v is None else check_host(v, "address")


def _one_line(v: str, what: str) -> str:
    if "\n" in v or "\r" in v:
        raise ValueError(f"{what} {v!r} spans lines (each value ends up on one #SBATCH line)")
    return v


class SlurmSection(Strict):
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    reservation: str | None = None
    constraint: str | None = None
    nodelist: str | None = None  # Slurm hostlist syntax, e.g. "gpu-[01-16]"
    exclude: str | None = None
    container: Literal["pyxis", "apptainer", "bare"] = "pyxis"
    time_limit: str = "04:00:00"
    exclusive: bool = True
    gres: Literal["gres", "gpus-per-node"] = "gres"
    extra_sbatch: list[str] = []
    # Job scripts, the job's output and every process's log; must be on a filesystem the login
    # node shares with the compute nodes (default: <state dir>/slurm/<deployment>, under $HOME).
    log_dir: str | None = None

    @field_validator("partition", "account", "qos", "reservation", "constraint", "nodelist", "exclude", "time_limit")
    @classmethod
    def _word(cls, v: str | None, info: ValidationInfo) -> str | None:
        # sbatch splits a directive line at white space: "gpu --uid=0" would be two options
        if v is not None and (not v or any(c.isspace() for c in v)):
            raise ValueError(f"slurm.{info.field_name} {v!r} must be one word (Slurm names have no spaces)")
        return v

    @field_validator("log_dir")
    @classmethod
    def _line(cls, v: str | None) -> str | None:
        return None if v is None else _one_line(v, "slurm.log_dir")

    @field_validator("extra_sbatch")
    @classmethod
    def _lines(cls, v: list[str]) -> list[str]:
        return [_one_line(x, "extra_sbatch line") for x in v]


class GpuHourPrice(Strict):
    """What one GPU of this inventory costs per hour: reports then show the cost per million tokens."""

    amount: float = Field(gt=0, le=GPU_HOUR_PRICE_MAX, allow_inf_nan=False)
    currency: str = "USD"

    @field_validator("currency")
    @classmethod
    def _currency(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Z]{3}", v):
            raise ValueError(f"gpu_hour_price.currency {v!r} is not a three-letter currency code (USD, EUR, ...)")
        return v


class RouterSection(Strict):
    node: str = "login"  # "login" (where k3launch runs) or an inventory node name
    address: str | None = None  # how clients reach it; default 127.0.0.1 on the login node
    port: int | None = Field(default=None, ge=1, le=65535)

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        return None if v is None else check_host(v, "router address")


class Observability(Strict):
    """OpenTelemetry traces of the engines (docs/monitoring.md, "Traces")."""

    otlp_endpoint: str | None = Field(default=None, pattern=r"^(https?|grpc)://[A-Za-z0-9._:\[\]/-]+$")  # vLLM's --otlp-traces-endpoint
    detailed_traces: list[Literal["model", "worker", "all"]] = []  # vLLM's --collect-detailed-traces


class WeightSource(Strict):
    """The weights on the nodes: where the engines read them (load-time predictions, ``weights
    probe``'s default directory), how (the load format and strategy every engine runs with,
    :mod:`k3launch.planning.loading` checks them against the plan's vLLM version), and whether
    ``up`` first stages them onto node-local disk."""

    path: str | None = None  # the directory probed on each node (default: where the engine looks for the model); with stage: the copy's source
    shared: bool = False  # one filesystem every node reads (NFS, Lustre, ...): all nodes' reads share one throughput
    read_gbps: float | None = Field(default=None, **READ_GBPS.field())  # GB/s (10^9 B/s): per node, or the shared total; beats a saved probe
    load_format: str | None = None  # --load-format of every engine (it beats the recipe's; a --set of another one is refused)
    load_strategy: str | None = None  # --safetensors-load-strategy of every engine
    stage: str | None = None  # node-local directory: `up` copies the model there from `path` first, and the engines read it there
    stage_read_gbps: float | None = Field(default=None, **READ_GBPS.field())  # GB/s reading the staged copy, per node

    @field_validator("load_format", "load_strategy")
    @classmethod
    def _word(cls, v: str | None, info: ValidationInfo) -> str | None:
        # vLLM lower-cases the load format; both are one argv word: a name, never an option or a path
        if v is not None and not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,63}", v.lower()):
            raise ValueError(f"weights.{info.field_name} {v!r} is not a load format or strategy name (e.g. safetensors, prefetch)")
        return None if v is None else v.lower()

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and ("\n" in v or "\r" in v or not v.strip()):
            raise ValueError(f"weights.path {v!r} is not a directory name (empty, or it spans lines)")
        return v

    @field_validator("stage")
    @classmethod
    def _stage(cls, v: str | None) -> str | None:
        # the containers' mount source (split on ':' and ','), the bare engines' HF_HUB_CACHE (never ~-expanded)
        if v is not None and (not v.startswith("/") or v.rstrip("/") == "" or any(c in v for c in ":,\n\r")):
            raise ValueError(f"weights.stage {v!r} must be an absolute directory on the nodes (not /), without ':' or ','")
        return None if v is None else v.rstrip("/")

    @model_validator(mode="after")
    def _staged(self) -> WeightSource:
        if self.stage is not None and not self.path:
            raise ValueError("weights.stage needs weights.path: the directory every node sees that the model is copied from")
        if self.stage is not None and self.path is not None and self.stage == self.path.rstrip("/"):
            raise ValueError(f"weights.stage and weights.path are both {self.stage}: the copy would be its own source")
        if self.stage_read_gbps is not None and self.stage is None:
            raise ValueError("weights.stage_read_gbps is the throughput of the staged copy: set weights.stage too")
        return self


class Inventory(Strict):
    name: str
    backend: str  # a registered backend (k3launch.models.backends): ssh, local, slurm
    hardware: str | None = None
    engine: Literal["vllm", "sim"] = "vllm"
    vllm_version: str | None = None  # the vLLM its nodes run: plans use its flag schema unless --vllm-version says otherwise
    replicas: int | None = Field(default=None, ge=1, le=256)  # copies of the engine plans on it serve, unless --replicas says otherwise
    description: str = ""
    # default factories, not instances: an instance here would build the model's validator at import
    defaults: NodeSettings = Field(default_factory=NodeSettings)
    nodes: list[InventoryNode] = []
    slurm: SlurmSection | None = None
    router: RouterSection = Field(default_factory=RouterSection)
    hf_token_file: str | None = None  # a path on the nodes: the launch scripts and `weights fetch` read it there; never copied into plans
    ssh_config: str | None = None
    known_hosts: str | None = None
    gpu_hour_price: GpuHourPrice | None = None  # {amount: 2.5, currency: USD}: for the cost per million tokens
    restart: RestartPolicy | None = None  # how `k3launch supervise` restarts (docs/supervise.md); flags override it
    weights: WeightSource | None = None  # the weight source: a shared filesystem? its read throughput (docs/ssh.md "Predicted load time")
    monitoring: Monitoring | None = None  # the controller's metrics address, the alert rules' thresholds (docs/monitoring.md)
    observability: Observability | None = None  # engines' OpenTelemetry traces (docs/monitoring.md)

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v not in backend_names():
            raise ValueError(f"backend {v!r} is not one of: {', '.join(backend_names())}")
        return v

    @field_validator("vllm_version")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}", v):
            raise ValueError(f"vllm_version {v!r} is not a version (e.g. 0.32.0)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Inventory:
        names = [n.name for n in self.nodes]
        dup = {n for n, c in Counter(names).items() if c > 1}
        if dup:
            raise ValueError(f"node names repeat: {', '.join(sorted(dup))}")
        addrs = [n.address or n.name for n in self.nodes]
        dup = {a for a, c in Counter(addrs).items() if c > 1}
        if dup:
            raise ValueError(f"nodes share an address ({', '.join(sorted(dup))}); ports are planned per address")
        if self.backend == "slurm" and self.slurm is None:
            raise ValueError("backend slurm needs a 'slurm:' section (partition, ...)")
        traits = backend_spec(self.backend)
        if traits.needs_nodes and not self.nodes:
            raise ValueError(f"backend {self.backend} needs at least one node under 'nodes:'")
        if traits.router_home == "allocation" and (self.router.node != "login" or self.router.address):
            raise ValueError(
                "on slurm the router runs inside the allocation, on the first engine node: "
                "router.node and router.address do not apply (router.port does)"
            )
        if self.weights is not None and self.weights.stage is not None and not traits.supports(Feature.WEIGHTS):
            raise ValueError(f"weights.stage: backend {self.backend} runs no commands on the nodes before the engines start, "
                             "so it cannot stage the weights (an ssh or local inventory can)")
        if self.router.node != "login" and self.router.node not in names:
            raise ValueError(f"router.node {self.router.node!r} is neither 'login' nor a node of this inventory")
        return self


def load_inventory(path: Path | str) -> Inventory:
    p = Path(path).expanduser()
    if p.is_dir():
        raise K3Error("unreadable-file", f"{p}: is a directory, not an inventory file", "pass the inventory's YAML file (see inventories/)")
    if not p.is_file():
        raise K3Error("missing-inventory", f"{p}: no such inventory file", "see inventories/ for examples")
    return load_yaml_model(p, Inventory, doc='docs/inventories.md ("Keys")', code="bad-inventory")


def load_placed(path: Path | str) -> Inventory:
    """An inventory as plans place on it: loaded, and (ssh) with ``~/.ssh/config`` aliases resolved."""
    inv = load_inventory(path)
    return apply_ssh_config(inv, read_ssh_config(inv)) if backend_spec(inv.backend).reads_ssh_config else inv


def apply_ssh_config(inv: Inventory, ssh_config_text: str | None) -> Inventory:
    """Resolve ``~/.ssh/config`` aliases: engines need a real address, ssh keeps the alias.

    A node with no ``address`` whose name the ssh config maps to another ``HostName`` gets that
    HostName as its address and its name as ``ssh_host``. Pure: the caller reads the file.
    """
    if not ssh_config_text:
        return inv
    import paramiko

    cfg = paramiko.SSHConfig.from_text(ssh_config_text)
    nodes = []
    for n in inv.nodes:
        if n.address is None:
            host = cfg.lookup(n.name).get("hostname", n.name)
            if host != n.name:
                try:
                    host = check_host(host, f"ssh config HostName of {n.name}")
                except ValueError as exc:
                    raise K3Error("bad-ssh-config", str(exc), "fix the HostName in the ssh config") from None
                n = n.model_copy(update={"address": host, "ssh_host": n.ssh_host or n.name})
        nodes.append(n)
    from pydantic import ValidationError

    try:  # re-validate: two aliases may resolve to one HostName
        return Inventory.model_validate({**inv.model_dump(), "nodes": [n.model_dump(exclude_unset=False) for n in nodes]})
    except ValidationError as exc:
        raise K3Error(
            "bad-inventory",
            f"inventory {inv.name} after resolving ssh aliases: {plain(exc.errors()[0]['msg'])}",
            "give the nodes distinct HostNames or explicit addresses",
        ) from None


def read_ssh_config(inv: Inventory) -> str | None:
    """The text of the inventory's ``ssh_config`` (default ``~/.ssh/config``), if it exists."""
    path = Path(inv.ssh_config or "~/.ssh/config").expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise K3Error(
            "bad-encoding",
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})",
            "is it the ssh config you meant? save it as UTF-8",
        ) from None
    except FileNotFoundError:
        if inv.ssh_config:
            raise K3Error("missing-file", f"ssh_config {path}: no such file", "fix the inventory's ssh_config path") from None
        return None
    except OSError as exc:
        raise K3Error("unreadable-file", f"{path}: {exc.strerror}", "check permissions") from None


def expand_nodelist(nodelist: str) -> list[str]:
    """A user's Slurm host list (``gpu-[01-04,07]``) → names; refused when malformed."""
    return expand_hostlist(nodelist)
