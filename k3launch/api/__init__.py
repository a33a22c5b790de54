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

from typing import TYPE_CHECKING, Any

# The API's names, each with the module it comes from: the one list of them. Type checkers and
# editors read these imports; at run time the block is skipped and each name is imported from its
# module on first use (PEP 562 __getattr__ below, reading this block's lines), so `plan` loads only
# the planning part of the API, not the lifecycle, the node operations or the backend table, on its
# way to start-up. A name is added here, and only here, as `from MODULE import NAME as NAME` (the
# form that says it is exported; tests/fast/test_api_names.py checks every one resolves).
if TYPE_CHECKING:
    from k3launch.api._common import InventoryArg as InventoryArg
    from k3launch.api._common import Loaded as Loaded
    from k3launch.api._common import bundled_inventory as bundled_inventory
    from k3launch.api._common import load as load
    from k3launch.api.caches import cache_dirs as cache_dirs
    from k3launch.api.canaries import canary as canary
    from k3launch.api.catalog import RecipeDetail as RecipeDetail
    from k3launch.api.catalog import RecipeListing as RecipeListing
    from k3launch.api.catalog import SchemaDumped as SchemaDumped
    from k3launch.api.catalog import recipe as recipe
    from k3launch.api.catalog import recipes as recipes
    from k3launch.api.catalog import schema_dump as schema_dump
    from k3launch.api.cordons import cordon as cordon
    from k3launch.api.cordons import cordoned as cordoned
    from k3launch.api.cordons import uncordon as uncordon
    from k3launch.api.lifecycle import bench_dir as bench_dir
    from k3launch.api.lifecycle import chat as chat
    from k3launch.api.lifecycle import deployed as deployed
    from k3launch.api.lifecycle import deployments as deployments
    from k3launch.api.lifecycle import down as down
    from k3launch.api.lifecycle import logs as logs
    from k3launch.api.lifecycle import nodes_in_use as nodes_in_use
    from k3launch.api.lifecycle import ready_timeout as ready_timeout
    from k3launch.api.lifecycle import record as record
    from k3launch.api.lifecycle import state_root as state_root
    from k3launch.api.lifecycle import status as status
    from k3launch.api.lifecycle import up as up
    from k3launch.api.monitoring import alert_rules as alert_rules
    from k3launch.api.monitoring import grafana_dashboard as grafana_dashboard
    from k3launch.api.monitoring import prometheus_config as prometheus_config
    from k3launch.api.monitoring import targets_dir as targets_dir
    from k3launch.api.nodes import active_array_tasks as active_array_tasks
    from k3launch.api.nodes import attached_record as attached_record
    from k3launch.api.nodes import doctor as doctor
    from k3launch.api.nodes import fleet as fleet
    from k3launch.api.nodes import load_against as load_against
    from k3launch.api.nodes import load_prediction as load_prediction
    from k3launch.api.nodes import power_sampler as power_sampler
    from k3launch.api.nodes import saved_probe as saved_probe
    from k3launch.api.nodes import submit_array as submit_array
    from k3launch.api.nodes import wait_array as wait_array
    from k3launch.api.nodes import weights_check as weights_check
    from k3launch.api.nodes import weights_fetch as weights_fetch
    from k3launch.api.nodes import weights_probe as weights_probe
    from k3launch.api.planning import check_port_base as check_port_base
    from k3launch.api.planning import dry_run as dry_run
    from k3launch.api.planning import explain as explain
    from k3launch.api.planning import lint as lint
    from k3launch.api.planning import plan as plan
    from k3launch.api.policy import restart_policy as restart_policy
    from k3launch.api.rollouts import rollout as rollout
    from k3launch.api.rollouts import rollout_continue as rollout_continue
    from k3launch.api.rollouts import rollout_preview as rollout_preview
    from k3launch.api.scaling import scale as scale
    from k3launch.api.supervision import events as events
    from k3launch.api.supervision import follow_events as follow_events
    from k3launch.api.supervision import stop_supervisor as stop_supervisor
    from k3launch.api.supervision import supervise as supervise
    from k3launch.api.supervision import supervise_detached as supervise_detached
    from k3launch.api.timelines import restart_timeline as restart_timeline
    from k3launch.api.timelines import timeline as timeline
    from k3launch.api.top import Top as Top
    from k3launch.models.access import Access as Access
# (end of the API's names)


def _homes() -> dict[str, str]:
    """Each name of the block above -> its module, read from this file once (the block is not run)."""
    import re
    from pathlib import Path

    text = Path(__file__).read_text(encoding="utf-8")
    block = text[text.index("\nif TYPE_CHECKING:\n"):text.index("\n# (end of the API's names)")]
    return {name: module for module, name in re.findall(r"^    from ([\w.]+) import (\w+) as \2$", block, re.MULTILINE)}


def __getattr__(name: str) -> Any:
    homes = globals().get("_HOMES")
    if homes is None:
        homes = globals()["_HOMES"] = _homes()
    if name == "__all__":
        value: Any = sorted(homes)
    elif name in homes:
        from importlib import import_module

        value = getattr(import_module(homes[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once found, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return list(__getattr__("__all__"))
