"""Model weights on the nodes, as ``weights check`` / ``weights fetch`` report them: data only.

Where a node keeps the plan's model (:class:`Where`), what the node reported of it
(:class:`State`), one node's outcome (:class:`NodeWeights`), a fetch's source (:class:`Source`)
and progress (:class:`FetchProgress`). The checks themselves run in the backends that support
``weights`` (:class:`~k3launch.models.backends.Feature`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Literal

from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.models.plan import Plan

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Where:
    """Where one node keeps the plan's model."""

    model: str  # a hub id, or a local directory
    revision: str
    hub: str  # the hub cache directory (~ expands on the node)

    @property
    def local(self) -> bool:
        return self.model.startswith(("/", "~", "."))

    @property
    def repo_dir(self) -> str:
        """The model's directory in the hub cache (or the local directory itself)."""
        return self.model if self.local else f"{self.hub.rstrip('/')}/models--{self.model.replace('/', '--')}"


@dataclass(frozen=True)
class State:
    """What the node reported (:data:`CHECK_PY`)."""

    dir: str = ""
    commit: str = ""
    files: int = 0
    bytes: int = 0
    missing: list[str] = field(default_factory=list)
    bad: list[tuple[str, int, int | None]] = field(default_factory=list)
    free: int | None = None
    error: str = ""
    total: int | None = None  # the index's metadata.total_size: the checkpoint's bytes (None: no index, or it does not say)

    @property
    def complete(self) -> bool:
        return bool(self.dir) and not (self.error or self.missing or self.bad)

    def problem(self) -> str:
        """What is wrong, in one line ('' when complete)."""
        if self.error:
            return self.error
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} file(s) missing: {', '.join(self.missing[:3])}{' ...' if len(self.missing) > 3 else ''}")
        for name, have, want in self.bad[:2]:
            parts.append(
                f"{name} is {have} bytes, its header says {want}" if want is not None else f"{name} has no readable safetensors header"
            )
        return "; ".join(parts)


@dataclass(frozen=True)
class Checkpoint:
    """How many GB a weight load reads, and whose figure that is, in words: the checkpoint's own
    index (``metadata.total_size``, read where the weights are) or the recipe's estimate."""

    gb: float
    source: str
    measured: bool = False


def index_total(text: str) -> int | None:
    """``metadata.total_size`` of a safetensors index (the bytes of every tensor, as the writer of
    the checkpoint counted them); None when the text does not give one."""
    try:
        meta = json.loads(text).get("metadata")
    except (ValueError, AttributeError):
        return None
    total = meta.get("total_size") if isinstance(meta, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None


def measured(total_bytes: int, where: str) -> Checkpoint:
    return Checkpoint(total_bytes / 1e9, f"{INDEX} metadata.total_size, {where}", True)


def estimated(plan: Plan) -> Checkpoint:
    """The recipe's figure, when no index was read: parameters x bytes per parameter (the plan's
    ``capacity.checkpoint_gb``; the 1.2 headroom of ``weights_gb`` is GPU memory's, not the
    files'), else the recipe's weights figure itself."""
    c = plan.capacity
    if c.checkpoint_gb:
        return Checkpoint(c.checkpoint_gb, "the recipe's parameters x bytes/param (no checkpoint index read)")
    return Checkpoint(c.weights_gb, f"the recipe's weights figure, {c.formula} (no checkpoint index read)")


def node_checkpoint(plan: Plan, state: State | None, node: str) -> Checkpoint:
    """The checkpoint's size as ``node`` reported it (its index), else the recipe's."""
    if state is not None and state.total:
        return measured(state.total, f"on {node}")
    return estimated(plan)


def revision(plan: Plan) -> str:
    """The ``--revision`` the engines load (vLLM's default: the hub's ``main``)."""
    for p in plan.processes:
        if "--revision" in p.argv[:-1]:
            return p.argv[p.argv.index("--revision") + 1]
    return "main"


@dataclass(frozen=True)
class Source:
    kind: Literal["hub", "path", "node"] = "hub"
    path: str = ""  # kind path: a directory the nodes see
    node: str = ""  # kind node: the plan node to copy from
    token_file: str | None = None  # kind hub: the inventory's hf_token_file (a path on the nodes)


@dataclass(frozen=True)
class NodeWeights:
    node: str
    where: Where
    state: State | None  # None: not checked (unreachable, no Python)
    error: str = ""  # why there is no state; or, after a fetch, why it failed
    fetched: bool = False  # a fetch ran on this node

    @property
    def complete(self) -> bool:
        return self.state is not None and self.state.complete


@dataclass(frozen=True)
class FetchProgress:
    done_bytes: int
    total_bytes: int  # an estimate: the source's size (or the plan's weights) per fetching node
    nodes_done: int
    nodes: int
    elapsed_s: float


ProbeMethod = Literal["o_direct", "fadvise", "nocache", "cached", ""]
# How a probe kept the page cache out of its read: O_DIRECT reads bypass it; ``fadvise``
# (posix_fadvise DONTNEED) and ``nocache`` (GNU dd's iflag=nocache) drop the file's pages before a
# normal read; ``cached``: nothing could drop them, the figure is the page cache's, not the disk's.
METHODS: dict[str, str] = {
    "o_direct": "O_DIRECT read (the page cache bypassed)",
    "fadvise": "posix_fadvise DONTNEED, then a normal read",
    "nocache": "dd iflag=nocache (pages dropped), then a normal read",
    "cached": "the page cache could NOT be dropped: this is not the disk's speed",
}


@dataclass(frozen=True)
class Probe:
    """One node's read throughput of the weight source, as ``weights probe`` measured it."""

    node: str
    dir: str  # the directory probed (the fresh file was written there, then removed)
    method: ProbeMethod = ""
    bytes: int = 0  # bytes read (fewer than written when the read hit the time bound)
    read_s: float = 0.0
    written: int = 0
    write_s: float = 0.0
    resident: int | None = None  # bytes of the file still in the page cache before the read (fincore), when known
    timed_out: bool = False  # the read was cut at the time bound: the figure is for the part read
    error: str = ""
    code: str = ""  # "probe-path": the directory is missing or not writable (the user's to fix)

    @property
    def ok(self) -> bool:
        return not self.error and self.bytes > 0 and self.read_s > 0

    @property
    def read_mbps(self) -> float:
        """Read throughput in MB/s (10^6 bytes per second); 0 when nothing was measured."""
        return self.bytes / self.read_s / 1e6 if self.ok else 0.0

    @property
    def write_mbps(self) -> float:
        return self.written / self.write_s / 1e6 if self.written and self.write_s > 0 else 0.0


def path_error(probes: list[Probe]) -> K3Error | None:
    """The user's error when a node's directory is missing or not writable (exit 2), else None."""
    bad = [p for p in probes if p.code == "probe-path"]
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more node(s))" if len(bad) > 1 else ""
    return K3Error(
        "probe-path",
        f"weights probe on {bad[0].node}: {bad[0].error}{more}",
        "pass --path DIR, a writable directory on the disk the weights load from (or `k3launch weights fetch` the model first)",
    )


def probe_rows(probes: list[Probe]) -> list[dict[str, object]]:
    """The probes as ``--json`` prints them and ``--save`` keeps them (with MB/s and the method's meaning)."""
    return [{**asdict(p), "read_mbps": round(p.read_mbps, 1), "write_mbps": round(p.write_mbps, 1),
             "method_means": METHODS.get(p.method, "")} for p in probes]


def probes_json(inventory: str, probes: list[Probe], at: float) -> str:
    return json.dumps({"inventory": inventory, "at": at, "nodes": probe_rows(probes)}, indent=2)


def read_probes(text: str) -> list[Probe]:
    """The probes a saved file holds (unknown keys ignored); ValueError when it is not one."""
    d = json.loads(text)
    names = {f.name for f in fields(Probe)}
    try:
        out = [Probe(**{k: v for k, v in row.items() if k in names}) for row in d["nodes"]]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a saved weights probe: {exc}") from None
    for p in out:  # the figures predictions divide by: numbers, or the file is not one k3launch wrote
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (p.bytes, p.read_s, p.written, p.write_s)):
            raise ValueError(f"not a saved weights probe: node {p.node!r} has a figure that is not a number")
    return out


@dataclass(frozen=True)
class RankLoad:
    """One engine process's predicted weight load: each of its ``ranks`` reads ``gb_per_rank``."""

    process: str
    node: str
    ranks: int
    gb_per_rank: float
    seconds: float  # until its ranks have read their share, contending as the prediction says (the copy included)
    copy_s: float = 0.0  # of which its node's copy of the staged weights, before the engines start


@dataclass(frozen=True)
class LoadPrediction:
    """How long the weights take to load, predicted from a read throughput (``plan``, ``doctor``, ``timeline``)."""

    ranks: list[RankLoad]  # empty when the way the engines read is not modelled (``unmodelled`` says why)
    gbps: dict[str, float]  # node -> GB/s it reads at ("*": the shared filesystem's total); with staging, the copy's source
    basis: str  # where the throughput came from, in words
    shared: bool  # every node reads one filesystem: all ranks contend for one throughput
    reading: str = ""  # how the engines read the checkpoint (their load format and strategy), as modelled
    notes: tuple[str, ...] = ()  # what the figure leaves out
    unmodelled: str = ""  # why there is no figure ('' when there is one)
    stage_gbps: dict[str, float] = field(default_factory=dict)  # node -> GB/s reading the staged copy ({}: not staged)
    checkpoint: Checkpoint | None = None  # the checkpoint's size the figure reads, and whose figure it is

    @property
    def total_s(self) -> float:
        """Until the last rank has its weights (0 when not modelled)."""
        return max((r.seconds for r in self.ranks), default=0.0)

    def seconds_of(self, process: str) -> float | None:
        return next((r.seconds for r in self.ranks if r.process == process), None)

    def rows(self) -> dict[str, object]:
        """As ``--json`` prints it: ``total_s`` is null when not modelled (``unmodelled`` says why);
        ``stage_gbps`` and each process's ``copy_s`` only with staging."""
        staged = bool(self.stage_gbps)
        procs = [{**{k: v for k, v in asdict(r).items() if k != "copy_s"}, "gb_per_rank": round(r.gb_per_rank, 2), "seconds": round(r.seconds, 1),
                  **({"copy_s": round(r.copy_s, 1)} if staged else {})} for r in self.ranks]
        out: dict[str, object] = {"total_s": None if self.unmodelled else round(self.total_s, 1), "shared": self.shared, "basis": self.basis,
                                  "gbps": {k: round(v, 3) for k, v in self.gbps.items()}, "processes": procs, "reading": self.reading}
        if staged:
            out["stage_gbps"] = {k: round(v, 3) for k, v in self.stage_gbps.items()}
        if self.notes:
            out["notes"] = list(self.notes)
        if self.unmodelled:
            out["unmodelled"] = self.unmodelled
        if self.checkpoint is not None:
            out["checkpoint_gb"] = round(self.checkpoint.gb, 1)
            out["checkpoint"] = self.checkpoint.source
        return out
