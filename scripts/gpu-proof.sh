#!/usr/bin/env bash
# Baton proven on a GPU (bench/gpu, docs/gpu.md): `baton up` with its trainers on the
# machine's GPU and a file:// store on local disk, the proofs within a budget, then
# $OUT/gpu.json (every figure, the machine's versions) and $OUT/gpu.md; every process it
# started is stopped, on failure too. Exits non-zero when a proof fails.
#
#   scripts/gpu-proof.sh                  # on a lent GPU machine: full sizes, goals judged
#   scripts/gpu-proof.sh --cpu --quick    # anywhere: tiny sizes, the same code paths (CI)
#   options: --out DIR (default $OUT, else out/gpu), --budget SECONDS (default 540, all
#            in), --only zygote,exact,framework,cost,overhead
#
# Where the Python lacks Baton's dependencies (a lent machine's image), the wheels carried
# in .whl/ (scripts/gpu-wheels.sh) are installed into a scratch path as the device installs
# them: pip --no-index --no-deps --target, put first on PYTHONPATH (their nats-server on
# PATH). The project itself runs from this working tree, not installed. Anywhere else the
# script sets up ./.venv first when there is none (scripts/bootstrap.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
budget=540
out=${OUT:-out/gpu}
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) budget=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
# The interpreter: PYTHON; else ./.venv's; else, on a lent machine (its python3 is 3.12 with
# torch, .whl/ holds the rest), python3; else ./.venv is set up first, as scripts/test.sh
# does.
lent='import sys, torch; sys.exit(sys.version_info[:2] != (3, 12))'
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
elif ls .whl/*.whl >/dev/null 2>&1 && python3 -c "$lent" 2>/dev/null; then PY=python3
else scripts/bootstrap.sh; PY=.venv/bin/python
fi
started=$SECONDS  # the budget counts from here: the wheels' install is in it, a bootstrap not
scratch=$(mktemp -d "${TMPDIR:-/tmp}/baton-gpu-XXXXXX")
root=$scratch/run
pid=
# The driver stops the stack itself (SIGTERM: it stops where it is, writes its report);
# whatever still names the run's scratch directory after that is SIGKILLed.
finish() {
  rc=$?
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 90); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  for p in /proc/[0-9]*; do
    n=${p#/proc/}
    [ "$n" = $$ ] && continue
    if grep -qsF -- "$root" "$p/cmdline" "$p/environ"; then
      echo "still running after the proofs, killed: $n $(tr '\0' ' ' <"$p/cmdline" 2>/dev/null)" >&2
      kill -KILL "$n" 2>/dev/null || true
    fi
  done
  rm -rf "$scratch"
  exit "$rc"
}
trap finish EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

if ! "$PY" -c "import nats, nkeys, msgspec, opentelemetry.sdk, cryptography, torchdata" \
     2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "$PY lacks Baton's dependencies, and .whl/ has no wheels (scripts/gpu-wheels.sh)" >&2
    exit 1
  fi
  site=$scratch/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$site/bin:$PATH"
  echo "installed $(ls .whl/*.whl | wc -l) carried wheels into $site ($((SECONDS - started)) s)"
fi
# This working tree first: `python -m baton`, the services and the proofs' jobs from it.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
left=$((budget - (SECONDS - started)))  # the driver keeps a minute of it to stop, report
"$PY" -m bench.gpu --out "$out" --root "$root" --budget "$left" ${args[@]+"${args[@]}"} &
pid=$!
rc=0
wait "$pid" || rc=$?
pid=
for f in gpu.json gpu.md; do
  [ -s "$out/$f" ] || { echo "no $out/$f" >&2; rc=1; }
done
echo "$((SECONDS - started)) s in all"
exit "$rc"
