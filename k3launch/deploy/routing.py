"""HTTP hands every controller shares, whatever runs its processes: a router's worker routes and
vLLM's fault-tolerance routes (the SSH supervisor on a login node and a Slurm job's own
controller ask the same servers the same way)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from k3launch.models.plan import FaultTolerancePool, Plan, Process

REROUTE_TIMEOUT_S = 30.0  # add_worker waits for the worker's /health; it is called once the engine serves


def ft_status(plan: Plan, procs: Sequence[Process], ranks: set[str], timeout: float) -> dict[str, str]:
    """Each fault-tolerant rank's engine state from its ``/fault_tolerance/status`` ("" when it
    did not answer): the worst of its engines (one per API server with external load balancing)."""
    path = next((f.status for f in plan.fault_tolerance), "/fault_tolerance/status")
    asked = [p for p in procs if p.id in ranks]
    if not asked:
        return {}

    def one(p: Process) -> str:
        try:
            with urllib.request.urlopen(f"http://{p.address}:{p.http_port}{path}", timeout=timeout) as r:
                data = json.loads(r.read())
            states = [str(e.get("status", "")) for e in data.get("engines", [])]
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return ""
        return next((st for st in states if st != "healthy"), "healthy" if states else "")

    with ThreadPoolExecutor(max_workers=min(32, len(asked))) as pool:
        return dict(zip((p.id for p in asked), pool.map(one, asked), strict=True))


def ft_retry(plan: Plan, pool: FaultTolerancePool, timeout: float) -> str | None:
    """POST ``retry`` to every rank of ``pool`` at once (recovery completes only when every rank got it)."""
    procs = [p for p in plan.processes if p.id in pool.processes]
    body = json.dumps({"instruction": "retry", "params": {}}).encode()

    def one(p: Process) -> str | None:
        req = urllib.request.Request(f"http://{p.address}:{p.http_port}{pool.apply}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return None if r.status == 202 else f"{p.id}: HTTP {r.status}"
        except urllib.error.HTTPError as exc:
            return f"{p.id}: HTTP {exc.code} {exc.read()[:200].decode(errors='replace')}"
        except (urllib.error.URLError, OSError) as exc:
            return f"{p.id}: {getattr(exc, 'reason', exc)}"

    with ThreadPoolExecutor(max_workers=min(32, len(procs) or 1)) as ex:
        errors = [e for e in ex.map(one, procs) if e]
    return "; ".join(errors) or None


def reroute(router: Process, remove: Sequence[str], add: Sequence[str]) -> str | None:
    """Tell the running router of moved engines: its worker routes (vllm-router's
    ``/remove_worker`` and ``/add_worker``, the URL as a query parameter). None when it took
    them, else why not. ``add`` blocks until the worker answers ``/health``: call it once the
    engine serves."""
    base = f"http://{router.address}:{router.http_port}"
    for route, urls in (("remove_worker", remove), ("add_worker", add)):
        for url in urls:
            req = urllib.request.Request(f"{base}/{route}?url={urllib.parse.quote(url, safe='')}", data=b"", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=REROUTE_TIMEOUT_S) as r:
                    r.read()
            except urllib.error.HTTPError as exc:
                said = exc.read()[:200].decode(errors="replace")
                if route == "add_worker" and "already exists" in said:
                    continue
                return f"{route} {url}: HTTP {exc.code} {said}"
            except (urllib.error.URLError, OSError) as exc:
                return f"{route} {url}: {getattr(exc, 'reason', exc)}"
    return None
