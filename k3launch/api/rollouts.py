"""``k3launch rollout NAME``: the plan a live deployment would change to, what changes, and the rollout.

The new plan is the deployment's own plan asked again (its ``origin``: the selection as given, on
the inventory it came from, with its name and port base) plus the changes: ``--set FLAG=V``
(replacing an earlier ``--set`` of the same flag), ``--env NAME=V`` (likewise), ``--unset X``
(dropping an earlier ``--set X=...`` or ``--env X=...``; a flag the recipe composes is the
recipe's to change), ``--image`` and ``--vllm-version``. Planning checks the values against that
vLLM's flag schema, so a typo or a refused value is one line and nothing changes. A rollout keeps
every process on its node and port: a change that would move, add or drop processes (other
nodes, another copy count) is refused.

While it rolls, and after it stopped, the record holds both plans and which unit runs which
(:mod:`k3launch.models.rollout`); a stopped rollout is resumed (:func:`rollout_continue`) or
undone (:func:`rollout_continue` with ``rollback``), and a new one is refused until then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from k3launch.api._common import load, store
from k3launch.api._rollgate import refuse_stale
from k3launch.deploy.rollout import RolloutResult, pd_plan
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.access import Access
from k3launch.models.backends import Feature, require
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord
from k3launch.models.rollout import RolloutState, RolloutUnit, changes_typed
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
    changes: tuple[str, ...] = ()  # the options, as typed
    surge: bool = False  # the new engines start on spare nodes beside the old ones (``--surge``)
    rebaseline: tuple[str, ...] = ()  # why the canary's recorded answers no longer apply to the new plan (none: they do)


def _flag(word: str) -> str:
    return word.split("=", 1)[0].strip().lstrip("-")


def merged_sets(sets: Sequence[str], add: Sequence[str], drop: Sequence[str], option: str = "--set") -> list[str]:
    """``sets`` (``FLAG=VALUE`` as typed; ``NAME=VALUE`` for ``--env``) with ``drop``'s names
    removed and ``add`` applied, a name set again replacing its earlier value in place."""
    out = [s for s in sets if _flag(s) not in {_flag(d) for d in drop}]
    for s in add:
        if "=" not in s:
            form = "FLAG=VALUE" if option == "--set" else "NAME=VALUE"
            raise K3Error("bad-set", f"{option} {s!r} needs {form}", "e.g. --set max-num-seqs=64 or --env VLLM_LOGGING_LEVEL=DEBUG")
        same = [i for i, old in enumerate(out) if _flag(old) == _flag(s)]
        if same:
            out[same[0]] = s
        else:
            out.append(s)
    return out


def rollout_preview(name: str, *, sets: Sequence[str] = (), unsets: Sequence[str] = (), env: Sequence[str] = (),
                    image: str | None = None, vllm_version: str | None = None, surge: bool = False,
                    state_dir: str | Path | None = None) -> RolloutPreview:
    """What ``rollout`` would do to ``name``; nothing is touched. Raises K3Error for a deployment
    that is not ready, is in a stopped rollout, cannot be planned again, or a change a rollout
    cannot make. ``surge``: the new engines go on spare nodes (:func:`surge_plan`)."""
    st = store(state_dir)
    rec = st.load(name)
    if rec.state not in ROLLABLE:
        raise K3Error("not-ready", f"{name} is {rec.state}: only a ready deployment is rolled", f"`k3launch status {name}`")
    if rec.rollout is not None or _pending(st, name, rec):
        if rec.rollout is None or not rec.rollout.stopped:
            changes = " ".join(rec.rollout.changes) if rec.rollout is not None else "written, not yet taken up"
            raise K3Error("rollout-running", f"{name} is in a rollout ({changes}) under way",
                          f"`k3launch status {name}` follows it; change it again once it is done, or `--rollback` once it stopped")
        raise K3Error("rollout-stopped", f"{name} is in a rollout ({' '.join(rec.rollout.changes)}) that stopped: "
                      f"{rec.rollout.stopped or 'its command ended before it finished'}",
                      f"`k3launch rollout {name} --continue` to finish it, or `--rollback` to undo it")
    origin = rec.plan.origin
    if origin is None or not rec.inventory or not Path(rec.inventory).is_file():
        raise K3Error("no-origin", f"{name} cannot be planned again: its record has no origin or its inventory file "
                      f"({rec.inventory or 'none'}) is gone", f"bring it up again with this k3launch (`k3launch down {name}`, then `up`)")
    if not (sets or unsets or env or image or vllm_version):
        raise K3Error("no-change", "nothing to roll out", "give --set FLAG=VALUE, --env NAME=VALUE, --unset X, --image or --vllm-version")
    given = [str(s) for s in origin.selection.get("sets") or ()]
    given_env = [str(e) for e in origin.selection.get("env") or ()]
    missing = [u for u in unsets if _flag(u) not in {_flag(s) for s in [*given, *given_env]}]
    if missing:
        raise K3Error("bad-unset", f"--unset {missing[0]}: {name} was not planned with --set or --env {_flag(missing[0])}=...",
                      f"its --set/--env: {', '.join([*given, *given_env]) or 'none'}; a recipe's own flag changes with --set FLAG=VALUE")
    selection = {**origin.selection, "sets": merged_sets(given, sets, unsets), "env": merged_sets(given_env, env, unsets, "--env")}
    if not selection["env"]:
        del selection["env"]  # a selection as `up` would have written it
    if vllm_version:
        selection["vllm_version"] = vllm_version
    if image:
        selection["image"] = image
    from k3launch.api.planning import plan

    held = st.nodes_in_use(exclude=name)  # other deployments' nodes; this one's own are its to keep
    inv = load(rec.inventory)
    taken = [n.name for n in inv.inventory.nodes if (n.address or n.name) in held]
    typed = tuple(changes_typed(sets, unsets, env, image, vllm_version))
    if surge:
        return _with_rebaseline(st, name, _surge_preview(rec.plan, lambda busy: plan(inv, selection=selection, name=name, exclude=[*origin.exclude, *taken, *busy],
                                                          port_base=origin.port_base, recipes_dir=origin.recipes_dir,
                                                          state_dir=state_dir), (*typed, "--surge")))
    new = plan(inv, selection=selection, name=name, exclude=[*origin.exclude, *taken], port_base=origin.port_base,
               recipes_dir=origin.recipes_dir, state_dir=state_dir)
    diffs = diff_plans(rec.plan, new)
    moved = [d for d in diffs if d.added or d.removed or any(c.what in ("node", "address") for c in d.changes)]
    if moved:
        what = ", ".join(f"{d.process} ({'added' if d.added else 'dropped' if d.removed else 'moved'})" for d in moved[:4])
        raise K3Error("rollout-moves", f"the change would move processes: {what}; a rollout keeps each process on its node",
                      "`k3launch down` then `up` for a new layout")
    changed = {d.process for d in diffs if d.changed}
    return _with_rebaseline(st, name, RolloutPreview(rec.plan, new, diffs, [u for u in units(new) if changed & set(u.processes)], typed))


def _with_rebaseline(st: StateStore, name: str, preview: RolloutPreview) -> RolloutPreview:
    from dataclasses import replace

    from k3launch.deploy import canary as io
    from k3launch.models.canary import rebaseline_reasons

    baseline = io.load(st, name)
    return replace(preview, rebaseline=tuple(rebaseline_reasons(baseline, preview.new))) if baseline is not None else preview


def _surge_refusal(old: Plan) -> K3Error | None:
    """Why a surge cannot change ``old`` at all, whatever nodes are spare (None: it can)."""
    if not any(p.role == "router" for p in old.processes):
        return K3Error("surge-no-router", f"{old.name} has no router: its endpoint is the engine itself, and engines on other nodes "
                       "would have another address", "--allow-downtime restarts it in place; copies (--replicas 2) get a router")
    if pd_plan(old):
        return K3Error("surge-pd", "vllm-router's P/D mode cannot add instances over HTTP, so a new set cannot be switched to",
                       "--allow-downtime rolls each instance in place")
    if old.fault_tolerance:
        return K3Error("surge-fault-tolerance", f"{old.name} runs vLLM's fault tolerance, whose pools a surge does not rename yet",
                       "--allow-downtime restarts it in place")
    return None


def _surge_preview(old: Plan, replan: Callable[[Sequence[str]], Plan], typed: tuple[str, ...]) -> RolloutPreview:
    """The new plan with every engine on nodes the deployment does not use (``replan`` excludes
    them), in the next generation of process ids (:mod:`k3launch.planning.surge`)."""
    from k3launch.planning.surge import generation, renamed

    refused = _surge_refusal(old)
    if refused is not None:
        raise refused
    router = next(p for p in old.processes if p.role == "router")
    busy = sorted({p.node for p in old.processes if p.role != "router"})
    try:
        new = replan(busy)
    except K3Error as exc:
        raise K3Error("surge-no-spares", f"--surge needs spare nodes for a whole new set of engines besides {', '.join(busy)}: "
                      f"{exc.message}", "free or add nodes of the same kind in the inventory, or roll copies one at a time") from None
    gen = generation(old) + 1
    new = renamed(new, gen)
    same = next((p for p in new.processes if p.role == "router"), None)
    if same is None or (same.node, same.address, same.http_port) != (router.node, router.address, router.http_port):
        raise K3Error("surge-router-moves", "the new plan puts the router elsewhere; a surge keeps it serving where it is",
                      "`k3launch down` then `up` for a new layout")
    diffs = diff_plans(renamed(old, gen), new)  # the same process in both generations, compared
    return RolloutPreview(old, new, diffs, [u for u in units(new) if u.kind != "router"], typed, surge=True)


def refusal(name: str, preview: RolloutPreview, max_unavailable: int = 1, allow_downtime: bool = False) -> K3Error | None:
    """Why :func:`rollout` would refuse ``preview`` with these options (None: it would not): what
    ``--dry-run`` says before the real run meets it."""
    engines = [u for u in units(preview.old) if u.kind != "router"]
    if max_unavailable < 1:
        return K3Error("bad-max-unavailable", f"--max-unavailable {max_unavailable}: at least 1 unit rolls at a time", "e.g. --max-unavailable 1")
    if pd_plan(preview.old) and not allow_downtime:
        return K3Error("rollout-pd", f"{name} is P/D: vllm-router's P/D mode can take an instance out of its lists but not add it "
                       "back, so each instance must restart in place, and requests paired with it fail until the router's "
                       "health check skips it (about a second)", "--allow-downtime rolls it so, one instance at a time")
    if len(engines) <= max_unavailable and not allow_downtime and not preview.surge:
        what = f"one engine ({engines[0].name if engines else 'none'})" if len(engines) < 2 else f"{len(engines)} engine units"
        # --surge only where a surge could run: it too is refused without a router (and for P/D, fault tolerance)
        surge = "" if _surge_refusal(preview.old) is not None else "--surge starts the new engines on spare nodes first; "
        return K3Error("rollout-downtime", f"{name} is {what}: rolling {max_unavailable} at a time stops serving",
                       f"{surge}--allow-downtime restarts them anyway; or{' a smaller --max-unavailable, or' if max_unavailable > 1 else ''} "
                       "copies (--replicas 2) behind the router")
    return None


def rollout(name: str, *, sets: Sequence[str] = (), unsets: Sequence[str] = (), env: Sequence[str] = (), image: str | None = None,
            vllm_version: str | None = None, drain_timeout: float = 120.0, start_timeout: float | None = None,
            max_unavailable: int = 1, allow_downtime: bool = False, say: Callable[[str], None] = lambda _: None,
            state_dir: str | Path | None = None, access: Access = Access(),
            preview: RolloutPreview | None = None, surge: bool = False, canary: bool = True,
            rebaseline: bool = False) -> RolloutResult:
    """Roll :func:`rollout_preview`'s plan out, ``max_unavailable`` units at a time: a new revision
    of the deployment's spec, converged by its controller (:mod:`k3launch.models.control.converge`). With
    a controller running (``supervise``), this waits for it; without one, it runs the controller
    here until the rollout is done or stopped. Either way the deployment stays supervised
    throughout: a unit that fails meanwhile is restarted, and the rollout goes on.

    Refused: a rollout that would leave no engine in the router (one engine unit, or
    ``max_unavailable`` as many as there are) unless ``allow_downtime``; a P/D deployment unless
    ``allow_downtime`` (it rolls in place). ``surge``: the whole new set of engines starts on
    spare nodes beside the old one, gated, then the router switches. ``canary``: each rolled unit
    also replays the correctness canary (``rebaseline`` when the change makes its answers stale)."""
    preview = preview or rollout_preview(name, sets=sets, unsets=unsets, env=env, image=image, vllm_version=vllm_version,
                                         surge=surge, state_dir=state_dir)
    if not preview.units:
        raise K3Error("no-change", "the change leaves every process as it is", "`k3launch rollout NAME ... --dry-run` shows the plan")
    refused = refusal(name, preview, max_unavailable, allow_downtime)
    if refused is not None:
        raise refused
    st = store(state_dir)
    if canary:
        refuse_stale(st, name, preview.rebaseline, rebaseline)
    rec = st.load(name)
    require(rec.backend, Feature.ROLLOUT, "rollout")
    now = time.time()
    router = any(p.role == "router" for p in preview.old.processes)
    state = RolloutState(old=preview.old, new=preview.new, changes=list(preview.changes), started=now, updated=now, surge=preview.surge,
                         units=[RolloutUnit(name=u.name, processes=list(u.processes)) for u in preview.units],
                         max_unavailable=max_unavailable, drain_timeout=drain_timeout, start_timeout=start_timeout,
                         canary=canary, rebaseline=rebaseline, routes=router and not pd_plan(preview.old))
    return _converge(name, state, say=say, state_dir=state_dir, access=access)


def rollout_continue(name: str, *, rollback: bool = False, drain_timeout: float | None = None, start_timeout: float | None = None,
                     max_unavailable: int | None = None, say: Callable[[str], None] = lambda _: None, state_dir: str | Path | None = None,
                     access: Access = Access(), canary: bool = True) -> RolloutResult:
    """Resume ``name``'s stopped rollout: roll the units that do not run the new plan yet (a unit
    that failed its gate is tried again). ``rollback``: take the units that run the new plan back
    to the old one instead, last rolled first. Either way the record drops the rollout once every
    unit runs one plan. ``nothing-to-continue`` (exit 2) when no rollout stopped. Options left
    None keep the rollout's own."""
    st = store(state_dir)
    rec = st.load(name)
    state = rec.rollout
    if state is None:
        raise K3Error("nothing-to-continue", f"{name} has no stopped rollout", f"`k3launch rollout {name} --set FLAG=VALUE ...` starts one")
    if rec.state not in ROLLABLE:
        raise K3Error("not-ready", f"{name} is {rec.state}: only a ready deployment is rolled", f"`k3launch status {name}`")
    if not state.stopped:
        raise K3Error("rollout-running", f"{name}'s rollout ({' '.join(state.changes)}) is under way",
                      f"`k3launch status {name}` follows it; `--rollback` once it stopped")
    if state.surge:
        if not rollback:
            raise K3Error("surge-stopped", f"{name}'s surge stopped midway ({state.stopped or 'its command ended'}); it is not resumed",
                          f"`k3launch rollout {name} --rollback` stops the new engines, then `rollout --surge` again")
        return _surge_back(name, state, say=say, state_dir=state_dir, access=access)
    ahead = state.model_copy(deep=True)
    ahead.stopped, ahead.logs = "", []
    for u in ahead.units:
        u.failed = ""
        if u.on == "rolling":  # between two steps when it stopped: the controller finds which plan it serves
            u.on = "new" if rollback else "old"
    if rollback:
        ahead.back = True
        order = list(reversed(state.rolled()))
        ahead.units.sort(key=lambda u: order.index(u.name) if u.name in order else len(order))
    ahead.drain_timeout = drain_timeout if drain_timeout is not None else ahead.drain_timeout
    ahead.start_timeout = start_timeout if start_timeout is not None else ahead.start_timeout
    ahead.max_unavailable = max_unavailable if max_unavailable is not None else ahead.max_unavailable
    ahead.canary = ahead.canary and canary
    if ahead.canary:  # answers recorded for the other plan are stale for this one: the first unit records anew
        target = ahead.old if rollback else ahead.new
        ahead.rebaseline = bool(_with_rebaseline(st, name, RolloutPreview(rec.plan, target, [], [])).rebaseline)
    return _converge(name, ahead, say=say, state_dir=state_dir, access=access)


def _surge_back(name: str, state: RolloutState, *, say: Callable[[str], None], state_dir: str | Path | None,
                access: Access) -> RolloutResult:
    """Undo a surge that stopped midway: stop the new set, run on the old plan again (its
    engines must still be running: a surge stops them only after the router switched)."""
    from k3launch.deploy.registry import supervise_ops
    from k3launch.deploy.rollout import GRACE_S

    st = store(state_dir)
    with st.lock(name):
        rec = st.load(name)
        old_ids = {p.id for p in state.old.processes}
        missing = sorted(old_ids - set(rec.processes))
        if missing:
            raise K3Error("surge-switched", f"{name}'s old engines are stopped already ({', '.join(missing[:3])}): the switch is done",
                          f"`k3launch status {name}`; `down` then `up` brings it back to one plan")
        ops = supervise_ops(rec.backend, "rollout", [access])
        watcher = ops.watcher(rec, st)
        try:
            extra = [i for i in rec.processes if i not in old_ids]
            say(f"stopping the new engines: {', '.join(extra) or 'none'}")
            watcher.stop(extra, GRACE_S)

            def back(r: DeploymentRecord) -> None:
                for i in extra:
                    r.processes.pop(i, None)
                r.rollout = None

            watcher.note(back)
            watcher.adopt(state.old, "")
        finally:
            watcher.close()
    return RolloutResult(state.old)




def _pending(st: StateStore, name: str, rec: DeploymentRecord) -> bool:
    """A rollout written to the spec that no controller has taken up yet."""
    from k3launch.deploy.control.process import read_spec

    spec = read_spec(st, name)
    done = rec.control.revision if rec.control is not None else 0
    return spec is not None and spec.rollout is not None and spec.rollout.revision == spec.revision and spec.revision > done


def _converge(name: str, state: RolloutState, *, say: Callable[[str], None], state_dir: str | Path | None,
              access: Access) -> RolloutResult:
    """Write ``state`` as the spec's new rollout and see the controller converge to it
    (:func:`k3launch.api._converge.converge`): done, or stopped with every unit back on one plan."""
    from k3launch.api._converge import converge

    if store(state_dir).load(name).job is not None:  # a Slurm job: its own controller rolls it, inside the allocation
        from k3launch.api._jobroll import converge_in_job

        return converge_in_job(store(state_dir), name, state, say)

    def refuse(st: StateStore, rec: DeploymentRecord) -> None:
        if (rec.rollout is not None and not rec.rollout.stopped) or _pending(st, name, rec):
            raise K3Error("rollout-running", f"{name} is in a rollout under way", f"`k3launch status {name}` follows it; change it again once it is done")

    def done(rec: DeploymentRecord) -> bool:
        ro = rec.rollout
        return ro is None or (bool(ro.stopped) and not any(u.on == "rolling" for u in ro.units))  # a failed unit is back too

    def progress(rec: DeploymentRecord) -> list[str]:
        ro = rec.rollout
        return [f"{u.name}: {u.on}" + (f" ({u.failed})" if u.failed else "") for u in ro.units] if ro is not None else []

    revision = converge(name, {"rollout": state}, done=done, refuse=refuse, what="rollout", say=say, state_dir=state_dir,
                        access=access, progress=progress)
    return _result(store(state_dir), name, revision)


def _result(st: StateStore, name: str, revision: int) -> RolloutResult:
    """What the rollout of spec ``revision`` came to, as the record says."""
    rec = st.load(name)
    ro = rec.rollout
    if ro is None or ro.revision != revision:
        done = rec.control.finished if rec.control is not None else None
        if done is None or done.revision != revision:
            return RolloutResult(rec.plan, failed="-", reason="the rollout did not finish: `k3launch status` says where it is")
        ro = done
    return RolloutResult.of(rec.plan, ro)
