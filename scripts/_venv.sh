# Sourced by the scripts in this folder: create .venv with Python 3.11 and install sbproxy
# (editable) with the given extras, pinned by constraints.txt. Idempotent and quick when
# everything is already installed.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SBPROXY_VENV:-$repo_root/.venv}"

find_python() {
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
      "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  echo "sbproxy needs Python 3.11 (python3.11 or python3 on PATH)" >&2
  return 1
}

ensure_venv() {
  local extras="$1"
  if [ ! -x "$venv/bin/python" ]; then
    "$(find_python)" -m venv "$venv"
  fi
  local target="$repo_root"
  if [ -n "$extras" ]; then
    target="$repo_root[$extras]"
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -c "$repo_root/constraints.txt" -e "$target"
  export PATH="$venv/bin:$PATH"
}

# Debian packages some tests drive (libfaketime steps a process's wall clock, chromium runs
# the console's browser tests). Installed when missing and this user may install; without
# them those tests say why they skip -- except with SBPROXY_REQUIRE_TOOLS=1 (CI, .ci/run),
# where a package that cannot be installed stops the run.
ensure_debian_packages() {
  local missing=()
  local pkg
  for pkg in "$@"; do
    # "install ok installed" only: a removed package keeps its record ("deinstall ... config-files").
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo="sudo -n"
    else
      echo "note: ${missing[*]} not installed (needs root); the tests that drive them skip" >&2
      [ "${SBPROXY_REQUIRE_TOOLS:-}" != 1 ] || { echo "error: CI needs ${missing[*]}" >&2; return 1; }
      return 0
    fi
  fi
  if command -v apt-get >/dev/null 2>&1; then
    $sudo apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 ||
      { $sudo apt-get update -qq >/dev/null 2>&1 &&
        $sudo apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; } ||
      { echo "note: could not install ${missing[*]}; the tests that drive them skip" >&2
        [ "${SBPROXY_REQUIRE_TOOLS:-}" != 1 ] || { echo "error: CI needs ${missing[*]}" >&2; return 1; }; }
  elif [ "${SBPROXY_REQUIRE_TOOLS:-}" = 1 ]; then
    echo "error: CI needs ${missing[*]} and this machine has no apt-get" >&2
    return 1
  fi
}
