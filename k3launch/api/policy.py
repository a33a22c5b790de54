"""The restart policy a deployment follows: the inventory's ``restart:`` section (the inventory the
deployment was brought up from), each field overridable by the caller (``supervise``'s flags,
``up --supervise``'s mapping).

Its own module because three parts of the API resolve it: ``supervise`` (a supervisor's policy),
``up`` and ``dry_run`` (the policy of a deployment that supervises itself); each imports it from
here and none of them from another, so the API's modules import each other in one direction.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3launch.api._common import load, store
from k3launch.errors import K3Error, plain

if TYPE_CHECKING:
    from k3launch.models.monitoring import Monitoring
    from k3launch.models.record import DeploymentRecord
    from k3launch.models.supervise import RestartPolicy
    from k3launch.planning.inventory import Inventory


def restart_policy(name: str, overrides: Mapping[str, Any] | None = None, *, state_dir: str | Path | None = None) -> RestartPolicy:
    """The policy a supervisor of ``name`` follows: the inventory's ``restart:``, then ``overrides``."""
    rec = store(state_dir).load(name)
    return merged_policy(_inventory_policy(rec), overrides)


def self_policy(inv: Inventory, supervise: bool | Mapping[str, Any]) -> RestartPolicy | None:
    """The policy a self-supervising deployment follows (None: not asked for): the inventory's
    ``restart:``, then the fields ``supervise`` overrides; refused by a backend without the feature."""
    from k3launch.models.backends import Feature, require

    if supervise is False:
        return None
    require(inv.backend, Feature.SELF_SUPERVISE, "supervision built into the deployment (up --supervise)")
    return merged_policy(inv.restart, supervise if isinstance(supervise, Mapping) else None)


def merged_policy(base: RestartPolicy | None, overrides: Mapping[str, Any] | None) -> RestartPolicy:
    """``base`` (an inventory's ``restart:``; None: the defaults) with the fields ``overrides`` sets (None values: not set)."""
    from pydantic import ValidationError

    from k3launch.models.supervise import RestartPolicy

    try:
        return RestartPolicy.model_validate({**(base or RestartPolicy()).model_dump(),
                                             **{k: v for k, v in (overrides or {}).items() if v is not None}})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        flag = "--restart" if field == "policy" else "--" + field.replace("_", "-")
        raise K3Error("bad-policy", f"restart policy {field} ({flag}, or restart.{field} in the inventory): {plain(err['msg'])}",
                      "see `k3launch supervise --help` for each setting's range") from None


def monitoring_settings(rec: DeploymentRecord) -> Monitoring:
    """The ``monitoring:`` section of the inventory ``rec`` was brought up from (the defaults
    where it has none, or the inventory is no longer there)."""
    from k3launch.models.monitoring import Monitoring

    inv = _inventory_of(rec)
    return inv.monitoring if inv is not None and inv.monitoring is not None else Monitoring()


def _inventory_policy(rec: DeploymentRecord) -> RestartPolicy:
    from k3launch.models.supervise import RestartPolicy

    inv = _inventory_of(rec)
    return inv.restart if inv is not None and inv.restart is not None else RestartPolicy()


def _inventory_of(rec: DeploymentRecord) -> Inventory | None:
    """The inventory ``rec`` was brought up from, while its file is still there."""
    return load(rec.inventory).inventory if rec.inventory and Path(rec.inventory).is_file() else None
