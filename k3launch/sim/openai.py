"""OpenAI-compatible request parsing and response bodies, in the shapes vLLM emits.

Only the fields a benchmark, a router or a health probe reads are honoured (model, prompt or
messages, max_tokens, stream, stream_options.include_usage, kv_transfer_params); anything else
— sampling knobs, and the SGLang-style fields vllm-router injects (``no_stop_trim``,
``separate_reasoning``, ...) — is accepted and ignored, as vLLM ignores unknown extras.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from k3launch.sim.wire import Json

DEFAULT_MAX_TOKENS = 16
CHAT_TEMPLATE_TOKENS = 3  # per message: role markers a chat template adds around the content


class ApiError(Exception):
    """An error response: vLLM's ``{"error": {...}}`` body with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind

    def body(self) -> Json:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}


@dataclass(frozen=True)
class GenRequest:
    """One completion or chat request, reduced to what the latency model and P/D need."""

    chat: bool
    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    kv_params: Json | None


def parse(body: Json, chat: bool, served: tuple[str, ...], max_model_len: int | None, request_id: str | None) -> GenRequest:
    model = body.get("model")
    if model is not None and model not in served:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    prompt_tokens = _chat_tokens(body) if chat else _prompt_tokens(body)
    raw_max = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else body.get("max_tokens")
    if raw_max is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif isinstance(raw_max, int) and not isinstance(raw_max, bool):
        max_tokens = raw_max
    else:
        raise ApiError(400, f"max_tokens must be an integer, got {raw_max!r}")
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.")
    if max_model_len is not None and prompt_tokens + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
                            "Please reduce the length of the messages or completion.")
    opts = body.get("stream_options")
    kv = body.get("kv_transfer_params")
    prefix = "chatcmpl-" if chat else "cmpl-"
    return GenRequest(
        chat=chat,
        request_id=prefix + (request_id or uuid.uuid4().hex),
        model=str(model) if model is not None else served[0],
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=body.get("stream") is True,
        include_usage=isinstance(opts, dict) and opts.get("include_usage") is True,
        kv_params=kv if isinstance(kv, dict) else None,
    )


def _words(text: str) -> int:
    return len(text.split())


def _prompt_tokens(body: Json) -> int:
    """A word-count stand-in for tokenization; token-id prompts count their ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return max(1, _words(prompt))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        first = prompt[0]  # a batch: the sim answers the first prompt (n=1, one choice)
        if isinstance(first, str):
            return max(1, _words(first))
        if isinstance(first, list):
            return max(1, len(first))
    raise ApiError(400, "prompt must be a string, a list of strings or a list of token ids")


def _chat_tokens(body: Json) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            raise ApiError(400, "each message must be an object with role and content")
        content = m.get("content")
        if isinstance(content, str):
            total += _words(content)
        elif isinstance(content, list):
            total += sum(_words(str(p.get("text", ""))) for p in content if isinstance(p, dict))
        total += CHAT_TEMPLATE_TOKENS
    return total


def usage(req: GenRequest, completion_tokens: int) -> Json:
    return {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None, "completion_tokens_details": None}


def full_body(req: GenRequest, text: str, n: int, finish: str, kv_out: Json | None) -> Json:
    """The non-streaming response, with the keys (and their order) of vLLM 0.32's own answers."""
    if req.chat:
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None, "function_call": None,
                   "reasoning": None}
        choice: Json = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                        "token_ids": None, "routed_experts": None}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None, "token_ids": None,
                  "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}
    body: Json = {"id": req.request_id, "object": "chat.completion" if req.chat else "text_completion",
                  "created": int(time.time()), "model": req.model, "choices": [choice], "service_tier": None,
                  "system_fingerprint": "vllm-k3launch-sim", "usage": usage(req, n)}
    if req.chat:
        body |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
    return body | {"kv_transfer_params": kv_out, "ec_transfer_params": None, "metrics": None}


def chunk(req: GenRequest, text: str | None, finish: str | None, first: bool = False) -> Json:
    """One SSE ``data:`` object of a streaming response (``text`` None: no content delta)."""
    if req.chat:
        delta: Json = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: Json = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish, "stop_reason": None}
    return {"id": req.request_id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": req.model, "choices": [choice]}


def usage_chunk(req: GenRequest, n: int) -> Json:
    """The final chunk ``stream_options.include_usage`` asks for: no choices, only usage."""
    return {"id": req.request_id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": req.model, "choices": [], "usage": usage(req, n)}
