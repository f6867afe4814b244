#!/usr/bin/env bash
# Quickstart, command 2: set up, then run the whole test suite against real servers.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# The dashboard's tests drive a real headless browser: Chromium from Debian's packages
# (never a browser downloaded at run time).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Chromium from the distribution's packages (for the dashboard's tests)" >&2
    apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 \
           && apt-get install -y -q --no-install-recommends chromium >/dev/null; }
  else
    echo "Chromium is missing: install it (Debian/Ubuntu: apt-get install chromium)" >&2
    exit 1
  fi
fi
# Two workers, a test module each at a time (`--dist loadfile`): a module's tests share its
# stack, and most of the suite's time is waiting on real servers (leases lapsing, links cut,
# elections), which two modules can do side by side. BATON_TEST_WORKERS=0 runs it serially.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 \
  -n "${BATON_TEST_WORKERS:-2}" --dist loadfile "$@"
