"""How each runtime runs an engine: one table, read by the SSH launch scripts (:mod:`.scripts`)
and the Slurm job scripts (:mod:`.sbatch`) alike.

A process runs in one of five runtimes. Over SSH the node's ``runtime`` decides (``docker``,
``podman``, ``apptainer``, ``bare``); in a Slurm job the inventory's ``slurm.container`` does
(``pyxis``, ``apptainer``, ``bare``). The router always runs ``bare``. :data:`RUNTIMES` says, per
runtime, how the engine command is wrapped -- the words that start it, the GPU devices per
platform, how a directory is bound in and how the environment gets there, how ``HF_TOKEN``
travels, the container's name and labels -- and how the process is stopped; :func:`wrap` turns
one entry into the words of one command, so the two renderers cannot drift apart.

* ``docker``: ``docker run -d`` with a name and labels, ``--gpus all`` (CUDA) or the kfd/dri
  devices (ROCm), the host's IPC and network namespaces, ``--shm-size``, binds ``-v``, variables
  ``-e``, ``HF_TOKEN`` by name, the plan's argv through ``--entrypoint``; stopped as a container.
* ``podman``: the same with CDI devices, no ``--shm-size``, ``HF_TOKEN`` as a podman secret.
* ``apptainer``: ``apptainer exec --nv|--rocm --cleanenv``, binds ``--bind``, variables ``--env``,
  ``HF_TOKEN`` as ``APPTAINERENV_HF_TOKEN``, then ``docker://IMAGE`` and the argv; its session is signalled.
* ``pyxis`` (Slurm only): srun's ``--container-image=``, every bind in one ``--container-mounts=``,
  the variables set by ``env`` inside and named in ``--container-env=``; GPUs are Slurm's.
* ``bare``: ``env`` with the node's venv first on ``PATH``, the variables and the argv; its
  session is signalled.

A process with CPUs of its own (the plan's ``cpus``: :mod:`k3launch.planning.cpusets`) is held
to them as a whole: ``taskset -c`` starts a bare or apptainer command (the mask is inherited by
everything it starts), docker and podman get ``--cpuset-cpus``; pyxis keeps Slurm's own binding.

A directory bound into a container is the node's HF cache at :data:`~.words.CONTAINER_HF_CACHE`
and the process's compile cache at :data:`~k3launch.models.caches.CONTAINER_CACHE` (whose
variables then point inside); only docker makes a missing bind source itself, so the others get
theirs made first (:attr:`Runtime.needs_bind_source`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from k3launch.models import caches
from k3launch.models.identity import ID_LABEL, OWNER_LABEL, owner_of
from k3launch.models.plan import Host, Plan, Process
from k3launch.render.words import CONTAINER_HF_CACHE, DEFAULT_HF_CACHE, Raw, cache_dir, cache_env, mount_word, venv_path

SECRET_ENV = ("HF_TOKEN",)
LABEL = "k3launch.deployment"
TOKEN_TARGET = "hf_token"  # podman: /run/secrets/hf_token
ROCM_DEVICES = ("--device", "/dev/kfd", "--device", "/dev/dri", "--group-add", "video", "--security-opt", "seccomp=unconfined")

# How HF_TOKEN reaches the engine, never as a value on a command line:
#   by-name        ``-e HF_TOKEN``: the value stays in the environment of whoever starts it
#   podman-secret  podman stores every -e value (inspect prints it): a root-only secret file instead
#   apptainerenv   --cleanenv passes only APPTAINERENV_*: the script exports APPTAINERENV_HF_TOKEN
#   env-names      pyxis: named in --container-env=, the value from the step's environment
#   inherited      a bare process inherits its starter's environment
Secret = Literal["by-name", "podman-secret", "apptainerenv", "env-names", "inherited"]
# Where the command and image go after the runtime's options:
#   entrypoint  ``--entrypoint ARGV0 IMAGE ARGV1...`` (the engine command line is exactly the plan's)
#   image       ``IMAGE ARGV...``
#   env         ``env [PATH=...] NAME=VALUE... ARGV...`` (the image, if any, came first)
Entry = Literal["entrypoint", "image", "env"]


@dataclass(frozen=True)
class Runtime:
    """How one runtime wraps an engine command (see the module's table)."""

    name: str
    run: tuple[str, ...] = ()  # the words that start it
    image: str = ""  # the image word, "{image}" replaced
    image_first: bool = False  # the image word before any option (pyxis: an srun option)
    named: bool = False  # ``--name k3-<deployment>-<process>`` and k3launch's labels (the deployment found without state)
    gpus: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # platform -> device words; absent: none needed
    gpus_always: bool = False  # also for the simulated engine and GPU-less processes (apptainer's only expose what the host has)
    isolate: tuple[str, ...] = ()  # namespaces shared with the host, or the host environment kept out
    shm_size: bool = False  # ``--shm-size`` (podman refuses it with the host IPC namespace, where it means nothing)
    bind: str = ""  # the option before one SRC:DST; ending in "=": every mount in one word after it; "": nothing bound
    setenv: str = ""  # the option before NAME=VALUE; "": NAME=VALUE words of ``env`` before the engine
    env_names: str = ""  # the option before the comma-separated names the runtime passes in (pyxis)
    cpuset: tuple[str, ...] = ()  # what holds the whole process to its CPUs ("{cpus}": the plan's list); none: the runtime's own binding
    cpuset_first: bool = False  # those words start the command (taskset), else they are an option of the runtime
    secret: Secret = "inherited"
    entry: Entry = "env"
    venv: bool = False  # the node's venv (and ``up``'s tools) first on the engine's PATH
    makes_bind_source: bool = False  # a missing bind source is made (docker), not refused
    detached: bool = False  # the runtime keeps it running itself (``run -d``); otherwise k3launch's background helper or a step
    # over SSH, container: ``stop``/``rm`` by name; group: its session is signalled (in a Slurm job every process is a step, ended with it)
    stop: Literal["container", "group", "step"] = "group"
    program: str | None = None  # what a node must have to run it; None: the engine's own program; "": nothing (an srun plugin)

    @property
    def needs_bind_source(self) -> bool:
        """Its bind sources must exist before it starts (podman, apptainer and pyxis refuse a missing one)."""
        return bool(self.bind) and not self.makes_bind_source


TASKSET = ("taskset", "-c", "{cpus}")  # util-linux; the mask is inherited by everything the process starts
_CONTAINER = Runtime("", named=True, isolate=("--ipc=host", "--network", "host"), bind="-v", setenv="-e", entry="entrypoint",
                     image="{image}", detached=True, stop="container", cpuset=("--cpuset-cpus", "{cpus}"))
RUNTIMES: dict[str, Runtime] = {
    "docker": replace(_CONTAINER, name="docker", run=("docker", "run", "-d"), gpus={"cuda": ("--gpus", "all"), "rocm": ROCM_DEVICES},
                      shm_size=True, secret="by-name", makes_bind_source=True, program="docker"),
    "podman": replace(_CONTAINER, name="podman", run=("podman", "run", "-d"),
                      gpus={"cuda": ("--device", "nvidia.com/gpu=all"), "rocm": ROCM_DEVICES}, secret="podman-secret", program="podman"),
    "apptainer": Runtime("apptainer", run=("apptainer", "exec"), gpus={"cuda": ("--nv",), "rocm": ("--rocm",)}, gpus_always=True,
                         isolate=("--cleanenv",), bind="--bind", setenv="--env", secret="apptainerenv", entry="image",
                         image="docker://{image}", program="apptainer", cpuset=TASKSET, cpuset_first=True),
    "pyxis": Runtime("pyxis", image="--container-image={image}", image_first=True, bind="--container-mounts=",
                     env_names="--container-env=", secret="env-names", stop="step", program=""),
    "bare": Runtime("bare", venv=True, cpuset=TASKSET, cpuset_first=True),
}


def ssh_runtime(proc: Process, host: Host) -> Runtime:
    """The runtime of ``proc`` started over SSH: its node's; the router's is bare."""
    return RUNTIMES["bare" if proc.role == "router" else host.runtime]


def slurm_runtime(proc: Process, container: str, image: str | None) -> Runtime:
    """The runtime of ``proc``'s step in a Slurm job: the inventory's ``slurm.container``, not the
    node's runtime; bare for the router and when the plan has no image."""
    return RUNTIMES["bare" if proc.role == "router" or not image else container]


def engine_argv(rt: Runtime, plan: Plan, proc: Process, host: Host) -> list[str]:
    """The program to exec for ``proc`` in ``rt`` (``vllm serve ...``): the simulated engine is
    ``python -m k3launch.sim`` with the node's interpreter where no image brings its own ``vllm``."""
    if plan.engine == "sim" and proc.argv[:2] == ["vllm", "serve"] and not rt.image:
        return [host.python or "python3", "-m", "k3launch.sim", *proc.argv[1:]]
    return list(proc.argv)


def container_name(plan: Plan, proc: Process) -> str:
    return f"k3-{plan.name}-{proc.id}"


def token_secret(container: str) -> str:
    """The podman secret holding a container's HF_TOKEN."""
    return f"{container}-hf-token"


def _names(rt: Runtime, plan: Plan, proc: Process, ident: str) -> list[str]:
    words = ["--name", container_name(plan, proc), "--label", f"{LABEL}={plan.name}", "--label", f"k3launch.process={proc.id}",
             "--label", f"k3launch.role={proc.role}"]
    if ident:  # whose it is (models.identity): `down` without state finds only its own
        words += ["--label", f"{ID_LABEL}={ident}", "--label", f"{OWNER_LABEL}={owner_of(ident)}"]
    return words


def gpu_words(rt: Runtime, plan: Plan, proc: Process) -> list[str]:
    """The device words ``proc`` needs in ``rt`` on the plan's platform (none on CPU)."""
    if not rt.gpus_always and not (proc.gpus and plan.engine != "sim"):  # the simulated engine needs (and has) no GPUs
        return []
    return list(rt.gpus.get(plan.platform, ()))


def wrap(rt: Runtime, plan: Plan, proc: Process, host: Host, argv: Sequence[str], env: Mapping[str, str], *,
         image: str | None, ident: str = "", tools: str | None = None) -> list[str]:
    """The words that run ``argv`` as ``proc`` in ``rt`` on ``host``, with ``env`` set and the
    node's HF and compile caches in reach (Raw words are quoted already). ``ident``: the deployment
    id a named container's labels carry; ``tools``: a directory a bare process finds programs in
    before the node's PATH."""
    img = rt.image.format(image=image or "")
    pin = [w.format(cpus=proc.cpus) for w in rt.cpuset] if proc.cpus else []
    words = [*(pin if rt.cpuset_first else []), *rt.run, *([img] if rt.image_first else [])]
    if rt.named:
        words += _names(rt, plan, proc, ident)
    words += [*gpu_words(rt, plan, proc), *rt.isolate, *([] if rt.cpuset_first else pin)]
    if rt.shm_size:
        words += ["--shm-size", host.shm_size or "64g"]
    cache = cache_dir(plan, proc, host)
    inner = [*(cache_env(cache) if cache is not None else []), *(f"{k}={v}" for k, v in env.items())]
    if rt.bind:  # the caches are seen where they are mounted; kept on the node, the next start of their key compiles nothing again
        mounts = [(host.hf_cache or DEFAULT_HF_CACHE, CONTAINER_HF_CACHE), *([(cache, caches.CONTAINER_CACHE)] if cache is not None else [])]
        words += [mount_word(mounts, rt.bind)] if rt.bind.endswith("=") else [w for m in mounts for w in (rt.bind, mount_word([m]))]
        inner = [*(cache_env(caches.CONTAINER_CACHE) if cache is not None else []), *(f"{k}={v}" for k, v in env.items())]
    if rt.setenv:
        words += [w for e in inner for w in (rt.setenv, e)]
        inner = []
    if rt.env_names:
        words.append(rt.env_names + ",".join([*env, *SECRET_ENV]))
    if rt.secret == "by-name":
        words += [w for k in SECRET_ENV for w in (rt.setenv, k)]
    elif rt.secret == "podman-secret":
        words.append(Raw('"${K3_SECRET[@]}"'))  # set by the start line: the token as a secret file (scripts.start_line)
    if rt.entry == "entrypoint":
        return [*words, "--entrypoint", argv[0], img, *argv[1:]]
    if rt.entry == "image":
        return [*words, img, *argv]
    path = venv_path(host.venv if rt.venv and proc.role != "router" else None, tools if rt.venv else None)
    return [*words, "env", *path, *inner, *argv]
