"""HTTP probes from the login node: ``/health`` of every endpoint, and one real completion.

Stdlib only (urllib), short timeouts, no retries here: the readiness loop decides when to ask
again. A probe never raises for a network problem; it returns what happened.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

PROBE_PROMPT = "k3launch readiness probe: say hello"
PROBE_TIMEOUT_S = 1.0  # per /health probe in a readiness poll; the next poll asks again


@dataclass(frozen=True)
class Probe:
    url: str
    ok: bool
    status: int | None
    detail: str
    seconds: float


def get(url: str, timeout: float = 2.0) -> Probe:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return Probe(url, r.status == 200, r.status, "", time.monotonic() - t0)
    except urllib.error.HTTPError as exc:
        return Probe(url, False, exc.code, exc.reason or "", time.monotonic() - t0)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return Probe(url, False, None, str(reason), time.monotonic() - t0)


def health(base: str, timeout: float = 2.0) -> Probe:
    return get(base.rstrip("/") + "/health", timeout)


@dataclass(frozen=True)
class Completion:
    ok: bool
    detail: str
    completion_tokens: int
    text: str
    seconds: float


@dataclass(frozen=True)
class Reply:
    """A JSON POST's outcome: ``status`` None when no answer came (refused, timed out, not HTTP);
    ``data`` the JSON object of a 200, ``detail`` what went wrong otherwise."""

    status: int | None
    data: dict[str, Any]
    detail: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == 200


def post_json(url: str, body: Mapping[str, Any], timeout: float, headers: Mapping[str, str] | None = None) -> Reply:
    """POST ``body`` as JSON; never raises for a network problem or an error answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})})
    return _json_reply(req, timeout)


def get_json(url: str, timeout: float) -> Reply:
    """GET a JSON object (``/version``, ``/v1/models``); never raises, as :func:`post_json`."""
    return _json_reply(urllib.request.Request(url), timeout)


def _json_reply(req: urllib.request.Request, timeout: float) -> Reply:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.loads(r.read().decode() or "{}")
    except urllib.error.HTTPError as exc:
        try:
            msg = exc.read().decode(errors="replace")[:200]
        except OSError:
            msg = ""
        return Reply(exc.code, {}, f"HTTP {exc.code}: {msg}".strip(), time.monotonic() - t0)
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
        return Reply(None, {}, str(getattr(exc, "reason", exc)), time.monotonic() - t0)
    if not isinstance(data, dict):
        return Reply(None, {}, f"not a JSON object: {str(data)[:100]}", time.monotonic() - t0)
    return Reply(200, data, "", time.monotonic() - t0)


def completion(base: str, model: str, max_tokens: int = 8, timeout: float = 60.0) -> Completion:
    """One real ``/v1/completions`` request; ok only with 200, choices and completion tokens > 0."""
    r = post_json(base.rstrip("/") + "/v1/completions", {"model": model, "prompt": PROBE_PROMPT, "max_tokens": max_tokens, "temperature": 0},
                  timeout)
    if not r.ok:
        return Completion(False, r.detail, 0, "", r.seconds)
    data, dt = r.data, r.seconds
    choices = data.get("choices") or []
    usage = data.get("usage") or {}
    tokens = int(usage.get("completion_tokens") or 0)
    text = str(choices[0].get("text", "")) if choices else ""
    if not choices or tokens <= 0:
        return Completion(False, f"no tokens generated (choices={len(choices)}, completion_tokens={tokens})", tokens, text, dt)
    return Completion(True, "", tokens, text, dt)


def probe_all(urls: dict[str, str], timeout: float = PROBE_TIMEOUT_S, paths: Mapping[str, str] | None = None) -> dict[str, bool]:
    """id → /health answered 200, all probes at once (``paths``: id → another path to ask)."""
    if not urls:
        return {}
    asked = {i: u.rstrip("/") + (paths or {}).get(i, "/health") for i, u in urls.items()}
    with ThreadPoolExecutor(max_workers=min(32, len(urls))) as pool:
        oks = pool.map(lambda u: get(u, timeout=timeout).ok, asked.values())
        return dict(zip(asked, oks, strict=True))


def get_text(url: str, timeout: float = 2.0) -> str | None:
    """A page's text (``/metrics``); None when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return str(r.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def metric_sums(base: str, names: tuple[str, ...], timeout: float) -> dict[str, float] | None:
    """Each of ``names`` in an engine's ``/metrics``, summed over its label sets (DP ranks); a
    name the page lacks is left out. None when the page cannot be read. A line scan: a look reads
    every engine's page, and vLLM's is about 100 KB."""
    text = get_text(base.rstrip("/") + "/metrics", timeout)
    if text is None:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names and " " in line:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return out


_WORK = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total")


def _work(base: str, timeout: float) -> tuple[float, float] | None:
    """(requests running or waiting, tokens generated so far); None when it cannot be read."""
    got = metric_sums(base, _WORK, timeout)
    if got is None or _WORK[2] not in got:
        return None
    return got.get(_WORK[0], 0.0) + got.get(_WORK[1], 0.0), got[_WORK[2]]


def work_all(urls: dict[str, str], timeout: float = PROBE_TIMEOUT_S) -> dict[str, tuple[float, float]]:
    """id → (requests held, tokens generated) of each engine whose ``/metrics`` could be read, all at once."""
    if not urls:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(urls))) as pool:
        got = pool.map(lambda u: _work(u, timeout), urls.values())
        return {i: w for i, w in zip(urls, got, strict=True) if w is not None}


class InFlight:
    """A completion request running on a daemon thread (a caller that gives up never waits for it)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Completion | None = None

    def wait(self, timeout: float) -> Completion | None:
        """The answer, or None while the request is still in flight."""
        if not self.done.wait(timeout):
            return None
        return self.result if self.result is not None else Completion(False, "the completion request failed", 0, "", 0.0)


def in_background(fn: Callable[[], Completion]) -> InFlight:
    job = InFlight()

    def work() -> None:
        try:
            job.result = fn()
        finally:
            job.done.set()

    threading.Thread(target=work, name="k3launch-completion", daemon=True).start()
    return job


def list_workers(base: str, timeout: float = 3.0) -> list[str] | None:
    """The worker URLs vllm-router lists (``GET /list_workers``: ``{"urls": [...]}``); None when it
    does not answer or says something else."""
    try:
        with urllib.request.urlopen(base.rstrip("/") + "/list_workers", timeout=timeout) as r:
            got = json.loads(r.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    urls = got.get("urls") if isinstance(got, dict) else None
    return [str(u) for u in urls] if isinstance(urls, list) else None
