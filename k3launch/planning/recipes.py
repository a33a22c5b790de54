"""Load a recipes tree (vLLM recipes layout) with file-and-line errors.

A tree is ``taxonomy.yaml``, ``strategies/*.yaml``, optional ``kv_store/*.yaml`` and
``models/<org>/<Model>.yaml``. Files are read lazily: ``plan`` reads the taxonomy, the
strategies and the one model it needs, so one broken model file elsewhere in a tree does not
block another model's plan (``k3launch recipes`` lists every file and reports broken ones).
Each file is read by k3launch's one YAML loader (:mod:`k3launch.util.yamlio`).
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from k3launch.errors import K3Error
from k3launch.models.recipe import Recipe, Strategy, Taxonomy
from k3launch.planning.recipe_keys import IgnoredKey, ignored_entry, load_lenient, unknown_key_error
from k3launch.util.yamlio import load_yaml_model

if TYPE_CHECKING:
    from k3launch.models.kvstore import KvStore

M = TypeVar("M", bound=BaseModel)

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
        from k3launch.models.kvstore import KvStore

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
