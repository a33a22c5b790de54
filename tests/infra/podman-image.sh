#!/usr/bin/env bash
# podman-image.sh [TAG] -- a podman set-up that works on this kind of VM, and an image whose
# `vllm` is the simulated engine, built with no registry.
#
#   * installs podman + runc with apt, only if missing (no services are started);
#   * writes $K3LAUNCH_PODMAN_CONF (default /var/tmp/k3launch-podman/containers.conf): runc
#     (crun fails here: cgroups hybrid mode), ulimits within this machine's hard limits (podman's
#     defaults exceed them), cgroupfs + file events (no systemd/journald);
#   * builds TAG (default localhost/k3launch-sim:test) with `podman import` from a rootfs made of
#     this machine's Python (interpreter, the shared libraries ldd names, and only the stdlib
#     modules the sim can import, found with modulefinder), the k3launch files the sim needs
#     (__init__, errors, defaults, planning/schema, data/, sim/) and /usr/local/bin/vllm =
#     `exec python3 -m k3launch.sim "$@"`;
#   * caches: the image carries a label with a hash of those sources (+ this script and the
#     Python version); a matching image is reused. K3LAUNCH_PODMAN_REBUILD=1 forces a rebuild.
#
# Last stdout line: `export CONTAINERS_CONF=...` (eval it, or set it yourself). Needs root.
# Env: PYTHON (interpreter to copy, default python3), K3LAUNCH_PODMAN_CONF, K3LAUNCH_PODMAN_REBUILD.
set -euo pipefail
TAG=${1:-localhost/k3launch-sim:test}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CONF=${K3LAUNCH_PODMAN_CONF:-/var/tmp/k3launch-podman/containers.conf}
log() { echo "podman-image: $*" >&2; }
PY=$(command -v "${PYTHON:-python3}") || { log "no ${PYTHON:-python3} to copy into the image"; exit 1; }
PY=$("$PY" -c 'import sys; print(sys.executable)')  # through pyenv shims to the real one
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}'; }

[ "$(id -u)" = 0 ] || { log "needs root (apt, podman storage in /var/lib/containers)"; exit 2; }

# ---------------------------------------------------------------- packages
need=()
for p in podman runc; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
if [ ${#need[@]} -gt 0 ]; then
  t=$(now)
  log "installing ${need[*]} (apt)"
  made_policy=0  # no service starts inside this VM
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1; }
  aptlog=/var/tmp/k3launch-podman-apt.log
  inst() { DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y --no-install-recommends "${need[@]}" >"$aptlog" 2>&1; }
  inst || { timeout 300 apt-get update >>"$aptlog" 2>&1 && inst; } || { [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d; log "apt failed, see $aptlog"; exit 1; }
  [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  log "installed in $(since "$t")s"
fi

# ---------------------------------------------------------------- containers.conf
# shellcheck source=lib-podman.sh
. "$HERE/lib-podman.sh"
podman_conf_write "$CONF"
export CONTAINERS_CONF=$CONF

# ---------------------------------------------------------------- cache check
SRC=(k3launch/__init__.py k3launch/errors.py k3launch/defaults.py k3launch/planning/__init__.py k3launch/planning/schema.py k3launch/data k3launch/sim)
hash=$(cd "$REPO" && {
  find "${SRC[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' | LC_ALL=C sort | xargs sha256sum
  sha256sum "$HERE/podman-image.sh" | cut -d' ' -f1
  "$PY" -c 'import sys; print(sys.version)'
} | sha256sum | cut -c1-16)
have=$(podman image inspect -f '{{index .Labels "k3launch.sim-hash"}}' "$TAG" 2>/dev/null || true)
if [ "$have" = "$hash" ] && [ "${K3LAUNCH_PODMAN_REBUILD:-0}" != 1 ]; then
  log "$TAG is up to date (sources hash $hash)"
  echo "export CONTAINERS_CONF=$CONF"
  exit 0
fi

# ---------------------------------------------------------------- rootfs
t0=$(now)
W=$(mktemp -d /var/tmp/k3launch-image.XXXXXX)
trap 'rm -rf "$W"' EXIT
R=$W/rootfs
"$PY" - "$R" "$REPO" <<'PYEOF'
"""Assemble a minimal rootfs: interpreter + libs + the stdlib closure of k3launch.sim."""
import compileall, modulefinder, os, re, shutil, subprocess, sys, sysconfig

root, repo = sys.argv[1], sys.argv[2]
ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
stdlib = sysconfig.get_paths()["stdlib"]
dynload = os.path.join(sys.base_exec_prefix, "lib", f"python{ver}", "lib-dynload")
dst_lib = f"{root}/usr/local/lib/python{ver}"
for d in ("usr/local/bin", f"usr/local/lib/python{ver}/lib-dynload", f"usr/local/lib/python{ver}/site-packages",
          "etc", "tmp", "var/tmp", "root", "proc", "sys", "dev", "bin", "run"):
    os.makedirs(f"{root}/{d}", exist_ok=True)
os.chmod(f"{root}/tmp", 0o1777)
os.chmod(f"{root}/var/tmp", 0o1777)

def copy(src, dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(src, dst)

# The stdlib closure: everything the sim's code (and Python's start-up, and -m) can import.
mf = modulefinder.ModuleFinder(path=[repo, stdlib, dynload], excludes=["tkinter", "test", "idlelib", "lib2to3", "ensurepip",
                                                                      "distutils", "pydoc", "turtle", "unittest", "doctest"])
entry = os.path.join(root, "..", "entry.py")
with open(entry, "w") as f:
    f.write("import k3launch.sim.__main__, runpy, site, encodings, encodings.aliases, encodings.utf_8, encodings.latin_1, "
            "encodings.ascii, encodings.idna\n")
mf.run_script(entry)
elf = [os.path.realpath(sys.executable)]
for name, m in mf.modules.items():
    f = m.__file__
    if not f or name == "__main__":
        continue
    f = os.path.realpath(f)
    if f.startswith(os.path.realpath(repo) + os.sep):
        continue  # k3launch itself is copied below
    if f.startswith(os.path.realpath(dynload) + os.sep):
        copy(f, f"{dst_lib}/lib-dynload/{os.path.basename(f)}")
        elf.append(f)
    elif f.startswith(os.path.realpath(stdlib) + os.sep):
        copy(f, f"{dst_lib}/{os.path.relpath(f, os.path.realpath(stdlib))}")
# encodings are looked up by name at run time: take the whole (small) package
shutil.copytree(f"{stdlib}/encodings", f"{dst_lib}/encodings", dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))

# Interpreter and every shared library ldd resolves (libpython goes to a default search dir,
# since the host binary's RUNPATH points at the host install).
copy(os.path.realpath(sys.executable), f"{root}/usr/local/bin/python{ver}")
os.symlink(f"python{ver}", f"{root}/usr/local/bin/python3")
libs = set()
for e in elf + ["/bin/dash"]:
    out = subprocess.run(["ldd", e], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.search(r"(\S+) => (/\S+)", line) or re.search(r"^\s*(/\S+) \(", line)
        if m:
            libs.add((os.path.basename(m.group(1)), m.group(m.lastindex)))
libc_dir = os.path.dirname(next(p for n, p in libs if n == "libc.so.6"))
for name, path in sorted(libs):
    # libpython goes next to libc (a default search dir): the host binary's RUNPATH names the host install
    dst = f"{root}{libc_dir}/{name}" if name.startswith("libpython") else root + path
    if not os.path.exists(dst):
        copy(os.path.realpath(path), dst)
        if name.startswith("libpython"):
            subprocess.run(["strip", "--strip-unneeded", dst], check=True)
copy("/bin/dash", f"{root}/bin/sh")
for p in [f"{root}/usr/local/bin/python{ver}"] + [os.path.join(f"{dst_lib}/lib-dynload", x) for x in os.listdir(f"{dst_lib}/lib-dynload")]:
    subprocess.run(["strip", "--strip-unneeded", p], check=True)

# k3launch: just what the sim imports
site = f"{dst_lib}/site-packages/k3launch"
for f in ("__init__.py", "errors.py", "defaults.py", "planning/__init__.py", "planning/schema.py"):
    copy(f"{repo}/k3launch/{f}", f"{site}/{f}")
for d in ("data", "sim"):
    shutil.copytree(f"{repo}/k3launch/{d}", f"{site}/{d}", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
compileall.compile_dir(f"{root}/usr/local/lib", quiet=2, workers=0)  # no compile on each container start

with open(f"{root}/usr/local/bin/vllm", "w") as f:
    f.write('#!/bin/sh\n# the simulated engine, with vLLM\'s command line\nexec /usr/local/bin/python3 -m k3launch.sim "$@"\n')
os.chmod(f"{root}/usr/local/bin/vllm", 0o755)
with open(f"{root}/etc/passwd", "w") as f:
    f.write("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")
with open(f"{root}/etc/group", "w") as f:
    f.write("root:x:0:\nnogroup:x:65534:\n")
for f in ("hosts", "resolv.conf", "hostname"):
    open(f"{root}/etc/{f}", "a").close()
PYEOF
t1=$(now)
tar -C "$R" --numeric-owner -cf "$W/rootfs.tar" .
old=$(podman image inspect -f '{{.Id}}' "$TAG" 2>/dev/null || true)
podman import -q \
  --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
  --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
  --change 'ENTRYPOINT ["/usr/local/bin/vllm"]' \
  --change "LABEL k3launch.sim-hash=$hash" \
  --change 'LABEL k3launch.purpose=simulated-vllm-for-tests' \
  "$W/rootfs.tar" "$TAG" >/dev/null
# the previous build, now untagged (kept only while a container still uses it)
[ -n "$old" ] && [ "$old" != "$(podman image inspect -f '{{.Id}}' "$TAG")" ] && { podman rmi "$old" >/dev/null 2>&1 || true; }
size=$(podman image inspect -f '{{.Size}}' "$TAG")
# Smoke test: the image's vllm is the sim.
timeout 60 podman run --rm --network none --entrypoint vllm "$TAG" serve --help >/dev/null 2>&1 || {
  timeout 60 podman run --rm --network none --entrypoint vllm "$TAG" serve --help 2>&1 | tail -5 >&2; log "smoke test failed"; exit 1; }
log "built $TAG in $(since "$t0")s (rootfs $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}')s), $(du -sh "$R" | cut -f1) rootfs, image $((size / 1024 / 1024)) MiB, hash $hash"
echo "export CONTAINERS_CONF=$CONF"
