"""The documented range of every number a user gives k3launch (options, inventories, campaign files).

One :class:`Bound` per kind of number. The CLI parses option values with :meth:`Bound.parse`
(so ``nan``, ``inf``, negatives and values out of range are one-line refusals at the prompt,
before anything runs), and the pydantic models put :meth:`Bound.field` on their fields (so the
same limits hold in YAML files and the Python API). The ranges are listed in
docs/troubleshooting.md ("Bounds"); each is wide enough for any real deployment and narrow
enough that no value makes k3launch loop, allocate or wait without end.
"""

from __future__ import annotations

import math
from typing import Any

from k3launch.errors import K3Error
from k3launch.util.records import record

DAY_S = 86_400


@record
class Bound:
    """A closed range ``[lo, hi]`` of finite numbers (``lo`` excluded when ``above``)."""

    lo: float
    hi: float
    unit: str
    integer: bool = False
    above: bool = False  # the value must be more than lo (a timeout of 0 s means nothing useful)

    def describe(self) -> str:
        kind = ("a whole number" + (f" of {self.unit}" if self.unit else "")) if self.integer else self.unit
        start = f"more than {_show(self.lo)} and at most" if self.above else f"from {_show(self.lo)} to"
        return f"{kind} {start} {_show(self.hi)}"

    def field(self) -> dict[str, Any]:
        """pydantic ``Field`` keywords for these bounds (NaN and infinities refused too)."""
        out: dict[str, Any] = {"gt" if self.above else "ge": self.lo, "le": self.hi}
        if not self.integer:
            out["allow_inf_nan"] = False
        return out

    def why_not(self, value: float) -> str | None:
        """Why ``value`` is outside the range, or None when it is inside."""
        if math.isnan(value):
            return "not a number"
        if math.isinf(value):
            return "not a finite number"
        if self.integer and value != int(value):
            return "not a whole number"
        if value < 0 <= self.lo:
            return "negative"
        if value < self.lo or (self.above and value == self.lo):
            return "below the minimum"
        if value > self.hi:
            return "above the maximum"
        return None

    def parse(self, what: str, raw: object) -> int | float:
        """``raw`` (a command-line string, or a number) as a number in range; else K3Error ``bad-value``
        naming ``what`` (the option) and the range."""
        hint = f"{what} takes {self.describe()}"
        text = str(raw).strip()
        try:
            value: int | float
            if isinstance(raw, bool):
                raise ValueError
            if isinstance(raw, int | float):
                value = raw
            elif self.integer:
                value = int(text, 10)
            else:
                value = float(text)
        except ValueError:
            kind = "a whole number" if self.integer else "a number"
            raise K3Error("bad-value", f"{what} {text!r}: not {kind}", hint) from None
        why = self.why_not(value)
        if why is not None:
            raise K3Error("bad-value", f"{what} {text}: {why}", hint)
        return int(value) if self.integer else float(value)


def _show(x: float) -> str:
    return str(int(x)) if x == int(x) else f"{x:g}"


# Nodes of one deployment (every plan strategy; a P/D pool is further limited to 16 by planning).
# 4096 nodes of 8 GPUs is past any single deployment of today, and plans that size in ~1 s.
NODES = Bound(1, 4096, "nodes", integer=True)
REPLICAS = Bound(1, 256, "replicas", integer=True)  # independent copies of one engine behind one router
# Timeouts and waits, in seconds.
CONNECT_TIMEOUT = Bound(0, 600, "seconds", above=True)
READY_TIMEOUT = Bound(0, 7 * DAY_S, "seconds", above=True)  # a giant model's first load takes hours, not weeks
QUEUE_TIMEOUT = Bound(0, 30 * DAY_S, "seconds", above=True)
GRACE = Bound(0, 3600, "seconds")  # 0: SIGKILL right after SIGTERM
BENCH_TIMEOUT = Bound(0, 7 * DAY_S, "seconds", above=True)
# Output sizes and load.
LOG_LINES = Bound(0, 1_000_000, "lines", integer=True)
TOKENS = Bound(1, 10_000_000, "tokens", integer=True)  # prompt or output tokens of one request
PROMPTS = Bound(1, 10_000_000, "requests", integer=True)
CONCURRENCY = Bound(1, 1_000_000, "requests", integer=True)
REQUEST_RATE = Bound(0, 1_000_000, "requests per second", above=True)  # and inf: all at once
WARMUPS = Bound(0, 1_000_000, "requests", integer=True)
SEED = Bound(0, 2**32 - 1, "", integer=True)  # numpy's and vLLM's random seeds are 32-bit
# Host memory of one node, in GB: more than any machine has (1 PiB).
MEMORY_GB = Bound(0, 1_048_576, "GB", above=True)
# Campaigns: cells (deployments x load points) and distinct deployment points of one file. Each
# cell is one `vllm bench serve` run and each deployment point one engine start of a giant model,
# so these are far past a week of measurements, and a matrix this size expands and plans in seconds.
MAX_CELLS = 10_000
MAX_DEPLOYMENTS = 1_000
CAMPAIGN_GROUP = Bound(0, MAX_DEPLOYMENTS - 1, "", integer=True)
ARRAY_LIMIT = Bound(1, MAX_DEPLOYMENTS, "tasks", integer=True)
BUSBW = Bound(0.0, 100_000.0, "GB/s", above=True)  # doctor --min-busbw: an all-reduce's bus bandwidth
PROGRESS_INTERVAL = Bound(0.1, 3600.0, "seconds")  # weights fetch --interval
SCRAPE_INTERVAL = Bound(1, 3600, "seconds", integer=True)  # monitoring config --interval
TOP_INTERVAL = Bound(0.2, 3600.0, "seconds")  # top --interval
TOP_WINDOW = Bound(2.0, 3600.0, "seconds")  # top --window
PROBE_BYTES = Bound(1 << 20, 16 << 30, "bytes", integer=True)  # weights probe --bytes: 1 MiB to 16 GiB written, read, removed
PROBE_TIMEOUT = Bound(0, 3600, "seconds", above=True)  # weights probe --timeout: each of its write and read
READ_GBPS = Bound(0, 10_000, "GB/s", above=True)  # a weight source's read throughput (inventory weights.read_gbps)
# The correctness canary: how many leading tokens of an answer must match (its answers are 8 tokens:
# k3launch.models.canary.MAX_TOKENS), and how long one of its requests may take.
CANARY_PREFIX = Bound(1, 8, "tokens", integer=True)
CANARY_TIMEOUT = Bound(0, 3600, "seconds", above=True)
