"""vLLM's config flags (``--compilation-config``, ``--attention-config``, ...) checked field by field.

A config flag's value is a JSON object validated against one of vLLM's config dataclasses, which
refuse fields they do not have: ``--compilation-config '{"use_inductor": false}'`` stops
``vllm serve`` at startup since ``use_inductor`` left CompilationConfig. The vendored schema dumps
each flag's default, and a config's default lists its fields (``AttentionConfig(backend=None, ...)``
or ``{'mode': None, ...}``), so both the whole JSON value and a dotted sub-key
(``-cc.pass_config.x=...``: its first part) are checked against them. Flags whose default is
``None`` (``--speculative-config``, ``--kv-transfer-config``) do not list their fields and are not
checked here, but their values must be JSON all the same (vLLM's type for them parses JSON). The
simulated engine keeps to :mod:`.schema` alone and does not check these.
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from collections.abc import Iterable
from functools import cache

from k3launch.planning.schema import Arg, FlagSpec, Problem

_ENUM_REPR = re.compile(r"<[^<>]*>")  # enum members repr as <Kind.X: 'x'>: not Python syntax


@cache
def fields_of(spec: FlagSpec) -> frozenset[str] | None:
    """The top-level fields of a config flag, where its dumped default lists them."""
    if spec.type != "parse_dataclass":
        return None
    try:
        doc = json.loads(spec.default)
    except json.JSONDecodeError:
        doc = None
        try:
            node = ast.parse(_ENUM_REPR.sub("None", spec.default), mode="eval").body
        except SyntaxError:
            return None
        if isinstance(node, ast.Call):  # a dataclass repr: Name(a=1, b=Sub(c=2))
            return frozenset(k.arg for k in node.keywords if k.arg) or None
        if isinstance(node, ast.Dict):  # a dict repr: {'a': 1, 'b': {...}}
            return frozenset(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)) or None
    if isinstance(doc, dict):
        return frozenset(doc) or None
    return None


def _hint(spec: FlagSpec, fields: frozenset[str], bad: str) -> str:
    close = difflib.get_close_matches(bad, sorted(fields), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    return f"drop it: vLLM refuses fields its config does not have (`vllm serve --help={spec.canonical}` lists them)"


def unknown_fields(version: str, args: Iterable[Arg]) -> list[Problem]:
    """A problem for each config field ``args`` set that vLLM ``version``'s config does not have, and
    for each value of a JSON flag that is not JSON (:mod:`.schema` checks those of json.loads and
    config dataclass types; an optional or dict-typed flag's type parses JSON too)."""
    out: list[Problem] = []
    for arg in args:
        if arg.spec.takes_dict and not arg.path and arg.value and arg.value.lstrip().startswith(("{", "[")):
            try:
                json.loads(arg.value)
            except json.JSONDecodeError as exc:
                out.append(Problem("bad-value", f"{arg.spec.canonical} {arg.value!r} is not valid JSON: {exc}",
                                   "vLLM parses this flag's value as JSON", option=arg.spec.canonical, value=arg.value))
                continue
        fields = fields_of(arg.spec)
        if fields is None or arg.value is None:
            continue
        if arg.path:
            names = [arg.path.split(".", 1)[0].removesuffix("+")]
            shown = f"{arg.written}.{arg.path}"
        else:
            try:
                doc = json.loads(arg.value)
            except json.JSONDecodeError:
                continue  # not JSON: the schema's value check reports it
            names = list(doc) if isinstance(doc, dict) else []
            shown = f"{arg.written} {arg.value}"
        for name in names:
            if name not in fields:
                out.append(Problem("unknown-field", f"{shown}: vLLM {version}'s {arg.spec.canonical} has no field {name!r}",
                                   _hint(arg.spec, fields, name), option=arg.spec.canonical, value=arg.value))
    return out
