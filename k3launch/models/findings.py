"""What ``lint`` finds in a pasted command and what ``explain`` tells of a flag: data only."""

from __future__ import annotations

from dataclasses import dataclass

from k3launch.models.plan import ProvenanceEntry

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class Finding:
    """One ``lint`` finding: an ``error`` (vLLM would refuse it) or a ``warning``."""

    severity: str
    code: str
    message: str
    hint: str

    def as_dict(self) -> dict[str, str]:
        return {"severity": self.severity, "code": self.code, "message": self.message, "hint": self.hint}


@dataclass(frozen=True)
class FlagHistory:
    """Which layers wrote one flag, in order, for the processes that share that history."""

    key: str
    processes: list[str]  # ids sharing this history
    entries: list[ProvenanceEntry]
    final: str | None  # None: not in the final command (a later layer removed it)
