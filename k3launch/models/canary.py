"""The correctness canary, the pure part: the fixed requests, the baseline, the targets, the verdict.

``/health`` says nothing about correctness: an engine (or a prefill/decode pairing whose KV
transfer is broken) can answer 200 with the wrong tokens. At first ready, k3launch records the
answers of a small fixed set of greedy requests (:data:`REQUESTS`: temperature 0, a fixed seed,
:data:`MAX_TOKENS` tokens each, completions and chats) as the deployment's :class:`Baseline`; a
replay asks them again of every :class:`Target` — each engine HTTP server directly, the router,
and for P/D plans every (prefill, decode) pairing the router can choose — and :func:`compare`
says which answers differ (docs/canary.md). The I/O is :mod:`k3launch.deploy.canary`.

Answers are compared by token ids (vLLM's ``return_token_ids``); where an answer carries none
(an engine or a router that does not pass them on), by text. :class:`Tolerance` is the one knob
for engines that are not deterministic at temperature 0.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from k3launch.models.plan import Plan, Process
from k3launch.util import bounds

MAX_TOKENS = 8  # enough tokens for a garbled KV cache to show, few enough to cost nothing
SEED = 1234  # fixed: with temperature 0 it changes nothing in vLLM, but an engine that samples anyway samples alike

RequestKind = Literal["completion", "chat"]
TargetKind = Literal["engine", "pair", "router"]
Outcome = Literal["ok", "mismatch", "unreachable", "failed"]
# kv_transfer_params of the prefill leg, as vllm-router and vLLM's toy P/D proxy send them with the NIXL connector
# (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py): prefill only, then keep the KV blocks for a remote decode.
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
              "remote_host": None, "remote_port": None}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CanaryRequest(_Frozen):
    """One fixed greedy request: a completion of ``prompt``, or a chat whose one user message it is."""

    id: str
    kind: RequestKind
    prompt: str
    max_tokens: int = MAX_TOKENS
    seed: int = SEED

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        """The request body (without the per-send ``cache_salt`` the I/O adds)."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": 0, "seed": self.seed,
                                "stream": False, "return_token_ids": True}
        if self.kind == "chat":
            return body | {"messages": [{"role": "user", "content": self.prompt}]}
        return body | {"prompt": self.prompt}


# A long prompt spans several KV blocks (vLLM's default block size is 16 tokens), so a P/D
# transfer moves more than one block; short ones and chats (another template, another path
# through the server) besides.
REQUESTS: tuple[CanaryRequest, ...] = (
    CanaryRequest(id="complete-capital", kind="completion", prompt="The capital of France is"),
    CanaryRequest(id="complete-sequence", kind="completion", prompt="1, 1, 2, 3, 5, 8, 13, 21,"),
    CanaryRequest(id="complete-long", kind="completion", prompt=(
        "A correctness canary is a small fixed set of requests whose answers are recorded once and asked again later. "
        "Sampling is greedy, so a healthy engine gives the same tokens every time; when a kernel, a cache or a transfer "
        "between a prefill and a decode instance goes wrong, the tokens change while every health check still passes. "
        "In one sentence, the reason to keep such a canary is")),
    CanaryRequest(id="chat-arithmetic", kind="chat", prompt="What is 17 times 23? Answer with the number only."),
    CanaryRequest(id="chat-translate", kind="chat", prompt="Translate into German: the weather is nice today."),
)


class Tolerance(_Frozen):
    """How much of an answer must match its baseline.

    ``prefix`` None (the default): every token. vLLM at temperature 0 is deterministic only as far
    as its arithmetic is: batch-dependent kernels (another batch size, another MoE all-to-all)
    change floating-point sums, and where the two likeliest tokens nearly tie another one wins —
    after which every later token may differ too. For such engines ``prefix=N`` asks only the
    first N tokens of each answer to match (N >= 1: a tolerance is never silence). Answers
    compared by text count whitespace-separated words instead of tokens. vLLM's
    ``VLLM_BATCH_INVARIANT=1`` makes the kernels batch invariant, so exact matching holds.
    """

    prefix: int | None = Field(default=None, **bounds.CANARY_PREFIX.field())

    def describe(self) -> str:
        return "every token" if self.prefix is None else f"the first {self.prefix} token(s)"


class Answer(_Frozen):
    """What a target answered one request: its token ids (None: it returned none) and text."""

    request: str
    token_ids: list[int] | None
    text: str


class Baseline(_Frozen):
    """The answers recorded for one deployment's served model, and what they were recorded on."""

    deployment: str
    model: str
    recorded: float  # unix time
    source: str  # the target whose answers these are
    engine: str  # the plan's engine: vllm or sim
    vllm_version: str  # the plan's vLLM version
    engine_version: str | None = None  # what the source's /version said
    fingerprint: dict[str, str] = {}  # what decides the tokens (fingerprint()): a change calls for a new baseline
    tolerance: Tolerance = Tolerance()
    requests: list[CanaryRequest]
    answers: list[Answer]

    def answer(self, request: str) -> Answer | None:
        return next((a for a in self.answers if a.request == request), None)


class Target(_Frozen):
    """Where the canary asks: one engine HTTP server, the router, or a (prefill, decode) pairing
    driven as vllm-router drives it (the prefill with :data:`PREFILL_KV` and one token, then the
    decode with the prefill's ``kv_transfer_params``)."""

    name: str  # a process id, "router", or "<prefill>><decode>"
    kind: TargetKind
    url: str  # engine and router: their base URL; pair: the decode's
    prefill: str | None = None  # pair: the prefill's base URL
    processes: tuple[str, ...]  # the plan processes it exercises


class Mismatch(_Frozen):
    """One answer that differs from the baseline's."""

    target: str
    request: str
    kind: RequestKind
    prompt: str
    basis: Literal["token_ids", "text"]
    expected: list[int] | None
    got: list[int] | None
    expected_text: str
    got_text: str
    first_difference: int  # the index of the first differing token (or word, by text)

    def line(self) -> str:
        """One line for an event's reason or a log: target, request, prompt, expected, got."""
        def said(ids: list[int] | None, text: str) -> str:
            return f"{ids if ids is not None else '(no ids)'} {json.dumps(text)}"

        return (f"{self.target}: {self.request} differs from {'token' if self.basis == 'token_ids' else 'word'} "
                f"{self.first_difference} on; prompt {json.dumps(self.prompt)}; expected {said(self.expected, self.expected_text)}; "
                f"got {said(self.got, self.got_text)}")


class TargetReport(_Frozen):
    """One target's verdict: every answer matched (ok), some did not (mismatch), no answer came
    (unreachable: refused, timed out), or an answer was an error (failed: an HTTP error, a prefill
    without ``kv_transfer_params``)."""

    target: str
    kind: TargetKind
    outcome: Outcome
    mismatches: list[Mismatch] = []
    reason: str = ""
    seconds: float = 0.0


class CanaryReport(_Frozen):
    """A replay of ``deployment``'s baseline (``recorded``: the baseline was recorded by this very
    call, ``--rebaseline``); ``rebaseline``: why its plan no longer matches the baseline's."""

    deployment: str
    baseline: Baseline
    targets: list[TargetReport]
    recorded: bool = False
    rebaseline: list[str] = []

    @property
    def ok(self) -> bool:
        return all(t.outcome == "ok" for t in self.targets)

    @property
    def mismatches(self) -> list[Mismatch]:
        return [m for t in self.targets for m in t.mismatches]


# -------------------------------------------------------------------------------- targets
def _url(p: Process) -> str:
    return f"http://{p.address}:{p.http_port}"


def targets(plan: Plan, only: Collection[str] | None = None) -> list[Target]:
    """Where a replay asks, in order: every engine HTTP server (a replica, a P/D instance, each DP
    API server), every (prefill, decode) pairing of a P/D plan, then the router. ``only``: the
    targets that exercise one of these processes (a unit a rollout just restarted); the router,
    which may route to any of them, always stays."""
    servers = [p for p in plan.processes if p.http_port is not None and p.role != "router"]
    out = [Target(name=p.id, kind="engine", url=_url(p), processes=(p.id,)) for p in servers]
    prefills = [p for p in servers if p.role == "prefill"]
    decodes = [p for p in servers if p.role == "decode"]
    for pre, dec in itertools.product(prefills, decodes):
        out.append(Target(name=f"{pre.id}>{dec.id}", kind="pair", url=_url(dec), prefill=_url(pre), processes=(pre.id, dec.id)))
    router = next((p for p in plan.processes if p.role == "router" and p.http_port is not None), None)
    if router is not None:
        out.append(Target(name="router", kind="router", url=_url(router), processes=(router.id,)))
    if only is None:
        return out
    return [t for t in out if t.kind == "router" or set(t.processes) & set(only)]


# -------------------------------------------------------------------------------- comparing
def _first_difference(a: Sequence[object], b: Sequence[object]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(target: str, request: CanaryRequest, expected: Answer, got: Answer, tolerance: Tolerance) -> Mismatch | None:
    """None when ``got`` matches ``expected`` within ``tolerance``; token ids when both answers
    carry them, else texts word by word."""
    if expected.token_ids is not None and got.token_ids is not None:
        basis: Literal["token_ids", "text"] = "token_ids"
        a: Sequence[object] = expected.token_ids
        b: Sequence[object] = got.token_ids
    else:
        basis, a, b = "text", expected.text.split(), got.text.split()
    if tolerance.prefix is not None:
        a, b = a[: tolerance.prefix], b[: tolerance.prefix]
    same = expected.text == got.text if basis == "text" and tolerance.prefix is None else list(a) == list(b)  # by text: its spacing too
    if same:
        return None
    return Mismatch(target=target, request=request.id, kind=request.kind, prompt=request.prompt, basis=basis,
                    expected=expected.token_ids, got=got.token_ids, expected_text=expected.text, got_text=got.text,
                    first_difference=_first_difference(a, b))


# -------------------------------------------------------------------------------- when a new baseline is due
# What decides a greedy answer's tokens besides the prompt: the weights and tokenizer, the dtype and
# quantization, the chat template and generation config, and kernels whose arithmetic differs.
SAMPLING_FLAGS = ("--tokenizer", "--revision", "--tokenizer-revision", "--code-revision", "--dtype", "--quantization",
                  "--kv-cache-dtype", "--generation-config", "--override-generation-config", "--seed", "--hf-overrides",
                  "--chat-template", "--tokenizer-mode", "--speculative-config", "--logits-processors", "--served-model-name",
                  "--moe-backend", "--all2all-backend", "--attention-backend", "--attention-config", "--model-impl")
SAMPLING_ENV = ("VLLM_BATCH_INVARIANT", "VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_USE_FLASHINFER_SAMPLER")


def _flags(argv: Sequence[str]) -> dict[str, str]:
    """``--flag value`` / ``--flag=value`` / a bare ``--flag`` (true) of an engine's argv; a JSON
    config's dotted sub-key (``--speculative-config.method x``) under its dotted name."""
    out: dict[str, str] = {}
    for i, word in enumerate(argv):
        if not word.startswith("--"):
            continue
        name, eq, value = word.partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            value = nxt if nxt and not nxt.startswith("--") else "true"
        out[name] = value
    return out


def fingerprint(plan: Plan) -> dict[str, str]:
    """What in ``plan`` decides the canary's tokens: the model, engine and vLLM version, and per
    engine role its image, sampling-relevant flags (:data:`SAMPLING_FLAGS`) and env."""
    seen: dict[str, set[str]] = {}
    for p in plan.processes:
        if p.role == "router":
            continue
        flags = _flags(p.argv)
        items = [("image", p.image or "")] + [(f, v) for f, v in sorted(flags.items()) if f.split(".", 1)[0] in SAMPLING_FLAGS]
        items += [(e, p.env[e]) for e in SAMPLING_ENV if e in p.env]
        for key, value in items:
            seen.setdefault(f"{p.role} {key}", set()).add(value)
    out = {"model": plan.model, "engine": plan.engine, "vllm_version": plan.vllm_version}
    return out | {k: " | ".join(sorted(v)) for k, v in sorted(seen.items())}


def rebaseline_reasons(baseline: Baseline, plan: Plan) -> list[str]:
    """Why ``plan`` may answer differently from what ``baseline`` recorded, legitimately (another
    model, vLLM or sampling-relevant flag): one line each; none: the baseline still applies."""
    now = fingerprint(plan)
    was = baseline.fingerprint
    out = []
    for key in sorted(set(now) | set(was)):
        if now.get(key) != was.get(key):
            out.append(f"{key}: {was.get(key, '(unset)')} -> {now.get(key, '(unset)')}")
    return out
