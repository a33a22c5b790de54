"""A fake command runner: records every command and answers from a script (no I/O)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from k3launch.transport.runners import Result, Target

Handler = Callable[[Target, str], tuple[int, str, str]]


@dataclass
class FakeRunner:
    handler: Handler
    calls: list[tuple[str, str]] = field(default_factory=list)
    closed: bool = False

    def run(self, target: Target, command: str, *, timeout: float = 60.0) -> Result:
        self.calls.append((target.name, command))
        code, out, err = self.handler(target, command)
        return Result(target.name, command, code, out, err, 0.0)

    def close(self) -> None:
        self.closed = True
