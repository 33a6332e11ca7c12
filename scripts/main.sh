#!/usr/bin/env bash
# The main job on the embedded default. Today (foundation stage) it installs sbproxy, shows
# the CLI, validates the canonical example and lists the built-in catalog resolved for this
# machine. Later stages make this `sbproxy run gemma-3-270m` with a real llama-server.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
ensure_venv ""

sbproxy --help
SB_ADMIN_PASSWORD="${SB_ADMIN_PASSWORD:-example-only-password}" \
  sbproxy config validate -f examples/model-host-managed/sb.yml
sbproxy models list
sbproxy models show gemma-3-270m
