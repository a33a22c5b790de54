"""How the engines load their weights, where the inventory chooses it: pure.

The inventory's ``weights`` section may set ``load_format`` (``--load-format``), ``load_strategy``
(``--safetensors-load-strategy``) and ``stage`` (a node-local directory ``up`` copies the model
into first). This module checks them against the plan's vLLM version, writes them into every
engine's sources with provenance, and holds them against what the recipe and the user wrote.

Decisions:

* **Checked against the plan's vLLM version.** Each flag must be in that version's ``vllm
  serve`` schema; the load format must be one its model-loader registry knows
  (``load-formats.json`` beside the vendored or dumped schema: the flag takes any string and
  vLLM refuses an unknown one only at start, "Load format `x` is not supported"); the strategy
  one of the flag's choices. Each refusal is one line with a hint (exit 2).
* **Which formats read the strategy.** Only vLLM's own safetensors iterator reads it: the formats
  ``auto``, ``hf``, ``safetensors`` and ``mistral`` of the default loader (vLLM 0.32's
  ``DefaultModelLoader._get_weights_iterator``). Every other format ignores it (fastsafetensors,
  instanttensor, runai_streamer, sharded_state, ...), and the default loader's multi-thread mode
  (``--model-loader-extra-config '{"enable_multithread_load": true}'``) refuses any strategy but
  ``lazy`` at start. So: a rejected strategy is refused in every plan, as vLLM would refuse it; an
  ignored one is refused when the inventory chose the strategy or the format (it asked for
  something that would not happen), and is a notice when the recipe and ``--set`` wrote both.
* **Precedence.** The inventory describes the machines, so how their storage is best read is
  its call: its choice beats the recipe's layers (base, variant, strategy, hardware; the plan's
  ``overridden`` notices say what it replaced). It is written in the advanced layer, after the
  recipe's advanced presets and before the user's ``--set``. Any later writer of another value
  (``--set``, a feature, the KV offload layer) or a hardware lock on the flag is a conflict no
  one chose between: refused, naming both writers, never resolved silently.
* **Staging** (``weights.stage``): the engines read the node-local directory as their Hugging
  Face home: containers mount it where they mount ``hf_cache`` (placement puts it in the plan's
  hosts as their ``hf_cache``), bare engines get ``HF_HUB_CACHE=<stage>/hub``, and the plan's
  ``stage`` tells ``up`` to copy the model's hub cache there from ``weights.path`` first
  (``weights fetch --from-path``'s copy, skipping nodes whose copy is complete). A hub model
  only: a model given as a directory is read where the recipe names it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch.errors import K3Error
from k3launch.models.plan import WeightStage
from k3launch.models.selection import Notice
from k3launch.planning.compose import LAYERS, Composed, Locked, Source
from k3launch.planning.schema import LOAD_FORMATS, FlagSchema, user_schema_dir, vendored_versions
from k3launch.util.records import record

if TYPE_CHECKING:
    from k3launch.planning.inventory import Inventory
    from k3launch.planning.placement import NodeSpec

FORMAT = "--load-format"
STRATEGY = "--safetensors-load-strategy"
EXTRA = "--model-loader-extra-config"
DEFAULT_FORMAT = "auto"  # vLLM's, when no layer sets --load-format
# The default loader's formats whose safetensors files go through safetensors_weights_iterator,
# the one reader of --safetensors-load-strategy.
READS_STRATEGY = frozenset({"auto", "hf", "safetensors", "mistral"})
DEFAULT_LOADER = "DefaultModelLoader"
HUB_ENV = "HF_HUB_CACHE"


@record
class KnownFormats:
    """The load formats one vLLM version's model-loader registry knows, and each one's loader class."""

    version: str
    loaders: Mapping[str, str]
    source: str  # where the list came from (a dump of an install, or carried over: the file says)

    def reads_strategy(self, fmt: str) -> bool:
        return fmt in READS_STRATEGY and self.loaders.get(fmt) == DEFAULT_LOADER


def _parse(version: str, text: str) -> KnownFormats | None:
    try:
        doc = json.loads(text)
        loaders = {str(k): str(v) for k, v in doc["load_formats"].items()}
        return KnownFormats(version, loaders, str(doc.get("source", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@cache
def _vendored(version: str) -> KnownFormats | None:
    f = resources.files("k3launch") / "data" / "vllm" / version / LOAD_FORMATS
    return _parse(version, f.read_text()) if f.is_file() else None


@cache
def _dumped(path: str, _mtime: int) -> KnownFormats | None:
    return _parse(Path(path).parent.name, Path(path).read_text())


def known_formats(version: str) -> KnownFormats | None:
    """The load formats of vLLM ``version``: a user's dump first (``k3launch schema dump`` writes
    them beside the flag schema), else the vendored list; None when neither has one."""
    dumped = user_schema_dir() / version / LOAD_FORMATS
    try:
        found = _dumped(str(dumped), dumped.stat().st_mtime_ns) if dumped.is_file() else None
    except OSError:
        found = None
    return found or (_vendored(version) if version in vendored_versions() else None)


# ---------------------------------------------------------------------- the inventory's choice
def _word(inv: Inventory, key: str) -> str:
    return f"inventory {inv.name} weights.{key}"


def check(inv: Inventory | None, schema: FlagSchema, model: str, locks: Sequence[Locked] = ()) -> tuple[WeightStage | None, list[Notice]]:
    """Refuse an inventory ``weights`` choice the plan's vLLM version (``schema``) lacks, or a
    stage of a model given as a directory; the plan's stage and notices otherwise. The choice's
    values are held against the composed commands by :func:`verify`."""
    w = inv.weights if inv is not None else None
    if inv is None or w is None:
        return None, []
    v = schema.version
    for key, flag, value in (("load_format", FORMAT, w.load_format), ("load_strategy", STRATEGY, w.load_strategy)):
        if value is None:
            continue
        found = schema.lookup(flag)
        if found is None:
            raise K3Error("weights-unsupported", f"{_word(inv, key)} {value}: vLLM {v}'s `vllm serve` has no {flag}",
                          f"drop weights.{key}, or plan for a vLLM that has it (--vllm-version, or the inventory's vllm_version)")
        lock = next((lk for lk in locks if lk.key == flag), None)
        if lock is not None:
            raise K3Error("locked-by-hardware", f"{_word(inv, key)} {value}: {flag} is fixed on this hardware: {lock.reason}",
                          f"drop weights.{key} (or use the inventory on other hardware)")
        allowed = [c for c in found[0].choices or () if c != "None"]
        if allowed and value not in allowed:
            raise K3Error("load-strategy-unknown", f"{_word(inv, key)} {value!r} is not a choice of vLLM {v}'s {flag}",
                          "choose one of: " + ", ".join(allowed))
    if w.load_format is not None:
        formats = known_formats(v)
        if formats is None:
            raise K3Error("weights-unsupported", f"{_word(inv, 'load_format')} {w.load_format}: k3launch has no list of vLLM {v}'s load formats to check it against",
                          "dump the version's schema again with this k3launch (`k3launch schema dump --python <the engine's python>`), or drop weights.load_format")
        if w.load_format not in formats.loaders:
            raise K3Error("load-format-unknown", f"{_word(inv, 'load_format')} {w.load_format!r} is not a load format of vLLM {v}",
                          "choose one of: " + ", ".join(sorted(formats.loaders)) + " (a plugin's own format: --set load-format=NAME, without weights.load_format)")
        if w.load_strategy is not None and not formats.reads_strategy(w.load_format):
            raise K3Error("load-strategy-ignored", f"{_word(inv, 'load_strategy')} {w.load_strategy}: --load-format {w.load_format} does not read it",
                          f"drop weights.load_strategy, or choose a load format that reads it: {', '.join(sorted(READS_STRATEGY))}")
    if w.stage is None:
        return None, []
    if model.startswith(("/", "~", ".")):
        raise K3Error("weights-stage", f"{_word(inv, 'stage')}: the model is the directory {model}, not a hub model whose cache can be staged",
                      "drop weights.stage and put the directory on node-local disk yourself (the recipe names it)")
    assert w.path is not None  # the inventory model requires it with stage
    note = Notice("weights-staged", f"up copies {model} from {w.path} to {w.stage} on each engine node whose copy is not complete "
                  f"({_word(inv, 'stage')}); the engines read it there")
    return WeightStage(source=w.path, dir=w.stage), [note]


def sources(inv: Inventory | None, node: NodeSpec) -> list[Source]:
    """The inventory's choice as sources of the advanced layer, one per key (each its provenance)."""
    w = inv.weights if inv is not None else None
    if inv is None or w is None:
        return []
    out = [Source("advanced", _word(inv, key), (flag, value))
           for key, flag, value in (("load_format", FORMAT, w.load_format), ("load_strategy", STRATEGY, w.load_strategy)) if value]
    if w.stage is not None and node.runtime == "bare":  # containers mount it as their HF home (placement's hf_cache)
        out.append(Source("advanced", _word(inv, "stage"), (), ((HUB_ENV, f"{w.stage}/hub"),)))
    return out


# ---------------------------------------------------------------------- the composed command
def _multithread(c: Composed) -> bool:
    """Whether the default loader's multi-thread mode is on (``enable_multithread_load``)."""
    dotted = c.value(f"{EXTRA}.enable_multithread_load")
    if dotted is not None:
        return dotted.strip().lower() == "true"
    try:
        doc = json.loads(c.value(EXTRA) or "{}")
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("enable_multithread_load") is True


def _before_advanced(c: Composed, key: str) -> str | None:
    """The value ``key`` had when the hardware layer ended (what a lock fixes)."""
    entries = [e for e in c.provenance.get(key, []) if LAYERS.index(e.layer) <= LAYERS.index("hardware")]
    return entries[-1].value if entries else None


def verify(inv: Inventory | None, c: Composed, locks: Sequence[Locked] = (), formats: KnownFormats | None = None) -> list[Notice]:
    """Hold one composed engine command against the inventory's choice: refuse a later writer of
    another value, an environment that says elsewhere where the hub cache is, and a strategy the
    load format ignores (inventory's choice) or rejects (any plan); notices for what is merely ignored."""
    w = inv.weights if inv is not None else None
    chosen = {FORMAT: w.load_format, STRATEGY: w.load_strategy} if w is not None else {}
    for flag, want in chosen.items():
        last = c.provenance.get(flag, [])[-1:] if want else []
        if last and last[0].value != want:
            key = "load_format" if flag == FORMAT else "load_strategy"
            assert inv is not None
            raise K3Error("weights-conflict", f"{_word(inv, key)} {want} and {flag} {last[0].value} ({last[0].origin}, {last[0].layer} layer) both set it",
                          f"keep one: drop weights.{key} from the inventory, or the other writer")
    if inv is not None and w is not None and w.stage is not None:
        other = next((e for e in c.provenance.get(HUB_ENV, []) if e.origin != _word(inv, "stage")), None)
        if other is not None:
            raise K3Error("weights-conflict", f"{_word(inv, 'stage')} and env {HUB_ENV}={other.value} ({other.origin}) both say where the engines' hub cache is",
                          f"keep one: drop {HUB_ENV} from the env, or weights.stage")
    fmt = (c.value(FORMAT) or DEFAULT_FORMAT).lower()
    strategy = c.value(STRATEGY)
    if strategy in (None, "None"):
        return []
    if _multithread(c) and strategy != "lazy":
        raise K3Error("load-strategy-refused", f"{STRATEGY} {strategy} with {EXTRA} enable_multithread_load: vLLM refuses it at start "
                      "(the multi-thread loader only implements lazy)", f"drop {STRATEGY}, or the multi-thread load")
    reads = formats.reads_strategy(fmt) if formats is not None else fmt in READS_STRATEGY
    if reads:
        return []
    if inv is not None and w is not None and (w.load_strategy or w.load_format):
        fmt_by = c.provenance[FORMAT][-1].origin if FORMAT in c.provenance else "vLLM's default"
        raise K3Error("load-strategy-ignored", f"{STRATEGY} {strategy} ({c.provenance[STRATEGY][-1].origin}): --load-format {fmt} ({fmt_by}) does not read it",
                      f"set weights.load_format to one that reads it ({', '.join(sorted(READS_STRATEGY))}), or drop the strategy")
    return [Notice("load-strategy-ignored", f"{STRATEGY} {strategy} is ignored by --load-format {fmt}: only {', '.join(sorted(READS_STRATEGY))} read it")]
