"""``VLLM_CPU_OMP_THREADS_BIND`` as vLLM's CPU backend reads it (vllm/utils/ompmultiprocessing.py, 0.32;
its parser is vLLM's, not k3launch's: the sim imports only the standard library and the flag schema).

k3launch's planning gives CPU engines that share a machine cores of their own through it
(k3launch.planning.cpusets); the simulated engine takes the same value, refuses what vLLM refuses
(a list that does not parse, fewer lists than this node's ranks) and logs vLLM's own binding lines,
so a test reads a simulated engine's cores from its log as it reads a real one's.
"""

from __future__ import annotations

from k3launch.sim.logs import Logger
from k3launch.sim.options import ServeOptions, SimConfigError

ENV = "VLLM_CPU_OMP_THREADS_BIND"
SRC = "ompmultiprocessing.py"


def parse_id_list(raw: str) -> list[int]:
    """vLLM's own parser (vllm/utils/cpu_resource_utils.py): ``0-2,4`` -> ``[0, 1, 2, 4]``; an empty
    list is empty; anything else is the ValueError vLLM's ``int()`` raises."""
    out: list[int] = []
    for part in raw.split(",") if raw else []:
        if "-" in part:
            lo, hi = map(int, part.split("-"))
            out.extend(range(lo, hi + 1))
        else:
            out.append(int(part))
    return sorted(set(out))


def local_world_size(o: ServeOptions) -> int:
    """The ranks of one engine core on this node: its share of TP x PP."""
    return max((o.tp * o.pp) // o.nnodes, 1)


def core_lists(o: ServeOptions) -> list[list[list[int]]] | None:
    """Per local DP rank, each local rank's cores; None for ``auto`` and ``nobind`` (vLLM picks, or
    binds nothing). Raises :class:`SimConfigError` with vLLM's message for what it refuses."""
    if o.omp_bind in ("auto", "nobind"):
        return None
    lists = o.omp_bind.split("|")
    lws = local_world_size(o)
    out = []
    for r in range(o.dp_local):  # vLLM slices the lists by local DP rank: [DP, PP, TP] order
        mine = lists[r * lws:(r + 1) * lws]
        if len(mine) != lws:
            raise SimConfigError(f"Given number of CPU id list {mine} doesn't match local world size {lws}.")
        try:
            out.append([parse_id_list(s) for s in mine])
        except ValueError as exc:  # vLLM's engine core dies with it
            raise SimConfigError(f"{ENV}={o.omp_bind!r}: {exc}") from None
    return out


def log_binding(log: Logger, o: ServeOptions) -> None:
    """vLLM's "OpenMP thread binding info" lines for an explicit binding (nothing for auto/nobind)."""
    per_rank = core_lists(o)
    if per_rank is None:
        return
    lws = local_world_size(o)
    for ranks in per_rank:
        lines = ["OpenMP thread binding info: ", f"\t{ENV}={o.omp_bind!r}, auto_setup=False, skip_setup=False",
                 f"\tlocal_world_size={lws}, reserve_cpu_num={lws}"]
        lines += [f"\tlocal_rank={i}, core ids={cpus}" for i, cpus in enumerate(ranks)]
        log.info("\n".join([*lines, "\treserved_cpus=[]"]), src=SRC)
