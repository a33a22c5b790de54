"""Keys of an upstream recipes tree that k3launch's models do not know: kept, reported, never errors.

The vLLM recipes project grows keys faster than k3launch follows them (display labels, install
notes, platform cards, ...). A tree without ``strict_keys: true`` in its taxonomy (an upstream
checkout) therefore loads with every unknown key dropped from the validated model and kept here,
value and all, with its file and line; each becomes an ``ignored-key`` notice of the plans that
use the file (:func:`notices`). Every key that changes a command upstream is modelled, so what
lands here does not change the ``vllm serve`` command the upstream generator would write. k3launch's
own trees set ``strict_keys: true``: there an unknown key is a typo, refused with file and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from k3launch.errors import K3Error, plain
from k3launch.util.records import record
from k3launch.util.yamlio import compose_file, line_of, load_yaml_model

if TYPE_CHECKING:
    import yaml

M = TypeVar("M", bound=BaseModel)

_MAX_PASSES = 8  # a pass drops every unknown key pydantic reported; a union's members may need another


@record
class IgnoredKey:
    """A key k3launch does not act on, as found in one file."""

    file: str  # relative to the tree root, e.g. "models/Qwen/Qwen3.8-27B.yaml"
    line: int | None
    path: str  # dotted, e.g. "variants.fp8.min_vllm_version"
    value: Any  # kept as loaded
    why: str = "is kept but not acted on by k3launch (it does not change the command)"

    def notice(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{where}: {self.path} {self.why}"


def ignored_entry(path: Path, rel: str, parts: list[str | int], value: Any, why: str) -> IgnoredKey:
    """An :class:`IgnoredKey` for a key found valid in shape but naming nothing k3launch can use."""
    return IgnoredKey(rel, line_of(compose_file(path), parts), ".".join(str(p) for p in parts), value, why)


class _Raw(BaseModel):
    """Any mapping: used to read a file through :func:`~k3launch.util.yamlio.load_yaml_model`'s
    checks (encoding, YAML, repeated keys, a mapping at the top) without its schema."""

    model_config = ConfigDict(extra="allow")


def _walk(data: Any, loc: tuple[int | str, ...]) -> tuple[list[str | int], Any, str | int] | None:
    """The real path of a pydantic error location in ``data``: (parents, parent object, key).

    Union members appear in locations as extra parts (``InstallNote``, ``str``): a part that is not
    a key of the mapping at hand is such a tag and is skipped."""
    cur, real = data, []
    for part in loc[:-1]:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
            real.append(part)
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            cur = cur[part]
            real.append(part)
    last = loc[-1] if loc else None
    if isinstance(cur, dict) and last in cur:
        return real, cur, last  # type: ignore[return-value]
    return None


def _drop_unknown(model: type[M], data: dict[str, Any], exc: ValidationError, path: Path, rel: str, out: list[IgnoredKey]) -> M:
    """``data`` as ``model`` without the keys it forbids; each dropped key is appended to ``out``."""
    root: yaml.Node | None = None
    for _ in range(_MAX_PASSES):
        dropped = 0
        for loc in [tuple(e["loc"]) for e in exc.errors() if e["type"] == "extra_forbidden"]:
            found = _walk(data, loc)
            if found is None:
                continue
            parents, parent, key = found
            if root is None:
                root = compose_file(path)
            full = [*parents, key]
            out.append(IgnoredKey(rel, line_of(root, full), ".".join(str(p) for p in full), parent.pop(key)))
            dropped += 1
        if not dropped:
            break
        try:
            return model.model_validate(data)
        except ValidationError as again:
            exc = again
    raise _error(path, exc)


def load_lenient(path: Path, model: type[M], rel: str, out: list[IgnoredKey]) -> M:
    """Load ``path`` as ``model``, keeping unknown keys in ``out`` instead of refusing them."""
    data = dict(load_yaml_model(path, _Raw).model_extra or {})
    try:
        return model.model_validate(data)  # the common case: nothing unknown, one validation
    except ValidationError as exc:
        return _drop_unknown(model, data, exc, path, rel, out)


def _error(path: Path, exc: ValidationError) -> K3Error:
    """The one-line refusal :func:`~k3launch.util.yamlio.load_yaml_model` gives, for data left
    after unknown keys were dropped."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    line = line_of(compose_file(path), list(loc)) or 1
    more = len(exc.errors()) - 1
    msg = f"{path}:{line}: {'.'.join(str(p) for p in loc)}: {plain(err['msg'])}" + (f" (and {more} more)" if more else "")
    return K3Error("bad-recipe", msg, 'see docs/planning.md ("Recipe format") for the expected shape')


def unknown_key_error(path: Path, key: IgnoredKey, total: int) -> K3Error:
    """A strict tree's refusal of an unknown key, worded as the loader words it."""
    more = f" (and {total - 1} more)" if total > 1 else ""
    return K3Error("bad-recipe", f"{path}:{key.line}: unknown key {key.path!r}{more}",
                   "remove it or fix its spelling (unknown keys are errors, never ignored)")
