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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from k3launch.api._common import load, store
from k3launch.api._rollgate import both_gates, canary_gate
from k3launch.deploy.rollout import Gate, RolloutResult, pd_plan
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord
from k3launch.models.rollout import On, RolloutState, RolloutUnit, changes_typed
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
    if rec.rollout is not None:
        if not rec.rollout.stopped:
            with st.lock(name):  # deployment-busy while the rollout's command holds it; else that command died
                pass
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


def _surge_preview(old: Plan, replan: Callable[[Sequence[str]], Plan], typed: tuple[str, ...]) -> RolloutPreview:
    """The new plan with every engine on nodes the deployment does not use (``replan`` excludes
    them), in the next generation of process ids (:mod:`k3launch.planning.surge`)."""
    from k3launch.planning.surge import generation, renamed

    router = next((p for p in old.processes if p.role == "router"), None)
    if router is None:
        raise K3Error("surge-no-router", f"{old.name} has no router: its endpoint is the engine itself, and engines on other nodes "
                      "would have another address", "--allow-downtime restarts it in place; copies (--replicas 2) get a router")
    if pd_plan(old):
        raise K3Error("surge-pd", "vllm-router's P/D mode cannot add instances over HTTP, so a new set cannot be switched to",
                      "--allow-downtime rolls each instance in place")
    if old.fault_tolerance:
        raise K3Error("surge-fault-tolerance", f"{old.name} runs vLLM's fault tolerance, whose pools a surge does not rename yet",
                      "--allow-downtime restarts it in place")
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


def rollout(name: str, *, sets: Sequence[str] = (), unsets: Sequence[str] = (), env: Sequence[str] = (), image: str | None = None,
            vllm_version: str | None = None, drain_timeout: float = 120.0, start_timeout: float | None = None,
            max_unavailable: int = 1, allow_downtime: bool = False, say: Callable[[str], None] = lambda _: None,
            state_dir: str | Path | None = None, accept_unknown_hosts: bool = False, connect_timeout: float = 10.0,
            preview: RolloutPreview | None = None, gate: Gate | None = None, surge: bool = False, canary: bool = True,
            rebaseline: bool = False) -> RolloutResult:
    """Apply :func:`rollout_preview`'s plan ``max_unavailable`` units at a time
    (:mod:`k3launch.deploy.rollout`). A running supervisor is stopped for the rollout and started
    again after it with its policy. A rollout that would leave no engine in the router (one engine
    unit, or ``max_unavailable`` as many as there are) is refused unless ``allow_downtime``.
    ``preview``: one the caller has shown already (else it is made here); ``gate``: an extra check
    of each restarted unit. The record holds both plans and where each unit is throughout, and
    the deployment's lock is held: a second rollout or a ``down`` meanwhile is ``deployment-busy``.
    ``surge``: start the whole new set of engines on spare nodes beside the old one, gate it,
    switch the router over, then drain and stop the old set (no unit is ever out of service).
    ``canary``: each restarted unit also replays the correctness canary (:func:`canary_gate`;
    ``rebaseline`` when the change makes its answers stale), after ``gate`` if one is given."""
    preview = preview or rollout_preview(name, sets=sets, unsets=unsets, env=env, image=image, vllm_version=vllm_version,
                                         surge=surge, state_dir=state_dir)
    if not preview.units:
        raise K3Error("no-change", "the change leaves every process as it is", "`k3launch rollout NAME ... --dry-run` shows the plan")
    engines = [u for u in units(preview.old) if u.kind != "router"]
    if max_unavailable < 1:
        raise K3Error("bad-max-unavailable", f"--max-unavailable {max_unavailable}: at least 1 unit rolls at a time", "e.g. --max-unavailable 1")
    if pd_plan(preview.old) and not allow_downtime:
        raise K3Error("rollout-pd", f"{name} is P/D: vllm-router's P/D mode can take an instance out of its lists but not add it "
                      "back, so each instance must restart in place, and requests paired with it fail until the router's "
                      "health check skips it (about a second)", "--allow-downtime rolls it so, one instance at a time")
    if len(engines) <= max_unavailable and not allow_downtime and not preview.surge:
        what = f"one engine ({engines[0].name if engines else 'none'})" if len(engines) < 2 else f"{len(engines)} engine units"
        raise K3Error("rollout-downtime", f"{name} is {what}: rolling {max_unavailable} at a time stops serving",
                      "--surge starts the new engines on spare nodes first; --allow-downtime restarts them anyway; "
                      "or a smaller --max-unavailable, or copies (--replicas 2) behind the router")
    if canary:
        gate = both_gates(gate, canary_gate(store(state_dir), name, preview, rebaseline))
    now = time.time()
    state = RolloutState(old=preview.old, new=preview.new, changes=list(preview.changes), started=now, updated=now, surge=preview.surge,
                         units=[RolloutUnit(name=u.name, processes=list(u.processes)) for u in preview.units])
    return _roll(name, preview.old, preview.new, preview.units, state, lambda on: on, max_unavailable=max_unavailable,
                 drain_timeout=drain_timeout, start_timeout=start_timeout, say=say, state_dir=state_dir,
                 accept_unknown_hosts=accept_unknown_hosts, connect_timeout=connect_timeout, gate=gate)


def rollout_continue(name: str, *, rollback: bool = False, drain_timeout: float = 120.0, start_timeout: float | None = None,
                     max_unavailable: int = 1, say: Callable[[str], None] = lambda _: None, state_dir: str | Path | None = None,
                     accept_unknown_hosts: bool = False, connect_timeout: float = 10.0, gate: Gate | None = None,
                     canary: bool = True) -> RolloutResult:
    """Resume ``name``'s stopped rollout: roll the units that do not run the new plan yet (a unit
    that failed its gate is tried again). ``rollback``: take the units that run the new plan back
    to the old one instead, last rolled first. Either way the record drops the rollout once every
    unit runs one plan. ``nothing-to-continue`` (exit 2) when no rollout stopped."""
    st = store(state_dir)
    rec = st.load(name)
    state = rec.rollout
    if state is None:
        raise K3Error("nothing-to-continue", f"{name} has no stopped rollout", f"`k3launch rollout {name} --set FLAG=VALUE ...` starts one")
    if rec.state not in ROLLABLE:
        raise K3Error("not-ready", f"{name} is {rec.state}: only a ready deployment is rolled", f"`k3launch status {name}`")
    if state.surge:
        if not rollback:
            raise K3Error("surge-stopped", f"{name}'s surge stopped midway ({state.stopped or 'its command ended'}); it is not resumed",
                          f"`k3launch rollout {name} --rollback` stops the new engines, then `rollout --surge` again")
        return _surge_back(name, state, say=say, state_dir=state_dir, accept_unknown_hosts=accept_unknown_hosts,
                           connect_timeout=connect_timeout)
    todo = list(reversed(state.rolled())) if rollback else state.pending()
    target = state.old if rollback else state.new
    order = {n: i for i, n in enumerate(todo)}
    picked = sorted((u for u in units(target) if u.name in order), key=lambda u: order[u.name])
    # back to the old plan, "new" means "old": the record names plans, the roller only its target
    flip: Callable[[On], On] = (lambda on: "old" if on == "new" else "new" if on == "old" else on) if rollback else (lambda on: on)
    if canary:  # answers recorded for the other plan are stale for this one: the first unit records anew
        ahead = _with_rebaseline(st, name, RolloutPreview(rec.plan, target, [], picked))
        gate = both_gates(gate, canary_gate(st, name, ahead, bool(ahead.rebaseline)))
    return _roll(name, rec.plan, target, picked, state, flip, max_unavailable=max_unavailable, drain_timeout=drain_timeout,
                 start_timeout=start_timeout, say=say, state_dir=state_dir, accept_unknown_hosts=accept_unknown_hosts,
                 connect_timeout=connect_timeout, gate=gate)


def _surge_back(name: str, state: RolloutState, *, say: Callable[[str], None], state_dir: str | Path | None,
                accept_unknown_hosts: bool, connect_timeout: float) -> RolloutResult:
    """Undo a surge that stopped midway: stop the new set, run on the old plan again (its
    engines must still be running: a surge stops them only after the router switched)."""
    from k3launch.api._common import access
    from k3launch.deploy.registry import supervise_ops
    from k3launch.deploy.rollout import GRACE_S

    st = store(state_dir)
    with _supervisor_paused(st, name, say, state_dir), st.lock(name):
        rec = st.load(name)
        old_ids = {p.id for p in state.old.processes}
        missing = sorted(old_ids - set(rec.processes))
        if missing:
            raise K3Error("surge-switched", f"{name}'s old engines are stopped already ({', '.join(missing[:3])}): the switch is done",
                          f"`k3launch status {name}`; `down` then `up` brings it back to one plan")
        ops = supervise_ops(rec.backend, "rollout", [access(accept_unknown_hosts, connect_timeout)])
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


def _roll(name: str, current: Plan, target: Plan, todo: Sequence[Unit], state: RolloutState, flip: Callable[[On], On], *,
          max_unavailable: int, drain_timeout: float, start_timeout: float | None, say: Callable[[str], None],
          state_dir: str | Path | None, accept_unknown_hosts: bool, connect_timeout: float, gate: Gate | None) -> RolloutResult:
    from k3launch.api._common import access
    from k3launch.api.lifecycle import ready_timeout
    from k3launch.deploy.registry import supervise_ops
    from k3launch.deploy.rollout import Roller
    from k3launch.models.backends import Feature, require

    st = store(state_dir)
    rec = st.load(name)
    require(rec.backend, Feature.ROLLOUT, "rollout")
    ops = supervise_ops(rec.backend, "rollout", [access(accept_unknown_hosts, connect_timeout)])
    state.stopped = ""
    stopped = "interrupted: the rollout command ended"  # unless it gets further
    with _supervisor_paused(st, name, say, state_dir):
        # held throughout: a second rollout, a `down` or a restarting supervisor is refused meanwhile
        with st.lock(name):
            watcher = ops.watcher(st.load(name), st)

            def keep(r: DeploymentRecord) -> None:
                r.rollout = state

            def mark(unit: str, on: On, why: str) -> None:
                state.mark(unit, flip(on), why, time.time())
                watcher.note(keep)

            try:
                watcher.note(keep)
                roller = Roller(watcher, current, target, drain_timeout=drain_timeout, say=say, mark=mark, gate=gate,
                                start_timeout=start_timeout or ready_timeout(target))
                if state.surge:
                    from k3launch.planning.surge import beside

                    result = roller.surge(beside(current, target), target, todo, [u for u in units(current) if u.kind != "router"])
                else:
                    result = roller.run(todo, batch=max_unavailable)
                stopped = "" if result.ok else f"{result.failed} failed its gate: {result.reason}"
                one_plan = result.ok and (not state.pending() or not state.rolled())
                if one_plan:
                    watcher.adopt(target, "")  # the target plan whole: its origin, for the next rollout
                    result.plan = target
            finally:
                state.stopped = stopped

                def settle(r: DeploymentRecord) -> None:
                    # a surge that failed left the old engines as they were: nothing to continue or undo
                    done = not stopped and (not state.pending() or not state.rolled())
                    r.rollout = None if done or (state.surge and stopped and not state.rolled()) else state

                watcher.note(settle)
                watcher.close()
    return result


@contextmanager
def _supervisor_paused(st: StateStore, name: str, say: Callable[[str], None], state_dir: str | Path | None) -> Iterator[None]:
    """A supervisor watching ``name`` is stopped meanwhile (it would restart a unit being
    drained), then started again as it was started (policy, --on-event, SSH options)."""
    from k3launch.api.supervision import stop_supervisor, supervise_detached
    from k3launch.deploy.supervisors import last_args

    sv = st.load(name).supervisor
    if sv is not None:
        say(stop_supervisor(name, state_dir=state_dir) or "supervisor stopped for the rollout")
    try:
        yield
    finally:
        if sv is not None:
            args = (last_args(st, name) if sv.detached else None) or sv.policy.args()  # a foreground one: by its policy
            try:
                supervise_detached(name, args, state_dir=state_dir)
                say("supervisor started again")
            except K3Error as exc:  # a `down` took the deployment meanwhile: nothing left to watch
                say(f"supervisor not started again: {exc.message}")
