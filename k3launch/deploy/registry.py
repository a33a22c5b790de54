"""Which :class:`~k3launch.deploy.base.Backend` runs an inventory's deployments.

The backends' names, features and traits are data in :mod:`k3launch.models.backends`; this module
turns a name into the implementation, imported when first used, so a command never pays for
backends it does not touch (``plan`` imports none). :mod:`k3launch.api` is the only caller, and
this the only module that reaches into a backend's own package (an import-linter contract).

A backend is built for each call with the option objects the caller has
(:mod:`k3launch.deploy.options`): it takes the types it lists in ``OPTIONS``; another backend's
option that changes the deployment is refused here (``not-supported``), once for every backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from importlib import import_module
from typing import TYPE_CHECKING, Any, cast

from k3launch.errors import K3Error
from k3launch.models.backends import Feature, require, spec

if TYPE_CHECKING:
    from k3launch.deploy.base import ArrayOps, Backend, CacheOps, CanaryOps, NodeOps, PowerOps, SuperviseOps
    from k3launch.deploy.options import BackendOptions


@cache
def _implementation(ref: str) -> Any:
    module, _, cls = ref.partition(":")
    return getattr(import_module(module), cls)


def _build(name: str, feature: Feature | None, what: str, options: Sequence[BackendOptions]) -> Any:
    s = require(name, feature, what or feature.value) if feature is not None else spec(name)
    cls = _implementation(s.implementation)
    accepted: tuple[type, ...] = getattr(cls, "OPTIONS", ())
    for o in options:
        if not isinstance(o, accepted) and (flags := o.given()):
            raise K3Error("not-supported", f"{flags[0]} applies to {o.APPLIES_TO} inventories only, not {name}", f"drop {flags[0]}")
    return cls(*[o for o in options if isinstance(o, accepted)])


def backend(name: str, options: Sequence[BackendOptions] = ()) -> Backend:
    """The backend registered as ``name`` (an inventory's or a record's ``backend``), built with ``options``."""
    return cast("Backend", _build(name, None, "", options))


def node_ops(name: str, feature: Feature, what: str, options: Sequence[BackendOptions] = ()) -> NodeOps:
    """``name``'s node operations; ``not-supported`` unless it declares ``feature`` (doctor, weights, fleet)."""
    return cast("NodeOps", _build(name, feature, what, options))


def power_ops(name: str, options: Sequence[BackendOptions] = ()) -> PowerOps:
    return cast("PowerOps", _build(name, Feature.POWER, "power sampling", options))


def array_ops(name: str, what: str, options: Sequence[BackendOptions] = ()) -> ArrayOps:
    return cast("ArrayOps", _build(name, Feature.ARRAYS, what, options))


def supervise_ops(name: str, what: str, options: Sequence[BackendOptions] = ()) -> SuperviseOps:
    return cast("SuperviseOps", _build(name, Feature.SUPERVISE, what, options))


def cache_ops(name: str, options: Sequence[BackendOptions] = ()) -> CacheOps:
    return cast("CacheOps", _build(name, Feature.CACHES, "compile caches on the nodes", options))


def canary_ops(name: str, what: str, options: Sequence[BackendOptions] = ()) -> CanaryOps:
    return cast("CanaryOps", _build(name, Feature.CANARY, what, options))
