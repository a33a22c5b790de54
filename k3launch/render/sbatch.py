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
stopped) and the script names the process and node. A supervised job (``up --supervise``) starts
no step itself: after the doctor and prepare steps it becomes the deployment's controller,
``python -m k3launch.deploy.slurm.injob`` (the interpreter recorded at submission), which starts
every step with the words :func:`step_words` renders here — the same ones ``k3_step`` gets in an
unsupervised script — and keeps them serving with the one controller's decisions (docs/slurm.md,
"The job supervises itself"). Its settings (:class:`JobControl`: the plan, the Slurm section, the
restart policy, the deployment id) travel inside the script, as one JSON line.

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
import sys
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict

from k3launch.errors import K3Error
from k3launch.models.identity import JOB_COMMENT
from k3launch.models.plan import Plan, Process
from k3launch.models.supervise import RestartPolicy
from k3launch.planning.inventory import SlurmSection
from k3launch.planning.porttable import process_ports
from k3launch.render.runtimes import Runtime, engine_argv, slurm_runtime, wrap
from k3launch.render.scripts import cache_meta_json, markers, shell_join, token_snippet
from k3launch.render.words import DEFAULT_HF_CACHE, Raw, cache_dir, home_path

LIBRARY = "k3launch-job.sh"
CONTROL_END = "K3_CONTROL_JSON"  # the here-document that carries a supervised job's JobControl
DOCTOR_FAILED_EXIT = 3  # the job's exit code when its doctor step refused a node


@functools.cache
def job_library() -> str:
    """The bash library every job script carries (bundled as ``k3launch/_slurm``; ``slurm/`` in a checkout)."""
    from k3launch.util.resources import bundled

    path = bundled("slurm", LIBRARY)
    if path is None:
        raise K3Error("missing-slurm-template", f"the job library {LIBRARY} is missing from the installation", "reinstall k3launch")
    return path.read_text()


class JobControl(BaseModel):
    """What a supervised job's controller (:mod:`k3launch.deploy.slurm.injob`) is given: the plan it
    starts and keeps serving (plan node *i* is the job's ``$K3_ADDR_i``), how its steps are run, its
    restart policy and the deployment id its steps' markers carry."""

    model_config = ConfigDict(extra="forbid")

    plan: Plan
    slurm: SlurmSection
    policy: RestartPolicy
    ident: str = ""


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


def _runtime(proc: Process, slurm: SlurmSection, image: str | None) -> Runtime:
    """Slurm's container mode, not the host's runtime, decides how the engine runs (runtimes.slurm_runtime)."""
    return slurm_runtime(proc, slurm.container, image)


def _step(plan: Plan, proc: Process, slurm: SlurmSection, addrs: dict[str, int], image: str | None, ident: str = "") -> list[str]:
    """srun options and command of one process (after ``k3_step NAME I``): its runtime's words
    (:func:`~k3launch.render.runtimes.wrap`), plan node addresses bound to the allocation. Its
    compile/JIT caches (models.caches) are the node's ``<compile_cache>/<key>``, which
    :func:`_prepare_lines` makes first: a bare engine's variables point there, a container gets it
    mounted at ``CONTAINER_CACHE``."""
    host = next(h for h in plan.hosts if h.name == proc.node)
    rt = _runtime(proc, slurm, image)
    words = wrap(rt, plan, proc, host, engine_argv(rt, plan, proc, host), {**proc.env, **markers(plan, proc, ident)}, image=image)
    pat = address_pattern(addrs)
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
        if _runtime(proc, slurm, image).needs_bind_source:
            seen.setdefault((i, host.hf_cache or DEFAULT_HF_CACHE), "")
        cache = cache_dir(plan, proc, host)
        if cache is not None:
            seen[(i, cache)] = cache_meta_json(plan, proc, host)
    lines = [shell_join(["k3_dir", str(i), _bind(home_path(d), addrs, pat), meta]) for (i, d), meta in seen.items()]
    return [*lines, "k3_prepare"] if lines else []


def _doctor_program(plan: Plan, slurm: SlurmSection, image: str | None) -> str:
    """What the doctor step finds on every node: the runtime's program ("" for pyxis, an srun
    plugin: nothing to find on the node's PATH), else the engine's own."""
    engines = [p for p in plan.processes if p.role != "router"]
    rt = _runtime(engines[0], slurm, image)
    if rt.program is not None:
        return rt.program
    host = next(h for h in plan.hosts if h.name == engines[0].node)
    program = engine_argv(rt, plan, engines[0], host)[0]
    return home_path(f"{host.venv.rstrip('/')}/bin/{program}") if host.venv and "/" not in program else program


def lean(plan: Plan) -> Plan:
    """``plan`` without what only explains it (each flag's provenance, planning's notices): what a job carries."""
    return plan.model_copy(update={"processes": [p.model_copy(update={"provenance": {}}) for p in plan.processes], "notices": []})


def step_words(plan: Plan, proc: Process, slurm: SlurmSection, ident: str = "") -> tuple[int, list[str]]:
    """Plan node index and shell words (srun options, then the command) of ``proc``'s step: what
    follows ``k3_step NAME`` in a job script, which a supervised job's controller expands the same way."""
    order = node_order(plan)
    index = {n: i for i, n in enumerate(order)}
    addrs = {h.address: index[h.name] for h in plan.hosts if h.name in index}
    image = next((p.image for p in plan.processes if p.image), None)
    return index.get(proc.node, 0), _step(plan, proc, slurm, addrs, image, ident)


def deployment_body(plan: Plan, slurm: SlurmSection, log_dir: str, *, doctor: bool = True, work: Sequence[str] = (),
                    hf_token_file: str | None = None, supervise: RestartPolicy | None = None, ident: str = "",
                    python: str | None = None) -> list[str]:
    """The calls of the job library that start ``plan`` in the current allocation; ``ident``: the
    deployment id. With ``supervise``, the script hands over to the controller instead
    (``k3_control``, run by ``python``, by default this interpreter), which starts the steps."""
    order = node_order(plan)
    index = {n: i for i, n in enumerate(order)}
    addrs = {h.address: index[h.name] for h in plan.hosts if h.name in index}
    lines = [f"K3_LOGDIR={shlex.quote(log_dir)}", f"K3_NODES={len(order)}", 'mkdir -p "$K3_LOGDIR"']
    image = next((p.image for p in plan.processes if p.image), None)
    apptainer = any(_runtime(p, slurm, image).secret == "apptainerenv" for p in plan.processes)
    lines += [ln for ln in token_snippet(hf_token_file, apptainer=apptainer).splitlines() if ln]
    lines.append("k3_bind")
    if doctor:
        specs = []
        for n in order:
            ports = sorted({q for p in plan.processes if p.node == n for q, _ in process_ports(p)})
            specs.append(f"{index[n]}:{','.join(map(str, ports))}")
        lines.append(shell_join(["k3_doctor", str(gpus_requested(plan)), _doctor_program(plan, slurm, image), *specs]))
    lines += _prepare_lines(plan, slurm, index, addrs, image)
    if supervise is not None:
        control = JobControl(plan=lean(plan), slurm=slurm, policy=supervise, ident=ident).model_dump_json(exclude_defaults=True)
        lines += [f"# supervised: the controller starts {len(plan.processes)} step(s) and keeps them serving (policy: the inventory's restart:)",
                  f"k3_control {shlex.quote(python or sys.executable)} <<'{CONTROL_END}'", control, CONTROL_END]
        return lines
    engines = [p for p in plan.processes if p.role != "router"]
    routers = [p for p in plan.processes if p.role == "router"]
    for proc in (*engines, *routers):
        node_i = index.get(proc.node, 0)
        lines.append(f"# {proc.id}: {proc.role}{' (head)' if proc.head else ''} on plan node {node_i} ({proc.node})")
        lines.append(shell_join(["k3_step", proc.id, str(node_i), *_step(plan, proc, slurm, addrs, image, ident)]))
    if work:
        lines.append(shell_join(["k3_work", *work]))
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
                       ident: str = "", python: str | None = None) -> str:
    """The job script of one deployment: it serves until cancelled, a step ends (with ``supervise``: until
    its restart policy gives up), or the time limit. ``ident``: the deployment id every step's
    markers carry (:mod:`k3launch.models.identity`)."""
    # Copies run in this one job (docs/planning.md, "Copies of an engine"): the header says how many share it.
    copies = f" x {plan.replicas} copies" if plan.replicas > 1 else ""
    head = ["#!/bin/bash", f"# Generated by k3launch: deployment {plan.name} ({plan.recipe}, {plan.strategy}{copies} on {plan.nodes} x {plan.hardware}).",
            f"# By hand: mkdir -p {shlex.quote(log_dir)} && sbatch THIS_FILE (slurmd opens --output before the script runs)."]
    head += directives(plan, slurm, f"{log_dir}/slurm-%j.out", extra_sbatch, [*plan.exclude, *exclude], ident=ident)
    body = deployment_body(plan, slurm, log_dir, doctor=doctor, hf_token_file=hf_token_file, supervise=supervise, ident=ident,
                           python=python)
    return "\n".join([*head, job_library().rstrip("\n"), "", *body, ""])


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
