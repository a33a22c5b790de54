"""What a Slurm job says and where it runs: helpers of the Slurm backend (pure, but for the
bad-nodes file).

* :func:`parse_output`: the lines the job library (``slurm/k3launch-job.sh``) writes to the job's
  output: the host and address bound to each plan node, the doctor step's verdicts, which step
  ended first.
* :func:`bind_plan`: the plan with its node addresses replaced by the allocated hosts' addresses.
* bad nodes: ``<state dir>/slurm-bad-nodes.json``, hosts the job's doctor refused or where a
  rank died, kept for a day (doctor refusals are excluded from later submissions).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from k3launch.deploy.state import StateStore
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.record import ProcessRecord, SlurmJob, SlurmRecord
from k3launch.render.sbatch import address_pattern, node_order
from k3launch.util.locks import locked

BAD_NODE_TTL_S = 24 * 3600.0

_NODE = re.compile(r"^k3launch: node (\d+) = (\S+) (\S+)$")
_DOCTOR_BAD = re.compile(r"^k3launch: doctor failed on (\S+): (.*)$")
_PREPARE_BAD = re.compile(r"^k3launch: prepare failed on (\S+): cannot make (.*)$")
_STEP_EXIT = re.compile(r"^k3launch: (?:then )?(\S+) on node (\d+) \((\S+)\) exited with code (-?\d+)")


@dataclass
class JobOutput:
    """What the job script said in its output file (see slurm/k3launch-job.sh)."""

    hosts: dict[int, tuple[str, str]] = field(default_factory=dict)  # plan node index -> (host, NodeAddr)
    doctor_ok: bool = False
    doctor_failed: dict[str, str] = field(default_factory=dict)  # host -> why
    prepare_failed: dict[str, str] = field(default_factory=dict)  # host -> the first directory the job could not make there
    step_exits: list[tuple[str, str, int]] = field(default_factory=list)  # (process id, host, exit code), first first
    supervising: bool = False  # a supervised job's controller watches its steps (it restarts a rank from now on)

    @property
    def step_exit(self) -> tuple[str, str, int] | None:
        return self.step_exits[0] if self.step_exits else None


def parse_output(text: str) -> JobOutput:
    out = JobOutput()
    for line in text.splitlines():
        if m := _NODE.match(line):
            out.hosts[int(m.group(1))] = (m.group(2), m.group(3))
        elif m := _DOCTOR_BAD.match(line):
            out.doctor_failed[m.group(1)] = m.group(2)
        elif m := _PREPARE_BAD.match(line):
            out.prepare_failed.setdefault(m.group(1), m.group(2))
        elif line.startswith("k3launch: doctor: "):
            out.doctor_ok = True
        elif line.startswith("k3launch: supervising "):
            out.supervising = True
        elif m := _STEP_EXIT.match(line):
            out.step_exits.append((m.group(1), m.group(3), int(m.group(4))))
    return out


def bind_plan(plan: Plan, addresses: dict[str, str]) -> Plan:
    """The plan with every plan-node address (in addresses, argv, env, URLs, endpoint) replaced by
    the address of the host bound to that node (``addresses``: plan node -> address)."""
    amap = {h.address: addresses[h.name] for h in plan.hosts if h.name in addresses}
    if not amap:
        return plan
    pat = address_pattern(amap)

    def sub(s: str) -> str:
        return pat.sub(lambda m: amap[m.group(0)], s)

    data = plan.model_dump()
    for p in data["processes"]:
        p["address"], p["argv"], p["env"] = sub(p["address"]), [sub(w) for w in p["argv"]], {k: sub(v) for k, v in p["env"].items()}
    for h in data["hosts"]:
        h["address"] = sub(h["address"])
    for u in data["ports"]:
        u["address"] = sub(u["address"])
    data["endpoint"] = sub(data["endpoint"])
    return Plan.model_validate(data)


# ---------------------------------------------------------------------- bad nodes
def _bad_path(store: StateStore) -> Path:
    return store.bad_nodes_path()


def bad_nodes(store: StateStore, now: float | None = None) -> dict[str, dict[str, object]]:
    """host -> {reason, kind ("doctor" | "rank-died"), time, deployment}, entries of the last day."""
    try:
        data = json.loads(_bad_path(store).read_text())
    except (OSError, ValueError):
        return {}
    t = time.time() if now is None else now
    return {h: v for h, v in data.items() if isinstance(v, dict) and t - float(v.get("time", 0)) < BAD_NODE_TTL_S}


def record_bad_node(store: StateStore, host: str, reason: str, kind: str, deployment: str) -> None:
    """Best effort, under a lock (several `up`s may record at once); a failure to record never
    hides the failure being reported."""
    import tempfile

    try:
        store.root.mkdir(parents=True, exist_ok=True)
        with locked(store.bad_nodes_path().with_suffix(".lock"), remove=True):
            data = bad_nodes(store)
            data[host] = {"reason": reason, "kind": kind, "time": time.time(), "deployment": deployment}
            fd, tmp = tempfile.mkstemp(dir=store.root, prefix=".slurm-bad-nodes.")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, _bad_path(store))
    except OSError:
        return


def tail_file(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
    except OSError:
        return f"(not readable on this machine: {path}; the log directory must be shared with the compute nodes)\n"


def read_file(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""




def attached_record(plan: Plan, env: Mapping[str, str], inventory: str | None = None) -> SlurmRecord:
    """The record of a deployment the current job array task runs (bound by the job library:
    ``K3_ADDR_i`` per plan node), for code that uses a deployment it did not start."""
    order = node_order(plan)
    missing = [f"K3_ADDR_{i}" for i in range(len(order)) if not env.get(f"K3_ADDR_{i}")]
    if missing:
        raise K3Error("not-in-a-task", f"{', '.join(missing)} not set: this runs inside a k3launch job array task only",
                      "submit with `k3launch campaign run FILE --out DIR --slurm-array`")
    bound = bind_plan(plan, {n: env[f"K3_ADDR_{i}"] for i, n in enumerate(order)})
    job = env.get("SLURM_JOB_ID", "")
    now = time.time()
    procs = {p.id: ProcessRecord(id=p.id, node=p.node, runtime="slurm", handle=f"{job}:{p.id}", started=True) for p in bound.processes}
    hosts = {n: env.get(f"K3_HOST_{i}", "") for i, n in enumerate(order)}
    slurm = SlurmJob(job_id=job, log_dir=env.get("K3_LOGDIR", ""), script="", hosts=hosts, addresses={n: env[f"K3_ADDR_{i}"] for i, n in enumerate(order)})
    return SlurmRecord(name=plan.name, state="ready", created=now, updated=now, inventory=inventory, endpoint=bound.endpoint,
                            plan=bound, processes=procs, slurm=slurm)
