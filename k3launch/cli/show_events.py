"""How a supervisor's event reads on a terminal: one line (``events``, ``supervise``, and the
events since a deployment served that ``timeline`` lists)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3launch.models.supervise import Event


def line(e: Event) -> str:
    """One event as one line: time, kind, where, why."""
    where = " ".join(x for x in (e.unit and f"unit {e.unit}", e.process and f"process {e.process}", e.node and f"node {e.node}") if x)
    t = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time))
    phases = ""
    if e.timeline is not None:  # a restart's phases (`k3launch timeline NAME --restart` has them all)
        from k3launch.models.bringups import in_brief

        brief = in_brief(e.timeline)
        phases = f" [{brief}]" if brief else ""
    return f"{t}  {e.kind:<16} {where + '  ' if where else ''}{e.reason}{phases}"
