"""Which :class:`~k3launch.deploy.base.Backend` runs an inventory's deployments.

The backends' names, features and traits are data in :mod:`k3launch.models.backends`; this module
turns a name into the implementation, imported when first used, so a command never pays for
backends it does not touch (``plan`` imports none). :mod:`k3launch.api` is the only caller, and
the only module that reaches a backend's own package (an import-linter contract keeps it so).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, cast

from k3launch.models.backends import Feature, require, spec

if TYPE_CHECKING:
    from k3launch.deploy.base import Backend

_instances: dict[str, Backend] = {}


def backend(name: str, feature: Feature | None = None, what: str = "") -> Backend:
    """The backend registered as ``name`` (an inventory's or a record's ``backend``); with
    ``feature``, refused (``not-supported``) unless the backend declares it."""
    s = require(name, feature, what or feature.value) if feature is not None else spec(name)
    found = _instances.get(s.implementation)
    if found is None:
        module, _, cls = s.implementation.partition(":")
        found = _instances[s.implementation] = cast("Backend", getattr(import_module(module), cls)())
    return found
