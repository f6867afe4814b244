#!/usr/bin/env bash
# Creates ./.venv with Baton and its test tools. Idempotent: a second run only checks.
#
# torch is installed first and on its own: on a machine without an NVIDIA GPU we take the
# CPU build (~200 MB) instead of letting a plain `pip install torch` pull several GB of
# CUDA wheels. pip's chatter goes to .venv/bootstrap.log and is shown only on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setting up .venv (first run only; log in .venv/bootstrap.log)" >&2
  "$PY" -m venv .venv
fi
V=.venv/bin/python
LOG=.venv/bootstrap.log
pipq() { "$V" -m pip install -q "$@" >>"$LOG" 2>&1; }
fail() { echo "bootstrap failed; the end of $LOG:" >&2; tail -n 30 "$LOG" >&2; exit 1; }
if ! "$V" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    pipq "torch>=2.3" || fail
  else
    # A CPU build served locally (find-links) or by PyTorch's CPU index.
    pipq "torch==2.13.0+cpu" || pipq torch --index-url https://download.pytorch.org/whl/cpu || fail
  fi
fi
if ! "$V" -c "import baton, nats, pytest" >/dev/null 2>&1 || [ ! -x .venv/bin/weed ] \
   || [ pyproject.toml -nt .venv/.installed ]; then
  pipq -e ".[dev]" || fail
  touch .venv/.installed
fi
