"""Reading what each process's log gained since the last poll, for live progress and the timeline.

Bare processes are read by byte offset, containers by the runtime's timestamps (over SSH, in the
liveness poll: :mod:`k3launch.render.logread`); on Slurm the logs are files in the job's shared
log directory, read here. Only whole lines advance the cursor: an unfinished last line (a tqdm
bar being redrawn) is shown now and read again, whole, later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from k3launch.models.phases import LogDelta
from k3launch.render.logread import CHUNK_BYTES, END, START


@dataclass
class LogCursor:
    """How far each process's log has been read."""

    offsets: dict[str, int] = field(default_factory=dict)  # bare logs: bytes of whole lines read
    since: dict[str, str] = field(default_factory=dict)  # container logs: the timestamp of the last line read

    def take(self, pid: str, text: str) -> LogDelta:
        """A bare log's new ``text`` (from the offset on): whole lines advance the offset."""
        whole = text[: text.rfind("\n") + 1]
        # the runner decoded the bytes (invalid UTF-8 replaced): a log that is not UTF-8 may be
        # read a few bytes off, which shifts one line, never the phases after it
        self.offsets[pid] = self.offsets.get(pid, 0) + len(whole.encode())
        return LogDelta(whole, text[len(whole) :])

    def take_container(self, pid: str, text: str) -> LogDelta:
        """Container log lines ``TIMESTAMP text``: those after the last timestamp read, without it."""
        last = self.since.get(pid, "")
        out = []
        for line in text.splitlines():
            ts, _, rest = line.partition(" ")
            if not ts[:1].isdigit() or ts == last:
                continue  # `--since` includes the line it starts from
            self.since[pid] = ts
            out.append(rest)
        return LogDelta("".join(f"{x}\n" for x in out))


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
