#!/usr/bin/env bash
# Quickstart, command 1: set up, then run the main job on the embedded stack (`baton demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/baton demo "$@"
