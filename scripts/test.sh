#!/usr/bin/env bash
# The test command: installs what it needs into .venv, runs the linters, then the tests.
#
# Without arguments the suite runs in two parts: every test but the real-engine ones (-m
# "not e2e") on $SBPROXY_TEST_WORKERS pytest-xdist workers (default 4: most tests wait on
# real processes, sockets and polls, so more workers than cores keep 2 CPUs busy), each test
# file on one worker (--dist loadfile: module fixtures such as the console's served host are
# built once); then the real-engine tests (-m e2e: llama-server serving real GGUFs) one at a
# time. Their llama-server is built once per machine into the default cache, where
# scripts/main.sh builds it too (tests/support/engine.py): whichever runs first builds it,
# the other reuses it. On a fresh machine that build starts in the background before the
# linters, so it is ready (or nearly) when the second part needs it.
#
# Extra arguments go to one plain pytest run instead (e.g. `bash scripts/test.sh -k catalog`,
# `bash scripts/test.sh -n 4 -m "not e2e"`).
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
ensure_venv dev
ensure_debian_packages faketime
# The journal's PostgreSQL tests start a throw-away cluster from Debian's binaries
# (tests/support/postgres.py); the system's own cluster is never used.
ensure_debian_packages postgresql
# The console's browser tests (tests/ui) drive Debian's chromium through Playwright.
ensure_debian_packages chromium

if [ "$#" -eq 0 ]; then
  echo "== the real llama-server: built in the background unless already there" >&2
  build_log="$(mktemp)"
  # A session of its own, so that an early exit stops the compilers too (the durable build
  # job restarts cleanly next time).
  setsid python -m tests.support.engine >"$build_log" 2>&1 &
  build_pid=$!
  trap 'kill -- "-$build_pid" 2>/dev/null || true; rm -f "$build_log"' EXIT
fi

echo "== ruff" >&2
ruff check .
ruff format --check .
echo "== mypy --strict" >&2
mypy
echo "== import-linter" >&2
lint-imports
if [ "$#" -gt 0 ]; then
  echo "== pytest $*" >&2
  exec pytest "$@"
fi

echo "== pytest -m 'not e2e' on ${SBPROXY_TEST_WORKERS:-4} workers" >&2
status=0
pytest -n "${SBPROXY_TEST_WORKERS:-4}" --dist loadfile -m "not e2e" || status=$?

echo "== pytest -m e2e (the real engine, one test at a time)" >&2
if ! wait "$build_pid"; then
  # The e2e fixture runs the same build again and reports why it failed.
  echo "note: the background engine build failed:" >&2
  tail -n 20 "$build_log" >&2
fi
pytest -m e2e || status=$?
exit "$status"
