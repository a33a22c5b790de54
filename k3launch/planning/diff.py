"""What changes, process by process, between a running plan and the plan that would replace it.

A rollout shows this before it touches anything (``rollout --dry-run`` stops there), and only the
processes with a change are restarted. An engine's argv is compared flag by flag through the flag
schema of each plan's own vLLM version (``--no-enable-x`` and ``--disable-x`` are one flag, the
order of flags is not a change, a dotted ``-cc.pass_config.X`` is its own key); the router's argv,
not a ``vllm serve`` command, by its ``--flag value...`` words. Env, image, node and address are
compared as values. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from k3launch.models.plan import Plan, Process
from k3launch.planning.schema import FlagSchema, load_schema

What = Literal["flag", "model", "env", "image", "node", "address"]


@dataclass(frozen=True)
class Change:
    """One difference: ``old`` None means added, ``new`` None removed. Booleans read ``on``/``off``."""

    what: What
    key: str
    old: str | None
    new: str | None

    def line(self) -> str:
        if self.old is None:
            return f"+ {self.key} {self.new}".rstrip()
        if self.new is None:
            return f"- {self.key} {self.old}".rstrip()
        return f"~ {self.key} {self.old} -> {self.new}"


@dataclass(frozen=True)
class ProcessDiff:
    """The changes of one process id (``added`` / ``removed``: the process is only in one plan)."""

    process: str
    changes: tuple[Change, ...]
    added: bool = False
    removed: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.changes) or self.added or self.removed


def _vllm_flags(schema: FlagSchema, argv: list[str]) -> tuple[str | None, dict[str, str]]:
    """(model, flag -> value) of a ``vllm serve MODEL FLAGS...`` argv; what the schema cannot
    read is kept word for word, so it still shows when it changes."""
    model = argv[2] if len(argv) > 2 and not argv[2].startswith("-") else None
    tokens = argv[3:] if model is not None else argv[2:]
    args, problems = schema.parse(tokens)
    out: dict[str, str] = {}
    for a in args:
        out[a.key] = ("on" if a.polarity else "off") if a.value is None else a.value
    for p in problems:
        out[p.option] = p.value or "?"
    return model, out


def _plain_flags(argv: list[str]) -> dict[str, str]:
    """``--flag value...`` words of a command that is not ``vllm serve`` (the router)."""
    out: dict[str, str] = {}
    key: str | None = None
    for word in argv[1:]:
        if word.startswith("--"):
            key = word
            out[key] = ""
        elif key is not None:
            out[key] = f"{out[key]} {word}".strip()
    return out


def _flags(p: Process, version: str) -> tuple[str | None, dict[str, str]]:
    if p.argv[:2] == ["vllm", "serve"]:
        return _vllm_flags(load_schema(version), p.argv)
    return None, _plain_flags(p.argv)


def _values(what: What, old: dict[str, str], new: dict[str, str]) -> list[Change]:
    return [Change(what, k, old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


def diff_process(old: Process, new: Process, old_version: str, new_version: str) -> ProcessDiff:
    om, of = _flags(old, old_version)
    nm, nf = _flags(new, new_version)
    values: tuple[tuple[What, str | None, str | None], ...] = (
        ("node", old.node, new.node), ("address", old.address, new.address), ("model", om, nm), ("image", old.image, new.image))
    changes = [Change(what, what, a, b) for what, a, b in values if a != b]
    changes += _values("flag", of, nf)
    changes += _values("env", old.env, new.env)
    return ProcessDiff(old.id, tuple(changes))


def diff_plans(old: Plan, new: Plan) -> list[ProcessDiff]:
    """One entry per process id of either plan, in the new plan's order (then those it drops)."""
    before = {p.id: p for p in old.processes}
    after = {p.id: p for p in new.processes}
    out: list[ProcessDiff] = []
    for p in new.processes:
        if p.id in before:
            out.append(diff_process(before[p.id], p, old.vllm_version, new.vllm_version))
        else:
            out.append(ProcessDiff(p.id, (), added=True))
    out += [ProcessDiff(pid, (), removed=True) for pid in before if pid not in after]
    return out
