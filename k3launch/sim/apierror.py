"""The sim's API errors in the shapes vLLM answers with, and the lax field coercion that decides them.

vLLM answers every API error with ``{"error": {"message", "type", "param", "code"}}`` and the
HTTP status ``code`` (``vllm/entrypoints/serve/engine/protocol.py``: ``ErrorResponse``). Who
builds the body decides ``type`` and ``param``:

* a request FastAPI cannot validate — malformed JSON, a field of the wrong type, a Content-Type
  other than ``application/json`` (``serve/exception_handling/handlers/validation.py``): type
  ``Bad Request``, the message ``N validation error(s):`` followed by one pydantic error dict per
  line, ``param`` the first error's location (``body.max_tokens``): :func:`validation_error`;
* vLLM's own checks, ``VLLMValidationError`` (``serve/exception_handling/error_response.py``):
  ``BadRequestError`` 400, ``param`` the checked parameter, and the message ends with
  `` (parameter=..., value=...)`` as that exception's ``str()`` does: :func:`invalid`;
* an unknown model (``serve/engine/serving.py``, ``_check_model``): ``NotFoundError`` 404.

Field values are coerced as pydantic's lax mode does (``"5"``, ``5.0`` and ``true`` are the
integers 5, 5 and 1; ``2.5`` is refused), so the sim accepts and refuses what vLLM does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from k3launch.sim.wire import Json

_MAX_REPORTED = 10  # validation.py: _MAX_REPORTED_ERRORS, _MAX_ERROR_INPUT_CHARS, _MAX_ERROR_CHARS
_MAX_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000
_INT = re.compile(r"([+-]?\d+(?:_\d+)*)(?:\.0*)?", re.ASCII)  # what pydantic parses as an integer
_TRUE = frozenset({"true", "t", "yes", "y", "on", "1"})
_FALSE = frozenset({"false", "f", "no", "n", "off", "0"})


class ApiError(Exception):
    """An error answer: vLLM's ``{"error": {...}}`` body with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param

    def body(self) -> Json:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def invalid(message: str, param: str | None = None, value: object = None) -> ApiError:
    """A ``VLLMValidationError`` as vLLM answers it: 400 ``BadRequestError``, ``param`` the parameter."""
    extras = [f"parameter={param}"] if param is not None else []
    if value is not None:
        extras.append(f"value={value}")
    return ApiError(400, f"{message} ({', '.join(extras)})" if extras else message, param=param)


def not_found(model: str, served: tuple[str, ...]) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.", "NotFoundError", "model")


def internal(message: str) -> ApiError:
    return ApiError(500, message, "InternalServerError")


@dataclass(frozen=True)
class FieldError:
    """One pydantic error: its type, location (``body.n``), message and the offending value."""

    kind: str
    loc: str
    msg: str
    value: object
    ctx: Json | None = None

    def line(self) -> str:
        """The error as vLLM prints it: the dict's ``str()``, the value summarized."""
        err: Json = {"type": self.kind, "loc": self.loc, "msg": self.msg, "input": _summary(self.value)}
        if self.ctx is not None:
            err["ctx"] = self.ctx
        text = str(err)
        return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def validation_error(errors: list[FieldError | str]) -> ApiError:
    """FastAPI's ``RequestValidationError`` as vLLM answers it (a plain string: an error without a location)."""
    label = "error" if len(errors) == 1 else "errors"
    lines = [e.line() if isinstance(e, FieldError) else e for e in errors[:_MAX_REPORTED]]
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {line}\n" for line in lines)
    if len(errors) > _MAX_REPORTED:
        message += f"  ...and {len(errors) - _MAX_REPORTED} more {label}\n"
    first = errors[0] if errors else None
    return ApiError(400, message.rstrip(), "Bad Request", first.loc if isinstance(first, FieldError) else None)


def _summary(value: object) -> str:
    """validation.py's ``_summarize_error_input``: containers described, long text cut."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:_MAX_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_INPUT_CHARS else text


class Invalid(Exception):
    """A value pydantic would refuse for a field's type: its error type and message."""

    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind
        self.msg = msg


def as_int(value: object) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Invalid("finite_number", "Input should be a finite number")
        if not value.is_integer():
            raise Invalid("int_from_float", "Input should be a valid integer, got a number with a fractional part")
        if abs(value) >= 2**63:
            raise Invalid("int_parsing_size", "Unable to parse input string as an integer, exceeded maximum size")
        return int(value)
    if isinstance(value, str):
        m = _INT.fullmatch(value.strip())
        if m:
            return int(m.group(1))
        raise Invalid("int_parsing", "Input should be a valid integer, unable to parse string as an integer")
    raise Invalid("int_type", "Input should be a valid integer")


def as_float(value: object) -> float:
    if isinstance(value, (bool, int, float)):
        try:
            return float(value)
        except OverflowError:
            raise Invalid("float_type", "Input should be a valid number") from None
    if isinstance(value, str) and value.isascii():
        try:
            return float(value.strip())
        except ValueError:
            pass
    if isinstance(value, str):
        raise Invalid("float_parsing", "Input should be a valid number, unable to parse string as a number")
    raise Invalid("float_type", "Input should be a valid number")


def as_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, float) and value in (0.0, 1.0):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, (int, str)):
        raise Invalid("bool_parsing", "Input should be a valid boolean, unable to interpret input")
    raise Invalid("bool_type", "Input should be a valid boolean")


def as_str(value: object) -> str:
    if isinstance(value, str):
        return value
    raise Invalid("string_type", "Input should be a valid string")


def as_list(value: object) -> list[object]:
    if isinstance(value, list):
        return value
    raise Invalid("list_type", "Input should be a valid list")
