"""The supervisor's decisions (k3launch.models.supervise), without processes: recovery units per
strategy, restart policy (backoff, window, give-up), hung engines, lost nodes."""

from __future__ import annotations

from functools import cache

import pytest

from k3launch import api
from k3launch.models.control.actions import GiveUp, Replace, Restart, StopAll
from k3launch.models.control.decisions import Supervision
from k3launch.models.control.memory import UnitState
from k3launch.models.control.observation import Observation
from k3launch.models.plan import Plan
from k3launch.models.supervise import RestartPolicy, units

RECIPE = "moonshotai/Kimi-K3"


@cache
def _plan(strategy: str, recipe: str = RECIPE) -> Plan:
    return api.plan(None, recipe=recipe, strategy=strategy, name="t-" + strategy.replace("_", "-"))


def _kinds(events: list[object]) -> list[str]:
    return [e.kind for e in events]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("strategy", "recipe", "want"), [
    ("multi_node_replicas", "k3launch/tiny-llama", [("serve-0", "engine", ("serve-0",)), ("serve-1", "engine", ("serve-1",)),
                                                     ("router", "router", ("router",))]),
    ("multi_node_tp", RECIPE, [("serve", "group", ("serve-0", "serve-1"))]),
    ("multi_node_tep", RECIPE, [("serve", "group", ("serve-0", "serve-1"))]),
    ("multi_node_dep", RECIPE, [("serve", "group", ("serve-0", "serve-1")), ("router", "router", ("router",))]),
    ("pd_cluster", RECIPE, [("prefill-0", "engine", ("prefill-0",)), ("decode", "group", ("decode-0", "decode-1")),
                            ("router", "router", ("router",))]),
    ("single_node_tp", RECIPE, [("serve-0", "engine", ("serve-0",))]),
])
def test_recovery_units_follow_the_strategy(strategy: str, recipe: str, want: list[tuple[str, str, tuple[str, ...]]]) -> None:
    """Ranks of one multi-node engine (TP, TEP, DEP) restart together; an engine on one node, and the router, alone."""
    got = [(u.name, u.kind, u.processes) for u in units(_plan(strategy, recipe))]
    assert got == want


def _sup(strategy: str = "multi_node_replicas", recipe: str = "k3launch/tiny-llama", **policy: object) -> Supervision:
    return Supervision(_plan(strategy, recipe), RestartPolicy.model_validate(policy), start_timeout=60.0)


ALL_OK = {"serve-0": True, "serve-1": True, "router": True}


def test_an_exit_is_restarted_at_once_then_reported_serving_with_its_seconds() -> None:
    s = _sup()
    ev, acts = s.step(Observation(100.0, dead={"serve-1": "exited with code 137"}, healthy={"serve-0": True, "router": True}))
    assert _kinds(ev) == ["detected", "restarting"]
    assert ev[0].unit == "serve-1" and ev[0].process == "serve-1" and ev[0].node == "local-2" and "137" in ev[0].reason
    assert [type(a) for a in acts] == [Restart] and acts[0].unit.name == "serve-1" and acts[0].attempt == 1  # type: ignore[union-attr]
    s.started(s.unit("serve-1"), 101.0)
    ev, acts = s.step(Observation(103.0, healthy={**ALL_OK, "serve-1": False}))
    assert ev == [] and acts == [] and s.state("serve-1") is UnitState.STARTING  # loading: not yet serving, not a failure
    ev, acts = s.step(Observation(104.5, healthy=ALL_OK))
    assert _kinds(ev) == ["restarted"] and ev[0].seconds == pytest.approx(4.5) and acts == []
    assert s.state("serve-1") is UnitState.SERVING and s.restarts == 1


def test_backoff_doubles_within_the_window_and_gives_up_after_max_restarts() -> None:
    s = _sup(max_restarts=3, backoff=5, backoff_max=8, window=1000)
    t, waits = 0.0, []
    for _ in range(3):
        ev, acts = s.step(Observation(t, dead={"serve-0": "exited with code 1"}, healthy={"serve-1": True, "router": True}))
        if not acts:  # a backoff: nothing until it is over
            (b,) = [e for e in ev if e.kind == "backoff"]
            waits.append(b.seconds)
            assert s.step(Observation(t + b.seconds - 0.1, healthy={"serve-1": True, "router": True}))[1] == []
            t += b.seconds
            ev, acts = s.step(Observation(t, healthy={"serve-1": True, "router": True}))
        else:
            waits.append(0.0)
        assert [type(a) for a in acts] == [Restart]
        s.started(s.unit("serve-0"), t)
        t += 1
        s.step(Observation(t, healthy=ALL_OK))
        t += 1
    assert waits == [0.0, 5.0, 8.0]  # at once, then backoff, then doubled but capped
    ev, acts = s.step(Observation(t, dead={"serve-0": "exited with code 1"}, healthy={"serve-1": True, "router": True}))
    assert _kinds(ev) == ["detected", "gave-up"] and "3 restarts within 1000s" in ev[1].reason
    assert [type(a) for a in acts] == [GiveUp]  # the other replica still serves: the deployment goes on
    assert s.can_serve()


def test_restarts_older_than_the_window_do_not_count() -> None:
    s = _sup(max_restarts=1, window=50)
    _, acts = s.step(Observation(0.0, dead={"serve-0": "exited"}))
    s.started(s.unit("serve-0"), 0.0)
    s.step(Observation(1.0, healthy=ALL_OK))
    _, acts = s.step(Observation(60.0, dead={"serve-0": "exited"}))
    assert [type(a) for a in acts] == [Restart]  # the first restart left the window


def test_the_last_unit_of_a_role_given_up_stops_everything() -> None:
    s = _sup("single_node_tp", RECIPE, policy="never")
    ev, acts = s.step(Observation(5.0, dead={"serve-0": "exited with code 1: ValueError: boom"}, tails={"serve-0": "ValueError: boom\n"}))
    assert _kinds(ev) == ["detected", "gave-up", "failed"]
    assert ev[0].log_tail == "ValueError: boom\n" and "restart policy never" in ev[1].reason
    assert [type(a) for a in acts] == [GiveUp, StopAll] and not s.can_serve() and s.failing() == ("serve-0",)


def test_a_pd_deployment_without_its_decode_pool_cannot_serve() -> None:
    s = _sup("pd_cluster", RECIPE, policy="never")
    _, acts = s.step(Observation(1.0, dead={"decode-1": "exited"}))
    assert [type(a) for a in acts] == [GiveUp, StopAll]
    assert acts[0].unit.processes == ("decode-0", "decode-1")  # type: ignore[union-attr]


def test_one_dead_rank_restarts_the_whole_group() -> None:
    s = _sup("multi_node_tp", RECIPE)
    ev, acts = s.step(Observation(1.0, dead={"serve-1": "exited with code 1"}, healthy={"serve-0": True}))
    assert [type(a) for a in acts] == [Restart] and acts[0].unit.processes == ("serve-0", "serve-1")  # type: ignore[union-attr]
    assert ev[0].node == "local-2"


def test_a_hung_engine_is_detected_after_unhealthy_after_and_restarted() -> None:
    s = _sup(unhealthy_after=10)
    sick = {**ALL_OK, "serve-0": False}
    assert s.step(Observation(0.0, healthy=sick)) == ([], [])
    assert s.step(Observation(9.0, healthy=sick)) == ([], [])
    ev, acts = s.step(Observation(10.0, healthy=sick))
    assert _kinds(ev) == ["detected", "restarting"] and "hung" in ev[0].reason and [type(a) for a in acts] == [Restart]


def test_a_healthy_answer_resets_the_hung_clock() -> None:
    s = _sup(unhealthy_after=10)
    s.step(Observation(0.0, healthy={**ALL_OK, "serve-0": False}))
    s.step(Observation(5.0, healthy=ALL_OK))
    assert s.step(Observation(12.0, healthy={**ALL_OK, "serve-0": False})) == ([], [])


def test_an_engine_that_answers_but_holds_requests_and_generates_nothing_is_hung() -> None:
    """Up but not serving: /health 200, requests held, the token count still for unhealthy_after."""
    s = _sup(unhealthy_after=10)
    busy = {"serve-0": (2.0, 500.0), "serve-1": (1.0, 40.0)}
    assert s.step(Observation(0.0, healthy=ALL_OK, work=busy)) == ([], [])
    # serve-1 keeps generating; serve-0 holds its two requests and generates nothing
    assert s.step(Observation(9.0, healthy=ALL_OK, work={**busy, "serve-1": (1.0, 90.0)})) == ([], [])
    ev, acts = s.step(Observation(10.0, healthy=ALL_OK, work={**busy, "serve-1": (1.0, 140.0)}))
    assert _kinds(ev) == ["detected", "restarting"] and ev[0].process == "serve-0", ev
    assert "2 request(s) held and no token generated for 10s, /health answering" in ev[0].reason
    assert [type(a) for a in acts] == [Restart] and acts[0].unit.name == "serve-0"  # type: ignore[union-attr]


def test_an_idle_engine_or_one_whose_tokens_move_is_not_hung() -> None:
    s = _sup(unhealthy_after=10)
    for t in range(0, 40, 5):  # idle: nothing held, no token
        assert s.step(Observation(float(t), healthy=ALL_OK, work={"serve-0": (0.0, 7.0)})) == ([], [])
    for t in range(40, 80, 5):  # busy and generating (slowly)
        assert s.step(Observation(float(t), healthy=ALL_OK, work={"serve-0": (3.0, 7.0 + t)})) == ([], [])
    for t in range(80, 120, 5):  # unreadable /metrics says nothing
        assert s.step(Observation(float(t), healthy=ALL_OK)) == ([], [])


def test_a_restart_that_never_serves_fails_after_the_start_timeout() -> None:
    s = Supervision(_plan("multi_node_replicas", "k3launch/tiny-llama"), RestartPolicy(start_timeout=30), start_timeout=999)
    s.step(Observation(0.0, dead={"serve-0": "exited"}))
    s.started(s.unit("serve-0"), 0.0)
    ev, acts = s.step(Observation(31.0, healthy={**ALL_OK, "serve-0": False}))
    assert _kinds(ev)[:1] == ["restart-failed"] and "not serving 30s after the restart" in ev[0].reason
    assert any(e.kind == "backoff" for e in ev) and acts == []


def test_a_restart_whose_processes_use_no_cpu_fails_after_stall_after_not_the_start_timeout() -> None:
    """A starting engine stuck in the kernel (or stopped, or blocked on storage) never serves: its
    session's CPU ticks stand still. Any new tick, in any look, starts the clock again."""
    s = _sup(stall_after=20, start_timeout=600, backoff=0)
    s.step(Observation(0.0, dead={"serve-0": "exited"}))
    s.started(s.unit("serve-0"), 0.0)
    starting = {**ALL_OK, "serve-0": False}
    for t, ticks in ((1.0, 10), (5.0, 40), (15.0, 40), (24.0, 40)):  # busy until 5 s, then still: 19 s < 20 s
        ev, acts = s.step(Observation(t, healthy=starting, cpu={"serve-0": (ticks, "state R")}))
        assert ev == [] and acts == [] and s.state("serve-0") is UnitState.STARTING
    ev, acts = s.step(Observation(25.5, healthy=starting, cpu={"serve-0": (40, "state R")}))
    assert _kinds(ev) == ["restart-failed", "restarting"] and ev[0].process == "serve-0"
    assert ev[0].reason == "serve-0 hung: no CPU time used for 20s while starting; state R"
    assert [type(a) for a in acts] == [Restart] and acts[0].hung  # type: ignore[union-attr]
    # the new attempt's clock starts afresh (the old ticks are not compared with the new session's)
    s.started(s.unit("serve-0"), 26.0)
    assert s.step(Observation(40.0, healthy=starting, cpu={"serve-0": (40, "state S")})) == ([], [])
    ev, _ = s.step(Observation(59.0, healthy=starting, cpu={"serve-0": (40, "state S")}))
    assert ev == []  # 19 s since the first look of this attempt
    ev, _ = s.step(Observation(61.0, healthy=ALL_OK, cpu={"serve-0": (40, "state S")}))
    assert _kinds(ev) == ["restarted"]  # serving wins: the stall clock only runs while starting


@pytest.mark.parametrize("policy", [{"stall_after": 0}, {}])
def test_stall_after_zero_never_fires_and_a_serving_engine_is_never_judged_by_cpu(policy: dict[str, float]) -> None:
    s = _sup(**policy)
    if policy:  # off: only the start timeout ends a start
        s.step(Observation(0.0, dead={"serve-0": "exited"}))
        s.started(s.unit("serve-0"), 0.0)
        for t in (1.0, 50.0, 59.0):
            assert s.step(Observation(t, healthy={**ALL_OK, "serve-0": False}, cpu={"serve-0": (7, "state D in nfs_wait")}))[0] == []
        assert _kinds(s.step(Observation(61.0, healthy={**ALL_OK, "serve-0": False}))[0])[:1] == ["restart-failed"]
    else:  # serving engines idle for hours are fine
        for t in (1.0, 500.0, 5000.0):
            assert s.step(Observation(t, healthy=ALL_OK, cpu={"serve-0": (7, "state S")})) == ([], [])


def test_a_start_that_fails_counts_as_an_attempt() -> None:
    s = _sup(policy="on-failure", max_restarts=1)
    s.step(Observation(0.0, dead={"serve-0": "exited"}))
    ev, acts = s.start_failed(s.unit("serve-0"), 1.0, "could not start serve-0 on local-1: start command exited 1", "serve-0", "no such file")
    assert _kinds(ev) == ["restart-failed", "gave-up"] and ev[0].log_tail == "no such file" and [type(a) for a in acts] == [GiveUp]


def test_a_silent_node_waits_then_restarts_its_unit_uncounted_and_is_lost_after_node_lost_after() -> None:
    s = _sup(node_lost_after=30, max_restarts=0, policy="on-failure")
    ev, acts = s.step(Observation(0.0, unreachable={"local-2": "no answer for 10s"}, healthy={"serve-0": True, "router": True}))
    assert _kinds(ev) == ["node-unreachable", "detected"] and acts == [] and s.state("serve-1") is UnitState.WAITING_NODE
    ev, acts = s.step(Observation(31.0, unreachable={"local-2": "no answer"}, healthy={"serve-0": True, "router": True}))
    assert _kinds(ev) == ["node-lost"] and [type(a) for a in acts] == [Replace]  # cordon and re-place (the executor may not)
    assert acts[0].node == "local-2" and [u.name for u in acts[0].units] == ["serve-1"]  # type: ignore[union-attr]
    ev, acts = s.step(Observation(40.0, healthy={"serve-0": True, "router": True}))
    assert _kinds(ev) == ["node-back", "restarting"] and [type(a) for a in acts] == [Restart]  # max_restarts 0: a lost node is not a crash


def test_policy_values_are_bounded() -> None:
    from pydantic import ValidationError

    for bad in ({"max_restarts": -1}, {"window": 0}, {"poll": 0.0}, {"policy": "always"}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            RestartPolicy.model_validate(bad)
    assert [RestartPolicy(backoff=10, backoff_max=300).delay(n) for n in range(7)] == [0, 10, 20, 40, 80, 160, 300]


def _ft() -> Supervision:
    plan = api.plan(None, recipe=RECIPE, strategy="multi_node_dep", fault_tolerance=True, name="t-ft")
    return Supervision(plan, RestartPolicy(), start_timeout=60.0)


def test_vllm_fault_tolerance_retry_goes_to_every_rank_once_all_are_unhealthy_then_recovers() -> None:
    from k3launch.models.control.actions import FtRetry

    s = _ft()
    (u,) = [x for x in s.units if x.kind == "group"]
    ranks = u.processes
    assert len(ranks) == 16 and s.ft[u.name].processes == list(ranks)
    ok = {r: "healthy" for r in ranks}
    some = {**ok, ranks[3]: "unhealthy"}
    ev, acts = s.step(Observation(0.0, ft=some, healthy=dict.fromkeys(ranks, True)))
    assert _kinds(ev) == ["detected"] and acts == [] and s.state(u.name) is UnitState.RECOVERING  # /health is 200 all along
    assert ranks[3] in ev[0].reason and "unhealthy" in ev[0].reason
    ev, acts = s.step(Observation(1.0, ft=dict.fromkeys(ranks, "unhealthy")))
    assert _kinds(ev) == ["ft-retry"] and [type(a) for a in acts] == [FtRetry]  # vLLM refuses a retry before a rank is unhealthy
    assert s.step(Observation(2.0, ft=dict.fromkeys(ranks, "unhealthy"))) == ([], [])  # sent once, not every look
    ev, acts = s.step(Observation(3.5, ft=ok))
    assert _kinds(ev) == ["recovered"] and ev[0].seconds == pytest.approx(3.5) and acts == []
    assert s.state(u.name) is UnitState.SERVING and s.restarts == 0


def test_no_recovery_within_the_engines_timeout_restarts_the_group_and_a_dead_rank_restarts_it_at_once() -> None:
    s = _ft()
    (u,) = [x for x in s.units if x.kind == "group"]
    ranks = u.processes
    timeout = s.ft[u.name].recovery_timeout_s
    s.step(Observation(0.0, ft=dict.fromkeys(ranks, "unhealthy")))
    ev, acts = s.step(Observation(timeout + 16.0, ft=dict.fromkeys(ranks, "unhealthy")))
    assert "did not recover" in ev[0].reason and [type(a) for a in acts] == [Restart] and acts[0].unit.processes == ranks  # type: ignore[union-attr]
    s2 = _ft()
    ev, acts = s2.step(Observation(0.0, dead={ranks[5]: "exited with code 137"}, ft=dict.fromkeys(ranks, "unhealthy")))
    assert [type(a) for a in acts] == [Restart]  # a dead rank cannot rejoin: retry would never complete
