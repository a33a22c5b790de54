"""Inside a job array task: wait until the task's deployment serves, run its work, write its result.

Started by the job script (``k3_work``) on the task's batch host once every step has started::

    python -m k3launch.deploy.slurm.task --plan DIR/plan.json --result DIR/result.json [--ready-timeout S] [-- CMD ...]

The plan's nodes are bound to the allocation by the job library (``$K3_HOST_i``/``$K3_ADDR_i``),
so the readiness checks are those of ``up``: every HTTP endpoint answers ``/health``, then a real
completion through the public endpoint. ``CMD`` then runs with ``K3LAUNCH_ENDPOINT``,
``K3LAUNCH_MODEL`` and ``K3LAUNCH_DEPLOYMENT`` set (a campaign's load points, a benchmark, a
test). The result (JSON, written atomically) says what happened either way; the exit code is
the work's (1 when the deployment never served), and the job ends with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from k3launch.deploy.readiness import Readiness
from k3launch.deploy.slurm.job import bind_plan
from k3launch.models.plan import Plan
from k3launch.models.reports import LaunchFailed
from k3launch.render.sbatch import node_order
from k3launch.util.polling import poll_until


def _write(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def wait_ready(plan: Plan, timeout_s: float) -> tuple[bool, str, int]:
    """(ready, detail, completion tokens): the readiness stages of ``up``, from inside the job."""
    t_end = time.monotonic() + timeout_s
    ready = Readiness(plan.processes, plan.endpoint, plan.model, lambda stage, msg: print(f"k3launch: {stage}: {msg}", flush=True))
    try:
        c = poll_until(lambda: ready.check(t_end), lambda c: c is not None, timeout=timeout_s, interval=0.5)
    except LaunchFailed as exc:
        return False, exc.message, 0
    if c is not None:
        return True, f"{c.completion_tokens} tokens in {c.seconds:.2f}s", c.completion_tokens
    return False, f"not ready after {timeout_s:g}s (not healthy: {', '.join(ready.missing) or 'none'})", 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3launch.deploy.slurm.task", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--plan", required=True, type=Path)
    ap.add_argument("--result", required=True, type=Path)
    ap.add_argument("--ready-timeout", type=float, default=1800.0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    plan = Plan.model_validate_json(a.plan.read_text())
    order = node_order(plan)
    hosts = {n: os.environ.get(f"K3_HOST_{i}", "") for i, n in enumerate(order)}
    bound = bind_plan(plan, {n: os.environ.get(f"K3_ADDR_{i}", "") for i, n in enumerate(order)})
    t0 = time.time()
    result: dict[str, object] = {
        "task": os.environ.get("SLURM_ARRAY_TASK_ID"), "array_job": os.environ.get("SLURM_ARRAY_JOB_ID"),
        "job": os.environ.get("SLURM_JOB_ID"), "deployment": plan.name, "strategy": plan.strategy, "nodes": plan.nodes,
        "hosts": hosts, "endpoint": bound.endpoint, "started": t0, "ok": False, "ready": False, "error": None,
    }
    a.result.parent.mkdir(parents=True, exist_ok=True)
    _write(a.result, {**result, "error": "waiting for the deployment"})
    ready, detail, tokens = wait_ready(bound, a.ready_timeout)
    result |= {"ready": ready, "ready_s": round(time.time() - t0, 3), "completion_tokens": tokens, "ready_detail": detail}
    rc = 1
    if not ready:
        result["error"] = detail
    elif cmd:
        env = {**os.environ, "K3LAUNCH_ENDPOINT": bound.endpoint, "K3LAUNCH_MODEL": plan.model, "K3LAUNCH_DEPLOYMENT": plan.name}
        rc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL).returncode
        result |= {"work": cmd, "work_rc": rc, "ok": rc == 0, "error": None if rc == 0 else f"work exited with code {rc}"}
    else:
        rc = 0
        result["ok"] = True
    result["ended"] = time.time()
    _write(a.result, result)
    return rc


if __name__ == "__main__":
    sys.exit(main())
