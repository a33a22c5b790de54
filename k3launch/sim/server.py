"""The OpenAI-compatible HTTP API of the sim, on the stdlib's threading HTTP server.

HTTP/1.1 with keep-alive: every plain response carries Content-Length, streams use chunked
transfer encoding with SSE ``data:`` events, so clients that pool connections (vllm-router,
``vllm bench serve``, aiohttp) behave as they do against uvicorn. A thread per connection keeps
concurrent requests concurrent; --max-num-seqs is enforced by the engine, not by the server.
"""

from __future__ import annotations

import json
import socket
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast

from k3launch.sim import openai
from k3launch.sim.engine import Engine, Session
from k3launch.sim.logs import Logger
from k3launch.sim.openai import ApiError, GenRequest
from k3launch.sim.options import ServeOptions
from k3launch.sim.wire import Json

_MAX_BODY = 64 << 20


class App:
    """What request handlers need: settings, engine, log and version."""

    def __init__(self, opts: ServeOptions, engine: Engine, log: Logger, version: str) -> None:
        self.opts = opts
        self.engine = engine
        self.log = log
        self.version = version
        self.created = int(time.time())


class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # in-flight requests must not hold up a SIGTERM exit
    allow_reuse_address = True
    request_queue_size = 2048  # socketserver's default backlog of 5 resets bursts of connections (uvicorn: 2048)

    def __init__(self, host: str, port: int, app: App) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.app = app
        super().__init__((host, port), Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hangs up mid-response is not an engine error; don't print tracebacks


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""

    @property
    def app(self) -> App:
        return cast(SimHTTPServer, self.server).app

    # -- plumbing ---------------------------------------------------------------------------
    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        host, port = self.client_address[:2]
        self.app.log.info(f'{host}:{port} - "{self.requestline}" {code}', src="h11_impl.py")

    def log_message(self, format: str, *args: object) -> None:
        pass  # BaseHTTPRequestHandler's stderr lines are replaced by log_request above

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Json) -> None:
        self._send(status, json.dumps(obj).encode())

    def _body(self) -> Json:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raw = self._read_chunked()
        else:
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY:
                raise ApiError(413, "request body too large")
            raw = self.rfile.read(length)
        try:
            obj = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(obj, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return obj

    def _read_chunked(self) -> bytes:
        out = b""
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                self.rfile.readline()  # the blank line after the last chunk
                return out
            out += self.rfile.read(size)
            self.rfile.readline()
            if len(out) > _MAX_BODY:
                raise ApiError(413, "request body too large")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _event(self, obj: Json | str) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj)
        self._chunk(f"data: {payload}\n\n".encode())

    # -- routes -----------------------------------------------------------------------------
    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        app = self.app
        if path in ("/health", "/ping"):
            self._send(200, b"")
        elif path == "/v1/models":
            perm = {"id": "modelperm-k3launch-sim", "object": "model_permission", "created": app.created, "allow_create_engine": False,
                    "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                    "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}  # vLLM's, as it answers
            data: list[Json] = [{"id": n, "object": "model", "created": app.created, "owned_by": "vllm", "root": app.opts.model,
                                 "parent": None, "max_model_len": app.opts.max_model_len, "permission": [perm]}
                                for n in app.opts.served_names]
            self._json(200, {"object": "list", "data": data})
        elif path == "/version":
            self._json(200, {"version": app.version})
        elif path == "/metrics":
            self._send(200, app.engine.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/load":
            self._json(200, {"server_load": app.engine.load()})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._body_discard()
            self._json(404, {"detail": "Not Found"})
            return
        try:
            req = openai.parse(self._body(), path == "/v1/chat/completions", self.app.opts.served_names,
                               self.app.opts.max_model_len, self.headers.get("X-Request-Id"))
            session = self.app.engine.open(req, self.headers.get("X-data-parallel-rank"))
        except ApiError as exc:
            self._json(exc.status, exc.body())
            return
        try:
            if req.stream:
                self._stream(req, session)
            else:
                text = session.text()
                self._json(200, openai.full_body(req, text, session.produced, session.finish_reason, session.kv_out))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left; the slot is freed below
        finally:
            session.close()

    @staticmethod
    def _final(chunk: Json, session: Session) -> Json:
        if session.kv_out is not None:
            chunk["kv_transfer_params"] = session.kv_out
        return chunk

    def _body_discard(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= _MAX_BODY:
            self.rfile.read(length)

    def _stream(self, req: GenRequest, session: Session) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if req.chat:
            self._event(openai.chunk(req, "", None, first=True))
        # Like vLLM's completion and chat stream generators, finish_reason rides on the chunk of
        # the last token: a separate empty finish chunk would still carry ``choices``, which
        # vllm bench serve's client counts as one more token arrival (one more ITL gap).
        for i, tok in enumerate(session.tokens()):
            if i < session.n - 1:
                self._event(openai.chunk(req, tok, None))
            else:
                self._event(self._final(openai.chunk(req, tok, session.finish_reason), session))
        if session.n == 0:  # no token at all (a zero-token engine): the finish reason comes alone
            self._event(self._final(openai.chunk(req, None if req.chat else "", session.finish_reason), session))
        if req.include_usage:
            self._event(openai.usage_chunk(req, session.produced))
        self._event("[DONE]")
        self._chunk(b"")  # zero-length chunk: end of the chunked body


def start(host: str, port: int, app: App) -> SimHTTPServer:
    """Bind now (OSError if the port is taken or the address is not ours)."""
    return SimHTTPServer(host, port, app)
