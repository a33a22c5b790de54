"""``k3launch top NAME``: a deployment's engines and router as their ``/metrics`` say, live.

Each :meth:`Top.sample` scrapes every target of the deployment's target file at once (the
engines' API servers, the router's metrics port: :func:`k3launch.render.monitoring.targets`)
and keeps the scrapes of the last ``span`` seconds; rates and latency percentiles are over that
window (:mod:`k3launch.models.scrape`), with the controller's state of each unit from the record.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3launch.api._common import store
from k3launch.models.scrape import Scrape, Window, parse, window

TOP_SPAN_S = 60.0


@dataclass(frozen=True)
class TopRow:
    process: str
    role: str
    copy: str
    node: str
    unit_state: str  # the controller's (serving, backoff, ...); "" when no controller has watched it
    up: bool  # its /metrics answered in the last scrape
    window: Window

    def as_dict(self) -> dict[str, Any]:
        return {"process": self.process, "role": self.role, "copy": self.copy, "node": self.node, "unit_state": self.unit_state,
                "up": self.up, **self.window.as_dict()}


@dataclass(frozen=True)
class TopView:
    name: str
    state: str
    time: float
    supervised: bool
    rows: list[TopRow]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state, "time": round(self.time, 3), "supervised": self.supervised,
                "processes": [r.as_dict() for r in self.rows]}


class Top:
    def __init__(self, name: str, state_dir: str | Path | None = None, span: float = TOP_SPAN_S, timeout: float = 2.0) -> None:
        self.name, self.st, self.span, self.timeout = name, store(state_dir), span, timeout
        self.seen: dict[str, list[Scrape]] = {}
        self.pool = ThreadPoolExecutor(max_workers=16)

    def sample(self) -> TopView:
        from k3launch.models.supervise import units
        from k3launch.render.monitoring import JOB_CONTROLLERS, targets
        from k3launch.transport.http import get_text

        rec = self.st.load(self.name)
        groups = [g for g in targets(rec) if g["labels"]["job"] != JOB_CONTROLLERS]
        now = time.time()
        texts = list(self.pool.map(lambda g: get_text(f"http://{g['targets'][0]}/metrics", self.timeout), groups))
        unit_of = {pid: u.name for u in units(rec.plan) for pid in u.processes}
        mem = rec.control.units if rec.control else {}
        rows = []
        for g, text in zip(groups, texts, strict=True):
            labels = g["labels"]
            pid = labels["process"]
            kept = self.seen.setdefault(pid, [])
            if text is not None:
                kept.append(parse(text, now))
            while kept and now - kept[0].time > self.span:
                kept.pop(0)
            state = mem.get(unit_of.get(pid, pid))
            rows.append(TopRow(pid, labels["role"], labels.get("copy", ""), labels["node"], state.state if state else "", text is not None,
                               window(kept)))
        return TopView(rec.name, rec.state, now, rec.supervisor is not None, rows)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
