#!/usr/bin/env bash
# Quickstart, command 2: set up, then run the whole test suite against real servers.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
