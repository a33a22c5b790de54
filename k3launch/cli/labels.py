"""Value labels in help: one style for every command's options and arguments.

Typer labels values its own way (``<int>``, ``<str>``, ``<list[str]>``, ``<int range>``,
``<path>``, and ``NAME <str>`` for an argument) beside the ``INTEGER``, ``NUMBER`` and ``PORT``
that k3launch's own options set; :func:`labelled` gives every value without a label click's
(``TEXT``, ``INTEGER``, ``PATH``, ``[a|b]``), so that help reads the same throughout.
"""

from __future__ import annotations

from typing import Any

# A value's label in help, one style for every option (click's): Typer's own are <int>, <str>,
# <list[str]>, <int range>, <path>, beside the INTEGER and NUMBER of the options that set theirs.
_LABELS = {"int": "INTEGER", "integer": "INTEGER", "float": "NUMBER", "str": "TEXT", "text": "TEXT", "path": "PATH",
           "file": "PATH", "directory": "PATH", "bool": "BOOLEAN", "boolean": "BOOLEAN"}


def _label(p: Any, ctx: Any) -> str:
    if hasattr(p, "type"):  # a Typer on click's parameters: click's type names them
        if p.type.name == "choice":
            return "[" + "|".join(map(str, p.type.choices)) + "]"
        kind = str(p.type.name)
    else:  # a Typer with its own parameters: its display type (<int range>, <list[str]>, <a|b>)
        try:
            kind = str(p.display_type(ctx)).strip("<>")
        except Exception:  # a choice it cannot name without a context
            return "VALUE"
        kind = kind[5:-1] if kind.startswith("list[") else kind
        if "|" in kind:
            return f"[{kind}]"
    return _LABELS.get(kind.removesuffix(" range"), "VALUE")


def _untyped(ctx: Any = None) -> None:
    return None


def labelled(cmd: Any, ctx: Any = None) -> Any:
    """``cmd`` (and a group's commands) with a label on every value its help shows that has none:
    an argument its name in capitals (FILE), an option its type's (TEXT, INTEGER, PATH, [a|b])."""
    for p in getattr(cmd, "params", ()):
        if p.param_type_name == "argument":
            p.metavar = p.metavar or (p.name or "value").upper()
            if hasattr(p, "display_type_rich"):  # a Typer that adds its type after the name (NAME <str>): the name says it
                p.display_type_rich = _untyped
        elif p.metavar is None and not getattr(p, "is_flag", False) and not getattr(p, "count", False):
            p.metavar = _label(p, ctx)
    for sub in getattr(cmd, "commands", {}).values():
        labelled(sub, ctx)
    return cmd
