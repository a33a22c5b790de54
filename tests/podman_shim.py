"""``python tests/podman_shim.py ARGS`` = ``k3launch ARGS`` with the podman fixes k3launch still lacks.

These are the changes proposed for k3launch (render/launch/remote/doctor), applied in-process so
tests/test_podman.py can prove them on real podman before k3launch adopts them. Each patch checks
whether k3launch already behaves, and applies only if not; once k3launch is fixed this module is
a plain pass-through (and ``test_k3launch_needs_no_podman_shim`` starts passing). Applied
patches are listed on stderr (``podman-shim: ...``). ``K3LAUNCH_PODMAN_SHIM=0`` disables all.

1. ``--shm-size`` with ``--ipc=host``: podman 4.3 refuses the pair ("cannot set shmsize when
   running in the {host } IPC Namespace"); with the host IPC namespace it means nothing anyway.
2. ``-e HF_TOKEN`` stores the value in the container config: ``podman inspect`` prints it (so do
   ``--secret ...,type=env`` secrets once the container runs). Instead: a root-only podman
   secret per container, mounted at /run/secrets/hf_token and named by
   ``HF_TOKEN_PATH`` (huggingface_hub reads the token from there); created from ``$HF_TOKEN``
   just before ``podman run`` (only if set), removed by ``down`` (and if ``run`` fails).
3. The HF cache directory must exist: podman refuses a missing bind source (``statfs ...: no such
   file or directory``), docker would create it. ``mkdir -p`` it first.
4. doctor's leftover check: podman's ``ps`` has no ``.Label`` template method (the command
   errors, ``|| true`` hides it, leftovers are never seen) and without ``-a`` a stopped
   leftover (whose name blocks ``run --name``) is missed: ``ps -a`` + ``{{index .Labels ...}}``.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

from k3launch import doctor, launch, remote, render
from k3launch.render import Raw

SECRET_TARGET = "hf_token"
APPLIED: list[str] = []


def secret_name(container: str) -> str:
    return f"{container}-hf-token"


def _needs_shm_fix(cmd: list[str]) -> bool:
    return cmd[:1] == ["podman"] and "--ipc=host" in cmd and "--shm-size" in cmd


def _hf_token_pair(cmd: list[str]) -> int | None:
    return next((i for i in range(len(cmd) - 1) if cmd[:1] == ["podman"] and cmd[i] == "-e" and cmd[i + 1] == "HF_TOKEN"), None)


def install() -> None:
    orig_start = render.start_command
    orig_line = launch._start_line
    orig_stop = remote.stop_containers
    orig_probe = doctor._probe_script

    def start_command(plan: Any, proc: Any, host: Any, log_dir: str = "") -> list[str]:
        cmd = list(orig_start(plan, proc, host, log_dir))
        if _needs_shm_fix(cmd):
            i = cmd.index("--shm-size")
            del cmd[i : i + 2]
            _note("no --shm-size with --ipc=host")
        i = _hf_token_pair(cmd)
        if i is not None:
            cmd[i : i + 2] = [Raw('"${K3_SECRET[@]}"')]  # set by the snippet _start_line puts first
            _note("HF_TOKEN as a podman secret file (HF_TOKEN_PATH)")
        return cmd

    def _start_line(plan: Any, proc: Any, fleet: Any, hf_token_file: str | None, log_dir: str) -> str:
        line = orig_line(plan, proc, fleet, hf_token_file, log_dir)
        host = fleet.host(proc.node)
        if proc.role == "router" or host.runtime != "podman":
            return line
        run = render.shell_join(start_command(plan, proc, host, log_dir))
        assert line.endswith(run), "launch._start_line changed shape; update the shim"
        cache = render.home_path(host.hf_cache or "~/.cache/huggingface")
        pre = f"mkdir -p {cache if isinstance(cache, Raw) else shlex.quote(cache)}\n"
        _note("mkdir -p the HF cache")
        post = ""
        if "${K3_SECRET[@]}" in run:
            sec = shlex.quote(secret_name(render.container_name(plan, proc)))
            pre += (f"podman secret rm {sec} >/dev/null 2>&1 || true\nK3_SECRET=()\n"
                    f'if [ -n "${{HF_TOKEN:-}}" ]; then printf %s "$HF_TOKEN" | podman secret create {sec} - >/dev/null && '
                    f"K3_SECRET=(--secret {sec},type=mount,target={SECRET_TARGET} -e HF_TOKEN_PATH=/run/secrets/{SECRET_TARGET}); fi\n")
            post = f" || {{ rc=$?; podman secret rm {sec} >/dev/null 2>&1; exit $rc; }}"
        return line[: -len(run)] + pre + run + post

    def stop_containers(runtime: str, names: Any, grace_s: int) -> str:
        names = list(names)
        out = orig_stop(runtime, names, grace_s)
        if runtime == "podman":  # `down` runs in its own process: remove whatever secret may exist
            out += "; " + "; ".join(f"podman secret rm {shlex.quote(secret_name(n))} >/dev/null 2>&1 || true" for n in names) + "; true"
        return out

    def _probe_script(plan: Any, host: Any, router_only: bool) -> str:
        s = orig_probe(plan, host, router_only)
        bad = """podman ps --filter label=k3launch.deployment --format '{{.Label "k3launch.deployment"}}'"""
        if host.runtime == "podman" and bad in s:
            s = s.replace(bad, """podman ps -a --filter label=k3launch.deployment --format '{{index .Labels "k3launch.deployment"}}'""")
            _note("doctor: podman ps -a, {{index .Labels}}")
        return s

    render.start_command = start_command
    launch.start_command = start_command
    launch._start_line = _start_line
    remote.stop_containers = stop_containers
    doctor._probe_script = _probe_script


def _note(what: str) -> None:
    if what not in APPLIED:
        APPLIED.append(what)
        print(f"podman-shim: {what}", file=sys.stderr)


def main() -> None:
    if os.environ.get("K3LAUNCH_PODMAN_SHIM", "1") != "0":
        install()
    from k3launch.cli import main as k3main

    sys.argv[0] = "k3launch"
    k3main()


if __name__ == "__main__":
    main()
