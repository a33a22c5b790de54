"""The correctness canary's I/O: record a baseline, replay it on every target, keep it on disk.

:func:`record` asks the fixed requests (:data:`~k3launch.models.canary.REQUESTS`) of the plan's
targets in order until one answers them all — an engine directly, normally — and keeps those
answers as the :class:`~k3launch.models.canary.Baseline`; then every other target is asked too,
so a disagreement is reported at record time. :func:`replay` asks every target (or those of
some processes) and compares (:func:`~k3launch.models.canary.compare`). Targets are asked in
parallel, each one's requests in turn; a target that does not answer one request is reported
``unreachable`` and asked nothing more, so a dead target costs one timeout.

Each request carries a fresh ``cache_salt`` (vLLM's per-request prefix-cache salt): a decode that
answered the same prompt directly a moment ago would otherwise find it in its own prefix cache
and pull little or nothing over the P/D path the pairing is meant to exercise.

The baseline lives in ``<state>/canary/NAME.json``, owner-only (:func:`save`), and ``down``
removes it (:func:`forget`). Docs: docs/canary.md.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import ValidationError

from k3launch.deploy.state import StateStore, io_error, write_atomic
from k3launch.errors import K3Error
from k3launch.models.canary import (
    PREFILL_KV,
    REQUESTS,
    Answer,
    Baseline,
    CanaryReport,
    CanaryRequest,
    Mismatch,
    Outcome,
    Target,
    TargetReport,
    Tolerance,
    compare,
    fingerprint,
    rebaseline_reasons,
    targets,
)
from k3launch.models.plan import Plan
from k3launch.transport import http

DEFAULT_TIMEOUT_S = 30.0  # one request: eight tokens on a loaded engine, a P/D leg's KV transfer included
MAX_PARALLEL = 16  # targets asked at once


class _NoAnswer(Exception):
    """A request got no usable answer: ``outcome`` unreachable (no HTTP answer) or failed."""

    def __init__(self, outcome: Outcome, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason


def _salted(body: dict[str, Any]) -> dict[str, Any]:
    return body | {"cache_salt": f"k3launch-canary-{uuid.uuid4().hex}"}


def _post(url: str, body: dict[str, Any], timeout: float, headers: dict[str, str] | None = None, leg: str = "") -> dict[str, Any]:
    r = http.post_json(url, body, timeout, headers)
    if r.ok:
        return r.data
    where = f"{leg}: " if leg else ""
    raise _NoAnswer("unreachable" if r.status is None else "failed", f"{where}{url}: {r.detail}")


def answer_of(request: CanaryRequest, data: dict[str, Any]) -> Answer:
    """An answer from vLLM's JSON: the first choice's ``token_ids`` (None where it gave none) and
    its text (a chat's reasoning, then its content)."""
    choices = data.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    ids = choice.get("token_ids")
    token_ids = [int(i) for i in ids] if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None
    if request.kind == "chat":
        msg = choice.get("message") or {}
        text = str(msg.get("reasoning") or msg.get("reasoning_content") or "") + str(msg.get("content") or "")
    else:
        text = str(choice.get("text") or "")
    return Answer(request=request.id, token_ids=token_ids, text=text)


def ask(target: Target, request: CanaryRequest, model: str, timeout: float) -> Answer:
    """``request``'s answer from ``target``; raises :class:`_NoAnswer`. A pairing is driven as
    vllm-router drives P/D with the NIXL connector: the prefill gets the request with
    :data:`PREFILL_KV`, one token and no stream; the decode gets the original request with the
    ``kv_transfer_params`` the prefill answered; both under one ``X-Request-Id``."""
    body = _salted(request.body(model))
    if target.kind != "pair" or target.prefill is None:
        return answer_of(request, _post(target.url + request.path, body, timeout))
    headers = {"X-Request-Id": f"k3launch-canary-{uuid.uuid4().hex}"}
    leg = body | {"kv_transfer_params": PREFILL_KV, "max_tokens": 1, "stream": False}
    prefilled = _post(target.prefill + request.path, leg, timeout, headers, "prefill")
    kv = prefilled.get("kv_transfer_params")
    if not isinstance(kv, dict) or not kv:
        raise _NoAnswer("failed", f"prefill: {target.prefill} answered without kv_transfer_params (is it a kv_producer?)")
    return answer_of(request, _post(target.url + request.path, body | {"kv_transfer_params": kv}, timeout, headers, "decode"))


def replay_target(target: Target, baseline: Baseline, tolerance: Tolerance, timeout: float) -> TargetReport:
    """Ask ``target`` every request of ``baseline`` and compare; the first one not answered ends it."""
    t0 = time.monotonic()
    mismatches: list[Mismatch] = []
    for request in baseline.requests:
        expected = baseline.answer(request.id)
        if expected is None:
            continue  # a baseline always has every answer; one edited by hand may not
        try:
            got = ask(target, request, baseline.model, timeout)
        except _NoAnswer as exc:
            return TargetReport(target=target.name, kind=target.kind, outcome=exc.outcome, mismatches=mismatches,
                                reason=f"{request.id}: {exc.reason}", seconds=time.monotonic() - t0)
        if (m := compare(target.name, request, expected, got, tolerance)) is not None:
            mismatches.append(m)
    return TargetReport(target=target.name, kind=target.kind, outcome="mismatch" if mismatches else "ok", mismatches=mismatches,
                        seconds=time.monotonic() - t0)


def replay(plan: Plan, baseline: Baseline, *, only: Collection[str] | None = None, skip: Collection[str] = (),
           tolerance: Tolerance | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> list[TargetReport]:
    """Every target of ``plan`` (only those exercising ``only``'s processes, none named in
    ``skip``) asked ``baseline``'s requests, in parallel: one report each, in target order.
    ``tolerance``: the baseline's own unless given."""
    todo = [t for t in targets(plan, only) if t.name not in skip]
    tol = tolerance or baseline.tolerance
    if not todo:
        return []
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(todo)), thread_name_prefix="k3launch-canary") as pool:
        return list(pool.map(lambda t: replay_target(t, baseline, tol, timeout), todo))


def check(store: StateStore, name: str, plan: Plan, *, only: Collection[str] | None = None,
          timeout: float = DEFAULT_TIMEOUT_S) -> CanaryReport | None:
    """The replay a supervisor (every ``canary_interval``) or a rollout's gate runs: ``name``'s
    baseline asked of ``plan``'s targets (``plan``: the addresses the processes bind; ``only``: the
    targets of these processes, and the router). None when ``name`` has no baseline (``up
    --no-canary``, or its recording failed): nothing to compare with. K3Error ``bad-canary`` for a
    baseline that cannot be read. ``report.rebaseline`` says why answers may differ legitimately
    (``plan`` no longer what the baseline was recorded on)."""
    baseline = load(store, name)
    if baseline is None:
        return None
    reports = replay(plan, baseline, only=only, timeout=timeout)
    return CanaryReport(deployment=name, baseline=baseline, targets=reports, rebaseline=rebaseline_reasons(baseline, plan))


def _answers(target: Target, requests: Sequence[CanaryRequest], model: str, timeout: float) -> list[Answer]:
    """Every request's answer from ``target``, each with tokens; raises :class:`_NoAnswer`."""
    out = []
    for request in requests:
        got = ask(target, request, model, timeout)
        if not got.text and not got.token_ids:
            raise _NoAnswer("failed", f"{request.id}: answered no tokens")
        out.append(got)
    return out


def record(plan: Plan, deployment: str, *, tolerance: Tolerance | None = None, timeout: float = DEFAULT_TIMEOUT_S,
           requests: Sequence[CanaryRequest] = REQUESTS, clock: Callable[[], float] = time.time) -> tuple[Baseline, list[TargetReport]]:
    """Record the baseline from the first target (in :func:`~k3launch.models.canary.targets`' order)
    that answers every request, then replay it on every other target: (baseline, one report per
    target, the source's first). K3Error ``canary-not-recorded`` when no target answers."""
    tried: list[str] = []
    for target in targets(plan):
        t0 = time.monotonic()
        try:
            answers = _answers(target, requests, plan.model, timeout)
        except _NoAnswer as exc:
            tried.append(f"{target.name}: {exc.reason}")
            continue
        version = http.get_json(target.url + "/version", min(timeout, 5.0)).data.get("version") if target.kind == "engine" else None
        baseline = Baseline(deployment=deployment, model=plan.model, recorded=clock(), source=target.name, engine=plan.engine,
                            vllm_version=plan.vllm_version, engine_version=str(version) if version else None,
                            fingerprint=fingerprint(plan), tolerance=tolerance or Tolerance(), requests=list(requests), answers=answers)
        own = TargetReport(target=target.name, kind=target.kind, outcome="ok", seconds=time.monotonic() - t0)
        return baseline, [own, *replay(plan, baseline, skip={target.name}, timeout=timeout)]
    said = "; ".join(tried) if tried else "the plan has no HTTP server"
    raise K3Error("canary-not-recorded", f"no target answered the canary's requests: {said[:400]}",
                  "check the deployment (`k3launch status NAME`), then `k3launch canary NAME --rebaseline`")


# -------------------------------------------------------------------------------- on disk
def save(store: StateStore, baseline: Baseline) -> None:
    """Keep ``baseline`` in ``<state>/canary/NAME.json``, readable by its owner only."""
    path = store.canary_path(baseline.deployment)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise io_error(exc, path.parent, "create") from None
    write_atomic(path, baseline.model_dump_json(indent=1))  # a mkstemp file: mode 0600, kept by the rename
    with contextlib.suppress(OSError):
        os.chmod(path, 0o600)  # said, not assumed: a umask or another writer never widens it


def load(store: StateStore, name: str) -> Baseline | None:
    """``name``'s baseline, None when it has none; K3Error ``bad-canary`` when it cannot be read."""
    path = store.canary_path(name)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise io_error(exc, path, "read") from None
    try:
        return Baseline.model_validate_json(text)
    except ValidationError:
        raise K3Error("bad-canary", f"{path}: unreadable canary baseline",
                      f"`k3launch canary {name} --rebaseline` records a new one") from None


def forget(store: StateStore, name: str) -> None:
    """Remove ``name``'s baseline (``down``; a new ``up`` of the name records its own)."""
    with contextlib.suppress(OSError):
        store.canary_path(name).unlink()
