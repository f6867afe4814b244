#!/usr/bin/env bash
# Creates ./.venv with Baton and its test tools. Idempotent: a second run only checks.
#
# torch is installed first and on its own: on a machine without an NVIDIA GPU we take the
# CPU build (~200 MB) instead of letting a plain `pip install torch` pull several GB of
# CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
V=.venv/bin/python
"$V" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$V" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$V" -m pip install -q "torch>=2.3"
  else
    # A CPU build served locally (find-links) or by PyTorch's CPU index.
    "$V" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || "$V" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$V" -m pip install -q -e ".[dev]"
