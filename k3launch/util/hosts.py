"""Host names and Slurm host lists: the one place they are checked and expanded.

Names and addresses reach ssh and shell command lines, so anything that is not a plain host name
or IP address is refused (instead of being quoted later). Host lists (``gpu-[01-04,07]``) are
expanded with python-hostlist, Slurm's own syntax and order: strictly for what a user wrote
(a malformed list is refused, not emptied), leniently for what Slurm printed (``(null)`` or an
unparsable field is no hosts).
"""

from __future__ import annotations

import re

from k3launch.errors import K3Error

# RFC 1123 host names, IPv4 and bracket-less IPv6; also ~/.ssh/config aliases (same charset).
HOST = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._:-]{0,252})$")


def check_host(value: str, what: str) -> str:
    """``value`` if it is a plain host name or IP address; ValueError (naming ``what``) otherwise."""
    if not HOST.match(value) or ".." in value:
        raise ValueError(f"{what} {value!r} is not a plain host name or IP address")
    return value


def expand_hostlist(text: str, *, lenient: bool = False) -> list[str]:
    """``gpu-[01-03],x`` → hosts. Strict (a user's nodelist): K3Error ``bad-nodelist`` for bad syntax
    or names; lenient (Slurm's output): no hosts instead."""
    import hostlist

    if lenient and (not text or text in ("(null)", "None")):
        return []
    try:
        names: list[str] = list(hostlist.expand_hostlist(text))
    except hostlist.BadHostlist as exc:
        if lenient:
            return []
        raise K3Error("bad-nodelist", f"nodelist {text!r}: {exc}", "use Slurm hostlist syntax, e.g. gpu-[01-16]") from None
    if not lenient:
        for n in names:
            try:
                check_host(n, "node name")
            except ValueError as exc:
                raise K3Error("bad-nodelist", str(exc), "use plain host names") from None
    return names
