"""Plan → the commands that start each process, and per-node shell scripts (pure string builders).

This is the only place values meet a shell, and every value goes through :func:`shlex.quote`;
a hostile value in an inventory or recipe (spaces, ``;``, ``$(...)``, quotes) ends up as data.

Runtimes:

* ``docker``: ``docker run -d`` with ``--gpus all`` (CUDA) or ``/dev/kfd`` + ``/dev/dri`` +
  ``video`` group (ROCm), ``--ipc=host --network host --shm-size``, the HF cache mounted at
  ``/root/.cache/huggingface``, ``--entrypoint`` + the plan's argv so the engine command line is
  exactly the plan's, and labels ``k3launch.deployment/process/role`` (and ``k3launch.id``,
  ``k3launch.owner``: whose it is, :mod:`k3launch.models.identity`) so a deployment's
  containers are found even without local state.
* ``podman``: the same, with CDI (``--device nvidia.com/gpu=all``) for CUDA GPUs, minus
  ``--shm-size`` (podman refuses it with ``--ipc=host``, where it means nothing), the HF cache
  directory created first (podman refuses a missing bind source), and ``HF_TOKEN`` as a secret.
* ``apptainer``: ``apptainer exec --nv|--rocm`` of ``docker://IMAGE``, started in the background,
  the HF cache directory created first (as for podman).
* ``bare``: the engine on the host (an installed vLLM, or the simulated engine); with a node's
  ``venv``, ``<venv>/bin`` goes first on the engine's ``PATH`` (``env PATH=<venv>/bin:"$PATH" ...``).

On platform ``cpu`` (vLLM's CPU build) containers get no GPU devices and apptainer neither
``--nv`` nor ``--rocm``.

Secrets never appear: ``HF_TOKEN`` is passed by name (``-e HF_TOKEN``; ``APPTAINERENV_HF_TOKEN``, in apptainer scripts only),
its value comes from the environment of whoever runs the script, or from ``hf_token_file`` read
at run time. podman stores (and ``podman inspect`` prints) every ``-e`` value, even a by-name one,
so there the token becomes a root-only podman secret mounted at ``/run/secrets/hf_token`` and
named by ``HF_TOKEN_PATH`` (where huggingface_hub reads it); ``down`` removes the secret.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from k3launch.models import caches
from k3launch.models.identity import ID_ENV, ID_LABEL, OWNER_LABEL, owner_of
from k3launch.models.plan import Host, Plan, Process, is_container

CONTAINER_HF_CACHE = "/root/.cache/huggingface"
DEFAULT_HF_CACHE = "~/.cache/huggingface"  # the node's, when the inventory names none
TOKEN_TARGET = "hf_token"  # podman: /run/secrets/hf_token
LABEL = "k3launch.deployment"
SECRET_ENV = ("HF_TOKEN",)


class Raw(str):
    """A word already quoted for the shell (only built here, from quoted pieces)."""


def home_path(path: str) -> str:
    """``~/x`` → ``"$HOME"/'x'`` so the home directory expands while the rest stays data."""
    if path == "~" or path.startswith("~/"):
        return Raw('"$HOME"' + (("/" + shlex.quote(path[2:])) if path[2:] else ""))
    return path


def path_word(path: str) -> str:
    """A path on the node as one shell word: ``~/...`` expands there, the rest stays data."""
    word = home_path(path)
    return word if isinstance(word, Raw) else shlex.quote(word)


def mount_word(pairs: Sequence[tuple[str, str]], prefix: str = "") -> str:
    """``prefix`` + ``SRC:DST[,SRC:DST...]`` as one word (docker's ``-v``, apptainer's ``--bind``, pyxis's
    ``--container-mounts=``): a source ``~/...`` expands on the node, the rest stays data."""
    words = [home_path(src) for src, _ in pairs]
    if not any(isinstance(w, Raw) for w in words):
        return prefix + ",".join(f"{src}:{dst}" for src, dst in pairs)
    out = [(w if isinstance(w, Raw) else shlex.quote(w)) + shlex.quote(":" + dst) for w, (_, dst) in zip(words, pairs, strict=True)]
    return Raw((shlex.quote(prefix) if prefix else "") + shlex.quote(",").join(out))


def _mount(src: str, dst: str) -> str:
    return mount_word([(src, dst)])


def cache_dir(plan: Plan, proc: Process, host: Host) -> str | None:
    """The node directory of ``proc``'s compile/JIT caches (``<root>/<key>``), None when it has
    none: the router, caches off on the node, the simulated engine by default (models.caches)."""
    root = caches.cache_root(host, plan.engine) if proc.role != "router" else None
    return None if root is None else f"{root}/{caches.cache_key(plan, proc, host)}"


def cache_env(where: str) -> list[str]:
    """``NAME=<where>/<sub>`` for every cache (``where`` may be ``~/...``: it expands on the node)."""
    out: list[str] = []
    for name, sub in caches.CACHE_ENV.items():
        word = home_path(f"{where}/{sub}")
        out.append(Raw(f"{name}=" + word) if isinstance(word, Raw) else f"{name}={word}")
    return out


def cache_mount(plan: Plan, proc: Process, host: Host, bind: str, setenv: str) -> list[str]:
    """A container's words for ``proc``'s compile caches: ``bind SRC:DST`` (the node's directory at
    :data:`~k3launch.models.caches.CONTAINER_CACHE`), then ``setenv NAME=...`` per cache; none without."""
    cache = cache_dir(plan, proc, host)
    if cache is None:
        return []
    return [bind, _mount(cache, caches.CONTAINER_CACHE), *(w for e in cache_env(caches.CONTAINER_CACHE) for w in (setenv, e))]


def cache_meta_json(plan: Plan, proc: Process, host: Host) -> str:
    """What ``proc``'s key stands for, the one line of its ``k3launch.json``."""
    import json

    return json.dumps(caches.cache_meta(plan, proc, host), sort_keys=True)


def cache_prep(plan: Plan, proc: Process, host: Host) -> str:
    """Shell text before ``proc`` starts: its cache directory made (a bind source must exist) and
    what its key stands for written beside (``k3launch cache ls``); "" without caches."""
    d = cache_dir(plan, proc, host)
    if d is None:
        return ""
    word = path_word(d)
    meta = shlex.quote(cache_meta_json(plan, proc, host))
    return f"mkdir -p {word} && printf '%s\\n' {meta} > {word}/{caches.META}\n"


def cache_list(root: str, clear: Sequence[str] = (), clear_all: bool = False) -> str:
    """Shell text for one node: remove ``clear``'s keys (or every key), then list what is left as
    ``@@KEY<TAB>KB<TAB>MTIME`` lines, each followed by its k3launch.json (one line). ``root`` may
    be ``~/...``."""
    r = home_path(root)
    r = r if isinstance(r, Raw) else shlex.quote(r)
    parts = [f"root={r}"]
    if clear_all:
        parts.append('[ -d "$root" ] && find "$root" -mindepth 1 -maxdepth 1 -type d -exec rm -rf -- {} +')
    for key in clear:
        parts.append(f'rm -rf -- "$root"/{shlex.quote(key)}')
    parts.append('[ -d "$root" ] || exit 0')
    parts.append('for d in "$root"/*/; do [ -d "$d" ] || continue; d=${d%/}; m="$d/' + caches.META + '"; '
                 't=$(stat -c %Y "$m" 2>/dev/null || stat -c %Y "$d"); '
                 'printf "@@%s\\t%s\\t%s\\n" "${d##*/}" "$(du -sk "$d" | cut -f1)" "$t"; '
                 'if [ -r "$m" ]; then tr -d "\\n" < "$m"; fi; echo; done')
    return "\n".join(parts) + "\n"


def run_dir(plan: Plan, proc: Process, host: Host, log_dir: str = "", ident: str = "") -> str:
    """The process's working directory and log home: ``<workdir>/k3launch/<deployment>.<id>/<process>``
    (``ident``: the deployment id, :mod:`k3launch.models.identity`; without one, as before ids,
    ``<workdir>/k3launch/<deployment>/<process>``).

    Per deployment identity, not per name: two state directories' deployments of one name on a
    node never share a directory (one's logs, pid and exit files are not the other's). Being the
    cwd matters: tools like setproctitle (vLLM and vllm-router use it) clobber
    ``/proc/PID/environ``, so a process whose environment markers vanished is still recognised
    -- name and id -- by its working directory.
    """
    root = (log_dir or host.workdir or "/tmp").rstrip("/")
    return f"{root}/k3launch/{plan.name}{'.' + ident if ident else ''}/{proc.id}"


def container_name(plan: Plan, proc: Process) -> str:
    return f"k3-{plan.name}-{proc.id}"


def token_secret(container: str) -> str:
    """The podman secret holding a container's HF_TOKEN."""
    return f"{container}-hf-token"


def markers(plan: Plan, proc: Process, ident: str = "") -> dict[str, str]:
    """Env markers on every process, so a bare process is found from /proc even without state:
    the deployment's name, the process id and (``ident``) the deployment id. The id comes last:
    a title written over the environment (setproctitle) clobbers it from the front, so the id
    survives whenever the name does."""
    return {"K3LAUNCH_DEPLOYMENT": plan.name, "K3LAUNCH_PROCESS": proc.id, **({ID_ENV: ident} if ident else {})}


def engine_argv(plan: Plan, proc: Process, host: Host) -> list[str]:
    """The program to exec for ``proc`` (``vllm serve ...``, or the simulated engine)."""
    if plan.engine == "sim" and proc.argv[:2] == ["vllm", "serve"]:
        if host.runtime == "bare":
            return [host.python or "python3", "-m", "k3launch.sim", *proc.argv[1:]]
        return list(proc.argv)  # the image's `vllm` is the simulated engine
    return list(proc.argv)


def _gpu_flags(runtime: str, platform: str) -> list[str]:
    if platform == "cpu":
        return []
    if platform == "rocm":
        return ["--device", "/dev/kfd", "--device", "/dev/dri", "--group-add", "video", "--security-opt", "seccomp=unconfined"]
    return ["--device", "nvidia.com/gpu=all"] if runtime == "podman" else ["--gpus", "all"]


def apptainer_gpu(platform: str) -> list[str]:
    """apptainer's GPU option: ``--nv`` (CUDA), ``--rocm``, none on CPU."""
    return {"rocm": ["--rocm"], "cpu": []}.get(platform, ["--nv"])


def venv_path(venv: str | None, tools: str | None = None) -> list[str]:
    """``PATH=<venv>/bin:<tools>:"$PATH"`` as one shell word (for ``env``), or nothing without
    either: ``tools`` is a directory of programs to find before the node's own PATH."""
    words = []
    for d in ([venv.rstrip("/") + "/bin"] if venv else []) + ([tools] if tools else []):
        w = home_path(d)  # ~/... expands to the home directory where it runs
        words.append(w if isinstance(w, Raw) else shlex.quote(w))
    return [Raw("PATH=" + ":".join(words) + ':"$PATH"')] if words else []


def start_command(plan: Plan, proc: Process, host: Host, log_dir: str = "", tools: str | None = None, ident: str = "") -> list[str]:
    # Words of type Raw are pre-quoted shell words; everything else is quoted by shell_join.
    """argv that starts ``proc`` detached on ``host`` (joined with shlex by :func:`script`).
    ``tools``: a directory whose programs a bare process finds before the node's PATH (``up`` on
    this machine: the directory of k3launch's interpreter, where ``vllm-router`` installed with
    k3launch lives). ``ident``: the deployment id its markers, labels and run directory carry."""
    env = {**proc.env, **markers(plan, proc, ident)}
    argv = engine_argv(plan, proc, host)
    runtime = host.runtime if proc.role != "router" else "bare"
    if is_container(runtime):
        cmd = [runtime, "run", "-d", "--name", container_name(plan, proc),
               "--label", f"{LABEL}={plan.name}", "--label", f"k3launch.process={proc.id}", "--label", f"k3launch.role={proc.role}"]
        if ident:
            cmd += ["--label", f"{ID_LABEL}={ident}", "--label", f"{OWNER_LABEL}={owner_of(ident)}"]
        if proc.gpus and plan.engine != "sim":  # the simulated engine needs (and has) no GPUs
            cmd += _gpu_flags(runtime, plan.platform)
        cmd += ["--ipc=host", "--network", "host"]
        if runtime == "docker":  # podman refuses --shm-size with the host IPC namespace
            cmd += ["--shm-size", host.shm_size or "64g"]
        cmd += ["-v", _mount(host.hf_cache or DEFAULT_HF_CACHE, CONTAINER_HF_CACHE)]
        cmd += cache_mount(plan, proc, host, "-v", "-e")  # kept on the node: the next start of this key compiles nothing again
        for k, v in env.items():
            cmd += ["-e", f"{k}={v}"]
        if runtime == "podman":
            cmd.append(Raw('"${K3_SECRET[@]}"'))  # set by start_line: the token as a secret file
        else:
            for k in SECRET_ENV:
                cmd += ["-e", k]  # by name: the value stays in the caller's environment
        return [*cmd, "--entrypoint", argv[0], proc.image or "", *argv[1:]]
    log = home_path(run_dir(plan, proc, host, log_dir, ident) + f"/{proc.id}.log")
    if runtime == "apptainer":
        inner = ["apptainer", "exec", *apptainer_gpu(plan.platform), "--cleanenv", "--bind", _mount(host.hf_cache or DEFAULT_HF_CACHE, CONTAINER_HF_CACHE)]
        inner += cache_mount(plan, proc, host, "--bind", "--env")
        for k, v in env.items():
            inner += ["--env", f"{k}={v}"]
        inner += [f"docker://{proc.image}", *argv]
    else:
        path = venv_path(host.venv if proc.role != "router" else None, tools)
        cache = cache_dir(plan, proc, host)
        inner = ["env", *path, *(cache_env(cache) if cache is not None else []), *(f"{k}={v}" for k, v in env.items()), *argv]
    return ["k3launch_background", log, *inner]


def start_line(plan: Plan, proc: Process, host: Host, log_dir: str = "", tools: str | None = None, ident: str = "") -> str:
    """The shell text that starts ``proc``: :func:`start_command`, after what podman needs first."""
    run = cache_prep(plan, proc, host) + shell_join(start_command(plan, proc, host, log_dir, tools, ident))
    if proc.role == "router" or host.runtime not in ("podman", "apptainer"):
        return run
    made = f"mkdir -p {path_word(host.hf_cache or DEFAULT_HF_CACHE)}\n"  # both refuse a missing bind source (docker makes it)
    if host.runtime == "apptainer":
        return made + run
    sec = shlex.quote(token_secret(container_name(plan, proc)))
    return (f"{made}podman secret rm {sec} >/dev/null 2>&1 || true\nK3_SECRET=()\n"
            f'if [ -n "${{HF_TOKEN:-}}" ]; then printf %s "$HF_TOKEN" | podman secret create {sec} - >/dev/null && '
            f"K3_SECRET=(--secret {sec},type=mount,target={TOKEN_TARGET} -e HF_TOKEN_PATH=/run/secrets/{TOKEN_TARGET}); fi\n"
            f"{run}")


# Starts a process detached, in its run directory, with exit bookkeeping (used by `up` and by
# the rendered scripts alike, so a manual run and `up` start identically): the engine still leads its own
# session (signals reach its whole tree) with the recorded pid, but its parent is a small waiter
# that writes "CODE TIME" to .k3launch-exit when it ends (bash's $EPOCHREALTIME: µs, no fork
# between the exit and the clock) -- log mtimes are too coarse to tell which of several ranks
# that died within a millisecond of each other died first. The pid comes back
# through a file: nothing of the background part may write to the caller's stdout.
BACKGROUND_HELPER = (
    "k3launch_background() { local log=$1 dir; shift; dir=$(dirname \"$log\"); mkdir -p \"$dir\"; "
    "rm -f \"$dir/.k3launch-pid\" \"$dir/.k3launch-exit\"; "
    "(cd \"$dir\" || exit 1; trap '' HUP; nohup setsid \"$@\" >\"$log\" 2>&1 </dev/null & echo $! >.k3launch-pid; "
    "wait $!; echo \"$? ${EPOCHREALTIME:-$(date +%s.%N)}\" >.k3launch-exit) </dev/null >/dev/null 2>&1 & "
    "local i=0; while [ ! -s \"$dir/.k3launch-pid\" ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i + 1)); done; "
    "echo \"started pid $(cat \"$dir/.k3launch-pid\" 2>/dev/null)\"; }\n"
)


_PRELUDE = """#!/usr/bin/env bash
# Generated by k3launch from plan {name} ({recipe}, {strategy} on {hardware}). Runnable by hand.
set -euo pipefail
"""

_HELPER_NOTE = """
# Processes without a container run detached, with their output (and exit code, in
# .k3launch-exit) in their run directory.
"""

_TOKEN = """# HF_TOKEN is passed by name; read it from a file when it is not in the environment.
if [ -z "${{HF_TOKEN:-}}" ]; then
  if [ -r {file} ]; then HF_TOKEN=$(cat {file}); export HF_TOKEN; else echo "k3launch: hf_token_file "{file}" is not readable here; no HF_TOKEN" >&2; fi
fi
"""
# apptainer's --cleanenv passes only APPTAINERENV_* variables into the container
_APPTAINER_TOKEN = 'export APPTAINERENV_HF_TOKEN="${HF_TOKEN:-}"\n'


def token_snippet(hf_token_file: str | None, apptainer: bool = False) -> str:
    """Where HF_TOKEN comes from when the script runs: the inventory's ``hf_token_file`` when the
    environment has none, and for apptainer the runtime's own variable (only what the runtime
    reads belongs in a script)."""
    out = ""
    if hf_token_file:
        word = home_path(hf_token_file)  # ~/... is the user's home where the script runs
        out = _TOKEN.format(file=word if isinstance(word, Raw) else shlex.quote(word))
    return out + (_APPTAINER_TOKEN if apptainer else "")


def runs_in_background(proc: Process, host: Host) -> bool:
    """Whether ``proc`` starts through ``k3launch_background`` (all but docker/podman containers)."""
    return proc.role == "router" or not is_container(host.runtime)


def runs_in_apptainer(proc: Process, host: Host) -> bool:
    return proc.role != "router" and host.runtime == "apptainer"


def script(plan: Plan, node: str, hf_token_file: str | None = None, log_dir: str = "", ident: str = "") -> str:
    """The launch script of every process of ``plan`` on ``node``: the background helper and the
    token lines only when a process of the node uses them. ``ident``: the deployment id its
    processes carry (``render``: one of the state directory it was rendered from)."""
    host = next(h for h in plan.hosts if h.name == node)
    procs = [p for p in plan.processes if p.node == node]
    head = _PRELUDE.format(name=plan.name, recipe=plan.recipe, strategy=plan.strategy, hardware=plan.hardware)
    head += token_snippet(hf_token_file, apptainer=any(runs_in_apptainer(p, host) for p in procs))
    if any(runs_in_background(p, host) for p in procs):
        head += _HELPER_NOTE + BACKGROUND_HELPER
    if plan.stage is not None and any(p.role != "router" for p in procs):  # paths are one line each (the inventory model)
        head += (f"\n# The engines read the staged copy of the weights in {shlex.quote(plan.stage.dir)}: `k3launch up` fills it first.\n"
                 f"# Run by hand, copy it there first: k3launch weights fetch --from-path {shlex.quote(plan.stage.source)} (with this plan's options)\n")
    out = [head]
    for proc in procs:
        out.append(f"# {proc.id}: {proc.role}{' (head)' if proc.head else ''} on {node} ({host.address})")
        out.append(start_line(plan, proc, host, log_dir, ident=ident))
        out.append("")
    return "\n".join(out)


def shell_join(argv: Sequence[str]) -> str:
    """One flag per line with continuation backslashes; every word quoted."""
    parts: list[str] = []
    for tok in argv:
        q = tok if isinstance(tok, Raw) else shlex.quote(tok)
        if tok.startswith("-") or not parts:
            parts.append(q)
        else:
            parts[-1] += " " + q
    return " \\\n  ".join(parts)


def script_names(plan: Plan) -> dict[str, str]:
    """node name → script file name."""
    return {h.name: f"{h.name}.sh" for h in plan.hosts}
