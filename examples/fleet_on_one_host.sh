#!/usr/bin/env bash
# A 2P2D fleet on one CPU host: two prefill and two decode vLLM engines with KVBridgeConnector
# behind one kvbridge proxy, which spreads requests by load, retries what a dead engine failed
# on the others, and takes dead engines out of rotation (docs/proxy.md, "Fleets"). Ctrl-C stops
# everything.
#
#   examples/fleet_on_one_host.sh [backend]      # backend: shm (default), nixl, mooncake
#
# PYTHON (default .venv/bin/python) and PORT (the proxy's, default 8000; the engines use
# PORT+100, +101, +200, +201) can be set in the environment.
#
# Then, from another shell:
#   curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
#        -d '{"model":"tiny","prompt":[5,6,7,8,9,10,11,12],"max_tokens":8}'
#   curl -s localhost:8000/health                 # in_rotation per engine
#   kill -9 -- -<pgid of one engine>              # then see it leave /health and the rotation
set -euo pipefail
cd "$(dirname "$0")/.."
backend="${1:-shm}"
py="${PYTHON:-.venv/bin/python}"
port="${PORT:-8000}"
model="$($py -c 'from kvbridge.tools.tiny_model import build_tiny_model; print(build_tiny_model())')"
common=(--served-model-name tiny --host 127.0.0.1 --enforce-eager --dtype float32
        --max-model-len 1024 --block-size 32 --kv-cache-memory-bytes 268435456)
cfg() {  # role engine_id
    printf '{"kv_connector":"KVBridgeConnector","kv_role":"%s","engine_id":"%s","kv_connector_extra_config":{"backend":"%s"}}' "$1" "$2" "$backend"
}
pids=()
cleanup() { for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
# Small host: the two P engines share core 0 and the two D engines core 1; never put a P and a D
# on one core (their first UCX connection can livelock, docs/backends/nixl.md). Idle engines do
# not spin (docs/usage.md).
export KVBRIDGE_ENGINE_SPIN_MS=2
start() {  # name role core port
    VLLM_CPU_OMP_THREADS_BIND=$3 setsid $py -m kvbridge.integrations.vllm_serve serve "$model" \
        "${common[@]}" --port "$4" --kv-transfer-config "$(cfg "$2" "$1")" \
        > "/tmp/kvbridge-fleet-$1.log" 2>&1 &
    pids+=($!)
    echo "$1 ($2) on :$4, pid/pgid $!"
}
engines=($((port + 100)) $((port + 101)) $((port + 200)) $((port + 201)))
start prefill-0 kv_producer 0 "${engines[0]}"
start prefill-1 kv_producer 0 "${engines[1]}"
start decode-0 kv_consumer 1 "${engines[2]}"
start decode-1 kv_consumer 1 "${engines[3]}"
echo "starting engines (logs: /tmp/kvbridge-fleet-*.log; 4 engines on 2 cores take minutes) …"
for p in "${engines[@]}"; do
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$p/health" >/dev/null && break
        kill -0 "${pids[@]}" 2>/dev/null || { echo "an engine died; see the logs" >&2; exit 1; }
        sleep 1
    done
done
url() { echo "http://127.0.0.1:$1"; }
# headroom: every request is handed off (push or pull by D's load), so all four engines serve
# some; the default, auto (the planner), may keep short prompts like these on D alone
$py -m kvbridge.proxy --prefill "$(url "${engines[0]}")" "$(url "${engines[1]}")" \
    --decode "$(url "${engines[2]}")" "$(url "${engines[3]}")" --mode headroom --port "$port" &
pids+=($!)
sleep 2
echo "eight requests through the proxy, then where they went:"
curls=()
for i in $(seq 8); do
    curl -s "localhost:$port/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"tiny\",\"prompt\":[5,6,7,8,9,10,$i],\"max_tokens\":8}" >/dev/null &
    curls+=($!)
done
wait "${curls[@]}"
curl -s "localhost:$port/metrics" | grep '^kvbridge_proxy_engine_requests_total'
echo "proxy on http://127.0.0.1:$port — Ctrl-C to stop"
wait
