"""The Python API: plan, bring up, observe and tear down deployments from a script.

The CLI is a thin layer over these functions, so a benchmark script, a notebook or a submitit
job drives deployments exactly as a user at the shell does (same checks, same state records,
same errors)::

    from k3launch import api

    plan = api.plan("inventories/h200-pair.yaml", strategy="multi_node_tep", nodes=2)
    with api.deployed(plan, "inventories/h200-pair.yaml") as rec:   # up ... down
        print(rec.endpoint, api.status(rec.name).state)

Every refusal is a :class:`~k3launch.errors.K3Error` (``code``, ``message``, ``hint``); a launch
that fails is a :class:`~k3launch.models.reports.LaunchFailed` naming the failing process and
node, with its last log lines. This package is the only caller of the backends: it picks one
from the registry (:mod:`k3launch.deploy.registry`) by the inventory's or the record's
``backend`` (``ssh`` and ``local``: processes over SSH / on this machine; ``slurm``: one sbatch
job per deployment), and an operation a backend does not support is refused there, in one place.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k3launch.api._common import InventoryArg, Loaded, bundled_inventory, load
    from k3launch.api.caches import cache_dirs
    from k3launch.api.canaries import canary
    from k3launch.api.cordons import cordon, cordoned, uncordon
    from k3launch.api.lifecycle import (
        bench_dir,
        chat,
        deployed,
        deployments,
        down,
        logs,
        nodes_in_use,
        ready_timeout,
        record,
        state_root,
        status,
        up,
    )
    from k3launch.api.nodes import (
        active_array_tasks,
        attached_record,
        doctor,
        fleet,
        load_against,
        load_prediction,
        power_sampler,
        saved_probe,
        submit_array,
        wait_array,
        weights_check,
        weights_fetch,
        weights_probe,
    )
    from k3launch.api.planning import (
        RecipeDetail,
        RecipeListing,
        SchemaDumped,
        check_port_base,
        dry_run,
        explain,
        lint,
        plan,
        recipe,
        recipes,
        schema_dump,
    )
    from k3launch.api.policy import restart_policy
    from k3launch.api.rollouts import rollout, rollout_continue, rollout_preview
    from k3launch.api.scaling import scale
    from k3launch.api.supervision import events, follow_events, stop_supervisor, supervise, supervise_detached
    from k3launch.api.timelines import restart_timeline, timeline

# Each name's module, imported on first use: `plan` then loads only the planning part of the API
# (not the lifecycle, node operations or the backend table) on its way to start-up.
_HOMES: dict[str, str] = {
    "InventoryArg": "_common",
    "Loaded": "_common",
    "RecipeDetail": "planning",
    "RecipeListing": "planning",
    "SchemaDumped": "planning",
    "active_array_tasks": "nodes",
    "attached_record": "nodes",
    "bench_dir": "lifecycle",
    "bundled_inventory": "_common",
    "cache_dirs": "caches",
    "canary": "canaries",
    "chat": "lifecycle",
    "check_port_base": "planning",
    "cordon": "cordons",
    "cordoned": "cordons",
    "deployed": "lifecycle",
    "deployments": "lifecycle",
    "doctor": "nodes",
    "down": "lifecycle",
    "dry_run": "planning",
    "explain": "planning",
    "events": "supervision",
    "fleet": "nodes",
    "follow_events": "supervision",
    "lint": "planning",
    "load": "_common",
    "logs": "lifecycle",
    "nodes_in_use": "lifecycle",
    "plan": "planning",
    "power_sampler": "nodes",
    "ready_timeout": "lifecycle",
    "restart_policy": "policy",
    "rollout": "rollouts",
    "rollout_continue": "rollouts",
    "rollout_preview": "rollouts",
    "scale": "scaling",
    "recipe": "planning",
    "recipes": "planning",
    "record": "lifecycle",
    "schema_dump": "planning",
    "state_root": "lifecycle",
    "status": "lifecycle",
    "stop_supervisor": "supervision",
    "submit_array": "nodes",
    "supervise": "supervision",
    "supervise_detached": "supervision",
    "uncordon": "cordons",
    "up": "lifecycle",
    "wait_array": "nodes",
    "weights_check": "nodes",
    "weights_fetch": "nodes",
    "weights_probe": "nodes",
    "saved_probe": "nodes",
    "load_prediction": "nodes",
    "load_against": "nodes",
    "timeline": "timelines",
    "restart_timeline": "timelines",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once found, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "InventoryArg",
    "Loaded",
    "RecipeDetail",
    "RecipeListing",
    "SchemaDumped",
    "active_array_tasks",
    "attached_record",
    "bench_dir",
    "bundled_inventory",
    "cache_dirs",
    "canary",
    "chat",
    "check_port_base",
    "cordon",
    "cordoned",
    "deployed",
    "deployments",
    "doctor",
    "down",
    "dry_run",
    "events",
    "explain",
    "fleet",
    "follow_events",
    "lint",
    "load",
    "load_against",
    "load_prediction",
    "logs",
    "nodes_in_use",
    "plan",
    "power_sampler",
    "ready_timeout",
    "recipe",
    "recipes",
    "record",
    "restart_policy",
    "restart_timeline",
    "rollout",
    "rollout_continue",
    "rollout_preview",
    "saved_probe",
    "scale",
    "schema_dump",
    "state_root",
    "status",
    "stop_supervisor",
    "submit_array",
    "supervise",
    "supervise_detached",
    "timeline",
    "uncordon",
    "up",
    "wait_array",
    "weights_check",
    "weights_fetch",
    "weights_probe",
]
