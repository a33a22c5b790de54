"""Backends by name: where each is implemented, what it supports, and the traits planning reads.

A backend is lifecycle + features + node operations (docs/design.md, "The backend seam"). The
lifecycle (``up``, ``status``, ``logs``, ``down``, ``sweep``, ``dry_run``) every backend has; the
:class:`Feature` s below it declares in its :class:`BackendSpec`, in the spirit of SkyPilot's
``CloudImplementationFeatures``, and :func:`require` is the one place an unsupported one is
refused (``not-supported``). The traits (where the router runs, the default runtime, ...) are
class-attribute-like facts in the spirit of dask-jobqueue's job classes: planning and placement
read them here, so neither imports a backend and ``plan`` stays as fast as before.

This is data only. :mod:`k3launch.deploy.registry` imports :attr:`BackendSpec.implementation` on
first use; :func:`register` adds a backend at run time (a plug-in, or a test's toy backend).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from k3launch.errors import K3Error
from k3launch.util.records import record


class Feature(StrEnum):
    """What a backend may support beyond the lifecycle."""

    DOCTOR = "doctor"  # pre-flight checks of the nodes, without starting anything (`k3launch doctor`)
    WEIGHTS = "weights"  # check and fetch the model's weights on the nodes (`k3launch weights`)
    FLEET = "fleet"  # run commands on a live deployment's nodes (`bench --client engine` there)
    POWER = "power"  # sample GPU power during a benchmark (campaign energy)
    ARRAYS = "arrays"  # one allocation per plan as a job array (`campaign run --slurm-array`)
    SUPERVISE = "supervise"  # keep a deployment serving from a login node (`k3launch supervise`: restart, cordon, re-place)
    SELF_SUPERVISE = "self-supervise"  # the deployment keeps itself serving (`up --supervise` builds the restart policy into it)
    ROLLOUT = "rollout"  # change a live deployment unit by unit (Slurm: a job brought up with --supervise, by its own controller)
    CANARY = "canary"  # ask a live deployment's HTTP servers from this machine (the correctness canary)
    CACHES = "caches"  # list and clear the compile/JIT caches engines keep on the nodes (`k3launch cache`)


# Where the router of a P/D or DEP plan runs: ``inventory`` — the inventory's ``router.node``
# (the login node by default); ``allocation`` — the first engine node, because the login node
# can neither be assumed to reach compute nodes' ports nor to outlive a job.
RouterHome = Literal["inventory", "allocation"]


@record
class BackendSpec:
    """One backend: its implementation (``module:Class``, imported on first use), its features, its traits."""

    name: str
    implementation: str
    features: frozenset[Feature]
    description: str = ""
    router_home: RouterHome = "inventory"
    default_runtime: str = "docker"  # a node's runtime when neither the node nor the inventory's defaults set one
    this_machine: bool = False  # every process runs on the machine k3launch runs on
    reads_ssh_config: bool = False  # node names resolve through the inventory's ssh_config / ~/.ssh/config
    needs_nodes: bool = True  # the inventory must list nodes (a scheduler may find them itself instead)
    scheduler_nodes: bool = False  # without listed nodes, nodes come from the scheduler's node list (``slurm.nodelist``)
    holds_nodes: bool = True  # k3launch arbitrates the nodes (a live deployment refuses them to another)
    instead: tuple[tuple[Feature, str], ...] = ()  # what to do on this backend instead of a feature it lacks (the hint)

    def supports(self, feature: Feature) -> bool:
        return feature in self.features


_SSH_FEATURES = frozenset({Feature.DOCTOR, Feature.WEIGHTS, Feature.FLEET, Feature.POWER, Feature.SUPERVISE, Feature.ROLLOUT,
                           Feature.CANARY, Feature.CACHES})
_SSH_INSTEAD = ((Feature.SELF_SUPERVISE, "here a supervisor on the login node keeps it serving: `k3launch up --supervise`, "
                                         "or `k3launch supervise NAME --detach` once it is up"),)

_BACKENDS: dict[str, BackendSpec] = {
    "ssh": BackendSpec("ssh", "k3launch.deploy.ssh.backend:SshBackend", _SSH_FEATURES, "processes or containers over SSH",
                       reads_ssh_config=True, instead=_SSH_INSTEAD),
    "local": BackendSpec("local", "k3launch.deploy.ssh.backend:SshBackend", _SSH_FEATURES, "processes on this machine",
                         default_runtime="bare", this_machine=True, instead=_SSH_INSTEAD),
    "slurm": BackendSpec("slurm", "k3launch.deploy.slurm.backend:SlurmBackend",
                         frozenset({Feature.POWER, Feature.ARRAYS, Feature.SELF_SUPERVISE, Feature.CANARY, Feature.ROLLOUT}),
                         "one sbatch job per deployment", router_home="allocation", needs_nodes=False, scheduler_nodes=True,
                         holds_nodes=False,
                         instead=((Feature.DOCTOR, "on Slurm the job's own doctor step checks each node when `up` submits it"),
                                  (Feature.WEIGHTS, "on Slurm check weights inside an allocation (srun), or from an ssh inventory of the same nodes"),
                                  (Feature.FLEET, "use --client local (the benchmark client on the login node)"),
                                  (Feature.SUPERVISE, "on Slurm the job supervises itself: bring it up with `k3launch up --supervise` "
                                                      "(policy: the inventory's restart:); `k3launch events NAME` shows what it did"),
                                  (Feature.CACHES, "on Slurm list or clear the compile caches inside an allocation "
                                                   "(srun ... ls ~/.cache/k3launch/compile), or from an ssh inventory of the same nodes"))),
}


def spec(name: str) -> BackendSpec:
    """The backend registered as ``name`` (an inventory's, a plan's or a record's ``backend``)."""
    found = _BACKENDS.get(name)
    if found is None:
        raise K3Error("unknown-backend", f"no backend named {name!r}", f"backends: {', '.join(names())}")
    return found


def names() -> list[str]:
    return sorted(_BACKENDS)


def register(backend: BackendSpec) -> None:
    """Add (or replace) a backend; ``plan``, ``up`` and the rest find it by name from then on."""
    _BACKENDS[backend.name] = backend


def unregister(name: str) -> None:
    _BACKENDS.pop(name, None)


def require(name: str, feature: Feature, what: str) -> BackendSpec:
    """The one refusal of a feature a backend lacks: ``what`` (the command or function) cannot run there."""
    s = spec(name)
    if feature in s.features:
        return s
    hint = dict(s.instead).get(feature)
    if hint is None:
        which = [n for n in names() if feature in _BACKENDS[n].features]
        hint = f"backends that support it: {', '.join(which)}" if which else f"no backend supports {feature.value} yet"
    raise K3Error("not-supported", f"{what} is not supported by the {name} backend ({feature.value})", hint)
