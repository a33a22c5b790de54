"""Compose one process's ``vllm serve`` argv and env from ordered layers, with provenance.

The layer order is the recipe page's: ``base → variant → strategy → hardware → advanced →
features → kv_offload``. Within that order each layer may have several *sources* (the strategy
file, then the recipe's ``strategy_overrides``, then k3launch's placement flags, ...). The rules:

* last writer wins per flag *key* (see :mod:`k3launch.planning.schema`: every spelling of one argparse
  dest, booleans included, is one key), so contradictory booleans can never both reach a command;
* every write is recorded in the flag's provenance, first writer first, and every write that
  changes an earlier value is a notice — nothing is overridden silently;
* one source that writes the same key twice with different values (``--enable-x`` and
  ``--no-enable-x`` in one list) is a recipe error, because no order can make that intended;
* a JSON config flag set both whole (``--compilation-config '{...}'``) and by dotted sub-key
  (``-cc.pass_config.x=...``) is folded into one JSON value: vLLM itself would append the dotted
  form last and silently drop the whole-JSON one.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from k3launch.errors import K3Error
from k3launch.models.selection import Notice
from k3launch.planning import ranges
from k3launch.planning.configs import unknown_fields
from k3launch.planning.schema import Arg, FlagSchema
from k3launch.util.records import record

LAYERS = ("base", "variant", "strategy", "hardware", "advanced", "features", "kv_offload")


@record
class Source:
    """One list of args/env written by one layer."""

    layer: str
    origin: str  # where it came from, e.g. "models/moonshotai/Kimi-K3.yaml hardware_overrides.blackwell"
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    user: bool = False  # written by the user (--set): locks and placement keys apply


@record
class Locked:
    """A hardware-mandated value: ``key`` is a flag key or ``<flag key>.<json path>`` or ``env:NAME``."""

    key: str
    reason: str


@record
class ProvEntry:
    layer: str
    value: str
    origin: str


@dataclass
class Composed:
    argv: list[str]
    env: dict[str, str]
    provenance: dict[str, list[ProvEntry]]
    notices: list[Notice] = field(default_factory=list)
    args: dict[str, Arg] = field(default_factory=dict)

    def value(self, key: str) -> str | None:
        arg = self.args.get(key)
        if arg is None:
            return None
        if arg.polarity is not None:
            return "true" if arg.polarity else "false"
        return arg.value


@lru_cache(maxsize=4096)
def _parse_cached(schema: FlagSchema, tokens: tuple[str, ...]) -> tuple[Arg, ...]:
    args, problems = schema.parse(list(tokens))
    problems += unknown_fields(schema.version, args)  # vLLM would refuse them at startup
    if problems:
        p = problems[0]
        raise K3Error(p.code, p.message, p.hint)
    return tuple(args)


def _parse_source(schema: FlagSchema, src: Source) -> tuple[Arg, ...]:
    try:
        return _parse_cached(schema, src.args)
    except K3Error as exc:
        # a value the user gave (--set, --env) is theirs to correct, not the recipe's
        hint = exc.hint or (f"correct your {src.origin.split(' ', 1)[0]}: give it a value vllm serve {schema.version} accepts" if src.user
                            else "fix the recipe")
        raise K3Error(exc.code, f"{src.origin}: {exc.message}", hint) from None


def _same(a: Arg, b: Arg) -> bool:
    return a.polarity == b.polarity and a.value == b.value


def _json_get(value: str | None, path: str) -> object:
    try:
        cur: object = json.loads(value or "")
    except json.JSONDecodeError:
        return None
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _json_value(text: str | None) -> object:
    """A dotted sub-key's value as vLLM reads it: JSON if it parses, else the raw string."""
    try:
        return json.loads(text or "")
    except json.JSONDecodeError:
        return text


def _locked_value(state: Mapping[str, Arg], env: Mapping[str, str], key: str) -> object:
    if key.startswith("env:"):
        return env.get(key[4:])
    if key in state:
        arg = state[key]
        if arg.polarity is not None:
            return arg.polarity
        return _json_value(arg.value) if arg.path else arg.value
    base, _, path = key.partition(".")
    while path:
        if base in state:
            return _json_get(state[base].value, path)
        head, _, path = path.partition(".")
        base = f"{base}.{head}"
    return None


def _checked(schema: FlagSchema, src: Source, reserved: Mapping[str, str]) -> tuple[Arg, ...]:
    """One source's args, refused as :func:`compose` refuses them: a flag vLLM does not have, one
    source writing a key twice with different values, a user's ``--set`` of a reserved flag."""
    parsed = _parse_source(schema, src)
    seen: dict[str, Arg] = {}
    for arg in parsed:
        prior = seen.get(arg.key)
        if prior is not None and not _same(prior, arg):
            raise K3Error(
                "contradictory-flags",
                f"{src.origin}: {' '.join(prior.tokens())} and {' '.join(arg.tokens())} in one layer",
                "keep one of them; a later layer may override an earlier one, never itself",
            )
        seen[arg.key] = arg
    if src.user:
        for arg in parsed:
            _check_user_arg(arg, reserved)
    return parsed


def last_writes(schema: FlagSchema, sources: Sequence[Source], keys: Collection[str],
                reserved: Mapping[str, str] | None = None) -> dict[str, ProvEntry]:
    """The provenance entry :func:`compose` would end with for each of ``keys`` that ``sources``
    write (the value that runs, and who wrote it), without composing: placement reads a recipe's
    own sizes before it places. Sources are checked as compose checks them, so a broken one is
    refused with compose's words."""
    out: dict[str, ProvEntry] = {}
    for src in sources:
        for arg in _checked(schema, src, reserved or {}):
            if arg.key in keys:
                out[arg.key] = ProvEntry(src.layer, arg.shown, src.origin)
    return out


def compose(
    schema: FlagSchema,
    program: Sequence[str],
    sources: Sequence[Source],
    locks: Sequence[Locked] = (),
    reserved: Mapping[str, str] | None = None,
) -> Composed:
    """Apply ``sources`` in order (they must already be in layer order).

    ``reserved`` maps flag keys the placement owns to the reason a user may not set them.
    """
    state: dict[str, Arg] = {}
    last_layer: dict[str, str] = {}
    env: dict[str, str] = {}
    env_layer: dict[str, str] = {}
    prov: dict[str, list[ProvEntry]] = {}
    notices: list[Notice] = []
    locked_snapshot: dict[str, object] | None = None
    reserved = reserved or {}

    for src in sources:
        if src.layer not in LAYERS:
            raise ValueError(f"unknown layer {src.layer}")
        if locked_snapshot is None and LAYERS.index(src.layer) > LAYERS.index("hardware"):
            locked_snapshot = {lk.key: _locked_value(state, env, lk.key) for lk in locks}
        for arg in _checked(schema, src, reserved):
            if arg.legacy:
                notices.append(
                    Notice(
                        "normalized-flag",
                        f"{arg.written} is spelled {' '.join(arg.tokens())} in vLLM {schema.version} ({src.origin})",
                    )
                )
            old = state.get(arg.key)
            if old is not None:
                if _same(old, arg):
                    shown = arg.shown if arg.polarity is not None else f"{arg.key} {arg.shown}"
                    notices.append(Notice("unchanged", f"{shown} set again by {src.layer}: no change"))
                else:
                    notices.append(
                        Notice(
                            "overridden",
                            f"{arg.key}: {old.shown} ({last_layer[arg.key]}) overridden by {arg.shown} ({src.layer})",
                        )
                    )
                    del state[arg.key]  # re-insert: keep the order of the value that runs
            state[arg.key] = arg
            last_layer[arg.key] = src.layer
            prov.setdefault(arg.key, []).append(ProvEntry(src.layer, arg.shown, src.origin))
        for name, value in src.env:
            if name in env and env[name] != value:
                notices.append(
                    Notice("overridden", f"env {name}: {env[name]} ({env_layer[name]}) overridden by {value} ({src.layer})")
                )
            env[name] = value
            env_layer[name] = src.layer
            prov.setdefault(name, []).append(ProvEntry(src.layer, value, src.origin))
        if src.user and locked_snapshot is not None:
            for lk in locks:
                now = _locked_value(state, env, lk.key)
                if now != locked_snapshot[lk.key]:
                    raise K3Error(
                        "locked-by-hardware",
                        f"{lk.key} is fixed to {locked_snapshot[lk.key]!r} on this hardware: {lk.reason}",
                        "drop this --set; choose other hardware to get another backend",
                    )

    _fold_dotted(state, prov, notices)
    ranges.refuse(schema, state, prov)  # values vLLM's config classes refuse, blamed on their writers
    argv = list(program)
    for arg in state.values():
        argv.extend(arg.tokens())
    for name in env:
        if name.startswith("VLLM_") and name not in schema.env_vars:
            notices.append(
                Notice("env-unknown", f"env {name} is not read by vLLM {schema.version} (a model-specific image may read it)")
            )
    return Composed(argv=argv, env=env, provenance=prov, notices=notices, args=dict(state))


def _check_user_arg(arg: Arg, reserved: Mapping[str, str]) -> None:
    base = arg.spec.canonical
    if base in reserved:
        raise K3Error(
            "reserved-flag",
            f"{base} is set by k3launch's placement ({reserved[base]})",
            "change the layout with --nodes/--strategy/--prefill-*/--decode-* instead of --set",
        )


def _fold_dotted(state: dict[str, Arg], prov: dict[str, list[ProvEntry]], notices: list[Notice]) -> None:
    for key in [k for k, a in state.items() if a.path]:
        dotted = state[key]
        base = dotted.spec.canonical
        whole = state.get(base)
        if whole is None or dotted.value is None:
            continue
        try:
            doc = json.loads(whole.value or "")
        except json.JSONDecodeError:
            doc = None
        val = _json_value(dotted.value)
        if not isinstance(doc, dict):
            continue
        cur = doc
        parts = dotted.path.split(".")
        for part in parts[:-1]:
            nxt = cur.setdefault(part, {})
            if not isinstance(nxt, dict):
                break
            cur = nxt
        else:
            cur[parts[-1]] = val
            merged = json.dumps(doc, separators=(",", ":"))
            state[base] = Arg(whole.spec, whole.written, merged, None)
            del state[key]
            layer = prov[key][-1].layer if prov.get(key) else "strategy"
            prov.setdefault(base, []).append(ProvEntry(layer, merged, f"merged {key} into {base}"))
            notices.append(Notice("folded", f"{key} merged into {base} (vLLM would drop one of the two)"))
