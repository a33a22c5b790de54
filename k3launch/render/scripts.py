"""Plan → the commands that start each process, and per-node shell scripts (pure string builders).

This is the only place values meet a shell, and every value goes through :func:`shlex.quote`;
a hostile value in an inventory or recipe (spaces, ``;``, ``$(...)``, quotes) ends up as data.

How each runtime wraps the engine command (docker, podman, apptainer, bare: binds, environment,
GPU flags, names) is :mod:`k3launch.render.runtimes`'s table, which the Slurm job scripts read too.
A process that is not a container (apptainer, bare, the router) runs in the background with its
log in its run directory; with a node's ``venv``, ``<venv>/bin`` goes first on a bare engine's
``PATH`` (``env PATH=<venv>/bin:"$PATH" ...``).

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
from k3launch.models.identity import ID_ENV
from k3launch.models.plan import Host, Plan, Process
from k3launch.render.runtimes import TOKEN_TARGET, container_name, engine_argv, ssh_runtime, token_secret, wrap
from k3launch.render.words import DEFAULT_HF_CACHE, Raw, cache_dir, home_path, path_word


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


def markers(plan: Plan, proc: Process, ident: str = "") -> dict[str, str]:
    """Env markers on every process, so a bare process is found from /proc even without state:
    the deployment's name, the process id and (``ident``) the deployment id. The id comes last:
    a title written over the environment (setproctitle) clobbers it from the front, so the id
    survives whenever the name does."""
    return {"K3LAUNCH_DEPLOYMENT": plan.name, "K3LAUNCH_PROCESS": proc.id, **({ID_ENV: ident} if ident else {})}


def start_command(plan: Plan, proc: Process, host: Host, log_dir: str = "", tools: str | None = None, ident: str = "") -> list[str]:
    # Words of type Raw are pre-quoted shell words; everything else is quoted by shell_join.
    """argv that starts ``proc`` detached on ``host`` (joined with shlex by :func:`script`): its
    runtime's words (:func:`~k3launch.render.runtimes.wrap`), through ``k3launch_background`` unless
    the runtime keeps it running itself. ``tools``: a directory whose programs a bare process finds
    before the node's PATH (``up`` on this machine: the directory of k3launch's interpreter, where
    ``vllm-router`` installed with k3launch lives). ``ident``: the deployment id its markers,
    labels and run directory carry."""
    rt = ssh_runtime(proc, host)
    words = wrap(rt, plan, proc, host, engine_argv(rt, plan, proc, host), {**proc.env, **markers(plan, proc, ident)},
                 image=proc.image, ident=ident, tools=tools)
    if rt.detached:
        return words
    return ["k3launch_background", home_path(run_dir(plan, proc, host, log_dir, ident) + f"/{proc.id}.log"), *words]


def start_line(plan: Plan, proc: Process, host: Host, log_dir: str = "", tools: str | None = None, ident: str = "") -> str:
    """The shell text that starts ``proc``: :func:`start_command`, after what its runtime needs
    first (its bind sources made, podman's token secret)."""
    rt = ssh_runtime(proc, host)
    run = cache_prep(plan, proc, host) + shell_join(start_command(plan, proc, host, log_dir, tools, ident))
    made = f"mkdir -p {path_word(host.hf_cache or DEFAULT_HF_CACHE)}\n" if rt.needs_bind_source else ""
    if rt.secret != "podman-secret":
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
    return not ssh_runtime(proc, host).detached


def runs_in_apptainer(proc: Process, host: Host) -> bool:
    """Whether ``proc``'s runtime reads HF_TOKEN as ``APPTAINERENV_HF_TOKEN`` (the script exports it)."""
    return ssh_runtime(proc, host).secret == "apptainerenv"


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
