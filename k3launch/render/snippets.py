"""Shell snippets run on nodes (pure string builders; every value shlex-quoted).

They use only POSIX tools and ``/proc`` so they work on any Linux node without Python: finding a
deployment's processes by the ``K3LAUNCH_DEPLOYMENT``/``K3LAUNCH_PROCESS`` markers in their
environment (so ``down`` works even when local state is lost), liveness, signals to whole
process groups (vLLM forks engine cores and workers), log tails, and listening ports from
``/proc/net/tcp{,6}``.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping

from k3launch.models.identity import ANY, Owned
from k3launch.render.runtimes import RUNTIMES, token_secret

# Finding a deployment's processes on a node. Lines "PID DEPLOYMENT ID PROCESS_ID" (ID: the
# K3LAUNCH_ID marker, "-" for a process started before ids existed), by the environment markers,
# or -- when setproctitle (vLLM, vllm-router) clobbered the environment -- by a working
# directory inside a run directory (.../k3launch/DEPLOYMENT.ID/PROCESS, or .../DEPLOYMENT/PROCESS
# before ids). K3_NAME keeps one name's; K3_ID, a case pattern, one deployment's or one state
# directory's (models.identity); empty, either keeps everything.
#
# Only processes in the scanning shell's network namespace count: that is the node. Every
# process k3launch starts shares it (bare processes, `--network host` containers), while test
# hosts that share one kernel (tests/infra: one netns per host) or unrelated containers do not
# -- without this, a node would report (and signal) another node's processes.
#
# Fast path (GNU grep/find): one grep over every environ and one find over every cwd, instead
# of several forks per process (0.3 s per scan on an idle machine, seconds on a busy one).
# Without them (busybox), the portable per-process loop.
_SCAN = r"""k3_scan() {
  if printf 'x\0' | grep -qz x 2>/dev/null && find / -maxdepth 0 -printf '' 2>/dev/null; then
    grep -a -s -z -H -e '^K3LAUNCH_DEPLOYMENT=' -e '^K3LAUNCH_PROCESS=' -e '^K3LAUNCH_ID=' /proc/[0-9]*/environ | tr '\0' '\n' | awk '
      { i = index($0, ":"); split(substr($0, 1, i - 1), a, "/"); kv = substr($0, i + 1); j = index(kv, "=")
        k = substr(kv, 1, j - 1); v = substr(kv, j + 1)
        if (k == "K3LAUNCH_DEPLOYMENT") d[a[3]] = v; else if (k == "K3LAUNCH_ID") { if (!(a[3] in q)) q[a[3]] = v } else if (!(a[3] in p)) p[a[3]] = v }
      END { for (x in d) print x, d[x], (q[x] == "" ? "-" : q[x]), p[x] }'
    find /proc/[0-9]*/cwd -maxdepth 0 -lname '*/k3launch/*/*' -printf '%h %l\n' 2>/dev/null | while read -r d c; do
      e=$(tr -d '\0' 2>/dev/null < "$d/environ") || continue
      case "$e" in *=*) continue ;; esac
      n=${c%/*}; n=${n##*/}
      case "$n" in *.*) i=${n#*.}; n=${n%%.*} ;; *) i=- ;; esac
      echo "${d#/proc/} $n $i ${c##*/}"
    done
  else
    for d in /proc/[0-9]*; do
      e=$(tr '\0' '\n' 2>/dev/null < "$d/environ") || continue
      n=$(printf '%s\n' "$e" | sed -n 's/^K3LAUNCH_DEPLOYMENT=//p' | head -n1)
      if [ -n "$n" ]; then
        p=$(printf '%s\n' "$e" | sed -n 's/^K3LAUNCH_PROCESS=//p' | head -n1)
        i=$(printf '%s\n' "$e" | sed -n 's/^K3LAUNCH_ID=//p' | head -n1)
      elif ! printf '%s' "$e" | grep -q '='; then
        c=$(readlink "$d/cwd" 2>/dev/null) || continue
        case "$c" in */k3launch/*/*) p=${c##*/}; n=${c%/*}; n=${n##*/} ;; *) continue ;; esac
        case "$n" in *.*) i=${n#*.}; n=${n%%.*} ;; *) i= ;; esac
      else
        continue
      fi
      echo "${d#/proc/} $n ${i:--} $p"
    done
  fi | while read -r pid n i p; do
    [ -z "$K3_NAME" ] || [ "$n" = "$K3_NAME" ] || continue
    [ -z "$K3_ID" ] || case "$i" in $K3_ID) ;; *) continue ;; esac
    s=; { read -r s < "/proc/$pid/stat"; } 2>/dev/null || continue
    s=${s##*) }; s=${s%% *}
    [ "$s" != Z ] && [ "$s" != X ] || continue
    [ -z "$K3_NETNS" ] || [ "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" = "$K3_NETNS" ] || continue
    echo "$pid $n $i $p"
  done
}
K3_NETNS=$(readlink /proc/self/ns/net 2>/dev/null || true)
"""


def _scan(name: str, owned: Owned = ANY) -> str:
    return f"K3_NAME={shlex.quote(name)}\nK3_ID={shlex.quote(owned.glob())}\n{_SCAN}"


def find_processes(name: str, owned: Owned = ANY) -> str:
    """Lines ``PID PROCESS_ID`` of live (non-zombie) processes of deployment ``name`` on this node
    (only those ``owned`` says are the deployment's)."""
    return _scan(name, owned) + "k3_scan | while read -r pid n i p; do echo \"$pid $p\"; done"


def find_any_deployment() -> str:
    """Lines ``PID DEPLOYMENT PROCESS_ID`` of every k3launch-started process on the node."""
    return _scan("") + "k3_scan | while read -r pid n i p; do echo \"$pid $n $p\"; done"


def find_and_signal(name: str, ids: Iterable[str] | None, sig: str | None, skip: Iterable[str] = (),
                    sessions: Mapping[str, str] | None = None, owned: Owned = ANY) -> str:
    """One round trip of teardown: print ``PID PROCESS_ID`` of every live process of deployment
    ``name`` (only those ``owned`` says are the deployment's) whose process id is in ``ids``
    (None: every process of ``name``), and send ``sig``
    (if any) to its process group (engines are started with setsid, so the pid leads its group)
    -- except to pids in ``skip``, which were signalled before (a second SIGTERM makes vLLM skip
    its graceful shutdown). ``sessions``: recorded engine pid (a session leader) -> process id:
    every live member of those sessions too, each signalled alone."""
    skipped = " ".join(shlex.quote(p) for p in skip)
    kill = "" if not sig else (
        f'case " {skipped} " in *" $pid "*) continue ;; esac\n'
        f"  kill -s {shlex.quote(sig)} -- -$pid 2>/dev/null || kill -s {shlex.quote(sig)} $pid 2>/dev/null || true")
    want = "" if ids is None else f"  case \" {' '.join(shlex.quote(i) for i in ids)} \" in *\" $p \"*) ;; *) continue ;; esac\n"
    out = _scan(name, owned) + f"k3_scan | while read -r pid n i p; do\n{want}  echo \"$pid $p\"\n  {kill or 'true'}\ndone"
    if sessions:
        # The members of each recorded engine's session, found by session id: a worker whose
        # leader was killed (SIGKILL, a crash) is orphaned out of its process group, and when
        # setproctitle left pieces of its environment it is not found by marker or run directory.
        sids = " ".join(shlex.quote(s) for s in sessions if s.isdigit())
        names = " ".join(f"{shlex.quote(s)}) p={shlex.quote(i)} ;;" for s, i in sessions.items() if s.isdigit())
        one = kill.replace(" -- -$pid 2>/dev/null || kill -s " + shlex.quote(sig or "") + " $pid", " $pid") if sig else "true"
        out += (f"\nfor d in /proc/[0-9]*; do\n  s=; {{ read -r s < \"$d/stat\"; }} 2>/dev/null || continue\n  set -- ${{s##*) }}\n"
                f"  case \"$1\" in Z|X) continue ;; esac\n  case \" {sids} \" in *\" $4 \"*) ;; *) continue ;; esac\n"
                f"  pid=${{d#/proc/}}; p=?; case $4 in {names} esac\n  echo \"$pid $p\"\n"
                # a member whose group leader lives got the group's signal already: once is enough
                f"  l=; {{ read -r l < \"/proc/$3/stat\"; }} 2>/dev/null; l=${{l##*) }}\n"
                f"  case \"${{l%% *}}\" in ''|Z|X) ;; *) continue ;; esac\n  {one}\ndone")
    return out


def process_status(items: Iterable[tuple[str, str]], tail_lines: int = 0) -> str:
    """For each ``(pid, log)``: ``PID up``, or ``PID down CODE TIME`` -- exit code and time (ns)
    from ``.k3launch-exit`` beside the log (written by ``up``'s start helper), else ``?`` and
    the log's mtime. Of ranks that died between two polls the first to die is the cause, the
    others followed it. With ``tail_lines``, a dead process's last log lines follow, prefixed
    ``@@PID `` (a failure is reported without another round trip). Builtins only while
    everything is up: this runs every poll."""
    lines = []
    for pid, log in items:
        q = shlex.quote(pid)
        down = f"echo {q} down ?"
        if log:
            down = (f"l={path_word(log)}; e=$(cat \"${{l%/*}}/.k3launch-exit\" 2>/dev/null) || e=; "
                    f"[ -n \"$e\" ] || e=\"? $(stat -c %.3Y \"$l\" 2>/dev/null || stat -c %Y \"$l\" 2>/dev/null || echo 0)\"; echo {q} down $e")
            if tail_lines:
                down += f"; tail -n {int(tail_lines)} \"$l\" 2>/dev/null | sed 's/^/@@{pid} /'"
        lines.append(f"s=; {{ read -r s < /proc/{q}/stat; }} 2>/dev/null; s=${{s##*) }}; s=${{s%% *}}\n"
                     f"case \"$s\" in ''|Z|X) {down} ;; *) echo {q} up ;; esac")
    return "\n".join(lines) or "true"


def containers_alive(runtime: str, names: Iterable[str]) -> str:
    rt = shlex.quote(runtime)
    ids = " ".join(shlex.quote(n) for n in names)
    return f"""for c in {ids}; do
  s=$({rt} inspect -f '{{{{.State.Running}}}}' "$c" 2>/dev/null || echo false)
  if [ "$s" = true ]; then echo "$c up"; else echo "$c down"; fi
done"""


# "inode path" of every /dev/shm mapping in the /proc/PID/maps lines it reads
SHM_MAPPINGS = r"awk '$6 ~ /^\/dev\/shm\// {print $5, $6}'"


def stop_containers(runtime: str, names: Iterable[str], grace_s: int) -> str:
    """Stop, remove, and (podman) drop the container's HF_TOKEN secret.

    SIGTERM goes to the container's whole process group first (its first process leads it; its
    host pid from ``inspect``), as to a bare engine's: ``stop`` alone signals that process only,
    and vLLM's API server then kills its EngineCore and workers at once (shutdown timeout 0), whose
    shared-memory segments (psm_*, hundreds of MB, in the host's /dev/shm with --ipc=host) nobody
    unlinks -- the container's resource tracker dies with its PID namespace. Signalled, every
    process shuts down on its own; ``wait`` gives them the grace period, then ``stop -t 0``. When
    the group cannot be signalled from here (a daemon's processes of another user), ``stop -t
    GRACE`` as before."""
    rt = shlex.quote(runtime)
    ids = " ".join(shlex.quote(n) for n in names)
    g = int(grace_s)
    # the container's HF_TOKEN secret (runtimes.token_secret), where its runtime keeps the token as one
    sec = f' {rt} secret rm "{token_secret("$c")}" >/dev/null 2>&1 || true;' if runtime in RUNTIMES and RUNTIMES[runtime].secret == "podman-secret" else ""
    wait = f"timeout {g} {rt} wait \"$c\" >/dev/null 2>&1 || true; " if g > 0 else ""  # timeout 0 would wait forever
    # The /dev/shm files the group maps, noted before the signal as "inode path"; after the
    # container is gone, those still there that no process maps are unlinked: with its own PID
    # namespace, the container's multiprocessing resource tracker (which unlinks them for a bare
    # engine) is killed with the namespace when the first process exits. By inode, because a
    # named semaphore (multiprocessing's sem.mp-*, e.g. tqdm's lock) is mapped under the
    # temporary name glibc made it with, renamed since ("/dev/shm/sem.XXXXXX (deleted)"); a file
    # is unlinked only under a name the group mapped, or as a semaphore of an inode it mapped.
    shm = ('shm=$(for d in /proc/[0-9]*; do s=$(cat "$d/stat" 2>/dev/null) || continue; s=${s##*) }; '
           f'set -- $s; [ "${{3:-}}" = "$p" ] && {SHM_MAPPINGS} "$d/maps" 2>/dev/null; done | sort -u) && ')
    # cat, not awk, reads every process's maps: mawk stops at a file it cannot open (a process gone)
    unlink = (f'if [ -n "$shm" ]; then used=$(cat /proc/[0-9]*/maps 2>/dev/null | {SHM_MAPPINGS} | cut -d" " -f1 | sort -u); '
              "find /dev/shm -maxdepth 1 -type f -printf '%i %p\\n' 2>/dev/null | while read -r i f; do "
              'printf "%s\\n" "$shm" | grep -q "^$i " || continue; '
              'case "$f" in /dev/shm/sem.*) ;; *) printf "%s\\n" "$shm" | grep -qxF "$i $f" || continue ;; esac; '
              'printf "%s\\n" "$used" | grep -qx "$i" || rm -f -- "$f"; done; fi; ')
    return (
        f"for c in {ids}; do p=$({rt} inspect -f '{{{{.State.Pid}}}}' \"$c\" 2>/dev/null) || p=0; shm=; "
        f"if [ \"${{p:-0}}\" -gt 1 ] 2>/dev/null && {shm}kill -s TERM -- \"-$p\" 2>/dev/null; then {wait}t=0; else t={g}; fi; "
        f"{rt} stop -t \"$t\" \"$c\" >/dev/null 2>&1 || true; {rt} rm -f \"$c\" >/dev/null 2>&1 || true;{sec} {unlink}done; true"
    )


def labelled_containers(runtime: str, name: str, owned: Owned = ANY) -> str:
    """Names of the containers labelled as deployment ``name``'s (only those ``owned`` says are its)."""
    also = "".join(f" --filter {shlex.quote(f)}" for f in owned.label_filters())
    return f"{shlex.quote(runtime)} ps -a --filter label=k3launch.deployment={shlex.quote(name)}{also} --format '{{{{.Names}}}}' 2>/dev/null || true"


def path_word(path: str) -> str:
    """A recorded log path as one shell word. Paths under ``~`` are recorded the way render writes
    them, ``"$HOME"/'rest'`` (already quoted, so that $HOME expands on the node): kept as is."""
    return path if path.startswith('"$HOME"/') else shlex.quote(path)


def log_tail(path: str, lines: int = 30) -> str:
    return f"tail -n {int(lines)} {path_word(path)} 2>/dev/null || echo '(no log file)'"


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


def port_holders(ports: Iterable[int]) -> str:
    """Lines ``ADDR:PORT PID SID COMM`` (address and port in ``/proc/net/tcp``'s hex) of the
    processes holding a listening socket on one of ``ports`` in this network namespace;
    ``ADDR:PORT ? ? ?`` when no holder is visible (another user's process). Sockets are matched to
    processes by inode through ``/proc/PID/fd`` (GNU find; elsewhere holders stay unknown). Costs
    one awk per table, and a find only for a port that is listening."""
    want = " ".join(f"{p:04X}" for p in sorted(set(ports)))
    return f"""for f in /proc/net/tcp /proc/net/tcp6; do
  [ -r "$f" ] && awk 'NR>1 && $4=="0A" {{print $2, $10}}' "$f"
done | while read -r a ino; do
  case " {want} " in *" ${{a##*:}} "*) ;; *) continue ;; esac
  h=$(find /proc/[0-9]*/fd -maxdepth 1 -lname "socket:\\[$ino\\]" 2>/dev/null | cut -d/ -f3 | sort -u)
  [ -n "$h" ] || {{ echo "$a ? ? ?"; continue; }}
  for pid in $h; do
    s=; {{ read -r s < "/proc/$pid/stat"; }} 2>/dev/null || continue
    c=${{s#*(}}; c=${{c%)*}}; r=${{s##*) }}
    set -- $r
    echo "$a $pid $4 $c"
  done
done"""


def parse_holders(output: str) -> list[tuple[str, int, str, str, str]]:
    """:func:`port_holders` output → ``(ip, port, pid, sid, comm)``; pid, sid and comm ``?`` when unknown."""
    out = []
    for line in output.splitlines():
        words = line.split(None, 3)
        if len(words) < 4 or ":" not in words[0]:
            continue
        got = parse_listening(words[0])
        if got:
            ip, port = next(iter(got))
            out.append((ip, port, words[1], words[2], words[3]))
    return out


def shm_files() -> str:
    return "ls -1 /dev/shm 2>/dev/null | grep -E '^(psm_|vllm|nccl-)' || true"


# vLLM's shared memory (multiprocessing's psm_* segments and named semaphores, its own vllm*
# files) that no process maps or holds open: what an engine killed with SIGKILL leaves behind,
# hundreds of MB each (a semaphore: 32 bytes, but one more per kill).
# Only files this user owns; run once the engine's processes are gone.
STALE_SHM = r"""maps=$(cat /proc/[0-9]*/maps 2>/dev/null | """ + SHM_MAPPINGS + r""" | sort -u)
used=$( { printf '%s\n' "$maps" | cut -d' ' -f2-; ls -l /proc/[0-9]*/fd 2>/dev/null | grep -o '/dev/shm/[^ ]*'; } | sort -u)
for f in /dev/shm/psm_* /dev/shm/vllm*; do
  [ -f "$f" ] && [ -O "$f" ] || continue
  case "
$used
" in *"
$f
"*) continue ;; esac
  rm -f -- "$f" && echo "$f"
done
# multiprocessing's named semaphores (sem.mp-*: tqdm's lock in vLLM's workers), unlinked by a
# resource tracker that a SIGKILL took too. A process maps one under glibc's temporary name
# ("/dev/shm/sem.XXXXXX (deleted)"), so "in use" is told by inode
inodes=$(printf '%s\n' "$maps" | cut -d' ' -f1)
for f in /dev/shm/sem.mp-*; do
  [ -f "$f" ] && [ -O "$f" ] || continue
  i=$(stat -c %i -- "$f" 2>/dev/null) || continue
  printf '%s\n' "$inodes" | grep -qx "$i" && continue
  rm -f -- "$f" && echo "$f"
done"""


def session_cpu(sessions: Iterable[str]) -> str:
    """For each recorded engine pid (a session leader, setsid): ``T SID TICKS`` -- the CPU clock
    ticks used by every live (not zombie) member of its session, with what they reaped (utime + stime + cutime
    + cstime) -- and ``S SID STATE WCHAN`` of the leader itself. A starting engine that uses no CPU
    at all is stuck (in the kernel, stopped, or waiting on something that never answers); the
    API server alone would not tell, as it waits idle while its engine core loads. One ``cat`` of
    every ``/proc/*/stat``: the comm field may hold spaces and parentheses, hence the last ``) ``."""
    sids = [s for s in sessions if s.isdigit()]
    if not sids:
        return "true"
    want = " ".join(sids)
    return (f"cat /proc/[0-9]*/stat 2>/dev/null | awk -v want=' {want} ' "
            "'{ sub(/^.*\\) /, \"\"); if ($1 != \"Z\" && $1 != \"X\" && index(want, \" \" $4 \" \")) t[$4] += $12 + $13 + $14 + $15 } "
            "END { for (s in t) print \"T\", s, t[s] }'\n"
            f"for s in {want}; do\n"
            "  x=; { read -r x < \"/proc/$s/stat\"; } 2>/dev/null || continue; x=${x##*) }\n"
            "  w=$(cat \"/proc/$s/wchan\" 2>/dev/null) || w=; echo \"S $s ${x%% *} ${w:-0}\"\ndone")


def parse_session_cpu(output: str) -> dict[str, tuple[int, str]]:
    """SID -> (ticks, "state R" / "state D in WCHAN") of :func:`session_cpu`'s output."""
    ticks: dict[str, int] = {}
    notes: dict[str, str] = {}
    for line in output.splitlines():
        f = line.split()
        if len(f) == 3 and f[0] == "T" and f[2].isdigit():
            ticks[f[1]] = int(f[2])
        elif len(f) == 4 and f[0] == "S":
            notes[f[1]] = f"state {f[2]}" + (f" in {f[3]}" if f[3] not in ("0", "") else "")
    return {s: (t, notes.get(s, "")) for s, t in ticks.items()}
