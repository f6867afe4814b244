#!/usr/bin/env bash
# Quickstart, command 2: set up, then run the whole test suite against real servers.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# System tools the tests drive, from the distribution's packages (never downloaded at run
# time): Chromium for the dashboard's tests, libfaketime to skew one process's clock.
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v faketime >/dev/null 2>&1 || missing+=(faketime)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} from the distribution's packages (for the tests)" >&2
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 \
           && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
  else
    echo "missing: ${missing[*]} (Debian/Ubuntu: apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi
# Two workers, a test module each at a time (`--dist loadfile`): a module's tests share its
# stack, and most of the suite's time is waiting on real servers (leases lapsing, links cut,
# elections), which two modules can do side by side. BATON_TEST_WORKERS=0 runs it serially.
# Tests that must run for minutes (links flapping for minutes, shaped links, soaks) are
# marked `soak`, a 3-node hub's leaders killed and restarted `cluster`,
# the frameworks' end-to-end tests `frameworks`, operators' controls end to end
# `operations`, replicated runs across sites `diloco`, a pool shared by people `sharing`,
# runs granted to sites through cuts and take-backs `sites`, exactly once against an
# adversary (both sides of a cut, a hub that forgets, the fault campaign) `adversary`, and
# all eight are left out, to keep this under 15 minutes on two cores;
# `scripts/test.sh -m "soak or cluster or frameworks or operations or diloco or sharing or sites or adversary"`
# runs them (.ci/run does, after the rest).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 \
  -n "${BATON_TEST_WORKERS:-2}" --dist loadfile \
  -m "not soak and not cluster and not frameworks and not operations and not diloco and not sharing and not sites and not adversary" \
  "$@"
