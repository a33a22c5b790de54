"""The one error type that reaches users.

Every refusal k3launch makes — bad input, a combination that cannot work, a deployment that
does not fit — is a :class:`K3Error` with a stable ``code``, a one-line ``message`` and a
``hint`` saying what to do next. The CLI turns it into exit code 2 (and, under ``--json``,
``{"error": {"code", "message", "hint"}}``); nothing else prints a traceback to users.
"""

from __future__ import annotations


class K3Error(Exception):
    """A user-facing refusal: ``code`` is stable and machine-readable."""

    def __init__(self, code: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message, "hint": self.hint}

    def __str__(self) -> str:
        return self.message


def plain(msg: str) -> str:
    """A validation message in k3launch's words: without the prefix pydantic puts before a
    validator's own message ("Value error, ...", "Assertion failed, ...")."""
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


# The advice for a host key that is not in known_hosts: said by the SSH runner at connect time and
# by the doctor's report of many nodes, in the same words.
HOST_KEY_HINT = ("check the host's key fingerprint and add it to known_hosts (ssh-keyscan), or pass --accept-unknown-hosts "
                 "to accept and remember keys not seen before")
