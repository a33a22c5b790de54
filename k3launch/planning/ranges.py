"""Values vLLM refuses, refused at planning: the bounds and cross-field rules of vLLM's config classes.

vLLM checks a ``vllm serve`` command's values only when it builds its config (``--gpu-memory-utilization
1.5``: ``Input should be less than or equal to 1``), which for a large model comes after a long
bring-up. ``constraints.json`` beside each flag schema (written by ``k3launch schema dump``, see
:mod:`.ranges_dump`) lists what vLLM's config classes refuse; this module holds a composed command
against it, in vLLM's own words.

Decisions:

* **The values that run are checked**, after composition (:func:`.compose.compose` calls
  :func:`refuse`): a recipe value a later layer or ``--set`` replaces never reaches vLLM, so it
  is not refused; the value that runs is blamed on its last writer (provenance: origin and layer).
* **A rule needs every value it relates.** A flag the command does not set takes the schema's
  dumped default when that is a number (``--tensor-parallel-size`` is 1); a default vLLM derives at
  start (``--max-num-seqs``: per platform and usage) is unknown, and a rule with an unknown value
  is not checked: planning never refuses what vLLM might accept.
* **Only when vLLM builds the config**: a bound or rule with ``when`` (LoRAConfig's, built only
  with ``--enable-lora``) holds only when its condition does. MultiModalConfig's bounds are
  checked for every model, though vLLM reads them for multimodal models only: such a value is a
  mistake either way.
* **Blame**: a value written by the user (an origin ``--set ...``, as ``plan`` and ``rollout``
  record it) gets a hint to correct the ``--set``; a recipe's, a hint to fix the recipe or
  override it with ``--set``.

Pure: the data files are read as package data (or a user's dump), as :mod:`.schema` reads them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from k3launch.errors import K3Error
from k3launch.planning.ranges_dump import CONSTRAINTS
from k3launch.planning.schema import Arg, FlagSchema, FlagSpec, Problem, user_schema_dir, vendored_versions
from k3launch.util.records import record

OUT_OF_RANGE = "value-out-of-range"
CONFLICT = "values-conflict"
# pydantic-core's order: the first limit a value breaks is the one vLLM names (NaN breaks the first present)
_OPS = ("multiple_of", "le", "lt", "ge", "gt")
_CHECKS = ("ge", "le", "divisible")


@record
class Limit:
    op: str  # one of _OPS
    limit: float
    message: str  # vLLM's (pydantic's) words for a value past it


@record
class Bound:
    field: str  # the config field the flag fills, e.g. CacheConfig.gpu_memory_utilization
    number: str  # "int" or "float": what vLLM validates the value as
    limits: tuple[Limit, ...]
    when: tuple[tuple[str, str, Any], ...] = ()


@record
class Rule:
    id: str
    config: str
    check: str  # one of _CHECKS: flags[0] against flags[1]
    flags: tuple[str, str]  # dests
    when: tuple[tuple[str, str, Any], ...]
    message: str  # vLLM's words, a format string over the dests


@record
class Constraints:
    version: str
    bounds: Mapping[str, Bound]
    rules: tuple[Rule, ...]


@record
class Violation:
    """A value (or combination) vLLM refuses: ``keys`` are the flag keys it is about, first the one to change."""

    code: str
    keys: tuple[str, ...]
    shown: tuple[str, ...]  # each key's value as vLLM reads it (a default's too)
    said: str  # vLLM's words
    where: str  # the config field or class that refuses it


def _when(raw: Any) -> tuple[tuple[str, str, Any], ...]:
    if not isinstance(raw, list) or not all(isinstance(c, list) and len(c) == 3 and c[1] in ("eq", "gt") for c in raw):
        raise ValueError(f"bad when {raw!r}")
    return tuple((str(c[0]), str(c[1]), c[2]) for c in raw)


def parse_constraints(text: str, version: str) -> Constraints:
    """``constraints.json`` read and checked; ValueError (or KeyError/TypeError) on a bad file."""
    doc = json.loads(text)
    if doc.get("vllm_version") != version or set(doc) != {"vllm_version", "source", "bounds", "rules"}:
        raise ValueError(f"want keys vllm_version ({version}), source, bounds, rules")
    bounds = {}
    for dest, b in doc["bounds"].items():
        limits = tuple(Limit(str(x["op"]), float(x["limit"]), str(x["message"])) for x in b["limits"])
        if b["number"] not in ("int", "float") or not limits or any(x.op not in _OPS for x in limits):
            raise ValueError(f"bad bound of {dest}")
        bounds[dest] = Bound(str(b["field"]), b["number"], limits, _when(b.get("when", [])))
    rules = []
    for r in doc["rules"]:
        flags = tuple(r["flags"])
        if r["check"] not in _CHECKS or len(flags) != 2:
            raise ValueError(f"bad rule {r.get('id')}")
        rules.append(Rule(str(r["id"]), str(r["config"]), r["check"], (str(flags[0]), str(flags[1])), _when(r["when"]), str(r["message"])))
    return Constraints(version, bounds, tuple(rules))


@cache
def _vendored(version: str) -> Constraints:
    path = resources.files("k3launch") / "data" / "vllm" / version / CONSTRAINTS
    return parse_constraints(path.read_text(), version) if path.is_file() else Constraints(version, {}, ())


@cache
def _dumped(path: str, _mtime: int, version: str) -> Constraints:
    try:
        return parse_constraints(Path(path).read_text(), version)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise K3Error("bad-schema-dump", f"{path}: not a readable constraints file ({type(exc).__name__}: {exc})",
                      "dump it again with `k3launch schema dump --python <the engine's python>`") from None


def constraints(version: str) -> Constraints:
    """vLLM ``version``'s constraints: a user's dump first, else the vendored file; none when neither has one
    (a dump by an older k3launch, an unknown version): nothing is then refused."""
    dumped = user_schema_dir() / version / CONSTRAINTS
    try:
        if dumped.is_file():
            return _dumped(str(dumped), dumped.stat().st_mtime_ns, version)
    except OSError:
        pass
    return _vendored(version) if version in vendored_versions() else Constraints(version, {}, ())


# ---------------------------------------------------------------------- values as vLLM reads them
_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def _human_int(text: str) -> int:
    """vLLM's ``human_readable_int``: ``1k`` is 1000, ``1K`` 1024 (binary suffixes take whole numbers only)."""
    m = _HUMAN.fullmatch(text.strip())
    if not m:
        return int(text)
    number, suffix = m.groups()
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.islower():
        return int(float(number) * 10 ** (3 * power))
    return int(number) << (10 * power)


def number_of(spec: FlagSpec, value: str, number: str = "int") -> float | None:
    """The number vLLM's argparse type makes of ``value`` (None: no number, e.g. ``auto`` or ``None``)."""
    text = value.strip()
    try:
        if spec.type == "human_readable_int_or_auto":
            return -1 if text.lower() in ("auto", "-1") else _human_int(text)
        if spec.type == "human_readable_int":
            return _human_int(text)
        if spec.type == "_optional_type" and text in ("", "None"):
            return None
        return float(text) if (spec.type == "float" or number == "float") else int(text)
    except ValueError:
        return None  # not a number: the schema's type check reports it


def _default(spec: FlagSpec) -> Any:
    try:
        value = json.loads(spec.default)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, (bool, int, float)) else None


def _past(op: str, value: float, limit: float) -> bool:
    """Whether ``value`` breaks the limit; written as pydantic tests it, so NaN breaks every bound."""
    if op == "multiple_of":
        return not math.isclose(math.remainder(value, limit), 0.0, abs_tol=1e-12) if math.isfinite(value) else True
    ok = {"gt": value > limit, "ge": value >= limit, "lt": value < limit, "le": value <= limit}[op]
    return not ok


class _Values:
    """The value of each dest in a composed command, or its numeric default; bound to one schema."""

    def __init__(self, schema: FlagSchema, args: Mapping[str, Arg], cons: Constraints) -> None:
        self.schema, self.cons = schema, cons
        self.by_dest = {a.spec.dest: a for a in args.values() if not a.path}

    def get(self, dest: str) -> Any:
        arg = self.by_dest.get(dest)
        if arg is not None:
            if arg.polarity is not None:
                return arg.polarity
            bound = self.cons.bounds.get(dest)
            return number_of(arg.spec, arg.value or "", bound.number if bound else "int")
        spec = next((s for s in self.schema.specs if s.dest == dest), None)
        return _default(spec) if spec is not None else None

    def holds(self, when: Sequence[tuple[str, str, Any]]) -> bool:
        for dest, op, want in when:
            have = self.get(dest)
            if have is None or (op == "eq" and have != want) or (op == "gt" and not (have > want)):
                return False
        return True


def violations(schema: FlagSchema, args: Mapping[str, Arg]) -> list[Violation]:
    """Every value of ``args`` (flag key → the value that runs) vLLM ``schema.version`` refuses."""
    cons = constraints(schema.version)
    if not cons.bounds and not cons.rules:
        return []
    vals = _Values(schema, args, cons)
    out: list[Violation] = []
    for dest, arg in vals.by_dest.items():
        bound = cons.bounds.get(dest)
        if bound is None or arg.polarity is not None or not vals.holds(bound.when):
            continue
        got = number_of(arg.spec, arg.value or "", bound.number)
        ordered = sorted(bound.limits, key=lambda lim: _OPS.index(lim.op))
        hit = next((lim for lim in ordered if got is not None and _past(lim.op, got, lim.limit)), None)
        if hit is not None:
            out.append(Violation(OUT_OF_RANGE, (arg.key,), (arg.shown,), hit.message, bound.field))
    for rule in cons.rules:
        a, b = (vals.get(d) for d in rule.flags)
        if a is None or b is None or isinstance(a, bool) or isinstance(b, bool) or not vals.holds(rule.when):
            continue
        ok = a >= b if rule.check == "ge" else a <= b if rule.check == "le" else (b != 0 and a % b == 0)
        if not ok:
            keys = tuple(vals.by_dest[d].key if d in vals.by_dest else "--" + d.replace("_", "-") for d in rule.flags)
            shown = (_shown(a), _shown(b))
            said = rule.message.format(**dict(zip(rule.flags, shown, strict=True)))
            out.append(Violation(CONFLICT, keys, shown, said, rule.config))
    return out


def _shown(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


class Written(Protocol):
    """A provenance entry (:class:`.compose.ProvEntry`): who wrote a value."""

    @property
    def origin(self) -> str: ...

    @property
    def layer(self) -> str: ...


def _writer(key: str, value: str, prov: Mapping[str, Sequence[Written]] | None) -> tuple[str, str | None]:
    """``--flag VALUE (from ORIGIN, LAYER layer)``, and the origin when the user wrote it (``--set ...``)."""
    entries = (prov or {}).get(key) or ()
    if not entries:
        return f"{key} {value}" + (" (vLLM's default)" if prov is not None else ""), None
    last = entries[-1]
    return f"{key} {value} (from {last.origin}, {last.layer} layer)", last.origin if last.origin.startswith("--set ") else None


def _said(v: Violation, version: str, prov: Mapping[str, Sequence[Written]] | None) -> tuple[str, list[str]]:
    writers = [_writer(k, shown, prov) for k, shown in zip(v.keys, v.shown, strict=True)]
    what = " with ".join(w for w, _ in writers)
    them = "it" if len(writers) == 1 else "them"
    return f"{what}: vLLM {version} refuses {them}: {v.said} ({v.where})", [u for _, u in writers if u]


def problems(schema: FlagSchema, args: Mapping[str, Arg]) -> list[Problem]:
    """:func:`violations` as schema problems (``k3launch lint``: a pasted command has no provenance)."""
    return [Problem(v.code, _said(v, schema.version, None)[0], "give it a value in vLLM's range" if v.code == OUT_OF_RANGE else "change one of them so vLLM's check holds",
                    option=v.keys[0])
            for v in violations(schema, args)]


def refuse(schema: FlagSchema, args: Mapping[str, Arg], prov: Mapping[str, Sequence[Written]]) -> None:
    """Raise the first value vLLM refuses as a one-line :class:`K3Error`, blaming its writers (``prov``:
    each key's provenance entries, with ``origin`` and ``layer``)."""
    found = violations(schema, args)
    if not found:
        return
    v = found[0]
    message, users = _said(v, schema.version, prov)
    if users:
        hint = f"correct your {' and '.join(users)}: " + ("give it a value" if v.code == OUT_OF_RANGE else "choose values") + \
            f" vLLM {schema.version} accepts"
    else:
        hint = f"fix the recipe, or override it with --set {v.keys[0].removeprefix('--')}=VALUE"
    raise K3Error(v.code, message, hint)
