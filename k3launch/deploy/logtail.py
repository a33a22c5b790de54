"""Reading what each process's log gained since the last poll, for live progress and the timeline.

Bare processes are read by byte offset, containers by the runtime's timestamps (over SSH, in the
liveness poll: :mod:`k3launch.render.logread`); on Slurm the logs are files in the job's shared
log directory, read here. Only whole lines advance the cursor: an unfinished last line (a tqdm
bar being redrawn) counts for the phase now and is read again, whole, later. A bare log's read
starts with the byte before the offset, which must be the newline that ended the last line read:
if the offset missed a line start, the text up to the next newline is the end of a line already
read (or half of one) and is skipped, so a fragment is never taken for a line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from k3launch.models.phases import LogDelta
from k3launch.render.logread import CHUNK_BYTES, END, START


@dataclass
class LogCursor:
    """How far each process's log has been read."""

    offsets: dict[str, int] = field(default_factory=dict)  # bare logs: bytes of whole lines read
    since: dict[str, str] = field(default_factory=dict)  # container logs: the timestamp of the last line read

    def forget(self, pids: Iterable[str]) -> None:
        """These processes start anew: their logs are read from the beginning (a bare log is
        truncated by the start, a container's is the new container's)."""
        for pid in pids:
            self.offsets.pop(pid, None)
            self.since.pop(pid, None)

    def take(self, pid: str, text: str) -> LogDelta:
        """A bare log's new ``text`` (:func:`k3launch.render.logread.log_from` at the offset): whole
        lines advance the offset."""
        at = self.offsets.get(pid, 0)
        if at > 0 and text:
            # the read began a byte early: a newline there means the offset is where a line starts.
            # The runner decoded the bytes (invalid UTF-8 replaced), so the count of a log that is
            # not UTF-8 can miss by a few bytes: then skip to the next line start
            skip = 1 if text[0] == "\n" else text.find("\n") + 1
            if skip == 0:
                return LogDelta()  # inside a line that has not ended yet: nothing to take
            at += len(text[:skip].encode()) - 1
            text = text[skip:]
        whole = text[: text.rfind("\n") + 1]
        self.offsets[pid] = at + len(whole.encode())
        return LogDelta(whole, text[len(whole) :])

    def take_container(self, pid: str, text: str) -> LogDelta:
        """Container log lines ``TIMESTAMP text``: those after the last timestamp read, without it.
        Split at newlines only (a tqdm redraw's ``\\r`` stays in its line); an unfinished last line
        is not taken, so it comes again, whole, from its own timestamp."""
        last = self.since.get(pid, "")
        *lines, unfinished = text.split("\n")
        out = []
        for line in lines:
            ts, _, rest = line.partition(" ")
            if not ts[:1].isdigit() or ts == last:
                continue  # `--since` includes the line it starts from
            self.since[pid] = ts
            out.append(rest)
        ts, _, rest = unfinished.partition(" ")
        return LogDelta("".join(f"{x}\n" for x in out), rest if ts[:1].isdigit() and ts != last else "")


def cut_sections(stdout: str) -> tuple[str, dict[str, str]]:
    """A poll's output without its log sections, and {process id: section text}."""
    rest: list[str] = []
    got: dict[str, str] = {}
    i = 0
    while True:
        j = stdout.find(START, i)
        while j > 0 and stdout[j - 1] != "\n":  # a marker only counts at the start of a line
            j = stdout.find(START, j + 1)
        if j < 0:
            rest.append(stdout[i:])
            break
        rest.append(stdout[i:j])
        eol = stdout.find("\n", j)
        if eol < 0:
            break
        pid = stdout[j + len(START) : eol]
        end = stdout.find(f"\n{END}{pid}", eol)
        after = end + 1 + len(END) + len(pid)
        if end < 0 or stdout[after : after + 1] not in ("", "\n"):  # cut short: read it again next poll
            break
        got[pid] = stdout[eol + 1 : end]
        i = after + 1
    return "".join(rest), got


def read_file(path: Path, cursor: LogCursor, pid: str) -> LogDelta:
    """What the file at ``path`` gained since ``cursor`` last read it (a shared log directory)."""
    offset = cursor.offsets.get(pid, 0)
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read(CHUNK_BYTES)
    except OSError:
        return LogDelta()
    whole = data[: data.rfind(b"\n") + 1]
    cursor.offsets[pid] = offset + len(whole)
    return LogDelta(whole.decode(errors="replace"), data[len(whole) :].decode(errors="replace"))
