"""Live progress of the waits: ``up`` (each process's phase) and ``bench`` (requests done of total).

On a terminal: a rich Live table, redrawn in place. Elsewhere (CI, nohup, Slurm output, a pipe):
plain lines — one when a process changes phase, and a summary at least every
:data:`HEARTBEAT_S` seconds — written whole: a line is never wrapped or cut at the 80 columns
rich assumes for a file.
"""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from k3launch.models.bringups import Comparison, Delta
from k3launch.models.phases import BringUp, Phase, ProcessProgress, Timeline
from k3launch.models.record import Stage

HEARTBEAT_S = 10.0  # the longest a wait stays silent when not on a terminal
LISTED = 8  # a summary line names each process up to this many, then counts them by phase


def phase_text(p: ProcessProgress) -> str:
    pct = f" {p.percent:.0f}%" if p.percent is not None and p.phase in (Phase.LOADING_WEIGHTS, Phase.COMPILING) else ""
    return p.phase.label + pct


def _plain(con: Console, text: str) -> None:
    con.print(text, soft_wrap=True, markup=False, highlight=False)  # soft_wrap: never folded at the console width


class UpView:
    """``up``'s stages and live progress (a context manager: the Live table stops on exit)."""

    def __init__(self, con: Console, quiet: bool = False, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.con = con
        self.quiet = quiet
        self.live_ok = con.is_terminal and not quiet
        self.heartbeat_s = heartbeat_s
        self.t0 = time.monotonic()  # times count from here, doctor included
        self._live: Live | None = None
        self._seen: dict[str, Phase] = {}
        self._said: dict[str, str] = {}  # each process's log line last printed: a heartbeat does not print it again
        self._last_line = self.t0

    def __enter__(self) -> UpView:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop()

    def _t(self) -> str:
        return f"{time.monotonic() - self.t0:7.1f}s"

    def stage(self, stage: Stage, message: str) -> None:
        if self.quiet:
            return
        if stage in (Stage.READY, Stage.FAILED):
            self._stop()  # the last table stays above; what follows (teardown, the endpoint) goes below it
        if self._live is not None:
            self._live.console.print(f"[dim]{self._t()}[/] [bold]{stage:<10}[/] {message}", soft_wrap=True)
        else:
            self.con.print(f"[dim]{self._t()}[/] [bold]{stage:<10}[/] {message}", soft_wrap=True)
        self._last_line = time.monotonic()

    def progress(self, b: BringUp) -> None:
        if self.quiet or not b.processes:
            return
        if self.live_ok:
            if self._live is None:
                self._live = Live(table(b), console=self.con, refresh_per_second=4, transient=False)
                self._live.start()
            else:
                self._live.update(table(b))
            return
        changed = [p for p in b.processes if self._seen.get(p.id) != p.phase]
        for p in changed:
            self._seen[p.id] = p.phase
            self._said[p.id] = p.last_line
            _plain(
                self.con, f"{self._t()} {'progress':<10} {p.id} on {p.node}: {phase_text(p)}" + (f" | {p.last_line}" if p.last_line else "")
            )
        if changed:
            self._last_line = time.monotonic()
        elif time.monotonic() - self._last_line >= self.heartbeat_s:
            _plain(self.con, f"{self._t()} {'progress':<10} {summary(b, self._said)}")
            self._last_line = time.monotonic()

    def _stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def summary(b: BringUp, said: dict[str, str] | None = None) -> str:
    """One line for every process: each by name when few, else counted by phase, with the laggard
    and its last log line, unless that line is the one ``said`` holds for it (printed already:
    an engine quiet for minutes would repeat it every heartbeat); ``said`` is updated."""
    procs = sorted(b.processes, key=lambda p: (p.phase.rank, p.since))
    if len(procs) <= LISTED:
        parts = "; ".join(f"{p.id} {phase_text(p)} {b.now - p.since:.0f}s" for p in procs)
    else:
        counts: dict[str, int] = {}
        for p in procs:
            counts[p.phase.label] = counts.get(p.phase.label, 0) + 1
        parts = ", ".join(f"{n} {label}" for label, n in counts.items())
    last = procs[0]  # the one furthest behind
    said = {} if said is None else said
    tail = f" | {last.id}: {last.last_line}" if last.last_line and said.get(last.id) != last.last_line else ""
    said[last.id] = last.last_line
    return f"{b.stage}, {b.elapsed:.0f}s: {parts}{tail}"


def table(b: BringUp) -> Table:
    t = Table(title=f"{b.stage} · {b.elapsed:.0f}s", title_justify="left", show_header=True, header_style="bold", expand=True)
    t.add_column("process", no_wrap=True)
    t.add_column("node", no_wrap=True)
    t.add_column("phase", no_wrap=True)
    t.add_column("in phase", justify="right", no_wrap=True)
    t.add_column("last log line", no_wrap=True, overflow="ellipsis", ratio=1)
    for p in b.processes:
        style = "green" if p.phase == Phase.HEALTHY else ""
        t.add_row(p.id, p.node, Text(phase_text(p), style=style), f"{b.now - p.since:.0f}s", Text(p.last_line, style="dim"))
    return t


class BenchView:
    """``bench``/``campaign run``: per load point, requests done of total, elapsed, ETA — a line when
    the first figures come, then at least every :data:`HEARTBEAT_S` seconds, and when it is done."""

    def __init__(self, con: Console, quiet: bool = False, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.con = con
        self.quiet = quiet
        self.heartbeat_s = heartbeat_s
        self._last: dict[str, float] = {}
        self._done: set[str] = set()

    def __call__(self, tag: str, done: int | None, total: int, elapsed: float) -> None:
        finished = done is not None and done >= total
        if self.quiet or tag in self._done:
            return
        now = time.monotonic()
        if tag in self._last and now - self._last[tag] < self.heartbeat_s and not finished:
            return
        self._last[tag] = now
        if finished:
            self._done.add(tag)
        _plain(self.con, f"bench {tag}: {bench_line(done, total, elapsed)}")


def bench_line(done: int | None, total: int, elapsed: float) -> str:
    if done is None:
        return f"?/{total} requests (not known until it ends), {elapsed:.0f}s elapsed"
    eta = "done" if done >= total else f"ETA {elapsed * (total - done) / done:.0f}s" if done else "ETA ?"
    return f"{done}/{total} requests, {elapsed:.0f}s elapsed, {eta}"


def timeline(con: Console, name: str, tl: Timeline) -> None:
    """``k3launch timeline NAME``: per process, each phase's start (from the bring-up's start) and length."""
    how = "ready" if tl.ready else "failed"
    con.print(f"[bold]{name}[/]: bring-up {how} in {tl.ended - tl.started:.1f}s", soft_wrap=True)
    t = Table(show_header=True, header_style="bold")
    for col, just in (("process", "left"), ("node", "left"), ("phase", "left"), ("from", "right"), ("to", "right"), ("seconds", "right")):
        t.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for p in tl.processes:
        # a phase entered again (compiling, then the KV cache, then CUDA graphs) is one row: from
        # its first start to its last end, its seconds those of its spans together (as --compare counts them)
        rows: dict[Phase, tuple[float, float, float]] = {}
        for s in p.phases:
            first, _, took = rows.get(s.phase, (s.start, s.end, 0.0))
            rows[s.phase] = (first, s.end, took + s.seconds)
        for i, (phase, (start, end, took)) in enumerate(rows.items()):
            t.add_row(p.id if i == 0 else "", p.node if i == 0 else "", phase.label, f"{start - tl.started:.1f}", f"{end - tl.started:.1f}",
                      f"{took:.1f}")
    con.print(t)
    slow = tl.slowest()
    if slow is not None:
        what = f"; it waited longest for {slow.waited_for.label} ({slow.waited_s:.1f}s)" if slow.waited_for else ""
        con.print(f"slowest: {slow.process} on {slow.node}, done {slow.seconds:.1f}s after the start{what}", soft_wrap=True, markup=False)


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def _diff(d: Delta) -> tuple[str, str]:
    """NAME − OTHER and NAME / OTHER, as shown ("" where one side has nothing)."""
    diff = "" if d.diff_s is None else f"{round(d.diff_s, 1) + 0.0:+.1f}"  # + 0.0: a difference that rounds to nothing is +0.0, not -0.0
    return diff, ("" if d.ratio is None else f"{d.ratio:.2f}")


def comparison(con: Console, c: Comparison) -> None:
    """``k3launch timeline NAME --compare OTHER``: per process and phase, the seconds in each, NAME − OTHER and NAME / OTHER."""
    other = c.other + (f" ({c.other_deployment})" if c.other_deployment not in (None, c.other) else "")

    def how(ready: bool, s: float | None) -> str:
        return f"{'ready in' if ready else 'failed after'} {_s(s)}s"

    diff, ratio = _diff(c.total)
    _plain(con, f"{c.name}: bring-up {how(c.ready, c.total.name_s)}; {other}: {how(c.other_ready, c.total.other_s)}; "
                f"difference {diff}s, ratio {ratio}")
    t = Table(show_header=True, header_style="bold")
    for col, just in (("process", "left"), ("role", "left"), ("phase", "left"), (c.name, "right"), (c.other, "right"),
                      ("diff", "right"), ("ratio", "right")):
        t.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for p in c.processes:
        rows = [(ph.phase.label, ph.delta) for ph in p.phases] + [("done (from the start)", p.done)]
        for i, (label, d) in enumerate(rows):
            t.add_row(p.id if i == 0 else "", p.role if i == 0 else "", label, _s(d.name_s), _s(d.other_s), *_diff(d),
                      style="bold" if i == len(rows) - 1 else None, end_section=i == len(rows) - 1)
    if c.processes:
        con.print(t)
    else:
        _plain(con, "no process in common (processes are matched by id)")
    for label, alone in ((c.name, c.only_name), (c.other, c.only_other)):
        if alone:
            _plain(con, f"only in {label}: " + ", ".join(
                f"{a.id} ({a.role or '?'}) on {a.node}" + (f", done after {a.done_s:.1f}s" if a.done_s is not None else "") for a in alone))


def load_lines(rows: list[dict[str, object]], basis: str) -> list[str]:
    """``timeline``: the predicted weight load next to vLLM's ``Loading weights took`` per process."""
    if not rows:
        return []
    out = ["weights load: predicted" + (f" (from {basis})" if basis else " (no throughput known: `k3launch weights probe --save`)")
           + " vs vLLM's \"Loading weights took\" (its slowest rank)"]
    for r in rows:
        pred = f"{r['predicted_s']:,.1f} s" if r["predicted_s"] is not None else "?"
        took = r["took_s"]
        actual = (f"{r['slowest_took_s']:,.1f} s of {len(took)} rank(s)" if isinstance(took, list) and took else "not logged")
        ratio = f", actual/predicted {r['ratio']:.2f}" if r["ratio"] is not None else ""
        out.append(f"  {r['process']} on {r['node']}: predicted {pred}, took {actual}{ratio}")
    return out
