"""The OpenAI-compatible HTTP API of the sim, on the stdlib's threading HTTP server.

HTTP/1.1 with keep-alive: every plain response carries Content-Length, streams use chunked
transfer encoding with SSE ``data:`` events, so clients that pool connections (vllm-router,
``vllm bench serve``, aiohttp) behave as they do against uvicorn. Accepted connections set
TCP_NODELAY, as uvicorn's do: a stream is many small writes, and with Nagle's algorithm each
would wait for the ACK of the previous one, which a keep-alive client delays (tens of ms of
TTFT). A thread per connection keeps concurrent requests concurrent; --max-num-seqs is enforced
by the engine, not by the server.

Routing answers as Starlette's router does under vLLM: an unknown path is 404 and a known path
asked with another method 405 (with ``Allow``), both ``{"detail": ...}``; everything else wrong
with a request is vLLM's ``{"error": {...}}`` (:mod:`k3launch.sim.apierror`). The
``/fault_tolerance/*`` routes exist only with ``--enable-fault-tolerance``, as vLLM registers
them only then (vllm/entrypoints/launchers/api_server/routers.py:85-90).
"""

from __future__ import annotations

import json
import socket
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast
from urllib.parse import urlsplit

from k3launch.sim import ft_api, openai
from k3launch.sim.apierror import ApiError, FieldError, validation_error
from k3launch.sim.engine import Engine, Session
from k3launch.sim.ft import FaultTolerance
from k3launch.sim.logs import Logger
from k3launch.sim.openai import GenRequest
from k3launch.sim.options import ServeOptions
from k3launch.sim.wire import Json

_MAX_BODY = 64 << 20
_GET = frozenset({"/health", "/ping", "/v1/models", "/version", "/metrics", "/load"})
_POST = frozenset({"/v1/completions", "/v1/chat/completions", "/ping"})
_UNSUPPORTED_MEDIA = "Unsupported Media Type: Only 'application/json' is allowed"  # serve/utils/api_utils.py validate_json_request


class App:
    """What request handlers need: settings, engine, log and version."""

    def __init__(self, opts: ServeOptions, engine: Engine, log: Logger, version: str) -> None:
        self.opts = opts
        self.engine = engine
        self.log = log
        self.version = version
        self.created = int(time.time())
        self.ft: FaultTolerance | None = engine.ft
        self.get_paths = _GET | ({ft_api.STATUS} if self.ft is not None else set())
        self.post_paths = _POST | ({ft_api.APPLY} if self.ft is not None else set())


class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # in-flight requests must not hold up a SIGTERM exit
    allow_reuse_address = True
    request_queue_size = 2048  # socketserver's default backlog of 5 resets bursts of connections (uvicorn: 2048)

    def __init__(self, host: str, port: int, app: App) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.app = app
        super().__init__((host, port), Handler)

    def get_request(self) -> tuple[socket.socket, object]:
        conn, addr = super().get_request()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see the module's docstring
        return conn, addr

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
        opts = self.app.opts
        if not opts.access_log or urlsplit(getattr(self, "path", "")).path in opts.quiet_paths:  # vLLM's access-log filter
            return
        host, port = self.client_address[:2]
        self.app.log.info(f'{host}:{port} - "{self.requestline}" {code}', src="h11_impl.py")

    def log_message(self, format: str, *args: object) -> None:
        pass  # BaseHTTPRequestHandler's stderr lines are replaced by log_request above

    def _send(self, status: int, body: bytes, ctype: str = "application/json", extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Json) -> None:
        self._send(status, json.dumps(obj).encode())

    def _raw_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY:
            self.close_connection = True  # the rest of it is never read
            raise ApiError(413, "request body too large", "Request Entity Too Large")
        return self.rfile.read(length)

    def _body(self) -> object:
        """The request's JSON as FastAPI reads it for vLLM: parsed when the Content-Type is JSON or
        absent (a decode error is a validation error), then the Content-Type checked; None: no body."""
        raw = self._raw_body()
        ctype = self.headers.get("Content-Type")
        media = (ctype or "").split(";", 1)[0].strip().lower()
        main, _, sub = media.partition("/")
        body: object = None
        if raw and (not ctype or (main == "application" and (sub == "json" or sub.endswith("+json")))):
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise validation_error(
                    [FieldError("json_invalid", f"body.{exc.pos}", "JSON decode error", {}, {"error": exc.msg})]
                ) from None
            except UnicodeDecodeError:
                raise ApiError(400, "There was an error parsing the body", "Bad Request") from None
        if media != "application/json":
            raise validation_error([_UNSUPPORTED_MEDIA])
        return body

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
                self.close_connection = True
                raise ApiError(413, "request body too large", "Request Entity Too Large")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _event(self, obj: Json | str) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj)
        self._chunk(f"data: {payload}\n\n".encode())

    # -- routes -----------------------------------------------------------------------------
    def _no_route(self, path: str) -> None:
        """Starlette's answers: 405 for a path that exists for another method, else 404."""
        app = self.app
        allow = "GET" if path in app.get_paths else "POST" if path in app.post_paths else None
        if allow is None:
            self._json(404, {"detail": "Not Found"})
            return
        self._send(405, b'{"detail":"Method Not Allowed"}', extra={"Allow": allow})

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        app = self.app
        if path in ("/health", "/ping"):
            # liveness only: 503 once the engine core died, 200 while it merely is unhealthy
            self._send(503 if app.ft is not None and app.ft.dead.is_set() else 200, b"")
        elif path == ft_api.STATUS and app.ft is not None:
            self._json(200, app.ft.status_body())
        elif path == "/v1/models":
            perm = {
                "id": "modelperm-k3launch-sim",
                "object": "model_permission",
                "created": app.created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }  # vLLM's, as it answers
            data: list[Json] = [
                {
                    "id": n,
                    "object": "model",
                    "created": app.created,
                    "owned_by": "vllm",
                    "root": app.opts.model,
                    "parent": None,
                    "max_model_len": app.opts.max_model_len,
                    "permission": [perm],
                }
                for n in app.opts.served_names
            ]
            self._json(200, {"object": "list", "data": data})
        elif path == "/version":
            self._json(200, {"version": app.version})
        elif path == "/metrics":
            self._send(200, app.engine.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/load":
            self._json(200, {"server_load": app.engine.load()})
        else:
            self._no_route(path)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == ft_api.APPLY and self.app.ft is not None:
            self._apply(self.app.ft)
            return
        if path not in ("/v1/completions", "/v1/chat/completions"):
            try:
                self._raw_body()  # read, so the next request on this connection starts where it should
            except ApiError:
                pass
            if path == "/ping":
                self._send(200, b"")
            else:
                self._no_route(path)
            return
        opts = self.app.opts
        try:
            req = openai.parse(
                self._body(),
                path == "/v1/chat/completions",
                opts.served_names,
                opts.max_model_len,
                self.headers.get("X-Request-Id"),
                opts.max_n_sequences,
            )
            session = self.app.engine.open(req, self.headers.get("X-data-parallel-rank"))
        except ApiError as exc:
            self._json(exc.status, exc.body())
            return
        try:
            if req.stream:
                self._stream(req, session)
            else:
                outputs = session.outputs()
                self._json(200, openai.full_body(req, outputs, session.produced, session.finish_reason, session.kv_out))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left; the slot is freed below
        finally:
            session.close()

    def _apply(self, ft: FaultTolerance) -> None:
        """``POST /fault_tolerance/apply``: 202 at once, the instruction runs afterwards."""
        try:
            instruction, _params = ft_api.parse_apply(self._raw_body(), self.headers.get("Content-Type"))
        except ApiError as exc:
            self._json(exc.status, exc.body())
            return
        request_id, body = ft_api.accepted()
        self._json(202, body)
        ft.apply(instruction, request_id)

    def _stream(self, req: GenRequest, session: Session) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if req.chat:
            for c in range(req.n):
                self._event(openai.role_chunk(req, c))
        # Like vLLM's completion and chat stream generators: each decode step sends one chunk per
        # choice, and finish_reason rides on the chunk of a choice's last token: a separate empty
        # finish chunk would still carry ``choices``, which vllm bench serve's client counts as
        # one more token arrival (one more ITL gap).

        def send(choice: int, text: str | None, finish: str | None, ids: list[int] | None = None, first: bool = False) -> None:
            chunk = openai.chunk(req, choice, text, finish, ids, first)
            if finish is not None and choice == req.n - 1 and session.kv_out is not None:
                chunk["kv_transfer_params"] = session.kv_out  # a P/D prefill's answer rides on the very last chunk
            self._event(chunk)

        for i, step in enumerate(session.steps()):
            for c, (tok, tid) in enumerate(step):
                send(c, tok, session.finish_reason if i == session.length - 1 else None, [tid], first=i == 0)
        if session.length == 0 or session.aborted:  # no (further) token: the finish reasons come alone
            for c in range(req.n):
                send(c, None if req.chat else "", session.finish_reason, first=session.produced == 0)
        if req.include_usage:
            self._event(openai.usage_chunk(req, session.produced * req.n))
        self._event("[DONE]")
        self._chunk(b"")  # zero-length chunk: end of the chunked body


def start(host: str, port: int, app: App) -> SimHTTPServer:
    """Bind now (OSError if the port is taken or the address is not ours)."""
    return SimHTTPServer(host, port, app)
