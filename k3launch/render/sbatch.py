"""Plan → one sbatch script (a pure string builder, golden-tested like submitit's ``_make_sbatch_string``).

The script is ``#SBATCH`` directives, the job library ``slurm/k3launch-job.sh`` (copied verbatim:
binding, doctor, steps, fail-fast supervision) and the deployment's own calls of it.

One job per deployment: P/D pools are one allocation split in plan order (prefill nodes first,
then decode) — one allocation starts all pools at once and ends them together, which a
heterogeneous job would not make simpler. Inside the job the plan's nodes are bound to the
allocated hosts with Slurm's own hostlist expansion (``scontrol show hostnames``): plan node *i*
is the *i*-th allocated host, and every occurrence of a plan node's address in an argv, env value
or URL becomes ``$K3_ADDR_i`` (the host's ``NodeAddr``). The router, when the plan has one, runs
inside the allocation on plan node 0. Each process is one ``srun`` step on its node —
pyxis/enroot (``--container-image``), apptainer (``exec --nv``/``--rocm``) or bare — with its
output in its own log. A doctor step first checks every node (GPUs visible, engine found,
planned ports free), then a prepare step makes on every node the directories its steps need before
they start (each engine's compile cache, ``k3launch.json`` included; a container's hf_cache). The job fails fast: the first step to exit ends the job (the others are
stopped) and the script names the process and node. A supervised job (``up --supervise``) watches
its steps instead (``slurm/k3launch-watch.sh``, appended to the library): a step that exits restarts
its recovery unit inside the allocation under the restart policy, and a crash loop ends the job
(docs/slurm.md, "The job supervises itself").

Job arrays (:func:`make_array_string`): one task per deployment, all of one shape (node count and
GPUs per node: Slurm gives every task of an array the same request); each task starts its
deployment, runs its work command on the batch host, and ends when the work ends.

``HF_TOKEN`` never travels through sbatch's environment (Slurm stores a job's environment in its
state files): a job reads it from the inventory's ``hf_token_file`` when it runs.
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Iterable, Sequence

from k3launch.errors import K3Error
from k3launch.models import caches
from k3launch.models.identity import JOB_COMMENT
from k3launch.models.plan import Plan, Process
from k3launch.models.supervise import RestartPolicy, units
from k3launch.planning.inventory import SlurmSection
from k3launch.planning.porttable import process_ports
from k3launch.render.scripts import (
    CONTAINER_HF_CACHE,
    DEFAULT_HF_CACHE,
    Raw,
    apptainer_gpu,
    cache_dir,
    cache_env,
    cache_meta_json,
    cache_mount,
    engine_argv,
    home_path,
    markers,
    mount_word,
    shell_join,
    token_snippet,
    venv_path,
)

SECRET_ENV = ("HF_TOKEN",)
LIBRARY = "k3launch-job.sh"
WATCH_LIBRARY = "k3launch-watch.sh"  # appended for a supervised job
DOCTOR_FAILED_EXIT = 3  # the job's exit code when its doctor step refused a node


@functools.cache
def job_library(supervised: bool = False) -> str:
    """The bash library every job script carries (bundled as ``k3launch/_slurm``; ``slurm/`` in a checkout),
    with the watch library after it when the job supervises itself."""
    from k3launch.util.resources import bundled

    text = ""
    for name in (LIBRARY, WATCH_LIBRARY) if supervised else (LIBRARY,):
        path = bundled("slurm", name)
        if path is None:
            raise K3Error("missing-slurm-template", f"the job library {name} is missing from the installation", "reinstall k3launch")
        text += path.read_text()
    return text


def node_order(plan: Plan) -> list[str]:
    """Plan nodes that need an allocated host, in plan order (index = position in the allocation)."""
    return list(dict.fromkeys(h.name for h in plan.hosts if h.role != "router" or h.gpus))


def address_pattern(addresses: Iterable[str]) -> re.Pattern[str]:
    """Any of ``addresses`` inside a word, the longest first (``node-1`` never matches in ``node-10``)."""
    return re.compile("|".join(re.escape(a) for a in sorted({a for a in addresses if a}, key=len, reverse=True)) or r"(?!)")


def _bind(word: str, addrs: dict[str, int], pat: re.Pattern[str]) -> str:
    """Replace plan node addresses inside ``word`` by ``$K3_ADDR_i`` (the rest stays quoted)."""
    out, pos = "", 0
    for m in pat.finditer(word):
        if m.start() > pos:
            out += shlex.quote(word[pos:m.start()])
        out += f'"$K3_ADDR_{addrs[m.group(0)]}"'
        pos = m.end()
    if not out:
        return word
    return Raw(out + (shlex.quote(word[pos:]) if pos < len(word) else ""))


def _bare(proc: Process, slurm: SlurmSection, image: str | None) -> bool:
    """Slurm's container mode, not the host's runtime, decides whether the engine runs bare."""
    return proc.role == "router" or slurm.container == "bare" or not image


def _step(plan: Plan, proc: Process, slurm: SlurmSection, addrs: dict[str, int], image: str | None, ident: str = "") -> list[str]:
    """srun options and command of one process (after ``k3_step NAME I``). Its compile/JIT caches
    (models.caches) are the node's ``<compile_cache>/<key>``, which :func:`_prepare_lines` makes first:
    a bare engine's variables point there, a container gets it mounted at ``CONTAINER_CACHE``."""
    pat = address_pattern(addrs)
    host = next(h for h in plan.hosts if h.name == proc.node)
    env = {**proc.env, **markers(plan, proc, ident)}
    bare = _bare(proc, slurm, image)
    argv = engine_argv(plan, proc, host.model_copy(update={"runtime": "bare"}) if bare else host)
    hf = host.hf_cache or DEFAULT_HF_CACHE  # "$HOME"/... expands on the node
    cache = cache_dir(plan, proc, host)
    if bare:
        path = venv_path(host.venv) if proc.role != "router" else []
        words = ["env", *path, *(cache_env(cache) if cache is not None else []), *(f"{k}={v}" for k, v in env.items()), *argv]
    elif slurm.container == "pyxis":  # the mounts are made before the command runs: the variables are set by it
        mounts = [(hf, CONTAINER_HF_CACHE), *([(cache, caches.CONTAINER_CACHE)] if cache is not None else [])]
        words = [f"--container-image={image}", mount_word(mounts, "--container-mounts="), "--container-env=" + ",".join([*env, *SECRET_ENV]),
                 "env", *(cache_env(caches.CONTAINER_CACHE) if cache is not None else []), *(f"{k}={v}" for k, v in env.items()), *argv]
    else:  # apptainer: --cleanenv so the job's environment does not leak into the engine
        words = ["apptainer", "exec", *apptainer_gpu(plan.platform), "--cleanenv", "--bind", mount_word([(hf, CONTAINER_HF_CACHE)])]
        words += cache_mount(plan, proc, host, "--bind", "--env")
        words += [w for k, v in env.items() for w in ("--env", f"{k}={v}")] + [f"docker://{image}", *argv]
    return [_bind(w, addrs, pat) for w in words]


def _prepare_lines(plan: Plan, slurm: SlurmSection, index: dict[str, int], addrs: dict[str, int], image: str | None) -> list[str]:
    """``k3_dir I DIR META`` per directory a step needs on its node before it starts, then ``k3_prepare``
    (one step on every node makes them): each engine's compile-cache directory, with what its key
    stands for (``META``, its ``k3launch.json``, as ``up`` writes it over SSH), and a container's
    hf_cache (no ``META``). pyxis mounts before the step's command runs, and pyxis and apptainer
    refuse a missing bind source. Nothing when no step needs a directory."""
    pat = address_pattern(addrs)
    seen: dict[tuple[int, str], str] = {}
    for proc in plan.processes:
        if proc.role == "router":
            continue
        host = next(h for h in plan.hosts if h.name == proc.node)
        i = index.get(proc.node, 0)
        if not _bare(proc, slurm, image):
            seen.setdefault((i, host.hf_cache or DEFAULT_HF_CACHE), "")
        cache = cache_dir(plan, proc, host)
        if cache is not None:
            seen[(i, cache)] = cache_meta_json(plan, proc, host)
    lines = [shell_join(["k3_dir", str(i), _bind(home_path(d), addrs, pat), meta]) for (i, d), meta in seen.items()]
    return [*lines, "k3_prepare"] if lines else []


def _doctor_program(plan: Plan, slurm: SlurmSection, image: str | None) -> str:
    if slurm.container == "apptainer" and image:
        return "apptainer"
    if slurm.container == "pyxis" and image:
        return ""  # pyxis is an srun plugin: nothing to find on the node's PATH
    engines = [p for p in plan.processes if p.role != "router"]
    host = next(h for h in plan.hosts if h.name == engines[0].node)
    program = engine_argv(plan, engines[0], host.model_copy(update={"runtime": "bare"}))[0]
    return home_path(f"{host.venv.rstrip('/')}/bin/{program}") if host.venv and "/" not in program else program


def _ms(seconds: float) -> str:
    return str(round(seconds * 1000))


def policy_lines(plan: Plan, policy: RestartPolicy) -> list[str]:
    """The watch library's settings: the deployment's name and the restart policy, times in milliseconds
    (``start_timeout`` None: 1800 s; ``up`` fills in the plan's ready timeout)."""
    p = policy
    return ["# supervised: a step that ends restarts its unit inside the allocation (policy: the inventory's restart:)",
            f"K3_DEPLOYMENT={shlex.quote(plan.name)}",
            f"K3_RS_POLICY={p.policy} K3_RS_MAX={p.max_restarts} K3_RS_WINDOW_MS={_ms(p.window)} K3_RS_BACKOFF_MS={_ms(p.backoff)}"
            f" K3_RS_BACKOFF_MAX_MS={_ms(p.backoff_max)}",
            f"K3_RS_START_TIMEOUT_MS={_ms(p.start_timeout or 1800)} K3_RS_POLL_MS={_ms(p.poll)}"]


def unit_lines(plan: Plan, addrs: dict[str, int]) -> list[str]:
    """One ``k3_unit NAME ROLE PROCESS[=HEALTH_URL]...`` per recovery unit (:func:`k3launch.models.supervise.units`)."""
    pat = address_pattern(addrs)
    procs = {p.id: p for p in plan.processes}
    out = []
    for u in units(plan):
        # a router's /health is 503 while any worker is down (a restarting engine): its own life is /liveness
        words = [f"{pid}=http://{procs[pid].address}:{procs[pid].http_port}{'/liveness' if procs[pid].role == 'router' else '/health'}"
                 if pid in u.http else pid for pid in u.processes]
        out.append(shell_join(["k3_unit", u.name, u.role, *(_bind(w, addrs, pat) for w in words)]))
    return out


def deployment_body(plan: Plan, slurm: SlurmSection, log_dir: str, *, doctor: bool = True, work: Sequence[str] = (),
                    hf_token_file: str | None = None, supervise: RestartPolicy | None = None, ident: str = "") -> list[str]:
    """The calls of the job library that start ``plan`` in the current allocation (and, with
    ``supervise``, keep it serving: the watch library's calls); ``ident``: the deployment id."""
    order = node_order(plan)
    index = {n: i for i, n in enumerate(order)}
    addrs = {h.address: index[h.name] for h in plan.hosts if h.name in index}
    lines = [f"K3_LOGDIR={shlex.quote(log_dir)}", f"K3_NODES={len(order)}", 'mkdir -p "$K3_LOGDIR"']
    image = next((p.image for p in plan.processes if p.image), None)
    lines += [ln for ln in token_snippet(hf_token_file, apptainer=slurm.container == "apptainer" and image is not None).splitlines() if ln]
    lines.append("k3_bind")
    if doctor:
        specs = []
        for n in order:
            ports = sorted({q for p in plan.processes if p.node == n for q, _ in process_ports(p)})
            specs.append(f"{index[n]}:{','.join(map(str, ports))}")
        lines.append(shell_join(["k3_doctor", str(gpus_requested(plan)), _doctor_program(plan, slurm, image), *specs]))
    lines += _prepare_lines(plan, slurm, index, addrs, image)
    if supervise is not None:
        lines += policy_lines(plan, supervise)
    engines = [p for p in plan.processes if p.role != "router"]
    routers = [p for p in plan.processes if p.role == "router"]
    for proc in (*engines, *routers):
        node_i = index.get(proc.node, 0)
        lines.append(f"# {proc.id}: {proc.role}{' (head)' if proc.head else ''} on plan node {node_i} ({proc.node})")
        start = "k3_step" if supervise is None else "k3_start"
        lines.append(shell_join([start, proc.id, str(node_i), *_step(plan, proc, slurm, addrs, image, ident)]))
    if work:
        lines.append(shell_join(["k3_work", *work]))
    if supervise is not None:
        lines += [*unit_lines(plan, addrs), "k3_watch"]
    else:
        lines.append("k3_supervise")
    return lines


def gpus_requested(plan: Plan) -> int:
    """GPUs per node the job asks Slurm for: none on a CPU profile (its ranks are not GPUs)."""
    return 0 if plan.platform == "cpu" else plan.gpus_per_node


def _check_lines(*values: str) -> None:
    for v in values:
        if "\n" in v or "\r" in v:
            raise K3Error("bad-sbatch-value", f"{v!r} spans lines; each value ends up on one #SBATCH line", "remove the line break")


def directives(plan: Plan, slurm: SlurmSection, output: str, extra_sbatch: Sequence[str] = (), exclude: Sequence[str] = (),
               job_name: str | None = None, ident: str = "") -> list[str]:
    _check_lines(*extra_sbatch, *exclude, output)
    gpus = gpus_requested(plan)
    # --no-requeue: a requeued job would start over on other nodes behind the login node's back
    # (its binding, endpoint and record would all be stale); k3launch resubmits itself instead.
    d = [f"--job-name={job_name or 'k3-' + plan.name}", f"--nodes={len(node_order(plan))}", "--ntasks-per-node=1",
         f"--output={output}", f"--time={slurm.time_limit}"]
    if ident:  # whose job it is: `down` without a record cancels only its own state directory's (models.identity)
        d.append(f"--comment={JOB_COMMENT}{ident}")
    if gpus:
        d.append(f"--gres=gpu:{gpus}" if slurm.gres == "gres" else f"--gpus-per-node={gpus}")
    d.append("--no-requeue")
    for key in ("partition", "account", "qos", "reservation", "constraint"):
        val = getattr(slurm, key)
        if val:
            d.append(f"--{key}={val}")
    if slurm.exclusive:
        d.append("--exclusive")
    excl = list(dict.fromkeys(x for x in ([slurm.exclude] if slurm.exclude else []) + list(exclude) if x))
    if excl:
        d.append("--exclude=" + ",".join(excl))
    return [f"#SBATCH {x}" for x in (*d, *slurm.extra_sbatch, *extra_sbatch)]


def make_sbatch_string(plan: Plan, slurm: SlurmSection, log_dir: str, extra_sbatch: Sequence[str] = (), exclude: Sequence[str] = (),
                       *, doctor: bool = True, hf_token_file: str | None = None, supervise: RestartPolicy | None = None,
                       ident: str = "") -> str:
    """The job script of one deployment: it serves until cancelled, a step ends (with ``supervise``: until
    its restart policy gives up), or the time limit. ``ident``: the deployment id every step's
    markers carry (:mod:`k3launch.models.identity`)."""
    # Copies run in this one job (docs/planning.md, "Copies of an engine"): the header says how many share it.
    copies = f" x {plan.replicas} copies" if plan.replicas > 1 else ""
    head = ["#!/bin/bash", f"# Generated by k3launch: deployment {plan.name} ({plan.recipe}, {plan.strategy}{copies} on {plan.nodes} x {plan.hardware}).",
            f"# By hand: mkdir -p {shlex.quote(log_dir)} && sbatch THIS_FILE (slurmd opens --output before the script runs)."]
    head += directives(plan, slurm, f"{log_dir}/slurm-%j.out", extra_sbatch, [*plan.exclude, *exclude], ident=ident)
    body = deployment_body(plan, slurm, log_dir, doctor=doctor, hf_token_file=hf_token_file, supervise=supervise, ident=ident)
    return "\n".join([*head, job_library(supervise is not None).rstrip("\n"), "", *body, ""])


def make_array_string(tasks: Sequence[tuple[Plan, Sequence[str]]], slurm: SlurmSection, log_dir: str, *, concurrency: int | None = None,
                      name: str = "k3-array", extra_sbatch: Sequence[str] = (), exclude: Sequence[str] = (), doctor: bool = True,
                      hf_token_file: str | None = None) -> str:
    """One array task per (plan, work argv); task *i*'s logs in ``LOG_DIR/task-i``."""
    if not tasks:
        raise K3Error("empty-array", "a job array needs at least one task", "add deployments")
    shapes = {(len(node_order(p)), p.gpus_per_node) for p, _ in tasks}
    if len(shapes) > 1:
        raise K3Error("mixed-array", f"array tasks need one shape (nodes x GPUs per node); got {sorted(shapes)}",
                      "submit one array per shape (k3launch.deploy.slurm.launch.submit_arrays groups them)")
    first = tasks[0][0]
    limit = f"%{concurrency}" if concurrency else ""
    head = ["#!/bin/bash", f"# Generated by k3launch: job array {name}, {len(tasks)} task(s), one deployment each."]
    excl = [x for p, _ in tasks for x in p.exclude]  # every task runs anywhere in the array's allocation pool
    head += directives(first, slurm, f"{log_dir}/slurm-%A_%a.out", [f"--array=0-{len(tasks) - 1}{limit}", *extra_sbatch],
                       [*excl, *exclude], job_name=name)
    out = [*head, job_library().rstrip("\n"), ""]
    for i, (plan, work) in enumerate(tasks):
        out.append(f"k3_task_{i}() {{  # {plan.name}: {plan.strategy} on {plan.nodes} x {plan.hardware}")
        # not indented: a quoted word may span lines, and indenting would change it
        out += deployment_body(plan, slurm, f"{log_dir}/task-{i}", doctor=doctor, work=work, hf_token_file=hf_token_file)
        out += ["}", ""]
    out.append('case "${SLURM_ARRAY_TASK_ID:-}" in')
    out += [f"  {i}) k3_task_{i} ;;" for i in range(len(tasks))]
    out += ['  *) k3_say "no task ${SLURM_ARRAY_TASK_ID:-} in this array" >&2; exit 2 ;;', "esac", ""]
    return "\n".join(out)
