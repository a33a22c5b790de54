"""Linux CPU lists (``0-3,8,10-11``): what ``taskset -c``, ``docker run --cpuset-cpus`` and vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` read, and ``/sys/devices/system/cpu/online`` prints."""

from __future__ import annotations

import re
from collections.abc import Iterable

_PART = re.compile(r"(\d+)(?:-(\d+))?")
MAX_CPU = 65535  # a CPU id beyond this is a typo (Linux's NR_CPUS tops out at 8192)


def parse(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (sorted, each once); ValueError for anything else."""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        m = _PART.fullmatch(part)
        if m is None:
            raise ValueError(f"{text!r} is not a CPU list (like 0-15 or 0-7,16-23)")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi > MAX_CPU:
            raise ValueError(f"{text!r}: {part} is not a range of CPU ids (low-high, at most {MAX_CPU})")
        out.update(range(lo, hi + 1))
    return sorted(out)


def format_list(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``: runs of consecutive ids as ranges."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def canonical(value: str | int) -> str:
    """An inventory's ``cpus``: a CPU list, or a count N (CPUs 0 to N-1), as one canonical CPU list."""
    if isinstance(value, bool):
        raise ValueError("cpus must be a CPU list (like 0-15) or a count of CPUs, not true/false")
    if isinstance(value, int):
        if not 1 <= value <= MAX_CPU + 1:
            raise ValueError(f"cpus {value}: a count of CPUs is at least 1")
        return format_list(range(value))
    return format_list(parse(value))
