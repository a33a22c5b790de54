"""The supervisor's loop (k3launch.deploy.control.loop) over the shipped FakeWatcher: what it does
with the decisions (restart, give up, stop everything), the record, the lock, the event log, the
hook, and ``down``'s stop request. No process is started: this is the fast tier."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection
from functools import cache
from pathlib import Path

import pytest
from paths import ROOT

from k3launch import api
from k3launch.deploy import eventlog
from k3launch.deploy.control import loop, process
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.control.observation import Observation
from k3launch.models.plan import Plan
from k3launch.models.record import ProcessRecord, SshRecord
from k3launch.models.supervise import Event, RestartPolicy, worker_urls
from k3launch.testing import FakeOps, FakeWatcher

FAST = RestartPolicy(poll=0.1, backoff=0, max_restarts=2)
OK = {"serve-0": True, "serve-1": True, "router": True}


@cache
def _plan(strategy: str) -> Plan:
    return api.plan(None, recipe="k3launch/tiny-llama", strategy=strategy, name="loop-" + strategy.replace("_", "-"))


def _record(store: StateStore, strategy: str = "multi_node_replicas", state: str = "ready") -> SshRecord:
    plan = _plan(strategy)
    rec = SshRecord(name=plan.name, state=state, created=time.time(), updated=time.time(), backend="local", endpoint=plan.endpoint,
                    plan=plan, processes={p.id: ProcessRecord(id=p.id, node=p.node, runtime="bare", handle="1", started=True)
                                          for p in plan.processes})
    store.save(rec)
    return rec


def _run(store: StateStore, name: str, watcher: FakeWatcher, stop: threading.Event, policy: RestartPolicy = FAST,
         hook: str | None = None, canary: loop.CanaryFn | None = None) -> tuple[str, list[Event]]:
    seen: list[Event] = []
    out = loop.supervise(name, store, FakeOps(watcher), policy, on_event=seen.append, hook=hook, stop=stop, canary=canary)
    return out, seen


def test_a_restart_is_made_counted_in_the_record_and_logged(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    rec = _record(store)
    stop = threading.Event()
    w = FakeWatcher([Observation(0, healthy=OK), Observation(0, dead={"serve-1": "exited with code 137"}, healthy=OK),
                     Observation(0, healthy=OK)], stop=stop)
    router = next(p for p in rec.plan.processes if p.role == "router")
    w.listed = worker_urls(router)  # what the router lists: membership is observed
    out, seen = _run(store, rec.name, w, stop)
    assert out == "stopped"
    assert ("restart", "serve-1") in w.calls and w.closed
    # the replica leaves the router's worker list before its restart, and is added back once it serves
    s1 = next(p for p in rec.plan.processes if p.id == "serve-1")
    url = f"http://{s1.address}:{s1.http_port}"
    assert url in worker_urls(router) and sorted(w.listed) == sorted(worker_urls(router))
    calls = [c for c in w.calls if c[0] in ("reroute", "restart")]
    assert calls == [("reroute", f"-{url}"), ("restart", "serve-1"), ("reroute", f"+{url}")], calls
    kinds = [e.kind for e in seen]
    assert kinds == ["watching", "detected", "restarting", "rerouted", "restarted", "rerouted", "stopped-watching"], kinds
    assert [e.reason for e in seen if e.kind == "rerouted"] == [f"removed {url} while serve-1 restarts", f"added {url}"]
    assert [e.kind for e in eventlog.read(store, rec.name)] == kinds  # the same events, in the log
    after = store.load(rec.name)
    assert after.supervisor is None and after.state == "ready"  # it let go: the deployment is as it was
    assert not process.lock_path(store, rec.name).exists()


def test_a_unit_that_keeps_failing_to_start_is_given_up_and_the_deployment_stopped(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    rec = _record(store, "single_node_tp")
    stop = threading.Event()
    w = FakeWatcher([Observation(0, dead={"serve-0": "exited with code 1"})], stop=stop, start_fails={"serve-0": 5})
    out, seen = _run(store, rec.name, w, stop)
    assert out == "failed"
    assert [c for c in w.calls if c[0] not in ("observe", "note")] == [("restart", "serve-0"), ("restart", "serve-0"), ("keep_logs", "serve-0"),
                                                        ("stop", "serve-0"), ("stop_all",)]
    kinds = [e.kind for e in seen]
    assert kinds.count("restart-failed") == 2 and kinds[-3:] == ["gave-up", "failed", "stopped-watching"], kinds
    failed = next(e for e in seen if e.kind == "restart-failed")
    assert failed.log_tail == "no such file\n" and "start command exited 1" in failed.reason
    gave = next(e for e in seen if e.kind == "gave-up")
    assert f"last log lines kept in {store.logs_dir(rec.name)}" in gave.reason
    after = store.load(rec.name)
    assert after.state == "failed" and after.error is not None and "2 restarts within 3600s" in after.error
    assert after.supervisor is None  # it let go of a deployment it stopped


def test_one_supervisor_per_deployment_and_a_stop_request_ends_it(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    rec = _record(store)
    stop = threading.Event()
    w = FakeWatcher([lambda now: Observation(now, healthy=OK)] * 10_000)  # healthy for ever
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(_run(store, rec.name, w, stop)[0]))
    t.start()
    deadline = time.monotonic() + 10
    while (store.load(rec.name).supervisor is None) and time.monotonic() < deadline:
        time.sleep(0.02)
    sv = store.load(rec.name).supervisor
    assert sv is not None and sv.pid > 0 and sv.policy == FAST
    with pytest.raises(K3Error) as exc:
        _run(store, rec.name, FakeWatcher([]), threading.Event())
    assert exc.value.code == "already-supervised" and f"pid {sv.pid}" in exc.value.message
    note = process.stop(store, rec.name, wait_s=10)  # what `down` does first (same process here: the stop file)
    t.join(timeout=10)
    assert result == ["stopped"] and note is not None and f"pid {sv.pid}" in note
    assert not process.lock_path(store, rec.name).exists() and not process.stop_path(store, rec.name).exists()
    assert process.stop(store, rec.name) is None  # nobody to stop now


def test_only_a_ready_deployment_is_supervised(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    rec = _record(store, state="failed")
    with pytest.raises(K3Error) as exc:
        _run(store, rec.name, FakeWatcher([]), threading.Event())
    assert exc.value.code == "not-ready" and "failed" in exc.value.message and "down" in exc.value.hint
    assert not process.lock_path(store, rec.name).exists()


def test_the_hook_gets_each_event_as_json_and_a_failing_hook_is_an_event(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    rec = _record(store)
    stop = threading.Event()
    got = tmp_path / "got.jsonl"
    hook = f"cat >> {got}; echo >> {got}; exit 3"
    w = FakeWatcher([Observation(0, healthy=OK)], stop=stop)
    _, seen = _run(store, rec.name, w, stop, hook=hook)
    lines = [json.loads(ln) for ln in got.read_text().splitlines() if ln.strip()]
    assert [x["kind"] for x in lines] == ["watching", "stopped-watching"] and lines[0]["deployment"] == rec.name
    failed = [e for e in seen if e.kind == "hook-failed"]
    assert len(failed) == 2 and "--on-event command exited 3" in failed[0].reason


def test_a_hook_that_hangs_is_cut_after_its_timeout() -> None:
    e = Event(time=1.0, kind="watching", deployment="x")
    t0 = time.monotonic()
    why = eventlog.run_hook("sleep 30 & sleep 30", e, timeout=0.5)
    assert why is not None and "did not finish within 0.5s" in why and time.monotonic() - t0 < 5


def test_supervise_is_refused_where_the_backend_lacks_it(tmp_path: Path) -> None:
    from k3launch.models.record import SlurmJob, SlurmRecord

    store = StateStore(tmp_path)
    plan = _plan("multi_node_replicas")
    store.save(SlurmRecord(name="on-slurm", state="ready", created=1.0, updated=1.0, endpoint="http://x:1", plan=plan,
                           slurm=SlurmJob(job_id="1", log_dir="/tmp", script="/tmp/s")))
    with pytest.raises(K3Error) as exc:
        api.supervise("on-slurm", state_dir=tmp_path)
    assert exc.value.code == "not-supported" and "the job supervises itself" in exc.value.hint and "`k3launch up --supervise`" in exc.value.hint


def test_the_policy_is_the_inventorys_with_flags_over_it(tmp_path: Path) -> None:
    import yaml

    inv = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    inv["restart"] = {"max_restarts": 7, "backoff": 3}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    store = StateStore(tmp_path / "state")
    rec = _record(store)
    rec.inventory = str(path)
    store.save(rec)
    pol = api.restart_policy(rec.name, {"backoff": 1.5, "poll": None}, state_dir=store.root)
    assert (pol.max_restarts, pol.backoff, pol.poll) == (7, 1.5, 2.0)
    with pytest.raises(K3Error) as exc:
        api.restart_policy(rec.name, {"max_restarts": -1}, state_dir=store.root)
    assert exc.value.code == "bad-policy" and "max_restarts" in exc.value.message
    inv["restart"] = {"max_restart": 7}
    path.write_text(yaml.safe_dump(inv))
    with pytest.raises(K3Error) as bad:
        api.restart_policy(rec.name, state_dir=store.root)
    assert "max_restart" in bad.value.message


def test_a_lost_node_is_cordoned_and_its_unit_re_placed_onto_a_spare(tmp_path: Path) -> None:
    """Replicas on local-1 and local-2; local-2 stops answering for node_lost_after: it is cordoned,
    the plan made again without it (serve-1 moves to local-3), the spare checked by the doctor, and
    every unit whose processes changed restarts (serve-1, and the router: its worker list changed)."""
    from k3launch.deploy.control.loop import Places

    store = StateStore(tmp_path)
    rec = _record(store)
    old = rec.plan
    new = api.plan(None, recipe="k3launch/tiny-llama", strategy="multi_node_replicas", name=rec.name, exclude=["local-2"])
    cordoned: list[tuple[str, str]] = []
    stop = threading.Event()
    silent = Observation(0, unreachable={"local-2": "no answer for 10s"}, healthy={"serve-0": True, "router": True})
    w = FakeWatcher([Observation(0, healthy=OK), silent, silent, silent, lambda now: Observation(now, healthy=OK)] + [Observation(0, healthy=OK)] * 3,
                    stop=stop)
    w.listed = worker_urls(next(p for p in old.processes if p.role == "router"))
    pol = RestartPolicy(poll=0.1, node_lost_after=0.15)
    out = loop.supervise(rec.name, store, FakeOps(w), pol, on_event=(seen := []).append, stop=stop,
                               places=Places(lambda node, why: cordoned.append((node, why)), lambda: new))
    assert out == "stopped"
    kinds = [e.kind for e in seen]
    assert kinds[:5] == ["watching", "node-unreachable", "detected", "rerouted", "node-lost"], kinds  # out of the router at once
    assert "cordoned" in kinds and "replaced" in kinds, kinds
    assert cordoned and cordoned[0][0] == "local-2" and "lost by the supervisor" in cordoned[0][1]
    moved = next(e for e in seen if e.kind == "replaced")
    assert "serve-1 local-2 -> local-3" in moved.reason and moved.reason.endswith("restarted: serve-1"), moved.reason
    old_url = next(f"http://{p.address}:{p.http_port}" for p in old.processes if p.id == "serve-1")
    new_url = next(f"http://{p.address}:{p.http_port}" for p in new.processes if p.id == "serve-1")
    acts = [c for c in w.calls if c[0] not in ("observe", "note")]
    # the router is not restarted: the engine whose node went silent leaves it at once, the moved one joins once it serves
    assert acts == [("reroute", f"-{old_url}"), ("check", "local-3"), ("adopt", "local-2"), ("restart", "serve-1"),
                    ("reroute", f"+{new_url}")], acts
    assert sorted(w.listed) == sorted(worker_urls(next(p for p in new.processes if p.role == "router")))
    assert w.plan == new and [p.node for p in old.processes if p.id == "serve-1"] == ["local-2"]
    after = kinds[kinds.index("replaced"):]
    assert after.index("restarted") < after.index("rerouted"), kinds  # added once serving


def test_no_spare_means_waiting_for_the_node(tmp_path: Path) -> None:
    from k3launch.deploy.control.loop import Places

    store = StateStore(tmp_path)
    rec = _record(store)
    stop = threading.Event()
    silent = Observation(0, unreachable={"local-2": "no answer"}, healthy={"serve-0": True, "router": True})

    def no_spare() -> Plan:
        raise K3Error("no-nodes", "multi_node_replicas needs 2 nodes of b300; 1 left after 1 cordoned", "uncordon")

    w = FakeWatcher([silent, silent, silent, Observation(0, healthy=OK), Observation(0, healthy=OK)], stop=stop)
    loop.supervise(rec.name, store, FakeOps(w), RestartPolicy(poll=0.1, node_lost_after=0.15), on_event=(seen := []).append,
                         stop=stop, places=Places(lambda n, w: None, no_spare))
    failed = next(e for e in seen if e.kind == "replace-failed")
    assert "no spare node fits" in failed.reason and "waiting for local-2" in failed.reason
    assert ("restart", "serve-1") in w.calls  # the node answered again: its unit restarted where it was
    assert not any(c[0] == "adopt" for c in w.calls)


def test_the_canary_is_replayed_while_everything_serves_and_a_mismatch_is_an_event(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    rec = _record(store)
    stop = threading.Event()
    answers: list[list[str] | None] = [None, ["serve-1: 'Hello' expected [5, 6] got [5, 9]"], [], []]
    asked: list[str] = []

    def canary(plan: Plan, only: Collection[str] | None) -> list[str] | None:
        asked.append(plan.name)
        out = answers.pop(0) if answers else []
        if not answers:
            stop.set()
        return out

    down = Observation(0, dead={"serve-1": "exited with code 137"}, healthy=OK)
    looks = [Observation(0, healthy=OK)] * 3 + [down] + [Observation(0, healthy=OK)] * 60
    w = FakeWatcher(looks, stop=stop)
    out, seen = _run(store, rec.name, w, stop, RestartPolicy(poll=0.1, backoff=0, canary_interval=0.15), canary=canary)
    kinds = [e.kind for e in seen if e.kind.startswith("canary")]
    assert out == "stopped" and asked and set(asked) == {rec.name}
    assert kinds[:2] == ["canary-mismatch", "canary-ok"], kinds  # None (no baseline) is no event; then mismatch, then matches again
    bad = next(e for e in seen if e.kind == "canary-mismatch")
    assert "expected [5, 6] got [5, 9]" in bad.reason


def test_no_canary_when_its_interval_is_zero(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    rec = _record(store)
    stop = threading.Event()
    asked: list[str] = []
    w = FakeWatcher([Observation(0, healthy=OK)] * 10, stop=stop)
    out = loop.supervise(rec.name, store, FakeOps(w), RestartPolicy(poll=0.1, canary_interval=0), on_event=lambda e: None,
                               stop=stop, canary=lambda p, only: asked.append(p.name) or [])
    assert out == "stopped" and asked == []


def test_a_refused_detach_changes_nothing_of_the_running_supervisors_policy(tmp_path: Path) -> None:
    """One supervisor runs (its lock held): a second `supervise --detach` with other flags is
    refused before the spec is written, so the next controller start keeps the first policy."""
    import subprocess
    import sys

    from k3launch.deploy.control.process import lock_path, read_spec

    store = StateStore(tmp_path)
    rec = _record(store)
    from k3launch.api.supervision import write_spec

    write_spec(store, rec.name, policy=RestartPolicy(poll=1.0, max_restarts=5))
    before = read_spec(store, rec.name)
    lock_path(store, rec.name).parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1],'a'); fcntl.flock(f, fcntl.LOCK_EX); "
                               "print('held', flush=True); time.sleep(30)", str(lock_path(store, rec.name))], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(K3Error) as refused:
            api.supervise_detached(rec.name, policy={"poll": 3.0, "max_restarts": 9}, state_dir=store.root)
    finally:
        holder.kill()
        holder.wait()
    assert refused.value.code == "already-supervised"
    assert read_spec(store, rec.name) == before and before is not None and before.policy is not None and before.policy.max_restarts == 5


def test_a_failed_deployment_is_not_offered_a_supervisor_and_detach_refuses_it_first_hand(tmp_path: Path) -> None:
    """`status` of a failed deployment says down-then-up (a supervisor refuses it); `supervise --detach`
    refuses it itself, with the controller's own code and words, before a spec is written or a process
    detached (not second-hand as `supervise-failed`)."""
    from typer.testing import CliRunner

    from k3launch.cli import app

    store = StateStore(tmp_path)
    rec = _record(store, state="failed")
    env = {"K3LAUNCH_STATE_DIR": str(tmp_path), "COLUMNS": "200"}
    shown = CliRunner().invoke(app, ["status", rec.name], env=env)
    assert f"`k3launch down {rec.name}`, then `up` again" in shown.output and "supervise" not in shown.output, shown.output
    refused = CliRunner().invoke(app, ["supervise", rec.name, "--detach"], env=env)
    assert refused.exit_code == 2
    assert refused.output.splitlines()[0] == f"error: {rec.name} is failed: only a ready deployment can be supervised [not-ready]", \
        refused.output
    assert not process.spec_path(store, rec.name).exists() and store.load(rec.name).supervisor is None


def test_the_spec_keeps_how_the_detached_controller_reaches_the_nodes(tmp_path: Path) -> None:
    """``access`` written with a revision is what the controller started from the spec uses; a
    later revision that does not say it keeps it."""
    from k3launch.api.supervision import write_spec
    from k3launch.deploy.control.process import read_spec

    store = StateStore(tmp_path)
    rec = _record(store)
    write_spec(store, rec.name, access=api.Access(accept_unknown_hosts=True, connect_timeout=3.5))
    write_spec(store, rec.name, policy=RestartPolicy(poll=1.0))
    spec = read_spec(store, rec.name)
    assert spec is not None and spec.revision == 2 and spec.access == api.Access(True, 3.5)


def test_the_controller_serves_its_view_as_metrics_and_its_target_comes_and_goes(tmp_path: Path) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    store = StateStore(tmp_path)
    rec = _record(store)
    stop = threading.Event()
    scraped: dict[str, object] = {}

    def scrape(now: float) -> Observation:
        cur = store.load(rec.name)
        assert cur.supervisor is not None
        scraped["address"] = cur.supervisor.metrics
        scraped["targets"] = json.loads((store.targets_dir() / f"{rec.name}.json").read_text())
        with urllib.request.urlopen(f"http://{cur.supervisor.metrics}/metrics", timeout=5) as r:
            text = r.read().decode()
        scraped["samples"] = {(s.name, tuple(sorted(s.labels.items()))): s.value
                              for f in text_string_to_metric_families(text) for s in f.samples}
        return Observation(now, healthy=OK)

    w = FakeWatcher([Observation(0, healthy=OK), Observation(0, dead={"serve-1": "exited with code 137"}, healthy=OK),
                     Observation(0, healthy=OK), scrape], stop=stop)
    router = next(p for p in rec.plan.processes if p.role == "router")
    w.listed = worker_urls(router)
    t0 = time.time()
    out = loop.supervise(rec.name, store, FakeOps(w), FAST, on_event=lambda e: None, stop=stop, metrics_listen="127.0.0.1:0")
    assert out == "stopped"
    d = (("deployment", rec.name),)
    samples = scraped["samples"]
    assert isinstance(samples, dict)
    assert samples[("k3launch_restarts_total", d)] == 1.0
    assert samples[("k3launch_units_serving", d)] == samples[("k3launch_units_desired", d)] == 3.0  # two replicas and the router
    assert samples[("k3launch_units_given_up", d)] == 0.0 and samples[("k3launch_units_out_of_router", d)] == 0.0
    assert samples[("k3launch_units", (("deployment", rec.name), ("state", "serving")))] == 3.0
    assert t0 <= samples[("k3launch_last_look_timestamp_seconds", d)] <= time.time()
    address = scraped["address"]
    assert isinstance(address, str) and address.startswith("127.0.0.1:")
    controller = [g for g in scraped["targets"] if g["labels"]["job"] == "k3launch-controller"]  # type: ignore[union-attr]
    assert controller == [{"targets": [address], "labels": {"job": "k3launch-controller", "deployment": rec.name, "inventory": "local",
                                                           "process": "controller", "node": controller[0]["labels"]["node"]}}]
    # it let go: no controller target, nothing listening
    after = json.loads((store.targets_dir() / f"{rec.name}.json").read_text())
    assert not [g for g in after if g["labels"]["job"] == "k3launch-controller"]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{address}/metrics", timeout=2)
