"""vLLM's ``vllm serve`` flag schema, vendored per vLLM version, and the argv tokenizer built on it.

The schema files under ``k3launch/data/vllm/<version>/`` are dumps of vLLM's own argparse
actions (options, dest, action class, nargs, type, choices) and of the environment variable
names ``vllm/envs.py`` reads. Everything that parses, checks or re-emits a ``vllm serve`` argv
goes through :class:`FlagSchema`, so k3launch never guesses which flags take values.

Key decisions:

* A flag's identity is its argparse ``dest``. Every spelling of one dest (``-tp`` and
  ``--tensor-parallel-size``; ``--enable-prefix-caching`` and ``--disable-prefix-caching``) is
  one *key*, so last-writer-wins composition can never leave two spellings of one setting.
* Boolean pairs: vLLM 0.33 spells the negative of ``--enable-x`` as ``--disable-x`` (and of
  ``--x`` as ``--no-x``); vLLM 0.32 and older spell every negative ``--no-x`` (``--no-enable-x``,
  ``--no-disable-x``). A spelling the selected schema does not list but one of these rules maps
  onto a boolean it does list -- ``--no-enable-x`` for 0.33, ``--disable-x`` / ``--enable-x`` for
  0.32 -- is the same key with inverted polarity (``legacy``: not this version's spelling) and is
  re-emitted in the form the selected schema knows, whichever direction that is.
* Dotted config flags (``-cc.pass_config.fuse_allreduce_rms=False``) are vLLM's way to set one
  field of a JSON config flag; their key is ``<canonical>.<path>``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from k3launch.defaults import DEFAULT_VLLM_VERSION
from k3launch.errors import K3Error

Kind = Literal["value", "bool", "store_true", "multi", "optional", "other"]

# Types of the flags that take JSON (vLLM's arg_utils), so dotted sub-keys too: vLLM folds ``--x.a.b v``
# into ``--x '{"a": {"b": v}}'`` for the flag's type. ``_optional_type`` hides its inner type: _JSON_OPTIONAL
# names the dests where it is JSON or a config dataclass (vLLM 0.32's parser, 0.33's arg_utils).
_DICT_TYPES = frozenset({"parse_dataclass", "loads", "union_dict_and_str", "_parse_type"})
_JSON_TYPES = frozenset({"loads", "parse_dataclass"})  # JSON values checked here; the others' in planning.configs
_JSON_OPTIONAL = frozenset({"quantization_config", "pooler_config", "mm_processor_kwargs", "default_mm_loras", "custom_histogram_buckets",
                            "speculative_config", "watermark_config", "diffusion_config", "kv_transfer_config", "kv_events_config",
                            "ec_transfer_config", "engram_config", "reasoning_config", "weight_transfer_config"})


@dataclass(frozen=True)
class FlagSpec:
    """One argparse action of ``vllm serve``."""

    dest: str
    options: tuple[str, ...]
    kind: Kind
    type: str | None
    choices: tuple[str, ...] | None

    canonical: str = ""  # the long option used as key and emitted spelling; derived below
    default: str = "null"  # as dumped: JSON, or the repr of a Python value (a config dataclass's lists its fields)

    def __post_init__(self) -> None:
        own = "--" + self.dest.replace("_", "-")
        longs = [o for o in self.options if o.startswith("--")]
        # frozen dataclass: computed once here, read on every flag of every process
        object.__setattr__(self, "canonical", own if own in self.options else (longs[0] if longs else self.options[0]))

    def bool_form(self, value: bool) -> str:
        """The spelling of a boolean flag that sets it to ``value`` in this schema."""
        if self.kind == "store_true":
            if not value:
                raise K3Error("flag-no-negative", f"{self.canonical} has no negative form in vLLM's schema",
                              "drop the flag instead of negating it")
            return self.canonical
        for opt in self.options:
            if opt.startswith("--") and _polarity(self, opt) is value:
                return opt
        raise K3Error("flag-no-form", f"{self.canonical} cannot be set to {value}", "")

    @property
    def takes_dict(self) -> bool:
        return self.type in _DICT_TYPES or (self.type == "_optional_type" and self.dest in _JSON_OPTIONAL)


def _polarity(spec: FlagSpec, option: str) -> bool:
    """Which boolean value a spelling of a boolean flag sets.

    vLLM names the dest after the positive spelling (``enable_prefix_caching``,
    ``disable_custom_all_reduce``, ``trust_remote_code``); short aliases (``-ep``, ``-dph``)
    alias the positive spelling. Every other long spelling is the negative.
    """
    if not option.startswith("--"):
        return True
    return option == "--" + spec.dest.replace("_", "-") or (
        spec.kind == "store_true"
    )


@dataclass(frozen=True)
class Arg:
    """One parsed flag occurrence of a ``vllm serve`` argv."""

    spec: FlagSpec
    written: str  # the option as written (before normalisation)
    value: str | None  # None for booleans
    polarity: bool | None  # booleans only
    path: str = ""  # dotted sub-key of a JSON config flag, e.g. "pass_config.fuse_allreduce_rms"
    legacy: bool = False  # a spelling the schema does not list (``--no-enable-x``)

    @property
    def key(self) -> str:
        return f"{self.spec.canonical}.{self.path}" if self.path else self.spec.canonical

    def tokens(self) -> list[str]:
        """This flag as the selected schema spells it."""
        if self.spec.kind in ("bool", "store_true"):
            assert self.polarity is not None
            return [self.spec.bool_form(self.polarity)]
        assert self.value is not None
        if self.path:
            return [f"{self.spec.canonical}.{self.path}={self.value}"]
        return [self.spec.canonical, self.value]

    @property
    def shown(self) -> str:
        """A short human form: the value, or the spelling for booleans."""
        if self.spec.kind in ("bool", "store_true"):
            return " ".join(self.tokens())
        return self.value or ""


@dataclass(frozen=True)
class Problem:
    """A schema finding on an argv: ``code`` is stable, ``message`` is one line."""

    code: str
    message: str
    hint: str = ""
    option: str = ""  # the option (or stray word) the problem is about
    value: str | None = None  # the offending value, when there is one


class FlagSchema:
    """The flags of ``vllm serve`` for one vLLM version."""

    def __init__(self, version: str, specs: list[FlagSpec], env_vars: frozenset[str]) -> None:
        self.version = version
        self.specs = specs
        self.env_vars = env_vars
        self._by_option: dict[str, FlagSpec] = {}
        for spec in specs:
            for opt in spec.options:
                self._by_option[opt] = spec

    # -- lookup -------------------------------------------------------------------------
    def lookup(self, option: str) -> tuple[FlagSpec, bool | None, bool] | None:
        """Resolve a spelling to ``(spec, polarity, legacy)``; ``None`` if unknown."""
        option = _normalise(option)
        spec = self._by_option.get(option)
        if spec is not None:
            pol = _polarity(spec, option) if spec.kind in ("bool", "store_true") else None
            return spec, pol, False
        found = self._other_spelling(option)
        return (found[0], found[1], True) if found is not None else None

    def _other_spelling(self, option: str) -> tuple[FlagSpec, bool] | None:
        """A boolean spelling of another vLLM version: ``(spec, polarity)`` in this schema.

        ``--no-Y`` negates ``--Y`` (0.32's negative, written for 0.33); ``--disable-x`` negates
        ``--enable-x`` and the other way round (0.33's negatives, written for 0.32). ``Y`` itself
        may be such a spelling (``--no-disable-x`` where only ``--enable-x`` is listed).
        """
        if option.startswith("--no-"):
            inner = "--" + option[5:]
            spec = self._by_option.get(inner)
            if spec is not None:
                return (spec, not _polarity(spec, inner)) if spec.kind == "bool" else None
            found = self._other_spelling(inner)
            return (found[0], not found[1]) if found is not None else None
        for this, other in (("--disable-", "--enable-"), ("--enable-", "--disable-")):
            if option.startswith(this):
                twin = other + option[len(this):]
                spec = self._by_option.get(twin)
                if spec is not None and spec.kind == "bool":
                    return spec, not _polarity(spec, twin)
        return None

    def suggest(self, option: str) -> str:
        import difflib

        names = [o for o in self._by_option if o.startswith("--")]
        close = difflib.get_close_matches(_normalise(option), names, n=1, cutoff=0.75)
        return f"did you mean {close[0]}?" if close else "see `vllm serve --help=all`"

    # -- parsing ------------------------------------------------------------------------
    def parse(self, tokens: list[str]) -> tuple[list[Arg], list[Problem]]:
        """Tokenize flags (no program, no positional model) into :class:`Arg` items.

        Never raises for bad input: problems are returned so ``lint`` can report them all.
        """
        args: list[Arg] = []
        problems: list[Problem] = []
        i = 0
        while i < len(tokens):
            tok = tokens[i]
            i += 1
            if not tok.startswith("-") or tok == "-":
                problems.append(Problem("stray-value", f"unexpected value {tok!r}", "quote it or drop it", option=tok))
                continue
            name, eq, inline = tok.partition("=")
            base, dot, path = name.partition(".")
            if dot and not base.startswith("--") and not base.startswith("-"):
                base, path = name, ""
            found = self.lookup(base)
            if found is None:
                problems.append(Problem("unknown-flag", f"{base} is not a flag of vllm serve {self.version}", self.suggest(base), option=base))
                # Skip a following value so one typo is one problem.
                if not eq and i < len(tokens) and not tokens[i].startswith("-"):
                    i += 1
                continue
            spec, pol, legacy = found
            if path:
                if not spec.takes_dict:
                    problems.append(Problem("bad-dotted", f"{base} takes no dotted sub-keys ({name})", f"pass {spec.canonical} VALUE", option=base))
                    i += 0 if eq else 1  # vLLM takes the next word as this key's value: one typo, one problem
                    continue
                # Without '=', vLLM takes the next word as the value whatever it looks like.
                value = inline if eq else (tokens[i] if i < len(tokens) else None)
                if not eq:
                    i += 1
                if value is None:
                    problems.append(Problem("missing-value", f"{name} needs a value", "", option=name))
                    continue
                args.append(Arg(spec, base, value, None, path, legacy))
                continue
            if spec.kind in ("bool", "store_true"):
                if eq:
                    problems.append(Problem("bad-value", f"{base} takes no value (got {inline!r})", f"write {base} alone", option=base, value=inline))
                    continue
                args.append(Arg(spec, base, None, pol, "", legacy))
                continue
            if spec.kind == "multi":
                vals: list[str] = [inline] if eq else []
                while not eq and i < len(tokens) and not tokens[i].startswith("--"):
                    vals.append(tokens[i])
                    i += 1
                if not vals:
                    problems.append(Problem("missing-value", f"{base} needs at least one value", "", option=base))
                    continue
                args.append(Arg(spec, base, " ".join(vals), None, "", legacy))
                continue
            if eq:
                value = inline
            elif i < len(tokens) and (not tokens[i].startswith("-") or _numeric(tokens[i])):
                value = tokens[i]
                i += 1
            elif spec.kind == "optional":
                value = ""
            else:
                problems.append(Problem("missing-value", f"{base} needs a value", f"write {base} VALUE", option=base))
                continue
            err = self.check_value(spec, value)
            if err:
                problems.append(err)
                continue
            args.append(Arg(spec, base, value, None, "", legacy))
        return args, problems

    def check_value(self, spec: FlagSpec, value: str) -> Problem | None:
        """Check ``value`` against the flag's choices and (where knowable) its type."""
        opt = spec.canonical
        if spec.choices is not None and value not in spec.choices:
            return Problem("bad-choice", f"{opt} {value!r} is not one of vLLM {self.version}'s choices",
                           "choose one of: " + ", ".join(spec.choices), option=opt, value=value)
        try:
            if spec.type == "int":
                int(value)
            elif spec.type == "float":
                float(value)
            elif spec.type == "human_readable_int_or_auto":
                if value.strip().lower() not in ("auto", "-1"):
                    _human_int(value)
            elif spec.type == "human_readable_int":
                _human_int(value)
            elif spec.type in _JSON_TYPES and value.lstrip().startswith(("{", "[")):
                json.loads(value)
        except (ValueError, json.JSONDecodeError) as exc:
            kind = "JSON" if spec.type in _JSON_TYPES else (spec.type or "value")
            return Problem("bad-value", f"{opt} {value!r} is not a valid {kind}: {exc}", "", option=opt, value=value)
        return None


def _numeric(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


def _human_int(value: str) -> int:
    v = value.strip()
    if v and v[-1] in "kKmMgGtT":
        return int(float(v[:-1]))
    return int(v)


def _normalise(option: str) -> str:
    """vLLM accepts underscores in long option names (``--max_model_len``)."""
    if option.startswith("--"):
        return "--" + option[2:].replace("_", "-")
    return option


def _kind(action: str | None, nargs: object) -> Kind:
    if action == "EnableDisableAction" or action == "BooleanOptionalAction":
        return "bool"
    if action in ("_StoreTrueAction", "_StoreFalseAction"):
        return "store_true"
    if nargs in ("+", "*") or action in ("_AppendAction", "LoRAParserAction"):
        return "multi" if nargs in ("+", "*") else "value"
    if nargs == "?":
        return "optional"
    if action in ("_HelpAction",):
        return "other"
    return "value"


SERVE_FLAGS = "serve-flags.json"
ENV_VARS = "env-vars.json"
LOAD_FORMATS = "load-formats.json"  # optional beside them: the version's --load-format values (planning.loading)
SCHEMA_DIR_ENV = "K3LAUNCH_SCHEMA_DIR"
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")


def user_schema_dir() -> Path:
    """Schemas users added (``k3launch schema dump``): ``$K3LAUNCH_SCHEMA_DIR``, else ``schemas/`` of
    the state directory (``$K3LAUNCH_STATE_DIR``, else ``~/.k3launch``, as ``k3launch.deploy.state``
    has it: this module stays standard library only, the simulated engine's image carries it)."""
    env = os.environ.get(SCHEMA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("K3LAUNCH_STATE_DIR") or "~/.k3launch").expanduser() / "schemas"


def _user_version_dir(version: str) -> Path | None:
    vdir = user_schema_dir() / version
    return vdir if (vdir / SERVE_FLAGS).is_file() and (vdir / ENV_VARS).is_file() else None


def load_schema(version: str = DEFAULT_VLLM_VERSION) -> FlagSchema:
    """The flag schema of one vLLM version (``--vllm-version``): a user's dump first
    (:func:`user_schema_dir`), else the one vendored under ``k3launch/data/vllm/``."""
    if _VERSION.fullmatch(version):
        user = _user_version_dir(version)
        if user is not None:
            serve, envs = user / SERVE_FLAGS, user / ENV_VARS
            return _load_user(str(user), serve.stat().st_mtime_ns, envs.stat().st_mtime_ns)
        if version in vendored_versions():
            return _load_vendored(version)
    dumped = dumped_versions()
    raise K3Error("unknown-vllm-version", f"no vLLM flag schema for version {version}",
                  "vendored versions: " + ", ".join(vendored_versions()) + (f"; dumped: {', '.join(dumped)}" if dumped else "")
                  + f"; add one with `k3launch schema dump --python <the engine's python>` (writes to {user_schema_dir()})")


@cache
def _load_vendored(version: str) -> FlagSchema:
    root = resources.files("k3launch") / "data" / "vllm" / version
    return _build(version, (root / SERVE_FLAGS).read_text(), (root / ENV_VARS).read_text())


@cache
def _load_user(vdir: str, _serve_mtime: int, _env_mtime: int) -> FlagSchema:
    """Cached per directory and file times: a new dump of the same version is read again."""
    path = Path(vdir)
    try:
        return _build(path.name, (path / SERVE_FLAGS).read_text(), (path / ENV_VARS).read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise K3Error("bad-schema-dump", f"{path}: not a readable flag schema ({type(exc).__name__}: {exc})",
                      "dump it again with `k3launch schema dump --python <the engine's python>`") from None


def spec_of(act: dict[str, Any]) -> FlagSpec:
    """One action of ``serve-flags.json`` (``load_schema`` and ``schema_dump.check_dumped`` read them alike)."""
    choices = act.get("choices")
    default = act.get("default")  # a string is a repr (or a string default): either way what configs reads
    return FlagSpec(dest=act["dest"], options=tuple(act["options"]), kind=_kind(act.get("action"), act.get("nargs")),
                    type=act.get("type"), choices=tuple(str(c) for c in choices) if choices else None,
                    default=default if isinstance(default, str) else json.dumps(default))


def _build(version: str, serve_flags: str, env_vars: str) -> FlagSchema:
    actions = json.loads(serve_flags)["actions"]
    specs = [spec_of(act) for act in actions if "options" in act and act.get("action") != "_HelpAction"]
    return FlagSchema(version, specs, frozenset(json.loads(env_vars)["env_vars"]))


def vendored_versions() -> list[str]:
    return list(_vendored())


@cache
def _vendored() -> tuple[str, ...]:
    root = resources.files("k3launch") / "data" / "vllm"
    return tuple(sorted(p.name for p in root.iterdir() if p.is_dir()))


def dumped_versions() -> list[str]:
    """Versions in :func:`user_schema_dir` (each a directory with both files)."""
    root = user_schema_dir()
    try:
        return sorted(p.name for p in root.iterdir() if _VERSION.fullmatch(p.name) and _user_version_dir(p.name) is not None)
    except OSError:
        return []


def available_versions() -> list[str]:
    """Every version :func:`load_schema` can load."""
    return sorted({*vendored_versions(), *dumped_versions()})
