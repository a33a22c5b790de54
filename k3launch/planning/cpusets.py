"""CPU sets for engines of vLLM's CPU backend: engines that share a machine get cores of their own.

vLLM's CPU backend binds each worker's OpenMP threads to cores. Left to itself
(``VLLM_CPU_OMP_THREADS_BIND=auto``) it picks the first cores of the process's CPU mask, so two
engines on one machine -- two copies on a ``local`` inventory's loopback nodes, say -- both bind
core 0: each runs at a fraction of its speed, and on some kernels a restarted one hangs while it
moves itself onto the busy core (docs/development.md). Planning gives them disjoint sets instead,
from the cores the inventory names (``cpus``, per node or in ``defaults``):

* **Machines.** Every node of a ``this_machine`` backend (``local``) is one machine; otherwise
  each node is a machine of its own (an inventory's nodes never share an address).
* **Shares.** Nodes of one machine that name the same ``cpus`` divide them equally, in inventory
  order (node *i* of *K* gets the *i*-th *K*-th). A node's share depends on the inventory alone,
  not on how many copies the plan runs: copies keep their cores when a deployment scales or a
  unit moves, and two deployments on different nodes of a machine do not meet. A node that names
  cores of its own keeps them.
* **Ranks.** The engine ranks on a node (a process's ``gpus``; one on a CPU profile) divide its
  share the same way. Each rank's OpenMP threads are bound to its part
  (``VLLM_CPU_OMP_THREADS_BIND``, ranks separated by ``|``, as vLLM reads it), less its last core
  when it has more than one -- what vLLM's own ``auto`` leaves to the process's other threads
  (API server, engine core) -- and the whole process is held in its part (:attr:`Process.cpus`:
  ``taskset``/``--cpuset-cpus``, :mod:`k3launch.render.runtimes`), so nothing it starts moves
  onto another engine's cores.
* **Too few cores.** With fewer cores than nodes (or ranks) to divide them among, shares wrap
  around and engines of the plan may share cores: the plan says so (notice ``cpus-shared``). A
  machine whose engines share it without any ``cpus`` gets ``cpus-unknown``. A process whose
  environment sets ``VLLM_CPU_OMP_THREADS_BIND`` itself (the inventory's ``env``) is left as it is.

Only the CPU platform: GPU engines' threads are the OS's to place (``cpus`` there: ``cpus-ignored``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from k3launch.models.backends import spec
from k3launch.models.plan import Process, ProvenanceEntry
from k3launch.models.selection import Notice
from k3launch.util.cpulist import format_list, parse

if TYPE_CHECKING:
    from k3launch.planning.inventory import Inventory
    from k3launch.planning.placement import NodeSpec

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
THIS_MACHINE = "this machine"


def _slice(ids: Sequence[int], i: int, k: int) -> list[int]:
    """Part ``i`` of ``k`` of ``ids``: equal runs, or one id each (wrapping) when there are fewer ids than parts."""
    n = len(ids)
    return list(ids[i * n // k:(i + 1) * n // k]) if n >= k else [ids[i % n]]


def _machines(inventory: Inventory | None, placed: Sequence[NodeSpec]) -> dict[str, tuple[str, str | None]]:
    """Node name -> (machine, its cpus), the inventory's nodes first, in its order."""
    one = inventory is not None and spec(inventory.backend).this_machine
    out: dict[str, tuple[str, str | None]] = {}
    if inventory is not None:
        for n in inventory.nodes:
            out[n.name] = (THIS_MACHINE if one else n.name, n.cpus or inventory.defaults.cpus)
    for node in placed:  # a scheduler's nodes, not listed in the inventory
        out.setdefault(node.name, (THIS_MACHINE if one else node.name, node.cpus))
    return out


def node_shares(inventory: Inventory | None, placed: Sequence[NodeSpec]) -> dict[str, list[int]]:
    """Node name -> the cores its engines divide (nodes without ``cpus`` are left out)."""
    machines = _machines(inventory, placed)
    groups: dict[tuple[str, str], list[str]] = {}
    for name, (machine, cpus) in machines.items():
        if cpus is not None:
            groups.setdefault((machine, cpus), []).append(name)
    return {name: _slice(parse(cpus), i, len(names)) for (_, cpus), names in groups.items() for i, name in enumerate(names)}


def _omp(part: list[int]) -> str:
    return format_list(part[:-1] if len(part) > 1 else part)


def bind(procs: Sequence[Process], placed: Sequence[NodeSpec], inventory: Inventory | None, platform: str,
         notices: list[Notice]) -> list[Process]:
    """``procs`` with each CPU engine's cores (``cpus`` and its ``VLLM_CPU_OMP_THREADS_BIND``); what
    planning says about them is added to ``notices``."""
    if platform != "cpu":
        named = [n.name for n in placed if n.cpus is not None]
        if named:
            notices.append(Notice("cpus-ignored", f"cpus of {', '.join(named)} are for vLLM's CPU backend: "
                                  f"this plan's engines ({platform}) are placed by the OS"))
        return list(procs)
    machines = _machines(inventory, placed)
    shares = node_shares(inventory, placed)
    engines = [p for p in procs if p.role != "router" and BIND_ENV not in p.env]
    got: dict[str, tuple[str, str]] = {}
    for node, share in shares.items():
        mine = [p for p in engines if p.node == node]
        ranks = sum(max(p.gpus, 1) for p in mine)
        j = 0
        for p in mine:
            parts = [_slice(share, j + r, ranks) for r in range(max(p.gpus, 1))]
            j += len(parts)
            got[p.id] = ("|".join(_omp(part) for part in parts), format_list(c for part in parts for c in part))
    notices.extend(_notices(engines, got, machines))
    return [_bound(p, *got[p.id], machines[p.node][1] or "") if p.id in got else p for p in procs]


def _bound(p: Process, omp: str, cpus: str, pool: str) -> Process:
    origin = f"k3launch cpus: {p.node}'s share of {pool} (the process runs on {cpus})"
    prov = {**p.provenance, BIND_ENV: [ProvenanceEntry(layer="strategy", value=omp, origin=origin)]}
    return p.model_copy(update={"env": {**p.env, BIND_ENV: omp}, "cpus": cpus, "provenance": prov})


def _notices(engines: Sequence[Process], got: dict[str, tuple[str, str]], machines: dict[str, tuple[str, str | None]]) -> list[Notice]:
    notices: list[Notice] = []
    by_machine: dict[str, list[Process]] = {}
    for p in engines:
        by_machine.setdefault(machines.get(p.node, (p.node, None))[0], []).append(p)
    for machine, mine in by_machine.items():
        where = machine if machine == THIS_MACHINE else f"node {machine}"
        loose = [p for p in mine if p.id not in got]
        if loose and sum(max(p.gpus, 1) for p in mine) > 1:
            notices.append(Notice("cpus-unknown", f"{len(mine)} engine processes share {where} ({', '.join(sorted({p.node for p in mine}))}) "
                                  f"and {', '.join(p.id for p in loose)} have no cpus: vLLM's CPU backend binds each one's threads to the "
                                  "same first cores, where they run at a fraction of their speed; give the nodes cpus (e.g. cpus: \"0-15\")"))
        sets = [(p.id, set(parse(got[p.id][1]))) for p in mine if p.id in got]
        shared = [f"{a} and {b} ({'core' if len(x & y) == 1 else 'cores'} {format_list(x & y)})" for i, (a, x) in enumerate(sets) for b, y in sets[i + 1:] if x & y]
        if shared:
            notices.append(Notice("cpus-shared", f"engines on {where} share cores: {', '.join(shared)}; its cpus have fewer "
                                  "cores than the nodes (or engine ranks) that divide them. Give more cores (cpus), or run fewer "
                                  "copies on it"))
    return notices
