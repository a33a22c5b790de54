"""``k3launch rollout NAME``: the plan a live deployment would change to, and what changes.

The new plan is the deployment's own plan asked again (its ``origin``: the selection as given, on
the inventory it came from, with its name and port base) plus the changes: ``--set FLAG=V``
(replacing an earlier ``--set`` of the same flag), ``--unset FLAG`` (dropping an earlier ``--set``;
a flag the recipe composes is the recipe's to change) and ``--vllm-version``. Planning checks the
values against that vLLM's flag schema, so a typo or a refused value is one line and nothing
changes. A rollout keeps every process on its node and port: a change that would move, add or
drop processes (other nodes, another copy count) is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from k3launch.api._common import load, store
from k3launch.deploy.rollout import RolloutResult
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.supervise import Unit, units
from k3launch.planning.diff import ProcessDiff, diff_plans

ROLLABLE = ("ready",)


@dataclass(frozen=True)
class RolloutPreview:
    """The running plan, the plan it would become, each process's changes, and the recovery units
    of the new plan that change, in the order a rollout takes them (engines first, the router last)."""

    old: Plan
    new: Plan
    diffs: list[ProcessDiff]
    units: list[Unit]


def _flag(word: str) -> str:
    return word.split("=", 1)[0].strip().lstrip("-")


def merged_sets(sets: Sequence[str], add: Sequence[str], drop: Sequence[str]) -> list[str]:
    """``sets`` (``FLAG=VALUE`` as typed) with ``drop``'s flags removed and ``add`` applied, a
    flag set again replacing its earlier value in place."""
    out = [s for s in sets if _flag(s) not in {_flag(d) for d in drop}]
    for s in add:
        if "=" not in s:
            raise K3Error("bad-set", f"--set {s!r} needs FLAG=VALUE", "e.g. --set max-num-seqs=64")
        same = [i for i, old in enumerate(out) if _flag(old) == _flag(s)]
        if same:
            out[same[0]] = s
        else:
            out.append(s)
    return out


def rollout_preview(name: str, *, sets: Sequence[str] = (), unsets: Sequence[str] = (), vllm_version: str | None = None,
                    state_dir: str | Path | None = None) -> RolloutPreview:
    """What ``rollout`` would do to ``name``; nothing is touched. Raises K3Error for a deployment
    that is not ready, cannot be planned again, or a change a rollout cannot make."""
    st = store(state_dir)
    rec = st.load(name)
    if rec.state not in ROLLABLE:
        raise K3Error("not-ready", f"{name} is {rec.state}: only a ready deployment is rolled", f"`k3launch status {name}`")
    origin = rec.plan.origin
    if origin is None or not rec.inventory or not Path(rec.inventory).is_file():
        raise K3Error("no-origin", f"{name} cannot be planned again: its record has no origin or its inventory file "
                      f"({rec.inventory or 'none'}) is gone", f"bring it up again with this k3launch (`k3launch down {name}`, then `up`)")
    if not (sets or unsets or vllm_version):
        raise K3Error("no-change", "nothing to roll out", "give --set FLAG=VALUE, --unset FLAG or --vllm-version")
    given = [str(s) for s in origin.selection.get("sets") or ()]
    missing = [u for u in unsets if _flag(u) not in {_flag(s) for s in given}]
    if missing:
        raise K3Error("bad-unset", f"--unset {missing[0]}: {name} was not planned with --set {_flag(missing[0])}=...",
                      f"its --set flags: {', '.join(given) or 'none'}; a recipe's own flag changes with --set FLAG=VALUE")
    selection = {**origin.selection, "sets": merged_sets(given, sets, unsets)}
    if vllm_version:
        selection["vllm_version"] = vllm_version
    from k3launch.api.planning import plan

    held = st.nodes_in_use(exclude=name)  # other deployments' nodes; this one's own are its to keep
    inv = load(rec.inventory)
    taken = [n.name for n in inv.inventory.nodes if (n.address or n.name) in held]
    new = plan(inv, selection=selection, name=name, exclude=[*origin.exclude, *taken], port_base=origin.port_base,
               recipes_dir=origin.recipes_dir, state_dir=state_dir)
    diffs = diff_plans(rec.plan, new)
    moved = [d for d in diffs if d.added or d.removed or any(c.what in ("node", "address") for c in d.changes)]
    if moved:
        what = ", ".join(f"{d.process} ({'added' if d.added else 'dropped' if d.removed else 'moved'})" for d in moved[:4])
        raise K3Error("rollout-moves", f"the change would move processes: {what}; a rollout keeps each process on its node",
                      "`k3launch down` then `up` for a new layout")
    changed = {d.process for d in diffs if d.changed}
    return RolloutPreview(rec.plan, new, diffs, [u for u in units(new) if changed & set(u.processes)])


def rollout(name: str, *, sets: Sequence[str] = (), unsets: Sequence[str] = (), vllm_version: str | None = None,
            drain_timeout: float = 120.0, start_timeout: float | None = None, allow_downtime: bool = False,
            say: Callable[[str], None] = lambda _: None, state_dir: str | Path | None = None,
            accept_unknown_hosts: bool = False, connect_timeout: float = 10.0, preview: RolloutPreview | None = None) -> RolloutResult:
    """Apply :func:`rollout_preview`'s plan one unit at a time (:mod:`k3launch.deploy.rollout`).
    A running supervisor is stopped for the rollout and started again after it with its policy.
    A deployment with one engine unit (nothing to route around it) is refused unless
    ``allow_downtime``. ``preview``: one the caller has shown already (else it is made here).
    The record holds the plan each process runs on throughout, and the
    deployment's lock is held: a second rollout or a ``down`` meanwhile is ``deployment-busy``."""
    from k3launch.api._common import access
    from k3launch.api.lifecycle import ready_timeout
    from k3launch.api.supervision import stop_supervisor, supervise_detached
    from k3launch.deploy.registry import supervise_ops
    from k3launch.deploy.rollout import Roller
    from k3launch.models.backends import Feature, require

    preview = preview or rollout_preview(name, sets=sets, unsets=unsets, vllm_version=vllm_version, state_dir=state_dir)
    if not preview.units:
        raise K3Error("no-change", "the change leaves every process as it is", "`k3launch rollout NAME ... --dry-run` shows the plan")
    st = store(state_dir)
    rec = st.load(name)
    require(rec.backend, Feature.SUPERVISE, "rollout")
    engines = [u for u in units(preview.old) if u.kind != "router"]
    if len(engines) < 2 and not allow_downtime:
        raise K3Error("rollout-downtime", f"{name} is one engine ({engines[0].name if engines else 'none'}): restarting it stops serving",
                      "--allow-downtime to restart it anyway, or serve copies (--replicas 2) behind the router")
    sv = rec.supervisor
    if sv is not None:
        say(stop_supervisor(name, state_dir=state_dir) or "supervisor stopped for the rollout")
    ops = supervise_ops(rec.backend, "rollout", [access(accept_unknown_hosts, connect_timeout)])
    try:
        # held throughout: a second rollout, a `down` or a restarting supervisor is refused meanwhile
        with st.lock(name):
            watcher = ops.watcher(st.load(name), st)
            try:
                roller = Roller(watcher, preview.old, preview.new, drain_timeout=drain_timeout,
                                start_timeout=start_timeout or ready_timeout(preview.new), say=say)
                result = roller.run(preview.units)
                if result.ok:
                    watcher.adopt(preview.new, "")  # the new plan whole: its origin, for the next rollout
                    result.plan = preview.new
            finally:
                watcher.close()
    finally:
        if sv is not None:
            from k3launch.deploy.supervisors import last_args

            # as it was started (policy, --on-event, SSH options); a foreground one by its policy
            args = (last_args(st, name) if sv.detached else None) or sv.policy.args()
            supervise_detached(name, args, state_dir=state_dir)
            say("supervisor started again")
    return result
