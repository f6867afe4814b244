#!/usr/bin/env bash
# The test suite on a loaded machine: BATON_HOGS busy processes (default 2), each pinned to
# one CPU in turn, spin beside `scripts/test.sh` for as long as it runs, so that every wait
# in the suite is tried against a machine that is not quiet (as CI's may not be).
# Arguments go to scripts/test.sh (and so to pytest). The hogs are stopped however the
# suite ends; the suite's exit status is this script's.
set -euo pipefail
cd "$(dirname "$0")/.."
hogs=${BATON_HOGS:-2}
cpus=$(nproc)
pids=()
stop_hogs() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; }
trap stop_hogs EXIT INT TERM
for ((i = 0; i < hogs; i++)); do
  # A plain busy loop: no I/O, no memory, one CPU's worth of work each.
  taskset -c $((i % cpus)) bash -c 'while :; do :; done' &
  pids+=($!)
done
echo "test-loaded: ${hogs} busy process(es) pinned across ${cpus} CPU(s): ${pids[*]}" >&2
status=0
scripts/test.sh "$@" || status=$?
exit "$status"
