#!/usr/bin/env bash
# The test command: installs what it needs into .venv, runs the linters, then the tests.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k catalog`).
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

echo "== ruff" >&2
ruff check .
ruff format --check .
echo "== mypy --strict" >&2
mypy
echo "== import-linter" >&2
lint-imports
echo "== pytest" >&2
pytest "$@"
