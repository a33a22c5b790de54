"""Load a recipes tree (vLLM recipes layout) with file-and-line errors.

A tree is ``taxonomy.yaml``, ``strategies/*.yaml``, optional ``kv_store/*.yaml`` and
``models/<org>/<Model>.yaml``. Files are read lazily: ``plan`` reads the taxonomy, the
strategies and the one model it needs, so one broken model file elsewhere in a tree does not
block another model's plan (``k3launch recipes`` lists every file and reports broken ones).

:func:`load_yaml_model` is the one YAML loader of k3launch: recipes, inventories and campaign
files all go through it, so each is refused the same way (file and line) when it is not UTF-8,
not YAML, repeats a key, or breaks its schema.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from k3launch.errors import K3Error
from k3launch.models.recipe import KvStore, Recipe, Strategy, Taxonomy
from k3launch.planning.recipe_keys import IgnoredKey, ignored_entry, line_of, load_lenient, unknown_key_error

M = TypeVar("M", bound=BaseModel)

# libyaml's loader is ~10x faster than the pure-Python one; same safe subset of YAML.
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE = "tag:yaml.org,2002:merge"
# libyaml builds nodes recursively in C: a document nested ~100,000 deep overflows the stack and
# kills the process. No k3launch file is nested more than a few levels, so deeper ones are refused
# before they are built; only files large enough to be that deep are scanned (~1 ms per 20 kB).
_MAX_DEPTH = 100
_SCAN_ABOVE_CHARS = 16_384


def _too_deep(text: str) -> int | None:
    """The line where ``text`` nests past ``_MAX_DEPTH`` collections, else None (malformed YAML is
    left to the loader, which says where)."""
    if len(text) <= _SCAN_ABOVE_CHARS:
        return None
    depth = 0
    try:
        for ev in yaml.parse(text, Loader=_Loader):
            if isinstance(ev, yaml.CollectionStartEvent):
                depth += 1
                if depth > _MAX_DEPTH:
                    return ev.start_mark.line + 1 if ev.start_mark is not None else 1
            elif isinstance(ev, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError:
        return None
    return None


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: object, line: int, first: int) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line, self.first = key, line, first


class _UniqueKeysLoader(_Loader):  # type: ignore[valid-type,misc]  # libyaml's loader when there is one
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


ENV_RECIPES_DIR = "K3LAUNCH_RECIPES_DIR"


def default_recipes_dir() -> Path:
    """``$K3LAUNCH_RECIPES_DIR``, else the tree shipped with k3launch."""
    env = os.environ.get(ENV_RECIPES_DIR)
    if env:
        return Path(env)
    from k3launch.util.resources import bundled

    taxonomy = bundled("recipes", "taxonomy.yaml")
    if taxonomy is not None:
        return taxonomy.parent
    raise K3Error(
        "no-recipes",
        "the bundled recipes tree is missing from this installation",
        f"reinstall k3launch or pass --recipes-dir DIR (or set {ENV_RECIPES_DIR})",
    )


def load_yaml_model(path: Path, model: type[M], doc: str = 'docs/planning.md ("Recipe format")', code: str = "bad-recipe") -> M:
    """Parse ``path`` into ``model``; every failure is a one-line :class:`K3Error`."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise K3Error("missing-file", f"{path}: no such file", "check the path") from None
    except IsADirectoryError:
        raise K3Error("unreadable-file", f"{path}: is a directory", "pass the YAML file itself") from None
    except OSError as exc:
        raise K3Error("unreadable-file", f"{path}: {exc.strerror}", "check permissions") from None
    except UnicodeDecodeError as exc:
        at = exc.object[: exc.start].count(b"\n") + 1
        raise K3Error(
            "bad-encoding",
            f"{path}:{at}: not UTF-8 text (byte {exc.object[exc.start]:#04x})",
            "is it the file you meant? YAML files are UTF-8 text",
        ) from None
    deep = _too_deep(text)
    if deep is not None:
        raise K3Error("bad-yaml", f"{path}:{deep}: nested more than {_MAX_DEPTH} levels deep", "is it the file you meant?")
    try:
        data = yaml.load(text, Loader=_UniqueKeysLoader)
    except _DuplicateKey as exc:
        raise K3Error(
            "duplicate-key",
            f"{path}:{exc.line}: duplicate key {exc.key!r} (first at line {exc.first})",
            "give each key once (YAML would silently keep the last)",
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        position = getattr(exc, "position", None)  # a reader error: a character YAML does not allow
        where = f":{mark.line + 1}" if mark is not None else f":{text[:position].count(chr(10)) + 1}" if position is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise K3Error("bad-yaml", f"{path}{where}: malformed YAML: {problem}", "fix the YAML syntax") from None
    except RecursionError:  # nesting deeper than Python's stack: no recipe, inventory or campaign is like that
        raise K3Error("bad-yaml", f"{path}: malformed YAML: nested too deeply", "fix the YAML structure") from None
    if not isinstance(data, dict):
        raise K3Error(code, f"{path}: expected a mapping at the top level", "")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        # The node tree (for the line number) is composed only now: the text parsed, so it composes.
        line = line_of(yaml.compose(text, Loader=_Loader), loc)
        dotted = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden":
            msg = f"{path}:{line}: unknown key {dotted!r}"
            hint = "remove it or fix its spelling (unknown keys are errors, never ignored)"
        else:
            msg = f"{path}:{line}: {dotted}: {err['msg']}"
            hint = f"see {doc} for the expected shape"
        more = len(exc.errors()) - 1
        if more:
            msg += f" (and {more} more)"
        raise K3Error(code, msg, hint) from None


class RecipeTree:
    """One recipes tree on disk."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_recipes_dir()
        if not (self.root / "taxonomy.yaml").is_file():
            raise K3Error(
                "no-recipes",
                f"{self.root}: not a recipes tree (no taxonomy.yaml)",
                "point --recipes-dir at a checkout of the vLLM recipes layout",
            )
        self._models: dict[str, Recipe] = {}
        # Keys k3launch does not know, per file relative to the root (trees without strict_keys).
        self.ignored: dict[str, list[IgnoredKey]] = {}
        self._strategy_files: dict[str, str] = {}
        from k3launch.util.resources import bundled_dir

        own = bundled_dir("recipes")
        self._bundled = own is not None and self.root.resolve() == own.resolve()

    @property
    def strict(self) -> bool:
        """Whether unknown keys are errors: the taxonomy says so, or this is k3launch's bundled tree
        (which says so too: a typo of ``strict_keys`` itself must not make it lenient)."""
        return self._bundled or self.taxonomy.strict_keys

    def _load(self, path: Path, model: type[M]) -> M:
        """A strict tree refuses unknown keys; an upstream one keeps them in :attr:`ignored`."""
        if self.strict:
            return load_yaml_model(path, model)
        rel = path.relative_to(self.root).as_posix()
        return load_lenient(path, model, rel, self.ignored.setdefault(rel, []))

    @cached_property
    def taxonomy(self) -> Taxonomy:
        path = self.root / "taxonomy.yaml"
        keys: list[IgnoredKey] = []
        tax = load_lenient(path, Taxonomy, "taxonomy.yaml", keys)
        if (self._bundled or tax.strict_keys) and keys:
            raise unknown_key_error(path, keys[0], len(keys))
        self.ignored["taxonomy.yaml"] = keys
        return tax

    @cached_property
    def strategies(self) -> dict[str, Strategy]:
        out: dict[str, Strategy] = {}
        for path in sorted((self.root / "strategies").glob("*.yaml")):
            strat = self._load(path, Strategy)
            out[strat.name] = strat
            self._strategy_files[strat.name] = path.relative_to(self.root).as_posix()
        return out

    @cached_property
    def kv_stores(self) -> dict[str, KvStore]:
        out: dict[str, KvStore] = {}
        for path in sorted((self.root / "kv_store").glob("*.yaml")):
            store = self._load(path, KvStore)
            out[store.name] = store
        return out

    def ignored_keys(self, recipe_id: str, strategies: list[str]) -> list[IgnoredKey]:
        """Unknown keys a plan of ``recipe_id`` with ``strategies`` read: the taxonomy's, the
        strategy files' and the recipe's (empty for a strict tree)."""
        self.model(recipe_id)
        self.strategies  # noqa: B018 -- loading them records their files
        files = ["taxonomy.yaml", *(self._strategy_files.get(s, "") for s in strategies), f"models/{recipe_id}.yaml"]
        return [k for f in dict.fromkeys(files) for k in self.ignored.get(f, [])]

    def model_ids(self) -> list[str]:
        base = self.root / "models"
        return sorted(str(p.relative_to(base).with_suffix("")) for p in base.glob("*/*.yaml"))

    def model_path(self, recipe_id: str) -> Path:
        return self.root / "models" / f"{recipe_id}.yaml"

    def resolve(self, name: str) -> str:
        """Accept ``org/Model``, ``Model``, the slug, or the HF model id (case-insensitive)."""
        ids = self.model_ids()
        low = name.lower()
        for rid in ids:
            if rid.lower() == low or rid.split("/")[-1].lower() == low:
                return rid
        for rid in ids:
            rec = self.model(rid)
            if rec.meta.slug.lower() == low or rec.model.model_id.lower() == low:
                return rid
        import difflib

        close = difflib.get_close_matches(name, ids, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}?" if close else "list them with `k3launch recipes`"
        raise K3Error("unknown-recipe", f"no recipe named {name!r} in {self.root}", hint)

    def model(self, recipe_id: str) -> Recipe:
        if recipe_id not in self._models:
            path = self.model_path(recipe_id)
            rec = self._load(path, Recipe)
            if not self.strict:
                rec = self._drop_unknown_hardware(path, rec)
            self._check_references(path, rec)
            self._models[recipe_id] = rec
        return self._models[recipe_id]

    def _drop_unknown_hardware(self, path: Path, rec: Recipe) -> Recipe:
        """An upstream recipe may mark GPUs its taxonomy has no profile for (``a100``): nothing can
        select them, so they are kept as ignored keys rather than refused."""
        known = self.taxonomy.hardware_profiles
        unknown = [h for h in rec.meta.hardware if h not in known]
        if not unknown:
            return rec
        rel = path.relative_to(self.root).as_posix()
        self.ignored.setdefault(rel, []).extend(
            ignored_entry(path, rel, ["meta", "hardware", h], rec.meta.hardware[h], "names no hardware profile of taxonomy.yaml")
            for h in unknown
        )
        kept = {h: v for h, v in rec.meta.hardware.items() if h in known}
        return rec.model_copy(update={"meta": rec.meta.model_copy(update={"hardware": kept})})

    def _check_references(self, path: Path, rec: Recipe) -> None:
        """Names a recipe uses must exist in its tree: a typo there is the recipe's error."""
        hw = self.taxonomy.hardware_profiles
        strategies = self.strategies
        problems: list[str] = []
        if rec.meta.default_hardware and rec.meta.default_hardware not in hw:
            problems.append(f"meta.default_hardware {rec.meta.default_hardware!r} is not in taxonomy.yaml")
        problems += [f"meta.hardware {h!r} is not in taxonomy.yaml" for h in rec.meta.hardware if h not in hw]
        problems += [f"compatible_strategies {s!r} has no strategies/{s}.yaml" for s in rec.compatible_strategies if s not in strategies]
        if rec.default_strategy and rec.default_strategy not in strategies:
            problems.append(f"default_strategy {rec.default_strategy!r} has no strategies/{rec.default_strategy}.yaml")
        problems += [f"opt_in_features {f!r} is not a feature of this recipe" for f in rec.opt_in_features if f not in rec.features]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise K3Error("bad-recipe", f"{path}: {problems[0]}{more}", "fix the name, or add the missing taxonomy/strategy entry")
