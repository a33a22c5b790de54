"""OpenAI-compatible request parsing and response bodies, in the shapes vLLM emits.

Only the fields a benchmark, a router, a health probe or a canary reads are honoured (model,
prompt or messages, max_tokens, n, stream, stream_options.include_usage, kv_transfer_params,
return_token_ids; temperature only for vLLM's greedy check); anything else — sampling knobs, and the SGLang-style fields
vllm-router injects (``no_stop_trim``, ``separate_reasoning``, ...) — is accepted and ignored, as
vLLM ignores unknown extras. Requests are checked in vLLM's order, each refusal shaped as vLLM
shapes it (:mod:`k3launch.sim.apierror`): the request model's "before" validators, the field
types, the model name, the lengths against ``--max-model-len``, the sampling parameters.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from k3launch.sim.apierror import (
    FieldError,
    Invalid,
    as_bool,
    as_float,
    as_int,
    as_list,
    as_str,
    invalid,
    not_found,
    validation_error,
)
from k3launch.sim.tokens import chat_ids, prompt_ids
from k3launch.sim.wire import Json

DEFAULT_MAX_TOKENS = 16  # vLLM's completions default; chat without one generates to EOS, which the sim has not: 16 too
CHAT_TEMPLATE_TOKENS = 3  # per message: role markers a chat template adds around the content
GREEDY_EPS = 1e-5  # vllm/sampling_params.py _SAMPLING_EPS: a lower temperature is greedy sampling
FINGERPRINT = "vllm-k3launch-sim"


@dataclass(frozen=True)
class GenRequest:
    """One completion or chat request, reduced to what the latency model and P/D need."""

    chat: bool
    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int  # per choice, already clamped to what the context holds
    n: int  # choices, each max_tokens long
    stream: bool
    include_usage: bool
    kv_params: Json | None
    # return_token_ids: answers carry the output ids (``token_ids``) and the prompt's
    # (``prompt_token_ids``), as vLLM's do; None unless asked
    prompt_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _Field:
    """One typed field of vLLM's request model: absent (or null, if nullable) gives ``default``."""

    name: str
    coerce: Callable[[object], object]
    default: object = None
    nullable: bool = True
    required: bool = False


# In the order of vLLM's request models (pydantic reports errors in field order):
# completion/protocol.py CompletionRequest, chat_completion/protocol.py ChatCompletionRequest.
_COMPLETION_FIELDS = (
    _Field("model", as_str),
    _Field("max_tokens", as_int, DEFAULT_MAX_TOKENS),
    _Field("n", as_int, 1, nullable=False),
    _Field("stream", as_bool, False),
    _Field("temperature", as_float),
    _Field("return_token_ids", as_bool),
)
_CHAT_FIELDS = (
    _Field("messages", as_list, required=True),
    _Field("model", as_str),
    _Field("max_tokens", as_int),
    _Field("max_completion_tokens", as_int),
    _Field("n", as_int, 1),
    _Field("stream", as_bool, False),
    _Field("temperature", as_float),
    _Field("return_token_ids", as_bool),
)


def parse(body: object, chat: bool, served: tuple[str, ...], max_model_len: int | None, request_id: str | None, max_n: int) -> GenRequest:
    """The request in ``body`` (parsed JSON; None: no body); raises ``ApiError`` where vLLM would
    refuse it (``max_n``: VLLM_MAX_N_SEQUENCES)."""
    if body is None or not isinstance(body, dict):
        kind, msg = (
            ("missing", "Field required")
            if body is None
            else ("model_attributes_type", "Input should be a valid dictionary or object to extract fields from")
        )
        raise validation_error([FieldError(kind, "body", msg, body)])
    # The models' "before" validators raise vLLM's own error, ahead of any field check.
    if not chat and body.get("prompt") in (None, "") and not body.get("prompt_embeds"):
        raise invalid("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    if body.get("stream_options") and not body.get("stream"):
        raise invalid("Stream options can only be defined when `stream=True`.", param="stream_options")
    f = _fields(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS)
    model = f["model"]
    if isinstance(model, str) and model and model not in served:
        raise not_found(model, served)
    requested, param = cast(int | None, f["max_tokens"]), "max_tokens"  # the coerced fields have their types
    if chat and f["max_completion_tokens"] is not None:
        requested, param = cast(int, f["max_completion_tokens"]), "max_completion_tokens"
    if max_model_len is not None and requested is not None and requested > max_model_len:
        raise invalid(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. Please request fewer output tokens.",
            param=param,
            value=requested,
        )
    prompt_tokens = _chat_tokens(f["messages"]) if chat else _prompt_tokens(body.get("prompt"))
    max_tokens = DEFAULT_MAX_TOKENS if requested is None else requested
    if max_model_len is not None:
        if prompt_tokens > max_model_len:
            raise invalid(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains {prompt_tokens} "
                "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
                "prompt.",
                param="input_tokens",
                value=prompt_tokens,
            )
        max_tokens = min(max_tokens, max_model_len - prompt_tokens)  # api_utils.py get_max_tokens: what the context holds
    n = cast(int, f["n"])
    _check_sampling(n, max_tokens, f["temperature"], max_n)
    opts, kv = body.get("stream_options"), body.get("kv_transfer_params")
    return GenRequest(
        chat=chat,
        request_id=("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex),
        model=model if isinstance(model, str) and model else served[0],
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        n=n,
        stream=f["stream"] is True,
        include_usage=isinstance(opts, dict) and _truthy(opts.get("include_usage")),
        kv_params=kv if isinstance(kv, dict) else None,
        prompt_ids=None if f["return_token_ids"] is not True else tuple(chat_ids(f["messages"]) if chat else prompt_ids(body.get("prompt"))),
    )


def _fields(body: Json, fields: tuple[_Field, ...]) -> dict[str, object]:
    """Each field coerced as pydantic does; every failing field is reported at once, as pydantic does."""
    out: dict[str, object] = {}
    errors: list[FieldError | str] = []
    for fld in fields:
        if fld.name not in body:
            if fld.required:
                errors.append(FieldError("missing", f"body.{fld.name}", "Field required", body))
            out[fld.name] = fld.default
            continue
        value = body[fld.name]
        if value is None and fld.nullable:
            out[fld.name] = fld.default
            continue
        try:
            out[fld.name] = fld.coerce(value)
        except Invalid as exc:
            errors.append(FieldError(exc.kind, f"body.{fld.name}", exc.msg, value))
    if errors:
        raise validation_error(errors)
    return out


def _check_sampling(n: int, max_tokens: int, temperature: object, max_n: int) -> None:
    """vllm/sampling_params.py, in its order: ``n``, ``max_tokens``, then greedy sampling."""
    if n < 1:
        raise invalid(f"n must be at least 1, got {n}.")
    if n > max_n:
        raise invalid(f"n must be at most {max_n}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.")
    if max_tokens < 1:
        raise invalid(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens", value=max_tokens)
    if isinstance(temperature, float) and temperature < GREEDY_EPS and n > 1:
        raise invalid(f"n must be 1 when using greedy sampling, got {n}.")


def _truthy(value: object) -> bool:
    """``stream_options.include_usage`` read as pydantic reads a bool; the sim validates no further
    inside ``stream_options``, so a value pydantic would refuse just counts as unset."""
    try:
        return value is not None and as_bool(value)
    except Invalid:
        return False


def _words(text: str) -> int:
    return len(text.split())


def _prompt_tokens(prompt: object) -> int:
    """A word-count stand-in for tokenization; token-id prompts count their ids.

    A batch of prompts is answered for its first prompt only (vLLM answers each).
    """
    if isinstance(prompt, str):
        return max(1, _words(prompt))
    if isinstance(prompt, list):
        if not prompt:
            raise invalid("You must pass at least one prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        first = prompt[0]
        if isinstance(first, str):
            return max(1, _words(first))
        if isinstance(first, list) and first:
            return len(first)
    # vLLM's pydantic union reports one error per branch; the sim sums them up in one line
    raise validation_error(
        [
            FieldError(
                "union_type",
                "body.prompt",
                "Input should be a string, a list of strings, a list of token ids or a list of lists of token ids",
                prompt,
            )
        ]
    )


def _chat_tokens(messages: object) -> int:
    if not isinstance(messages, list) or not messages:
        raise invalid("Cannot apply chat template to an empty conversation. Provide at least one message.")
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise validation_error([FieldError("model_type", f"body.messages.{i}", "Input should be an object with role and content", m)])
        content = m.get("content")
        if isinstance(content, str):
            total += _words(content)
        elif isinstance(content, list):
            total += sum(_words(str(p.get("text", ""))) for p in content if isinstance(p, dict))
        total += CHAT_TEMPLATE_TOKENS
    return total


# -- answers --------------------------------------------------------------------------------------


def usage(req: GenRequest, completion_tokens: int) -> Json:
    return {
        "prompt_tokens": req.prompt_tokens,
        "total_tokens": req.prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def full_body(req: GenRequest, outputs: list[tuple[str, list[int]]], per_choice: int, finish: str, kv_out: Json | None) -> Json:
    """The non-streaming response, with the keys (and their order) of vLLM 0.32's own answers: one
    choice per (text, token ids) output, usage counting every choice's tokens. With
    ``return_token_ids`` a choice carries its ``token_ids`` and the prompt's ids ride on the
    completion choice, or on the chat response itself (vLLM 0.32's completion/serving.py and
    chat_completion/serving.py ``request.return_token_ids``)."""
    asked = req.prompt_ids is not None
    prompt = list(req.prompt_ids) if req.prompt_ids is not None else None
    choices: list[Json] = []
    for i, (text, ids) in enumerate(outputs):
        if req.chat:
            message = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": ids if asked else None,
                    "routed_experts": None,
                }
            )
        else:
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": ids if asked else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt,
                    "routed_experts": None,
                }
            )
    body: Json = {
        "id": req.request_id,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": usage(req, per_choice * len(outputs)),
    }
    if req.chat:
        body |= {"prompt_logprobs": None, "prompt_token_ids": prompt, "prompt_text": None}
    return body | {"kv_transfer_params": kv_out, "ec_transfer_params": None, "metrics": None}


def _chunk(req: GenRequest, choice: Json) -> Json:
    return {
        "id": req.request_id,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
    }


def role_chunk(req: GenRequest, index: int) -> Json:
    """A chat stream's opening chunk of one choice (vLLM sends one per choice before any token),
    with the prompt's ids when ``return_token_ids`` asked for them."""
    choice: Json = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ids = list(req.prompt_ids) if req.prompt_ids is not None else None
    return _chunk(req, choice) | {"prompt_token_ids": ids, "prompt_text": None}


def chunk(req: GenRequest, index: int, text: str | None, finish: str | None, ids: list[int] | None = None, first: bool = False) -> Json:
    """One SSE ``data:`` object of a streaming response: choice ``index``'s next token (``text``
    None: no content delta; ``ids``: its token ids, sent when ``return_token_ids`` asked; ``first``:
    the choice's first completion chunk, which carries the prompt's ids then). vLLM dumps these with
    ``exclude_unset``, hence the keys differ between a token chunk and the one with the finish
    reason; a terminal chunk carries the fingerprint unless a usage chunk follows."""
    asked = req.prompt_ids is not None
    token_ids = (ids or []) if asked else None
    finishing = {"finish_reason": finish, "stop_reason": None} if finish is not None else {"finish_reason": None}
    if req.chat:
        delta: Json = {} if text is None else {"content": text}
        out = _chunk(req, {"index": index, "delta": delta, "logprobs": None, **finishing, "token_ids": token_ids})
    else:
        out = _chunk(
            req,
            {
                "index": index,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_token_ids": list(req.prompt_ids) if first and req.prompt_ids is not None else None,
                "token_ids": token_ids,
            },
        )
    if finish is not None and not req.include_usage:
        out["system_fingerprint"] = FINGERPRINT
    return out


def usage_chunk(req: GenRequest, completion_tokens: int) -> Json:
    """The final chunk ``stream_options.include_usage`` asks for: no choices, the usage of every
    choice, dumped with ``exclude_none`` (no ``*_details``), fingerprinted."""
    u = {k: v for k, v in usage(req, completion_tokens).items() if v is not None}
    return {
        "id": req.request_id,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [],
        "usage": u,
        "system_fingerprint": FINGERPRINT,
    }
