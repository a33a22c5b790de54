"""The one YAML loader of k3launch: recipes, inventories and campaign files all go through
:func:`load_yaml_model`, so each is refused the same way (file and line) when it is not UTF-8,
not YAML, nested too deep, repeats a key, or breaks its schema.

It is generic over the pydantic model a file is read into: the models themselves live in the
layers above.

**The parse cache.** What a file parsed to is kept, marshalled, under ``$K3LAUNCH_CACHE_DIR``
(default ``$XDG_CACHE_HOME/k3launch``, else ``~/.cache/k3launch``; ``off`` disables it), in
``yaml/<sha256 of the file's bytes and the interpreter's version>``. Keyed by the content, an
entry can never be stale: an edited file is another key. Only a file that parsed cleanly and
that its model accepted is kept (every refusal is made anew, every time: a file refused for a
secret in an env is never copied), and validation against the model runs on every load.
Entries are the user's own (``0600`` in a ``0700`` directory). A hit skips importing PyYAML and parsing: the recipe tree's three or four
files are most of what ``k3launch plan`` reads, and PyYAML's import alone is ~10 ms of its
start-up. The cache is best effort: an unwritable directory or a damaged entry is a miss. Like
Python's own ``__pycache__``, it trusts the user's own cache directory (marshal is not meant for
data someone else wrote).
"""

from __future__ import annotations

import marshal
import os
import sys
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from k3launch.errors import K3Error, plain
from k3launch.util.digest import sha256

if TYPE_CHECKING:
    import yaml

M = TypeVar("M", bound=BaseModel)

_MERGE = "tag:yaml.org,2002:merge"
# libyaml builds nodes recursively in C: a document nested ~100,000 deep overflows the stack and
# kills the process. No k3launch file is nested more than a few levels, so deeper ones are refused
# before they are built; only files large enough to be that deep are scanned (~1 ms per 20 kB).
_MAX_DEPTH = 100
_SCAN_ABOVE_CHARS = 16_384
# The libyaml bundled with PyYAML 6.0.4 and later refuses nesting past its own limit (1000) while
# it scans, looking ahead of the events the depth count reads: its refusal is worded as k3launch's.
_PYYAML_NESTING = "exceeded maximum nesting depth"


def _loader() -> type[yaml.SafeLoader]:
    """libyaml's loader (~10x faster than the pure-Python one; the same safe subset of YAML)."""
    import yaml

    loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return loader


def _nesting_line(exc: yaml.YAMLError) -> int | None:
    """The line where PyYAML refused ``exc`` for its own nesting limit, else None."""
    if _PYYAML_NESTING not in (getattr(exc, "problem", None) or ""):
        return None
    mark = getattr(exc, "problem_mark", None)
    return mark.line + 1 if mark is not None else 1


def _too_deep(text: str) -> int | None:
    """The line where ``text`` nests past ``_MAX_DEPTH`` collections, else None (malformed YAML is
    left to the loader, which says where)."""
    if len(text) <= _SCAN_ABOVE_CHARS:
        return None
    import yaml

    depth = 0
    try:
        for ev in yaml.parse(text, Loader=_loader()):
            if isinstance(ev, yaml.CollectionStartEvent):
                depth += 1
                if depth > _MAX_DEPTH:
                    return ev.start_mark.line + 1 if ev.start_mark is not None else 1
            elif isinstance(ev, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as exc:
        return _nesting_line(exc)
    return None


def _deep_error(path: Path, line: int) -> K3Error:
    return K3Error("bad-yaml", f"{path}:{line}: nested more than {_MAX_DEPTH} levels deep", "is it the file you meant?")


class _DuplicateKey(Exception):
    def __init__(self, key: object, line: int, first: int) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line, self.first = key, line, first


@cache
def _unique_keys_loader() -> type[yaml.SafeLoader]:
    """The loader refusing duplicate keys: a class over PyYAML's, built the first time a file is
    parsed, so a command whose files all come from the cache never imports PyYAML."""

    class UniqueKeysLoader(_loader()):  # type: ignore[misc]  # libyaml's loader when there is one
        """YAML says a mapping's keys are unique; PyYAML silently keeps the last of two. A repeated key
        in a recipe, an inventory or a campaign file is a mistake (two `nodes:` lists, a setting given
        twice with different values), so it is refused with both lines."""

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self._checked: set[int] = set()

        def flatten_mapping(self, node: yaml.MappingNode) -> None:
            # Every mapping passes here before it is built (merged ones too) with its keys as written;
            # the merge (`<<: *base`) then adds keys, which the node's own keys may override.
            if id(node) not in self._checked:
                self._checked.add(id(node))
                seen: dict[object, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == _MERGE:
                        continue
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        if key in seen:
                            raise _DuplicateKey(key, line, seen[key])
                        seen[key] = line
                    except TypeError:  # an unhashable key: PyYAML refuses it with its own message
                        continue
            super().flatten_mapping(node)

    return UniqueKeysLoader


# marshal's format follows the interpreter; the loader's rules are part of what a parse means
_CACHE_KEY = f"k3launch-yamlio-1 {sys.implementation.name} {sys.version_info[0]}.{sys.version_info[1]}".encode()


def _cache_dir() -> Path | None:
    env = os.environ.get("K3LAUNCH_CACHE_DIR")
    if env == "off":
        return None
    if env:
        return Path(env).expanduser() / "yaml"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "k3launch" / "yaml"


def _entry(raw: bytes) -> Path | None:
    d = _cache_dir()
    return None if d is None else d / sha256(_CACHE_KEY + raw).hexdigest()


def _cached(entry: Path | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    try:
        data = marshal.loads(entry.read_bytes())
    except (OSError, EOFError, ValueError, TypeError):
        return None  # no entry, or a damaged one: parse
    return data if isinstance(data, dict) else None


def _keep(entry: Path | None, data: dict[str, Any]) -> None:
    if entry is None:
        return
    try:
        blob = marshal.dumps(data)
    except ValueError:
        return  # a value marshal cannot hold (a YAML timestamp): not cached
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}")
    try:
        entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the user's own, like the files it copies
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, entry)  # readers see the whole entry or none
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def compose_file(path: Path) -> yaml.Node | None:
    """The node tree of a file :func:`load_yaml_model` has read (for the line of a key)."""
    import yaml

    return yaml.compose(path.read_text(encoding="utf-8"), Loader=_loader())


def line_of(node: yaml.Node | None, loc: tuple[int | str, ...] | list[str | int]) -> int | None:
    """Best line (1-based) for a pydantic error location inside a composed YAML node."""
    import yaml

    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == str(part):
                    nxt = v
                    line = k.start_mark.line + 1
                    break
            if nxt is None:
                return line
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def load_yaml_model(path: Path, model: type[M], doc: str = 'docs/planning.md ("Recipe format")', code: str = "bad-recipe") -> M:
    """Parse ``path`` into ``model``; every failure is a one-line :class:`K3Error` (``code`` for
    a schema error, whose hint points at ``doc``)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise K3Error("missing-file", f"{path}: no such file", "check the path") from None
    except IsADirectoryError:
        raise K3Error("unreadable-file", f"{path}: is a directory", "pass the YAML file itself") from None
    except OSError as exc:
        raise K3Error("unreadable-file", f"{path}: {exc.strerror}", "check permissions") from None
    entry = _entry(raw)
    data = _cached(entry)
    hit = data is not None
    if data is None:
        data = _parse(path, raw, code)
    try:
        loaded = model.model_validate(data)
    except ValidationError as exc:
        raise _schema_error(path, raw.decode("utf-8"), exc, doc, code) from None
    if not hit:
        _keep(entry, data)  # only what a model accepted: a refused file (a secret in an env, say) is never copied
    return loaded


def _parse(path: Path, raw: bytes, code: str) -> dict[str, Any]:
    """What ``raw`` (the bytes of ``path``) parses to: a mapping, or a one-line refusal."""
    import yaml

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = exc.object[: exc.start].count(b"\n") + 1
        raise K3Error(
            "bad-encoding",
            f"{path}:{at}: not UTF-8 text (byte {exc.object[exc.start]:#04x})",
            "is it the file you meant? YAML files are UTF-8 text",
        ) from None
    deep = _too_deep(text)
    if deep is not None:
        raise _deep_error(path, deep)
    try:
        data = yaml.load(text, Loader=_unique_keys_loader())
    except _DuplicateKey as exc:
        raise K3Error(
            "duplicate-key",
            f"{path}:{exc.line}: duplicate key {exc.key!r} (first at line {exc.first})",
            "give each key once (YAML would silently keep the last)",
        ) from None
    except yaml.YAMLError as exc:
        deep = _nesting_line(exc)  # a file too small to be scanned, past PyYAML's own limit
        if deep is not None:
            raise _deep_error(path, deep) from None
        mark = getattr(exc, "problem_mark", None)
        position = getattr(exc, "position", None)  # a reader error: a character YAML does not allow
        where = f":{mark.line + 1}" if mark is not None else f":{text[:position].count(chr(10)) + 1}" if position is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise K3Error("bad-yaml", f"{path}{where}: malformed YAML: {problem}", "fix the YAML syntax") from None
    except RecursionError:  # nesting deeper than Python's stack: no recipe, inventory or campaign is like that
        raise K3Error("bad-yaml", f"{path}: malformed YAML: nested too deeply", "fix the YAML structure") from None
    if not isinstance(data, dict):
        raise K3Error(code, f"{path}: expected a mapping at the top level", "")
    return data


def _schema_error(path: Path, text: str, exc: ValidationError, doc: str, code: str) -> K3Error:
    import yaml

    err = exc.errors()[0]
    loc = tuple(err["loc"])
    # The node tree (for the line number) is composed only now: the text parsed, so it composes.
    line = line_of(yaml.compose(text, Loader=_loader()), loc)
    dotted = ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden":
        msg = f"{path}:{line}: unknown key {dotted!r}"
        hint = "remove it or fix its spelling (unknown keys are errors, never ignored)"
    else:
        msg = f"{path}:{line}: {dotted}: {plain(err['msg'])}"
        hint = f"see {doc} for the expected shape"
    more = len(exc.errors()) - 1
    if more:
        msg += f" (and {more} more)"
    return K3Error(code, msg, hint)
