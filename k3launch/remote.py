"""Shell snippets run on nodes (pure string builders; every value shlex-quoted).

They use only POSIX tools and ``/proc`` so they work on any Linux node without Python: finding a
deployment's processes by the ``K3LAUNCH_DEPLOYMENT``/``K3LAUNCH_PROCESS`` markers in their
environment (so ``down`` works even when local state is lost), liveness, signals to whole
process groups (vLLM forks engine cores and workers), log tails, and listening ports from
``/proc/net/tcp{,6}``.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

# Prints "PID PROCESS_ID" for every live process of deployment $K3_NAME: by the environment
# marker, or — when the environment was clobbered by setproctitle (vLLM, vllm-router) — by a
# working directory inside the deployment's run directory (.../k3launch/NAME/PROCESS).
_FIND = r"""for d in /proc/[0-9]*; do
  s=$(awk '{print $3}' "$d/stat" 2>/dev/null) || continue
  [ -n "$s" ] && [ "$s" != Z ] || continue
  e=$(tr '\0' '\n' < "$d/environ" 2>/dev/null) || continue
  if printf '%s\n' "$e" | grep -qx "K3LAUNCH_DEPLOYMENT=$K3_NAME"; then
    p=$(printf '%s\n' "$e" | sed -n 's/^K3LAUNCH_PROCESS=//p' | head -n1)
  elif ! printf '%s' "$e" | grep -q '='; then
    c=$(readlink "$d/cwd" 2>/dev/null) || continue
    case "$c" in */k3launch/"$K3_NAME"/*) p=${c##*/} ;; *) continue ;; esac
  else
    continue
  fi
  echo "${d#/proc/} $p"
done"""


def find_processes(name: str) -> str:
    """Lines ``PID PROCESS_ID`` of live (non-zombie) processes of deployment ``name``."""
    return f"K3_NAME={shlex.quote(name)}\n{_FIND}"


def find_any_deployment() -> str:
    """Lines ``PID DEPLOYMENT PROCESS_ID`` of every k3launch-started process on the node."""
    return r"""for d in /proc/[0-9]*; do
  s=$(awk '{print $3}' "$d/stat" 2>/dev/null) || continue
  [ -n "$s" ] && [ "$s" != Z ] || continue
  e=$(tr '\0' '\n' < "$d/environ" 2>/dev/null) || continue
  n=$(printf '%s\n' "$e" | sed -n 's/^K3LAUNCH_DEPLOYMENT=//p' | head -n1)
  if [ -n "$n" ]; then
    p=$(printf '%s\n' "$e" | sed -n 's/^K3LAUNCH_PROCESS=//p' | head -n1)
  elif ! printf '%s' "$e" | grep -q '='; then
    c=$(readlink "$d/cwd" 2>/dev/null) || continue
    case "$c" in */k3launch/*/*) p=${c##*/}; n=${c%/*}; n=${n##*/} ;; *) continue ;; esac
  else
    continue
  fi
  echo "${d#/proc/} $n $p"
done"""


def alive(pids: Iterable[str]) -> str:
    """Prints ``PID up|down`` for each pid (zombies count as down: they have exited)."""
    ids = " ".join(shlex.quote(p) for p in pids)
    return f"""for p in {ids}; do
  s=$(awk '{{print $3}}' /proc/$p/stat 2>/dev/null || true)
  if [ -n "$s" ] && [ "$s" != Z ]; then echo "$p up"; else echo "$p down"; fi
done"""


def containers_alive(runtime: str, names: Iterable[str]) -> str:
    rt = shlex.quote(runtime)
    ids = " ".join(shlex.quote(n) for n in names)
    return f"""for c in {ids}; do
  s=$({rt} inspect -f '{{{{.State.Running}}}}' "$c" 2>/dev/null || echo false)
  if [ "$s" = true ]; then echo "$c up"; else echo "$c down"; fi
done"""


def signal_groups(pids: Iterable[str], sig: str) -> str:
    """Signal each pid's process group (started with setsid: the pid leads its group)."""
    ids = " ".join(shlex.quote(p) for p in pids)
    return f"for p in {ids}; do kill -{shlex.quote(sig)} -- -$p 2>/dev/null || kill -{shlex.quote(sig)} $p 2>/dev/null || true; done; true"


def stop_containers(runtime: str, names: Iterable[str], grace_s: int) -> str:
    rt = shlex.quote(runtime)
    ids = " ".join(shlex.quote(n) for n in names)
    return f"for c in {ids}; do {rt} stop -t {int(grace_s)} \"$c\" >/dev/null 2>&1 || true; {rt} rm -f \"$c\" >/dev/null 2>&1 || true; done; true"


def labelled_containers(runtime: str, name: str) -> str:
    return f"{shlex.quote(runtime)} ps -a --filter label=k3launch.deployment={shlex.quote(name)} --format '{{{{.Names}}}}' 2>/dev/null || true"


def log_tail(path: str, lines: int = 30) -> str:
    return f"tail -n {int(lines)} {shlex.quote(path)} 2>/dev/null || echo '(no log file)'"


def container_log_tail(runtime: str, name: str, lines: int = 30) -> str:
    return f"{shlex.quote(runtime)} logs --tail {int(lines)} {shlex.quote(name)} 2>&1 || true"


LISTENING = r"""for f in /proc/net/tcp /proc/net/tcp6; do
  [ -r "$f" ] && awk 'NR>1 && $4=="0A" {print $2}' "$f"
done"""


def parse_listening(output: str) -> set[tuple[str, int]]:
    """``/proc/net/tcp`` local addresses (hex) of LISTEN sockets → {(ip, port)}; IPv6 kept as hex."""
    out: set[tuple[str, int]] = set()
    for line in output.split():
        if ":" not in line:
            continue
        addr, port_hex = line.rsplit(":", 1)
        try:
            port = int(port_hex, 16)
        except ValueError:
            continue
        if len(addr) == 8:
            b = bytes.fromhex(addr)[::-1]
            out.add((".".join(str(x) for x in b), port))
        else:
            out.add(("0.0.0.0" if set(addr) == {"0"} else addr.lower(), port))
    return out


def port_busy(listening: set[tuple[str, int]], address: str, port: int) -> bool:
    """A planned (address, port) is busy if something listens on it or on the wildcard."""
    return any(p == port and a in (address, "0.0.0.0") for a, p in listening)


def shm_files() -> str:
    return "ls -1 /dev/shm 2>/dev/null | grep -E '^(psm_|vllm|nccl-)' || true"
