"""OpenTelemetry traces where the inventory asks for them (``observability:``; docs/monitoring.md).

Every engine process that serves HTTP gets vLLM's ``--otlp-traces-endpoint`` (and
``--collect-detailed-traces`` when the inventory names modules), with the inventory as its
provenance. A vLLM whose flag schema lacks the flag is refused, not planned without traces; the
router is named in a notice: vllm-router 0.1.17 has no tracing flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from k3launch.errors import K3Error
from k3launch.models.plan import Process, ProvenanceEntry
from k3launch.models.selection import Notice
from k3launch.planning.schema import FlagSchema

if TYPE_CHECKING:  # a plan without an inventory does not load the inventory models
    from k3launch.planning.inventory import Observability

ENDPOINT, DETAILED = "--otlp-traces-endpoint", "--collect-detailed-traces"
ORIGIN = "inventory observability"


def apply(procs: Sequence[Process], obs: Observability | None, schema: FlagSchema, notices: list[Notice]) -> list[Process]:
    if obs is None or obs.otlp_endpoint is None:
        return list(procs)
    wanted = [(ENDPOINT, obs.otlp_endpoint, "otlp_endpoint")]  # flag, value, the inventory key it comes from
    if obs.detailed_traces:
        wanted.append((DETAILED, ",".join(obs.detailed_traces), "detailed_traces"))
    for flag, _, _ in wanted:
        if schema.lookup(flag) is None:
            raise K3Error("tracing-unsupported", f"observability in the inventory asks for traces, and vLLM {schema.version} has no {flag}",
                          "plan for a vLLM that has it (--vllm-version), or remove observability from the inventory")
    out = []
    for p in procs:
        if p.role == "router" or p.http_port is None:
            out.append(p)
            continue
        argv = [*p.argv, *(w for flag, value, _ in wanted for w in (flag, value))]
        prov = {**p.provenance, **{flag: [ProvenanceEntry(layer="strategy", value=f"{flag} {value}", origin=f"{ORIGIN}.{key}")]
                                   for flag, value, key in wanted}}
        out.append(p.model_copy(update={"argv": argv, "provenance": prov}))
    if any(p.role == "router" for p in procs):
        notices.append(Notice("tracing-router", "the router is not traced: vllm-router 0.1.17 has no tracing flag (the engines are)"))
    return out
