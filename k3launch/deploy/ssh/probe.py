"""``weights probe``: how fast each engine node reads the disk its weights load from.

One shell program per node, all nodes at once (one round trip each). It writes a fresh file of
random bytes (random: a compressing filesystem cannot shrink it) into the directory probed,
``fsync`` s it, keeps it out of the page cache, times one sequential read of it with ``dd`` and
removes it whatever happens. Keeping the page cache out, in order of preference:

1. ``o_direct``: ``dd iflag=direct`` (O_DIRECT) — the read bypasses the page cache;
2. ``fadvise``: where O_DIRECT is refused, ``posix_fadvise(POSIX_FADV_DONTNEED)`` from the node's
   Python drops the file's pages (clean after the fsync), then a normal read;
3. ``nocache``: without Python, GNU ``dd iflag=nocache count=0`` drops them, then a normal read;
4. ``cached``: nothing could: the figure is said to be the page cache's.

Where ``fincore`` (util-linux) exists, the bytes of the file still resident just before the read
are reported too. Both ``dd`` s run under ``timeout -s INT``: GNU dd prints what it copied when
interrupted, so a slow disk gives a figure for the part read within the bound (``timed_out``).

The directory is ``--path``, else where the node's engine looks for the model (the model's
directory in the hub cache when it exists, else the hub cache; a model given as a directory, that
directory): the same disk the weights will be read from.
"""

from __future__ import annotations

import re
import shlex
from typing import cast

from k3launch.deploy.ssh import weights as w
from k3launch.deploy.ssh.fetch import engine_nodes
from k3launch.deploy.ssh.launch import run_host
from k3launch.errors import K3Error
from k3launch.models.plan import Host, Plan
from k3launch.models.weights import METHODS, Probe, ProbeMethod, Where
from k3launch.transport.fleet import Fleet

MIB = 1 << 20
DEFAULT_BYTES = 256 * MIB
DEFAULT_TIMEOUT_S = 60.0
NO_DIR, NOT_WRITABLE = 3, 4  # the program's exit codes for a path that cannot be probed

FADVISE_PY = "import os,sys\nfd=os.open(sys.argv[1],os.O_RDONLY)\nos.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)\nos.close(fd)"

# $1.. are set by the caller: size in MiB, the time bound, the Python, then the candidate directories.
PROBE_SH = r"""export LC_ALL=C
n=$1; t=$2; py=$3; shift 3
d=""
for c in "$@"; do if [ -d "$c" ]; then d=$c; break; fi; done
if [ -z "$d" ]; then echo "K3P error=nodir"; exit 3; fi
echo "K3P dir=$d"
f=$(mktemp "$d/.k3launch-probe.XXXXXX" 2>/dev/null) || { echo "K3P error=unwritable"; exit 4; }
trap 'rm -f "$f"' EXIT
trap 'exit 130' INT TERM HUP
now() { date +%s%N; }
copied() { sed -n 's/^\([0-9][0-9]*\) bytes.*/\1/p' | tail -n 1; }
t0=$(now); e=$(timeout -s INT "$t" dd if=/dev/urandom of="$f" bs=1M count="$n" conv=fsync 2>&1); rc=$?; t1=$(now)
echo "K3P written=$(stat -c %s "$f") write_ns=$((t1 - t0)) write_rc=$rc"
if [ ! -s "$f" ]; then echo "K3P error=nowrite $(echo "$e" | tail -n 1)"; exit 5; fi
sync "$f" 2>/dev/null
m=""
t0=$(now); e=$(timeout -s INT "$t" dd if="$f" of=/dev/null bs=4M iflag=direct 2>&1); rc=$?; t1=$(now)
b=$(echo "$e" | copied)
if [ "$rc" = 0 ] || { [ "$rc" = 124 ] && [ "${b:-0}" -gt 0 ]; }; then m=o_direct; fi
if [ -z "$m" ]; then
  if "$py" -c "$K3P_FADVISE" "$f" 2>/dev/null; then m=fadvise
  elif dd if="$f" iflag=nocache count=0 2>/dev/null; then m=nocache
  else m=cached; fi
  r=$(fincore -nb -o RES "$f" 2>/dev/null | tail -n 1 | tr -d ' ')
  case "$r" in ''|*[!0-9]*) ;; *) echo "K3P resident=$r";; esac
  t0=$(now); e=$(timeout -s INT "$t" dd if="$f" of=/dev/null bs=4M 2>&1); rc=$?; t1=$(now)
  b=$(echo "$e" | copied)
fi
echo "K3P method=$m bytes=${b:-0} read_ns=$((t1 - t0)) read_rc=$rc"
if [ "$rc" != 0 ] && [ "$rc" != 124 ]; then echo "K3P error=read $(echo "$e" | tail -n 1)"; fi
"""


def directories(plan: Plan, host: Host, path: str | None) -> list[str]:
    """The directories to try on ``host``, first existing first: ``path``, else where its engine looks."""
    if path:
        return [path]
    spot: Where = w.where(plan, host)
    return [spot.model] if spot.local else [spot.repo_dir, spot.hub]


def probe_command(host: Host, dirs: list[str], size: int, timeout_s: float) -> str:
    """The shell text that probes the first existing directory of ``dirs`` on ``host`` (every value quoted)."""
    mib = max(1, size // MIB)
    args = " ".join([str(mib), str(max(1, int(timeout_s))), w.python_word(host), *(w.word(d) for d in dirs)])
    return f"K3P_FADVISE={shlex.quote(FADVISE_PY)} bash -c {shlex.quote(PROBE_SH)} k3launch-probe {args} 2>&1"


def parse(node: str, out: str, dirs: list[str]) -> Probe:
    """One node's :class:`Probe` from the program's ``K3P`` lines."""
    kv: dict[str, str] = {}
    error = ""
    for line in out.splitlines():
        if not line.startswith("K3P "):
            continue
        body = line[4:]
        if body.startswith("error="):
            error = body[6:].strip()
            continue
        if body.startswith("dir="):  # a directory may hold spaces: the rest of the line
            kv["dir"] = body[4:]
            continue
        kv.update(re.findall(r"(\w+)=(\S*)", body))
    where = kv.get("dir", "") or " or ".join(dirs)
    code = "probe-path" if error in ("nodir", "unwritable") else ""
    if error == "nodir":
        error = f"no directory {where}"
    elif error == "unwritable":
        error = f"cannot create a file in {where}"
    elif not error and "method" not in kv:
        tail = out.strip().splitlines()[-1][:160] if out.strip() else "no output"
        error = f"the probe did not run: {tail}"

    def num(key: str) -> int:
        v = kv.get(key, "")
        return int(v) if v.isdigit() else 0

    method = kv.get("method", "")
    resident = kv.get("resident")
    return Probe(
        node,
        where,
        method=cast("ProbeMethod", method) if method in METHODS else "",
        bytes=num("bytes"),
        read_s=num("read_ns") / 1e9,
        written=num("written"),
        write_s=num("write_ns") / 1e9,
        resident=int(resident) if resident and resident.isdigit() else None,
        timed_out=kv.get("read_rc") == "124",
        error=error,
        code=code,
    )


def probe(plan: Plan, fleet: Fleet, path: str | None = None, size: int = DEFAULT_BYTES,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Probe]:
    """Every engine node's read throughput of its weight source, in parallel; per node outcomes."""
    nodes = engine_nodes(plan)
    hosts = {n: run_host(fleet, n) for n in nodes}
    dirs = {n: directories(plan, hosts[n], path) for n in nodes}
    cmds = {n: probe_command(hosts[n], dirs[n], size, timeout_s) for n in nodes}
    out = fleet.run_many(cmds, timeout=2 * timeout_s + 30)
    rows: list[Probe] = []
    for n in nodes:
        o = out[n]
        if isinstance(o, K3Error):
            rows.append(Probe(n, " or ".join(dirs[n]), error=o.message))
        else:
            rows.append(parse(n, o.stdout + o.stderr, dirs[n]))
    return rows


__all__ = ["DEFAULT_BYTES", "DEFAULT_TIMEOUT_S", "NOT_WRITABLE", "NO_DIR", "ProbeMethod", "directories", "parse", "probe", "probe_command"]
