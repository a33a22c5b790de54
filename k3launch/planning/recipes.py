"""Load a recipes tree (vLLM recipes layout) with file-and-line errors.

A tree is ``taxonomy.yaml``, ``strategies/*.yaml``, optional ``kv_store/*.yaml`` and
``models/<org>/<Model>.yaml``. Files are read lazily: ``plan`` reads the taxonomy, the
strategies and the one model it needs, so one broken model file elsewhere in a tree does not
block another model's plan (``k3launch recipes`` lists every file and reports broken ones).
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

M = TypeVar("M", bound=BaseModel)

# libyaml's loader is ~10x faster than the pure-Python one; same safe subset of YAML.
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

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


def _line_of(node: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """Best line (1-based) for a pydantic error location inside a composed YAML node."""
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
    """Parse ``path`` into ``model``; every failure is a one-line :class:`K3Error`."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise K3Error("missing-file", f"{path}: no such file", "check the path") from None
    except OSError as exc:
        raise K3Error("unreadable-file", f"{path}: {exc.strerror}", "check permissions") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise K3Error("bad-yaml", f"{path}{where}: malformed YAML: {problem}", "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise K3Error(code, f"{path}: expected a mapping at the top level", "")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        # The node tree (for the line number) is composed only now: the text parsed, so it composes.
        line = _line_of(yaml.compose(text, Loader=_Loader), loc)
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

    @cached_property
    def taxonomy(self) -> Taxonomy:
        return load_yaml_model(self.root / "taxonomy.yaml", Taxonomy)

    @cached_property
    def strategies(self) -> dict[str, Strategy]:
        out: dict[str, Strategy] = {}
        for path in sorted((self.root / "strategies").glob("*.yaml")):
            strat = load_yaml_model(path, Strategy)
            out[strat.name] = strat
        return out

    @cached_property
    def kv_stores(self) -> dict[str, KvStore]:
        out: dict[str, KvStore] = {}
        for path in sorted((self.root / "kv_store").glob("*.yaml")):
            store = load_yaml_model(path, KvStore)
            out[store.name] = store
        return out

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
            rec = load_yaml_model(path, Recipe)
            self._check_references(path, rec)
            self._models[recipe_id] = rec
        return self._models[recipe_id]

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
