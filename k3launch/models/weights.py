"""Model weights on the nodes, as ``weights check`` / ``weights fetch`` report them: data only.

Where a node keeps the plan's model (:class:`Where`), what the node reported of it
(:class:`State`), one node's outcome (:class:`NodeWeights`), a fetch's source (:class:`Source`)
and progress (:class:`FetchProgress`). The checks themselves run in the backends that support
``weights`` (:class:`~k3launch.models.backends.Feature`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


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
