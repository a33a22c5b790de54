"""What can be planned: the recipe tree (``recipes``, ``recipe``) and vLLM's flag schemas
(``schema_dump``). Nothing here starts a process or connects to a node.

Apart from :mod:`k3launch.api.planning` so that ``plan``, which imports that module at every
start, does not also define these result types (each dataclass costs its start-up a little).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch.errors import K3Error

if TYPE_CHECKING:
    from k3launch.models.recipe import Recipe, Taxonomy


@dataclass(frozen=True)
class RecipeListing:
    """The recipe tree at a glance (``k3launch recipes``)."""

    root: Path
    recipes: list[tuple[str, str, str]]  # id, title, verified hardware
    broken: list[dict[str, str]]  # a recipe that does not load: id, code, message, hint
    taxonomy: Taxonomy
    strategies: list[str]


def recipes(recipes_dir: str | Path | None = None) -> RecipeListing:
    from k3launch.planning.recipes import RecipeTree

    t = RecipeTree(Path(recipes_dir) if recipes_dir else None)
    rows: list[tuple[str, str, str]] = []
    broken: list[dict[str, str]] = []
    for rid in t.model_ids():
        try:
            rec = t.model(rid)
        except K3Error as err:
            broken.append({"id": rid, **err.as_dict()})
            continue
        rows.append((rid, rec.meta.title, ", ".join(h for h, v in rec.meta.hardware.items() if v == "verified")))
    return RecipeListing(t.root, rows, broken, t.taxonomy, sorted(t.strategies))


@dataclass(frozen=True)
class RecipeDetail:
    """One recipe (``k3launch recipes show``) and the selection ``plan --recipe ID`` makes of it."""

    id: str
    recipe: Recipe
    taxonomy: Taxonomy
    default: dict[str, object]  # hardware, strategy, nodes, variant; or refused, message
    kv_offload: dict[str, dict[str, bool]]  # the KV offload options' support on ``kv_hardware``
    kv_hardware: str
    one_node: dict[str, bool | None]  # hardware id -> one node holds the first variant's weights (None: the recipe gives no figure)


def recipe(recipe_id: str, recipes_dir: str | Path | None = None) -> RecipeDetail:
    from k3launch.models.selection import Selection
    from k3launch.planning import capacity
    from k3launch.planning.build import build_plan
    from k3launch.planning.options import kv_offload_matrix
    from k3launch.planning.recipes import RecipeTree

    t = RecipeTree(Path(recipes_dir) if recipes_dir else None)
    rid = t.resolve(recipe_id)
    rec = t.model(rid)
    # The default is what `plan --recipe ID` selects (the recipes project's rules), not only the
    # author's meta.default_hardware; a recipe that cannot be planned says why.
    try:
        p = build_plan(t, Selection(recipe=rid))
        default: dict[str, object] = {"hardware": p.hardware, "strategy": p.strategy, "nodes": p.nodes, "variant": p.variant}
    except K3Error as err:
        default = {"refused": err.code, "message": err.message}
    kv_hw = str(default.get("hardware") or rec.meta.default_hardware or next(iter(t.taxonomy.hardware_profiles)))
    try:  # the weights a plan counts, against one node as a plan checks it
        w: float | None = capacity.weights(rec, next(iter(rec.variants.values()))).gb
    except K3Error:
        w = None
    one_node = {hid: None if w is None else capacity.fits(w, capacity.node_memory(hid, prof), 1)
                for hid, prof in t.taxonomy.hardware_profiles.items()}
    return RecipeDetail(rid, rec, t.taxonomy, default, kv_offload_matrix(t, rec, kv_hw), kv_hw, one_node)


@dataclass(frozen=True)
class SchemaDumped:
    """What :func:`schema_dump` wrote: vLLM ``version``'s flag schema in ``path`` (``<out>/<version>/``)."""

    version: str
    path: Path
    flags: int  # `vllm serve` options (argparse actions with option strings)
    env_vars: int
    used: bool  # ``path`` is where plans look for schemas (:func:`~k3launch.planning.schema.user_schema_dir`)
    bounded: int = 0  # flags with limits in constraints.json (k3launch.planning.ranges)
    rules: int = 0  # cross-field checks of vLLM's config classes found in this vLLM
    rules_missing: tuple[str, ...] = ()  # catalogued checks this vLLM did not reproduce: planning does not make them


def schema_dump(python: str | Path, out: str | Path | None = None) -> SchemaDumped:
    """Dump the ``vllm serve`` flag schema and the env names of the vLLM that ``python`` imports
    (vLLM runs in a child process of that interpreter, never in this one) into ``out/<version>/``;
    ``out`` defaults to where plans look first: ``$K3LAUNCH_SCHEMA_DIR``, else ``~/.k3launch/schemas``
    (the state directory's ``schemas/``). Plans then take ``--vllm-version <version>``."""
    from k3launch.planning.schema import user_schema_dir
    from k3launch.planning.schema_dump import check_dumped, dump

    root = Path(out).expanduser() if out is not None else user_schema_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise K3Error("write-failed", f"cannot create {root}: {exc.strerror}", "pass --out DIR (a writable directory)") from None
    vdir = dump(str(python), root)
    dumped = check_dumped(vdir)
    used = root.resolve() == user_schema_dir().resolve()
    from k3launch.planning.ranges_dump import RULES

    cons = dumped.constraints
    found = {r.id for r in cons.rules} if cons is not None else set()
    return SchemaDumped(dumped.version, vdir, len(dumped.schema.specs), len(dumped.env_vars), used, len(cons.bounds) if cons else 0,
                        len(found), tuple(r["id"] for r in RULES if r["id"] not in found))
