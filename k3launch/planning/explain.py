"""``k3launch explain FLAG``: the layer history of one flag (or env name) in a plan."""

from __future__ import annotations

from k3launch.errors import K3Error
from k3launch.models.findings import FlagHistory
from k3launch.models.plan import Plan
from k3launch.planning.schema import load_schema


def flag_key(plan: Plan, name: str) -> str:
    """Normalise ``max-num-seqs`` / ``--max-num-seqs`` / ``-tp`` / ``VLLM_X`` to a provenance key."""
    if name.isupper() or (not name.startswith("-") and "_" in name and name.upper() == name):
        return name
    schema = load_schema(plan.vllm_version)
    option = name if name.startswith("-") else "--" + name
    base, dot, path = option.partition(".")
    found = schema.lookup(base)
    if found is None:
        raise K3Error("unknown-flag", f"{name} is not a flag of vllm serve {schema.version}", schema.suggest(base))
    canonical = found[0].canonical
    return f"{canonical}.{path}" if dot else canonical


def explain(plan: Plan, name: str, process: str | None = None) -> list[FlagHistory]:
    key = flag_key(plan, name)
    procs = plan.processes
    if process is not None:
        procs = [p for p in procs if p.id == process]
        if not procs:
            raise K3Error("unknown-process", f"no process {process!r} in this plan", "processes: " + ", ".join(p.id for p in plan.processes))
    groups: dict[str, FlagHistory] = {}
    for p in procs:
        entries = p.provenance.get(key)
        if not entries:
            continue
        sig = repr([(e.layer, e.value, e.origin) for e in entries])
        if sig in groups:
            groups[sig].processes.append(p.id)
        else:
            removed = not key.startswith("-") and key not in p.env  # an env name a later step took out (P/D on HGX nodes)
            groups[sig] = FlagHistory(key, [p.id], list(entries), None if removed else entries[-1].value)
    return list(groups.values())
