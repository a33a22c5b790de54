"""What a power sampler collected (:class:`Trace`) and what every sampler offers (:class:`Sampler`):
data and a protocol, so campaigns integrate readings without knowing which backend took them."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

from k3launch.models.bench import Sample

TOOLS = ("nvidia-smi", "amd-smi", "rocm-smi")
NO_TOOL = "none"


@dataclass
class Trace:
    """What a sampler collected: readings per node, the tools read, the first problem met."""

    nodes: list[str]
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    tools: set[str] = field(default_factory=set)
    problem: str | None = None  # why nothing can be measured (no tool, no step)
    errors: list[str] = field(default_factory=list)  # readings that failed (a gap, if they last)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, node: str, t: float, tool: str, watts: tuple[float, ...]) -> None:
        with self.lock:
            if tool == NO_TOOL or not watts:
                why = f"none of {', '.join(TOOLS)} there" if tool == NO_TOOL else f"{tool} printed no figure"
                self.problem = self.problem or f"{node}: no GPU power reading ({why})"
                return
            self.samples.setdefault(node, []).append(Sample(t, watts))
            self.tools.add(tool)

    def fail(self, why: str, fatal: bool = False) -> None:
        with self.lock:
            if fatal:
                self.problem = self.problem or why
            else:
                self.errors.append(why)

    @property
    def source(self) -> str:
        return "+".join(sorted(self.tools)) or NO_TOOL

    @property
    def measured(self) -> bool:
        """Whether anything was read at all (a deployment without any power tool is not measured)."""
        return bool(self.samples)


class Sampler(Protocol):
    def start(self) -> None: ...

    def stop(self) -> Trace: ...
