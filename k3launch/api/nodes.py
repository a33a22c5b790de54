"""Operations on nodes outside the lifecycle, each a feature a backend declares
(:class:`~k3launch.models.backends.Feature`): the pre-flight checks, the weights, commands on a
live deployment's nodes, power sampling, and Slurm job arrays. A backend without the feature
refuses it in one place (``not-supported``, :func:`k3launch.models.backends.require`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from k3launch.api._common import InventoryArg, load, store
from k3launch.errors import K3Error
from k3launch.models.access import Access
from k3launch.models.backends import Feature

if TYPE_CHECKING:
    from k3launch.deploy.base import NodeOps
    from k3launch.models.plan import Plan
    from k3launch.models.power import Sampler
    from k3launch.models.record import DeploymentRecord
    from k3launch.models.reports import ArrayJob, ArrayResult, DoctorReport
    from k3launch.models.weights import Checkpoint, FetchProgress, LoadPrediction, NodeWeights, Probe
    from k3launch.planning.inventory import Inventory
    from k3launch.transport.fleet import Fleet


def _node_ops(inventory: InventoryArg, feature: Feature, what: str, access: Access) -> tuple[Inventory, NodeOps]:
    """The inventory and its backend's node operations (``not-supported`` without ``feature``)."""
    from k3launch.deploy.registry import node_ops

    inv = load(inventory).inventory
    return inv, node_ops(inv.backend, feature, what, [access])


def doctor(plan: Plan, inventory: InventoryArg = None, *, state_dir: str | Path | None = None, bandwidth: bool = False,
           min_busbw: float | None = None, access: Access = Access()) -> DoctorReport:
    """The pre-flight checks ``up`` runs, on the plan's nodes, without starting anything; with
    ``bandwidth``, a short all-reduce per node and across nodes (``min_busbw`` GB/s to pass)."""
    from k3launch.util import bounds

    if min_busbw is not None:
        min_busbw = bounds.BUSBW.parse("min_busbw", min_busbw)
    inv, ops = _node_ops(inventory, Feature.DOCTOR, "doctor", access)
    return ops.doctor(plan, inv, [r.name for r in store(state_dir).list()], bandwidth, min_busbw)


def weights_check(plan: Plan, inventory: InventoryArg = None, *, access: Access = Access()) -> list[NodeWeights]:
    """Per engine node: is ``plan.model`` (at its ``--revision``) complete in the node's Hugging
    Face cache, and how much disk is free there."""
    inv, ops = _node_ops(inventory, Feature.WEIGHTS, "weights check", access)
    return ops.weights_check(plan, inv)


def weights_fetch(plan: Plan, inventory: InventoryArg = None, *, from_path: str | None = None,
                  from_node: str | None = None, on_progress: Callable[[FetchProgress], None] | None = None, interval: float = 10.0,
                  access: Access = Access()) -> list[NodeWeights]:
    """Bring ``plan.model`` to every engine node that lacks it, in parallel: from the hub on each
    node (the inventory's ``hf_token_file`` as the token), or copied from ``from_path`` (a
    directory the nodes share) or ``from_node`` (over the same SSH); ``on_progress`` every ``interval`` s."""
    from k3launch.models.weights import Source
    from k3launch.util import bounds

    interval = bounds.PROGRESS_INTERVAL.parse("interval", interval)
    if from_path and from_node:
        raise K3Error("bad-source", "--from-path and --from-node both given", "pick one source (neither: the hub)")
    inv, ops = _node_ops(inventory, Feature.WEIGHTS, "weights fetch", access)
    src = (Source("path", path=from_path) if from_path else Source("node", node=from_node) if from_node
           else Source("hub", token_file=inv.hf_token_file))
    return ops.weights_fetch(plan, inv, src, on_progress, interval)


def weights_probe(plan: Plan, inventory: InventoryArg = None, *, path: str | None = None, size: int = 256 << 20,
                  timeout: float = 60.0, save: bool = False, state_dir: str | Path | None = None,
                  access: Access = Access()) -> list[Probe]:
    """Per engine node: the read throughput of the disk its weights load from (``path``, else where
    its engine looks for ``plan.model``): a fresh file of ``size`` bytes written there, kept out of
    the page cache (each :class:`~k3launch.models.weights.Probe` says how), read, removed; the write
    and the read each bounded by ``timeout`` s. A missing or unwritable directory is ``probe-path``;
    other failures are per node. ``save``: kept in the state directory for ``plan`` and ``doctor``."""
    from k3launch.models.weights import path_error, probes_json
    from k3launch.util import bounds

    size = int(bounds.PROBE_BYTES.parse("size", size))
    timeout = bounds.PROBE_TIMEOUT.parse("timeout", timeout)
    inv, ops = _node_ops(inventory, Feature.WEIGHTS, "weights probe", access)
    rows = ops.weights_probe(plan, inv, path or (inv.weights.path if inv.weights else None), size, timeout)
    err = path_error(rows)
    if err is not None:
        raise err
    if save:
        import time

        from k3launch.deploy.state import write_atomic

        target = store(state_dir).probe_path(inv.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, probes_json(inv.name, rows, time.time()))
    return rows


def saved_probe(inventory: InventoryArg = None, state_dir: str | Path | None = None) -> list[Probe]:
    """The last ``weights probe --save`` on ``inventory`` ([] when none was saved, or it is unreadable)."""
    from k3launch.models.weights import read_probes

    path = store(state_dir).probe_path(load(inventory).inventory.name)
    try:
        return read_probes(path.read_text())
    except (OSError, ValueError):
        return []


def load_prediction(plan: Plan, inventory: InventoryArg = None, state_dir: str | Path | None = None,
                    checkpoint: Checkpoint | None = None) -> LoadPrediction | None:
    """How long ``plan``'s engines take to read their weights (per process and the total), from
    the inventory's ``weights.read_gbps`` or the last saved ``weights probe``, read the way the
    plan's load format and strategy read (:mod:`k3launch.planning.loadtime`); with staging, the
    copy from that source plus the read of the copy at ``weights.stage_read_gbps``. None when no
    throughput is known for every engine node (or the plan is on placeholder nodes); a prediction
    without figures when the plan's way of reading is not modelled (``unmodelled`` says why).
    ``checkpoint``: the checkpoint's size as a node's index gave it (the doctor's); else the
    index where this machine sees the model (:func:`local_checkpoint`), else the recipe's estimate."""
    from k3launch.planning.loadtime import predict

    if plan.inventory is None:
        return None
    inv = load(inventory).inventory
    checkpoint = checkpoint or local_checkpoint(plan)
    src = inv.weights
    shared = bool(src and src.shared)
    staged = dict.fromkeys((h.name for h in plan.hosts), src.stage_read_gbps) if src is not None and src.stage_read_gbps else None
    if src is not None and src.read_gbps is not None:
        return predict(plan, dict.fromkeys((h.name for h in plan.hosts), src.read_gbps), shared=shared, shared_gbps=src.read_gbps,
                       basis=f"inventory weights.read_gbps {src.read_gbps:g} GB/s" + (" (shared)" if shared else ""), stage_gbps=staged,
                       checkpoint=checkpoint)
    probes = [p for p in saved_probe(inv, state_dir) if p.ok]
    if not probes:
        return None
    methods = sorted({p.method for p in probes})
    basis = f"weights probe --save ({', '.join(methods)})" + (": the page cache, NOT the disk" if "cached" in methods else "")
    return predict(plan, {p.node: p.read_mbps / 1e3 for p in probes}, shared=shared, basis=basis + (" (shared)" if shared else ""),
                   stage_gbps=staged, checkpoint=checkpoint)


def local_checkpoint(plan: Plan) -> Checkpoint | None:
    """The checkpoint's size from its ``model.safetensors.index.json`` where this machine sees the
    model: a model given as a directory; else a Hugging Face hub cache here, at the plan's
    revision -- the nodes' ``hf_cache`` and the engines' ``HF_HUB_CACHE`` / ``HF_HOME`` (the local
    backend's nodes are this machine; a shared home is the same disk), then this process's own
    (``HF_HUB_CACHE``, ``HF_HOME``, the default). None when no index here gives it: the recipe's
    estimate is used then."""
    import os

    from k3launch.models.weights import INDEX, index_total, measured, revision

    model = plan.model
    if model.startswith(("/", "~", ".")):
        dirs = [Path(model).expanduser()]
    else:
        envs = [*(p.env for p in plan.processes if p.role != "router"), os.environ]  # the engines' own (bare), then this process's
        hubs = [f"{h.hf_cache.rstrip('/')}/hub" for h in plan.hosts if h.hf_cache]  # what containers mount as HF_HOME
        hubs += [e.get("HF_HUB_CACHE") or f"{e.get('HF_HOME', '~/.cache/huggingface').rstrip('/')}/hub" for e in envs]
        rev = revision(plan)
        dirs = [_snapshot(Path(hub).expanduser() / ("models--" + model.replace("/", "--")), rev) for hub in dict.fromkeys(hubs) if hub]
    for d in dirs:
        try:
            total = index_total((d / INDEX).read_text(encoding="utf-8"))
        except OSError:
            continue
        if total:
            return measured(total, f"read here in {d}")
    return None


def _snapshot(repo: Path, rev: str) -> Path:
    """The snapshot directory of ``rev`` in a hub cache's model ``repo`` (a commit, or a ref such as ``main``)."""
    if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev):
        return repo / "snapshots" / rev
    try:
        return repo / "snapshots" / (repo / "refs" / rev).read_text(encoding="utf-8").strip()
    except OSError:
        return repo / "snapshots" / "?"  # no such ref here: a directory that is not there


def load_against(rec: DeploymentRecord, state_dir: str | Path | None = None) -> tuple[LoadPrediction | None, list[dict[str, object]]]:
    """A deployment's predicted weight load (None: no throughput known, or its inventory is gone)
    and, per engine process, the prediction next to vLLM's ``Loading weights took`` of each rank
    (:func:`k3launch.planning.loadtime.against`; [] when neither is known or there is no timeline)."""
    from k3launch.planning.loadtime import against

    try:  # the prediction needs the inventory (its weights section, its saved probe)
        pred = load_prediction(rec.plan, rec.inventory, state_dir) if rec.inventory else None
    except K3Error:
        pred = None
    return pred, against(rec.timeline, pred) if rec.timeline is not None else []


def fleet(rec: DeploymentRecord, access: Access = Access()) -> Fleet:
    """A :class:`~k3launch.transport.fleet.Fleet` reaching the nodes of a live deployment, for
    commands on them (``bench --client engine``); use it as a context manager (``with``) or close it."""
    from k3launch.deploy.registry import node_ops

    return node_ops(rec.backend, Feature.FLEET, "commands on the deployment's nodes", [access]).fleet(rec)


def power_sampler(rec: DeploymentRecord, access: Access = Access()) -> Sampler:
    """A sampler of the GPU power of ``rec``'s engine nodes (``start()``, then ``stop()`` returns the trace)."""
    from k3launch.deploy.registry import power_ops

    return power_ops(rec.backend, [access]).power_sampler(rec)


def submit_array(plans: Sequence[Plan], inventory: InventoryArg, *, work: Callable[[int, Plan], Sequence[str]] | None = None,
                 concurrency: int | None = None, log_dir: str | Path | None = None, name: str = "k3-array",
                 extra_sbatch: Sequence[str] = (), ready_timeout: float = 1800.0, state_dir: str | Path | None = None) -> list[ArrayJob]:
    """Slurm: one job-array task per plan (one array per shape), each bringing its deployment up
    in its own allocation, running ``work(i, plan)`` (argv; ``K3LAUNCH_ENDPOINT`` set) once it
    serves, and tearing down. Returns :class:`~k3launch.models.reports.ArrayJob` s; see :func:`wait_array`.
    Logs and per-task results go to ``log_dir`` (default ``<state dir>/slurm/arrays``)."""
    from k3launch.deploy.registry import array_ops

    inv = load(inventory).inventory
    root = Path(log_dir) if log_dir else store(state_dir).arrays_dir()
    return array_ops(inv.backend, "job arrays").submit_array(plans, inv, str(root), work, concurrency, name, extra_sbatch, ready_timeout)


def wait_array(job: ArrayJob, timeout: float = 3600.0, backend: str = "slurm") -> ArrayResult:
    """Wait for every task of an array job; its :class:`~k3launch.models.reports.ArrayResult` (per-task results)."""
    from k3launch.deploy.registry import array_ops

    return array_ops(backend, "job arrays").wait_array(job, timeout)


def active_array_tasks(job_ids: Sequence[str], backend: str = "slurm") -> set[str]:
    """``<job>_<task>`` of every task of these arrays still pending or running; ``<job>_*`` for an
    array squeue could not tell about (a busy controller): every task of it may still run, and
    running one of its groups again would run it twice."""
    from k3launch.deploy.registry import array_ops

    return array_ops(backend, "job arrays").active_tasks(job_ids)


def attached_record(plan: Plan, env: Mapping[str, str], inventory: InventoryArg) -> DeploymentRecord:
    """Inside a job array task: the record of the deployment the task's job brought up (for code
    that uses a deployment it did not start, such as ``campaign run --attached``)."""
    from k3launch.deploy.registry import array_ops

    inv = load(inventory).inventory
    return array_ops(inv.backend, "attaching to an array task's deployment").attached_record(plan, env, inv.name)
