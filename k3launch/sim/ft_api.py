"""The HTTP side of vLLM 0.33.0's fault tolerance: ``POST /fault_tolerance/apply`` and its answers.

Checked in vLLM's order (vllm/entrypoints/serve/fault_tolerance/api_router.py, 0.33.0):

1. the ``validate_json_request`` dependency: a Content-Type other than ``application/json`` is a
   FastAPI validation error (``serve/utils/api_utils.py``), answered as every validation error;
2. ``await raw_request.json()``: a body that is no JSON (an empty one too) is
   ``HTTPException(400, "Invalid JSON format")`` (api_router.py:48-51); bytes that are no UTF-8
   raise a ``UnicodeDecodeError``, a ``ValueError``, which vLLM's fallback handler answers 400
   ``BadRequestError`` with the exception's text (serve/exception_handling/register.py);
3. ``_validate_payload`` (api_router.py:23-34): not an object; a falsy ``instruction`` (missing,
   null, "", 0, false, [] or {}); one not in ``{"retry"}`` (a non-empty list or object is not
   even hashable: the ``TypeError`` is a 400 ``BadRequestError`` "unhashable type: 'list'");
   ``params`` present but no object (null included).

An ``HTTPException`` is answered ``{"error": {"message", "type": "Bad Request", "param": null,
"code": 400}}`` with its detail sanitized (serve/exception_handling/handlers/http.py). A valid
instruction is accepted at once with 202 and a fresh request id (api_router.py:53-73); the work
runs afterwards and its outcome is only visible in ``GET /fault_tolerance/status``.
"""

from __future__ import annotations

import json
import re
import uuid

from k3launch.sim.apierror import ApiError, validation_error
from k3launch.sim.wire import Json

INSTRUCTIONS = frozenset({"retry"})  # api_router.py:20 _ALLOWED_INSTRUCTIONS
ACCEPTED = "Request accepted; poll /fault_tolerance/status for updates."
APPLY = "/fault_tolerance/apply"
STATUS = "/fault_tolerance/status"
UNSUPPORTED_MEDIA = "Unsupported Media Type: Only 'application/json' is allowed"  # serve/utils/api_utils.py


def _http_exception(detail: str) -> ApiError:
    """``HTTPException(400, detail)`` as vLLM's handler answers it."""
    return ApiError(400, sanitize(detail), "Bad Request", None)


def sanitize(message: str) -> str:
    """``sanitize_message`` (serve/exception_handling/utils.py): no addresses, traceback lines or paths."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def parse_apply(raw: bytes, content_type: str | None) -> tuple[str, Json]:
    """The instruction and params of an apply request; raises :class:`ApiError` as vLLM answers."""
    media = (content_type or "").lower().split(";", 1)[0]
    if media != "application/json":  # validate_json_request compares the raw media type, unstripped
        raise validation_error([UNSUPPORTED_MEDIA])
    try:
        body: object = json.loads(raw)
    except json.JSONDecodeError:
        raise _http_exception("Invalid JSON format") from None
    except ValueError as exc:  # UnicodeDecodeError: reaches vLLM's fallback handler for ValueError
        raise ApiError(400, sanitize(str(exc)), "BadRequestError") from None
    if not isinstance(body, dict):
        raise _http_exception("Request body must be a JSON object.")
    instruction = body.get("instruction")
    if not instruction:
        raise _http_exception("'instruction' is required.")
    if isinstance(instruction, (list, dict)):  # `instruction not in _ALLOWED_INSTRUCTIONS` hashes it
        raise ApiError(400, f"unhashable type: '{type(instruction).__name__}'", "BadRequestError")
    if instruction not in INSTRUCTIONS:
        raise _http_exception(f"Invalid instruction: '{instruction}'.")  # Python's str(): true reads 'True'
    params = body.get("params", {})
    if not isinstance(params, dict):
        raise _http_exception("'params' must be an object.")
    return str(instruction), params


def accepted() -> tuple[str, Json]:
    """The 202 body of an accepted instruction and its request id."""
    request_id = str(uuid.uuid4())
    return request_id, {"message": ACCEPTED, "request_id": request_id}
