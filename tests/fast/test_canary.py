"""The correctness canary (docs/canary.md) in the fast tier.

The pure part (targets of each layout, the comparison and its tolerance, when a new baseline is
due) on plans; the I/O against simulated engines running in this process — a prefill
(``kv_producer``) and two decodes (``kv_consumer``) with real NIXL side channels, the second
decode under the ``corrupt-pd`` fault — placed into a real P/D plan's processes, with no router
listening. Then ``api.canary`` and the real ``k3launch canary`` command (a subprocess asking the
engines of this process) on a record of that plan.
"""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from paths import ROOT
from simproc import free_port

from k3launch import api
from k3launch.api.canaries import record_at_ready
from k3launch.deploy import canary
from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.canary import (
    MAX_TOKENS,
    REQUESTS,
    Answer,
    Tolerance,
    compare,
    rebaseline_reasons,
    targets,
)
from k3launch.models.plan import Plan
from k3launch.models.record import SshRecord
from k3launch.planning.schema import load_schema
from k3launch.sim.cli import parse_serve
from k3launch.sim.engine import Engine
from k3launch.sim.logs import Logger
from k3launch.sim.nixl import SideChannel
from k3launch.sim.options import Knobs
from k3launch.sim.server import App, SimHTTPServer, start
from k3launch.util import bounds

LOCAL = ROOT / "inventories" / "local.yaml"
HOST = "127.0.81."  # this module's own loopback addresses: .1 prefill, .2 and .3 decodes, .9 nothing
MODEL = "moonshotai/Kimi-K3"


def _pd_plan(**kw: object) -> Plan:
    return api.plan(LOCAL, strategy="pd_cluster", **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- the pure part
def test_targets_are_every_engine_server_every_pairing_and_the_router() -> None:
    pd = _pd_plan()
    assert [t.name for t in targets(pd)] == ["prefill-0", "decode-0", "decode-1", "prefill-0>decode-0", "prefill-0>decode-1", "router"]
    pair = next(t for t in targets(pd) if t.kind == "pair")
    prefill, decode = (next(p for p in pd.processes if p.id == i) for i in ("prefill-0", "decode-0"))
    assert pair.prefill == f"http://{prefill.address}:{prefill.http_port}" and pair.url == f"http://{decode.address}:{decode.http_port}"
    # a rollout's gate: the targets of one restarted unit, and the router that may route to it
    assert [t.name for t in targets(pd, only=["decode-1"])] == ["decode-1", "prefill-0>decode-1", "router"]
    copies = api.plan(LOCAL, strategy="multi_node_tp", nodes=2, replicas=2)
    # a headless rank serves no HTTP: one target per copy, then the router
    assert [t.name for t in targets(copies)] == ["r0-serve-0", "r1-serve-0", "router"]
    single = api.plan(LOCAL, strategy="single_node_tp")
    assert [(t.name, t.kind) for t in targets(single)] == [("serve-0", "engine")]


def test_compare_by_token_ids_by_text_and_with_a_tolerance() -> None:
    req = REQUESTS[0]
    want = Answer(request=req.id, token_ids=[1, 2, 3, 4], text="a b c d")
    assert compare("t", req, want, want, Tolerance()) is None
    late = Answer(request=req.id, token_ids=[1, 2, 9, 9], text="a b x x")
    m = compare("t", req, want, late, Tolerance())
    assert m is not None and m.basis == "token_ids" and m.first_difference == 2 and m.expected == [1, 2, 3, 4] and m.got == [1, 2, 9, 9]
    assert m.prompt == req.prompt and m.target == "t"
    assert compare("t", req, want, late, Tolerance(prefix=2)) is None  # only the first two tokens must match
    assert compare("t", req, want, late, Tolerance(prefix=3)) is not None
    # an answer without ids (an engine or router that does not return them) is compared by text
    no_ids = Answer(request=req.id, token_ids=None, text="a b c d")
    assert compare("t", req, want, no_ids, Tolerance()) is None
    spaced = Answer(request=req.id, token_ids=None, text="a b c  d")
    m = compare("t", req, want, spaced, Tolerance())
    assert m is not None and m.basis == "text"  # by text, the whole text must match, its spacing too
    with pytest.raises(ValueError):
        Tolerance(prefix=0)  # a tolerance is never silence
    assert bounds.CANARY_PREFIX.hi == MAX_TOKENS == REQUESTS[0].max_tokens


def test_a_changed_model_or_sampling_flag_calls_for_a_new_baseline() -> None:
    plan = _pd_plan()
    base = canary_baseline(plan)
    assert rebaseline_reasons(base, plan) == []
    moved = plan.model_copy(update={"processes": [
        p.model_copy(update={"argv": [("triton" if a == "deep_gemm_mega_moe" else a) for a in p.argv]}) for p in plan.processes]})
    assert rebaseline_reasons(base, moved) == ["decode --moe-backend: deep_gemm_mega_moe -> triton"]
    other = plan.model_copy(update={"vllm_version": "0.32.0"})
    assert rebaseline_reasons(base, other) == ["vllm_version: 0.33.0 -> 0.32.0"]
    # what decides no token (ports, max-num-seqs) is no reason
    busier = plan.model_copy(update={"processes": [p.model_copy(update={"argv": [*p.argv, "--max-num-seqs", "7"]}) for p in plan.processes]})
    assert rebaseline_reasons(base, busier) == []


def canary_baseline(plan: Plan) -> canary.Baseline:
    from k3launch.models.canary import fingerprint

    return canary.Baseline(deployment="x", model=plan.model, recorded=0, source="prefill-0", engine=plan.engine,
                           vllm_version=plan.vllm_version, fingerprint=fingerprint(plan), requests=list(REQUESTS), answers=[])


# ---------------------------------------------------------------------------------- simulated engines in this process
def _serve(host: str, role: str, fault: str | None = None) -> tuple[SimHTTPServer, SideChannel]:
    env = {"K3LAUNCH_SIM_TTFT_MS": "0", "K3LAUNCH_SIM_ITL_MS": "0", "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), **({"K3LAUNCH_SIM_FAIL": fault} if fault else {})}
    knobs = Knobs.from_env(env)
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "fail"})
    opts = parse_serve(load_schema(knobs.version), [MODEL, "--kv-transfer-config", kv], env)
    log = Logger(stream=io.StringIO())
    side = SideChannel(opts.nixl_host, opts.nixl_port, opts.local_dp_ranks, opts.dp, opts.tp, log)
    side.start()
    httpd = start(host, 0, App(opts, Engine(opts, knobs, log, side), log, knobs.version))
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return httpd, side


@pytest.fixture(scope="module")
def engines() -> Iterator[Plan]:
    """The P/D plan's prefill-0, decode-0 and decode-1 served here (decode-1 under corrupt-pd); its router is nowhere."""
    running = {"prefill-0": _serve(HOST + "1", "kv_producer"), "decode-0": _serve(HOST + "2", "kv_consumer"),
               "decode-1": _serve(HOST + "3", "kv_consumer", fault="corrupt-pd")}
    plan = _pd_plan()

    def moved(pid: str) -> dict[str, object]:
        if pid in running:
            host, port = running[pid][0].server_address[:2]
            return {"address": host, "http_port": port}
        return {"address": HOST + "9", "http_port": free_port()}  # the router: nothing listens there

    try:
        yield plan.model_copy(update={"processes": [p.model_copy(update=moved(p.id)) for p in plan.processes]})
    finally:
        for httpd, side in running.values():
            httpd.shutdown()
            httpd.server_close()
            side.close()


def test_record_then_replay_catch_the_corrupted_pairing_and_only_it(engines: Plan) -> None:
    t0 = time.monotonic()
    baseline, reports = canary.record(engines, "pd", timeout=5)
    recorded_s = time.monotonic() - t0
    assert baseline.source == "prefill-0" and baseline.engine_version == "0.33.0"  # the first engine, asked directly
    assert [a.request for a in baseline.answers] == [r.id for r in REQUESTS]
    assert all(a.token_ids is not None and len(a.token_ids) == MAX_TOKENS for a in baseline.answers)
    verdict = {r.target: r.outcome for r in reports}
    # decode-1 asked directly prefills itself: right; over the P/D path its tokens are corrupted
    assert verdict == {"prefill-0": "ok", "decode-0": "ok", "decode-1": "ok", "prefill-0>decode-0": "ok",
                       "prefill-0>decode-1": "mismatch", "router": "unreachable"}, reports
    router = next(r for r in reports if r.target == "router")
    assert "refused" in router.reason.lower() and router.reason.startswith(REQUESTS[0].id), router.reason

    t0 = time.monotonic()
    again = canary.replay(engines, baseline, timeout=5)
    replay_s = time.monotonic() - t0
    assert {r.target: r.outcome for r in again} == verdict
    bad = next(r for r in again if r.target == "prefill-0>decode-1")
    assert [m.request for m in bad.mismatches] == [r.id for r in REQUESTS]  # every answer, completions and chats
    m = bad.mismatches[0]
    expected = baseline.answers[0]
    assert (m.prompt, m.expected, m.expected_text) == (REQUESTS[0].prompt, expected.token_ids, expected.text)
    assert m.got is not None and m.got[0] == m.expected[0] and m.got[1:] != m.expected[1:] and m.first_difference == 1  # type: ignore[index]
    assert m.got_text != m.expected_text
    # a tolerance of one token would let this corruption through: a tolerance is a choice, said in the docs
    lenient = canary.replay(engines, baseline, only=["decode-1"], tolerance=Tolerance(prefix=1), timeout=5)
    assert {r.target: r.outcome for r in lenient} == {"decode-1": "ok", "prefill-0>decode-1": "ok", "router": "unreachable"}
    print(f"\n[canary on the sim, in process: record {recorded_s:.2f}s, replay of {len(again)} targets "
          f"x {len(REQUESTS)} requests {replay_s:.2f}s]")


def test_baseline_is_kept_owner_only_read_back_and_forgotten(engines: Plan, tmp_path: Path) -> None:
    st = StateStore(tmp_path)
    baseline, _ = canary.record(engines, "pd-store", timeout=5)
    canary.save(st, baseline)
    path = st.canary_path("pd-store")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert canary.load(st, "pd-store") == baseline
    assert canary.load(st, "other") is None
    path.write_text("{not json")
    with pytest.raises(K3Error) as err:
        canary.load(st, "pd-store")
    assert err.value.code == "bad-canary" and "--rebaseline" in err.value.hint
    canary.save(st, baseline)
    # what a supervisor or a rollout's gate calls: None without a baseline, else the verdict
    assert canary.check(st, "other", engines) is None
    report = canary.check(st, "pd-store", engines, only=["decode-1"], timeout=5)
    assert report is not None and [t.target for t in report.targets] == ["decode-1", "prefill-0>decode-1", "router"]
    assert not report.ok and report.rebaseline == [] and len(report.mismatches) == len(REQUESTS)
    line = report.mismatches[0].line()  # an event's reason: target, request, prompt, expected, got
    assert line.startswith("prefill-0>decode-1: complete-capital differs from token 1 on; prompt \"The capital of France is\"; expected [")
    assert "; got [" in line and "\n" not in line
    canary.forget(st, "pd-store")
    assert not path.exists()


def _record(st: StateStore, plan: Plan, name: str, state: str = "ready") -> SshRecord:
    rec = SshRecord(name=name, state=state, created=time.time(), updated=time.time(), backend="local",  # type: ignore[arg-type]
                    endpoint=plan.endpoint, plan=plan.model_copy(update={"name": name}))
    st.save(rec)
    return rec


def test_up_records_at_ready_and_a_failure_to_record_is_a_notice(engines: Plan, tmp_path: Path) -> None:
    st = StateStore(tmp_path)
    note = record_at_ready(_record(st, engines, "pd-up"), st)
    assert note.recorded and not note.agree
    assert "recorded from prefill-0: 4 of 6 target(s) agree" in note.message and "prefill-0>decode-1 mismatch" in note.message
    assert st.load("pd-up").canary == note and canary.load(st, "pd-up") is not None
    nowhere = engines.model_copy(update={"processes": [p.model_copy(update={"address": HOST + "9"}) for p in engines.processes]})
    note = record_at_ready(_record(st, nowhere, "pd-dead"), st)
    assert not note.recorded and note.message.startswith("no canary recorded: no target answered the canary's requests: prefill-0: ")
    assert st.load("pd-dead").canary == note and canary.load(st, "pd-dead") is None


def _cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(state), "COLUMNS": "250", "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "k3launch", "canary", *args], env=env, capture_output=True, text=True, timeout=60)


def test_api_and_cli_exit_0_on_match_1_on_a_difference_2_when_refused(engines: Plan, tmp_path: Path) -> None:
    st = StateStore(tmp_path)
    clean = engines.model_copy(update={"processes": [p for p in engines.processes if p.id not in ("decode-1", "router")]})
    _record(st, clean, "pd-clean")
    _record(st, engines, "pd-bad")
    _record(st, clean, "pd-failed", state="failed")

    r = _cli(tmp_path, "pd-clean")
    assert r.returncode == 2 and "error: pd-clean has no canary baseline" in r.stderr and "--rebaseline" in r.stderr, r.stderr
    first = api.canary("pd-clean", rebaseline=True, state_dir=tmp_path)
    assert first.recorded and first.ok and [t.target for t in first.targets] == ["prefill-0", "decode-0", "prefill-0>decode-0"]
    r = _cli(tmp_path, "pd-clean")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 of 3 target(s) gave the recorded answers" in r.stdout and "every token must match" in r.stdout

    r = _cli(tmp_path, "pd-bad", "--rebaseline", "--timeout", "5")
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {line.split()[0]: line.split(None, 1)[1] for line in r.stdout.splitlines() if line.startswith("  ") and len(line.split()) > 1}
    assert rows["prefill-0>decode-1"].startswith("MISMATCH (5 of 5 answers differ)"), r.stdout
    assert rows["router"].startswith("UNREACHABLE") and "Connection refused" in rows["router"], r.stdout
    assert all(rows[t].startswith("ok ") for t in ("prefill-0", "decode-0", "decode-1", "prefill-0>decode-0")), r.stdout
    assert f"prompt:   {json.dumps(REQUESTS[0].prompt)}" in r.stdout and "expected: [" in r.stdout and "got:      [" in r.stdout
    r = _cli(tmp_path, "pd-bad", "--json", "--timeout", "5")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["ok"] is False and out["recorded"] is False
    bad = [m for t in out["targets"] for m in t["mismatches"]]
    assert {m["target"] for m in bad} == {"prefill-0>decode-1"} and all(m["expected"] != m["got"] for m in bad)

    for args, code in ((["nope"], "unknown-deployment"), (["pd-failed"], "not-ready"), (["pd-clean", "--match-prefix", "0"], "bad-value")):
        r = _cli(tmp_path, *args, "--json")
        assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == code, (args, r.stdout, r.stderr)
    r = _cli(tmp_path, "pd-failed")
    assert r.returncode == 2 and r.stderr.count("\n") == 2 and "hint: `k3launch status pd-failed`" in r.stderr, r.stderr  # one line and a hint
