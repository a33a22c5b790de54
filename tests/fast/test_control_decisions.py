"""The one controller's decisions on a fake clock: a rollout is desired state that the same step
which restarts units converges, unit by unit (:mod:`k3launch.models.control.converge`); router
membership is observed and repaired; the memory survives a new controller; silence counts from
the last good answer."""

from __future__ import annotations

from functools import cache

from paths import ROOT

from k3launch.api.planning import plan
from k3launch.models.control.actions import Action, Gate, Restart, Route, Swap
from k3launch.models.control.converge import url
from k3launch.models.control.decisions import Supervision
from k3launch.models.control.memory import UnitState
from k3launch.models.control.observation import Observation
from k3launch.models.plan import Plan
from k3launch.models.rollout import RolloutState, RolloutUnit
from k3launch.models.supervise import RestartPolicy, units

INV = ROOT / "inventories" / "local.yaml"


@cache
def _plans(copies: int) -> tuple[Plan, Plan]:
    sel = {"recipe": "k3launch/tiny-llama", "strategy": "single_node_tp", "replicas": copies}
    return plan(INV, selection=sel), plan(INV, selection={**sel, "sets": ["max-num-seqs=4"]})


def _rollout(old: Plan, new: Plan, **kw: object) -> RolloutState:
    todo = [u for u in units(new) if u.kind != "router"]
    return RolloutState(old=old, new=new, changes=["--set max-num-seqs=4"], started=0, updated=0,
                        units=[RolloutUnit(name=u.name, processes=list(u.processes)) for u in todo], **kw)  # type: ignore[arg-type]


class World:
    """A deployment as the step sees it: which HTTP processes answer, what the router lists."""

    def __init__(self, p: Plan) -> None:
        self.plan = p
        self.healthy = {x.id: True for x in p.processes if x.http_port}
        self.router = next(x for x in p.processes if x.role == "router")
        self.listed = [url(x) for x in p.processes if x.role != "router" and x.http_port]
        self.dead: dict[str, str] = {}
        self.events: list[str] = []  # kinds of the events the executor's reports produced

    def look(self, now: float, **kw: object) -> Observation:
        return Observation(now, healthy=dict(self.healthy), dead=dict(self.dead), routers={self.router.id: tuple(self.listed)},
                           **kw)  # type: ignore[arg-type]

    def apply(self, sup: Supervision, actions: list[Action], now: float, gate: str = "") -> list[str]:
        """Carry out what the step asked, as the executor would; what was done, in order."""
        done = []
        for a in actions:
            if isinstance(a, Route):
                self.listed = [u for u in self.listed if u not in a.remove] + list(a.add)
                done += [f"+{u}" for u in a.add] + [f"-{u}" for u in a.remove]  # added first: never an empty router
            elif isinstance(a, Swap):
                done.append(f"swap {a.unit.name} {a.to}")
                sup.started(a.unit, now)
            elif isinstance(a, Restart):
                done.append(f"restart {a.unit.name}")
                self.dead.pop(a.unit.processes[0], None)
                sup.started(a.unit, now)
            elif isinstance(a, Gate):
                done.append(f"gate {a.unit.name}")
                events, more = sup.gated(a.unit, gate, now)
                self.events += [e.kind for e in events]
                done += self.apply(sup, more, now)
        return done


def _sup(p: Plan, **policy: object) -> Supervision:
    return Supervision(p, RestartPolicy.model_validate({"backoff": 0, **policy}), start_timeout=60.0)


def test_a_rollout_rolls_one_copy_at_a_time_out_of_the_router_drained_swapped_gated_and_back() -> None:
    old, new = _plans(2)
    w, sup = World(old), _sup(old)
    sup.rollout = _rollout(old, new)
    u0, u1 = (url(x) for x in old.processes if x.role != "router")
    done: list[str] = []
    kinds: list[str] = []
    for t in range(12):
        events, actions = sup.step(w.look(float(t), running={"r0-serve-0": 0.0 if t > 1 else 2.0, "r1-serve-0": 0.0}))
        kinds += [e.kind for e in events]
        done += w.apply(sup, actions, float(t))
    assert done == [f"-{u0}", "swap r0-serve-0 new", "gate r0-serve-0", f"+{u0}",
                    f"-{u1}", "swap r1-serve-0 new", "gate r1-serve-0", f"+{u1}"], done  # r0 back in before r1 leaves
    assert [u.on for u in sup.rollout.units] == ["new", "new"] and sup.rollout.done() and not sup.rollout.stopped
    assert kinds.count("rolling") == 2 and w.events.count("rolled") == 2
    assert sup.rollout.units[0].drained_s == 2.0  # running requests at t=1, none at t=2: drained after two looks


def test_a_kill_of_the_other_copy_during_a_roll_is_repaired_and_the_rollout_goes_on_after_it() -> None:
    old, new = _plans(2)
    w, sup = World(old), _sup(old)
    sup.rollout = _rollout(old, new)
    done: list[str] = []
    for t in range(16):
        if t == 1:  # r0 drains; r1 is killed
            w.dead["r1-serve-0"] = "exited with code 137"
            w.healthy["r1-serve-0"] = False
        if t == 2:
            w.healthy["r1-serve-0"] = True
        _events, actions = sup.step(w.look(float(t), running={"r0-serve-0": 0.0, "r1-serve-0": 0.0}))
        done += w.apply(sup, actions, float(t))
    r1 = [d for d in done if "r1-serve-0" in d or "12:" in d]
    assert "restart r1-serve-0" in done and done.index("restart r1-serve-0") < done.index("swap r1-serve-0 new"), done
    assert [u.on for u in sup.rollout.units] == ["new", "new"], (sup.rollout.units, r1)
    assert sup.restarts == 1 and len(sup.memory["r1-serve-0"].restarts) == 1  # counted as any restart


def test_a_unit_that_fails_its_gate_goes_back_and_the_rollout_stops_with_the_other_untouched() -> None:
    old, new = _plans(2)
    w, sup = World(old), _sup(old)
    sup.rollout = _rollout(old, new)
    done: list[str] = []
    for t in range(10):
        _events, actions = sup.step(w.look(float(t), running={"r0-serve-0": 0.0}))
        done += w.apply(sup, actions, float(t), gate="canary: 'Hello' expected [1] got [2]")
    assert "swap r0-serve-0 old" in done and "swap r1-serve-0 new" not in done, done
    assert sup.rollout.stopped.startswith("r0-serve-0 failed its gate: canary") and sup.rollout.units[0].failed
    assert [u.on for u in sup.rollout.units] == ["old", "old"]
    assert all(sup.state(u.name) is UnitState.SERVING for u in sup.units)
    assert sorted(w.listed) == sorted(url(x) for x in old.processes if x.role != "router")  # everyone back in


def test_max_unavailable_rolls_a_batch_together() -> None:
    old, new = _plans(3)
    w, sup = World(old), _sup(old)
    sup.rollout = _rollout(old, new, max_unavailable=2)
    _events, actions = sup.step(w.look(0.0))
    assert next(a for a in actions if isinstance(a, Route)).remove and len(next(a for a in actions if isinstance(a, Route)).remove) == 2
    assert [sup.state(n) for n in ("r0-serve-0", "r1-serve-0", "r2-serve-0")] == [UnitState.DRAINING, UnitState.DRAINING, UnitState.SERVING]


def test_membership_is_observed_a_serving_copy_missing_from_the_router_is_added_a_stranger_removed() -> None:
    old, _ = _plans(2)
    w, sup = World(old), _sup(old)
    u0 = url(next(x for x in old.processes if x.id == "r0-serve-0"))
    w.listed = [x for x in w.listed if x != u0] + ["http://10.9.9.9:8000"]  # r0 left out (an interrupted command), a stray worker
    _, actions = sup.step(w.look(0.0))
    route = next(a for a in actions if isinstance(a, Route))
    assert route.add == (u0,) and route.remove == ("http://10.9.9.9:8000",) and "not an engine of the plan" in route.reason
    w.apply(sup, actions, 0.0)
    assert not [a for a in sup.step(w.look(1.0))[1] if isinstance(a, Route)]  # converged: nothing more to do


def test_a_new_controller_adopts_the_memory_restart_counts_and_a_roll_under_way() -> None:
    old, new = _plans(2)
    w, sup = World(old), _sup(old)
    sup.rollout = _rollout(old, new)
    w.apply(sup, sup.step(w.look(0.0, running={"r0-serve-0": 1.0}))[1], 0.0)  # r0 leaves the router, draining
    w.dead["r1-serve-0"] = "exited with code 137"
    w.apply(sup, sup.step(w.look(1.0, running={"r0-serve-0": 1.0}))[1], 1.0)
    saved = sup.dump(revision=3)
    assert saved.units["r0-serve-0"].state == "draining" and saved.restarts == 1
    again = _sup(old)
    again.rollout = sup.rollout
    again.restore(saved, 2.0)
    assert again.restarts == 1 and len(again.memory["r1-serve-0"].restarts) == 1
    # caught draining, r0 never swapped: it serves its old plan, and rolls again once the others serve
    assert again.state("r0-serve-0") is UnitState.SERVING and again.rollout is not None and again.rollout.units[0].on == "old"


def test_silence_counts_from_the_last_good_answer() -> None:
    old, _ = _plans(2)
    w, sup = World(old), _sup(old, unhealthy_after=3, poll=0.5)
    sup.step(w.look(0.0))
    w.healthy["r0-serve-0"] = False  # SIGSTOP: the first failed probe returns after its 3 s timeout
    _, actions = sup.step(w.look(3.5))
    assert any(isinstance(a, Restart) and a.hung for a in actions), actions  # 3.5 s after the last answer, not 3 s after this look


def test_re_placement_keeps_every_slot_but_the_lost_one_on_its_node() -> None:
    """The first copy's node is lost: planning again from the origin alone would shift the second
    copy onto the first one's slot (and call its own node a spare); with ``keep`` only the lost
    slot takes a spare."""
    sel = {"recipe": "k3launch/tiny-llama", "strategy": "single_node_tp", "replicas": 2}
    old = plan(INV, selection=sel)
    nodes = {p.id: p.node for p in old.processes if p.role != "router"}
    lost = nodes["r0-serve-0"]
    slots = list(dict.fromkeys(p.node for p in old.processes if p.role != "router"))
    shifted = plan(INV, selection=sel, exclude=[lost])
    again = plan(INV, selection=sel, exclude=[lost], keep=slots)
    moved = {p.id: p.node for p in again.processes if p.role != "router"}
    assert {p.id: p.node for p in shifted.processes if p.role != "router"}["r1-serve-0"] != nodes["r1-serve-0"]  # the bug it fixes
    assert moved["r1-serve-0"] == nodes["r1-serve-0"] and moved["r0-serve-0"] not in nodes.values(), (nodes, moved)
    assert [p for p in again.processes if p.id == "r1-serve-0"] == [p for p in old.processes if p.id == "r1-serve-0"]


def test_scale_out_is_one_resize_while_everything_serves_and_new_copies_beyond_the_wanted_are_standbys() -> None:
    from k3launch.models.control.actions import Resize

    old, _ = _plans(2)
    w, sup = World(old), _sup(old)
    sup.copies_wanted, sup.standby_wanted = 3, 1
    _, actions = sup.step(w.look(0.0))
    assert [a for a in actions if isinstance(a, Resize)] == [Resize(4, (), "out to 4 copies")]
    assert not [a for a in sup.step(w.look(1.0))[1] if isinstance(a, Resize)]  # one at a time: the executor reports back
    big, _ = _plans(4)
    started = [u.name for u in units(big) if u.name.startswith(("r2", "r3"))]
    sup.resized(big, started, 2.0)
    w = World(big)
    w.listed = [x for x in w.listed if "13:" not in x and "14:" not in x]  # the router knows the first two copies
    events, actions = sup.step(w.look(3.0))
    done = w.apply(sup, actions, 3.0)
    assert sup.standby == {"r3"} and sup.scaled(), (sup.standby, [e.kind for e in events])
    r2 = url(next(x for x in big.processes if x.id == "r2-serve-0"))
    assert done == [f"+{r2}"], done  # r2 joins the router; the standby r3 serves, out of it


def test_scale_in_drains_the_highest_copies_then_resizes() -> None:
    from k3launch.models.control.actions import Resize

    big, _ = _plans(4)
    w, sup = World(big), _sup(big)
    sup.copies_wanted = 2
    _events, actions = sup.step(w.look(0.0, running={"r2-serve-0": 1.0, "r3-serve-0": 0.0}))
    done = w.apply(sup, actions, 0.0)
    assert [sup.state(f"r{i}-serve-0") for i in range(4)] == [UnitState.SERVING] * 2 + [UnitState.DRAINING] * 2
    assert len(done) == 2 and all(d.startswith("-") for d in done), done  # both leave the router first
    _, actions = sup.step(w.look(1.0, running={"r2-serve-0": 1.0, "r3-serve-0": 0.0}))
    assert not [a for a in actions if isinstance(a, Resize)]  # r2 still has a request running
    _, actions = sup.step(w.look(2.0, running={"r2-serve-0": 0.0, "r3-serve-0": 0.0}))
    assert [a for a in actions if isinstance(a, Resize)] == [Resize(2, ("r2", "r3"), "in to 2 copies: r2, r3 drained")]


def test_a_standby_takes_a_failed_copys_place_in_the_same_look() -> None:
    old, _ = _plans(3)
    w, sup = World(old), _sup(old)
    sup.copies_wanted, sup.standby_wanted = 2, 1
    w.apply(sup, sup.step(w.look(0.0))[1], 0.0)  # r2 becomes the standby and leaves the router
    r2 = url(next(x for x in old.processes if x.id == "r2-serve-0"))
    r0 = url(next(x for x in old.processes if x.id == "r0-serve-0"))
    assert sup.standby == {"r2"} and r2 not in w.listed
    w.dead["r0-serve-0"] = "exited with code 137"
    w.healthy["r0-serve-0"] = False
    events, actions = sup.step(w.look(1.0))
    done = w.apply(sup, actions, 1.0)
    assert "promoted" in [e.kind for e in events] and sup.standby == {"r0"}
    assert done[:2] == [f"+{r2}", f"-{r0}"] and "restart r0-serve-0" in done, done  # in before the failed one is out
    w.healthy["r0-serve-0"] = True
    w.apply(sup, sup.step(w.look(2.0))[1], 2.0)
    assert sup.state("r0-serve-0") is UnitState.SERVING and r0 not in w.listed and sup.scaled()  # back, as the standby


def test_a_copy_that_rolls_hands_its_place_in_the_router_to_a_standby_first() -> None:
    """One serving copy and one standby (``up --replicas 1 --standby 1``): each copy that rolls
    leaves the router only once the standby is in it; it rolls as the standby. The router never
    lists no engine, and both copies end on the new plan."""
    old, new = _plans(2)
    w, sup = World(old), _sup(old)
    sup.copies_wanted, sup.standby_wanted = 1, 1
    w.apply(sup, sup.step(w.look(0.0))[1], 0.0)  # r1 becomes the standby and leaves the router
    u0, u1 = (url(x) for x in old.processes if x.role != "router")
    assert sup.standby == {"r1"} and w.listed == [u0]
    sup.rollout = _rollout(old, new)
    done: list[str] = []
    kinds: list[str] = []
    listed: list[list[str]] = []
    for t in range(1, 14):
        events, actions = sup.step(w.look(float(t), running={"r0-serve-0": 0.0, "r1-serve-0": 0.0}))
        kinds += [e.kind for e in events]
        done += w.apply(sup, actions, float(t))
        listed.append(list(w.listed))
    assert done[:3] == [f"+{u1}", f"-{u0}", "swap r0-serve-0 new"], done  # the standby is in before r0 leaves
    assert done.index("gate r0-serve-0") < done.index(f"+{u0}") < done.index(f"-{u1}") < done.index("swap r1-serve-0 new"), done
    assert [u.on for u in sup.rollout.units] == ["new", "new"] and sup.rollout.done(), sup.rollout.units
    assert kinds.count("promoted") == 2 and sup.standby == {"r1"} and w.listed == [u0], (kinds, sup.standby, w.listed)
    assert all(len(x) >= 1 for x in listed), listed
