"""Plans and what is known of them before anything runs: ``plan``, ``dry_run``, ``explain``,
``lint``. Nothing here starts a process or connects to a node. (What can be planned, the recipe
tree and vLLM's flag schemas, is :mod:`k3launch.api.catalog`: `plan` does not load it.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3launch.api._common import InventoryArg, load, store
from k3launch.errors import K3Error, plain

if TYPE_CHECKING:
    from k3launch.models.cordon import Cordon
    from k3launch.models.findings import Finding, FlagHistory
    from k3launch.models.plan import Plan
    from k3launch.models.reports import DryRun
    from k3launch.models.selection import Selection


def _selection(selection: Selection | Mapping[str, Any] | None, fields: Mapping[str, Any]) -> Selection:
    """The selection, refused in one shape whoever asks: an unknown field is ``bad-selection``,
    a bad value ``bad-value`` naming the option that sets it."""
    from pydantic import ValidationError

    from k3launch.models.selection import Selection

    base = selection.model_dump() if isinstance(selection, Selection) else dict(selection or {})
    try:
        return Selection.model_validate({**base, **fields})
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else "selection"
        if err["type"] == "extra_forbidden":
            raise K3Error("bad-selection", f"selection {name}: not a selection field", "use Selection fields: " + ", ".join(Selection.model_fields)) from None
        flag = next((f for n, f, _, _ in Selection.cli_fields() if n == name), name)
        raise K3Error("bad-value", f"{flag}: {plain(err['msg'])}", f"`k3launch plan --help` lists {flag}'s values") from None


def plan(inventory: InventoryArg = None, *, selection: Selection | Mapping[str, Any] | None = None,
         name: str | None = None, exclude: Sequence[str] = (), port_base: int | None = None, recipes_dir: str | Path | None = None,
         placeholders: bool = False, state_dir: str | Path | None = None, cordons: Mapping[str, Cordon] | None = None,
         keep: Sequence[str] = (), **fields: Any) -> Plan:
    """Build a plan from a :class:`~k3launch.models.selection.Selection` (or its fields as a mapping),
    and/or its fields as keywords (``strategy``, ``nodes``, ``hardware``, ``features``, ``sets``, ...;
    keywords win). ``placeholders``: on placeholder nodes, without an inventory (``k3launch plan``
    without ``--inventory``); else on ``inventory``'s nodes (``None``: the bundled local inventory),
    skipping those cordoned in ``state_dir`` (``cordons``: these cordons instead, node → Cordon).
    ``keep``: the engine nodes, slot by slot, of a plan being re-placed: each slot keeps its node
    while it is usable, and only the others take spare nodes."""
    from k3launch.planning.build import build_plan
    from k3launch.planning.recipes import RecipeTree

    sel = _selection(selection, fields)
    tree = RecipeTree(Path(recipes_dir) if recipes_dir else None)
    if placeholders:
        return build_plan(tree, sel, exclude=tuple(exclude), port_base=port_base, name=name)
    from k3launch.api.cordons import for_planning
    from k3launch.models.plan import PlanOrigin

    loaded = load(inventory)
    built = build_plan(tree, sel, inventory=loaded.inventory, exclude=tuple(exclude), port_base=port_base, name=name,
                       cordoned=for_planning(loaded, state_dir, cordons), keep=tuple(keep))
    origin = PlanOrigin(selection=sel.model_dump(mode="json", exclude_defaults=True), exclude=list(exclude), port_base=port_base,
                        recipes_dir=str(recipes_dir) if recipes_dir else None)
    return built.model_copy(update={"origin": origin})


def check_port_base(base: int) -> int:
    """``base`` if planning accepts it as a port base (its 512-port block inside 1024-65535, clear
    of the default ports); else the refusal ``plan`` would give."""
    from k3launch.planning.placement import Ports

    Ports.shifted(base)
    return base


def dry_run(plan: Plan, inventory: InventoryArg = None, *, state_dir: str | Path | None = None,
            extra_sbatch: Sequence[str] = (), supervise: bool | Mapping[str, Any] = False) -> DryRun:
    """What ``up`` would run for ``plan`` (per-node scripts, or the sbatch script), and the same as
    files for ``render``; starts nothing. Without an inventory, a plan on placeholder nodes gets
    the SSH backend's scripts. ``supervise``: as :func:`k3launch.api.up`'s (Slurm: the job script
    that supervises itself)."""
    from k3launch.deploy.options import SlurmOptions, UpOptions
    from k3launch.deploy.registry import backend

    loaded = load(inventory) if inventory is not None else None
    inv = loaded.inventory if loaded is not None else None
    if loaded is not None:
        from k3launch.api.cordons import refuse_cordoned

        refuse_cordoned(plan, loaded, state_dir)  # `up` would refuse it: its dry run shows nothing that would run
    name = inv.backend if inv is not None else plan.backend if plan.backend != "none" else "ssh"
    b = backend(name, [SlurmOptions(extra_sbatch=tuple(extra_sbatch))])
    policy = None
    if supervise is not False and inv is not None:
        from k3launch.api.policy import self_policy

        policy = self_policy(inv, supervise)
    return b.dry_run(plan, inv, store(state_dir), UpOptions(supervise=policy))


def explain(plan: Plan, flag: str, process: str | None = None) -> tuple[str, list[FlagHistory]]:
    """(the provenance key ``flag`` names, which layers wrote it, in order, per group of processes)."""
    from k3launch.planning.explain import explain as histories
    from k3launch.planning.explain import flag_key

    return flag_key(plan, flag), histories(plan, flag, process)


def lint(words: Sequence[str], vllm_version: str) -> list[Finding]:
    """Findings on a pasted ``vllm serve`` command, against vLLM ``vllm_version``'s flag schema."""
    from k3launch.planning.lint import lint as run_lint
    from k3launch.planning.schema import load_schema

    return run_lint(load_schema(vllm_version), list(words))
