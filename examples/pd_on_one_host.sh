#!/usr/bin/env bash
# One prefill and one decode vLLM engine with KVBridgeConnector, and kvbridge's proxy, on one CPU
# host — the commands a deployment runs, spelled out. Ctrl-C stops everything.
#
#   examples/pd_on_one_host.sh [backend]      # backend: shm (default), nixl, mooncake
#
# Then, from another shell:
#   curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
#        -d '{"model":"tiny","prompt":[5,6,7,8,9,10,11,12],"max_tokens":8}'
set -euo pipefail
cd "$(dirname "$0")/.."
backend="${1:-shm}"
py=.venv/bin/python
model="$($py -c 'from kvbridge.tools.tiny_model import build_tiny_model; print(build_tiny_model())')"
common=(--served-model-name tiny --host 127.0.0.1 --enforce-eager --dtype float32
        --max-model-len 1024 --block-size 32 --kv-cache-memory-bytes 268435456)
cfg() {  # role engine_id
    printf '{"kv_connector":"KVBridgeConnector","kv_role":"%s","engine_id":"%s","kv_connector_extra_config":{"backend":"%s"}}' "$1" "$2" "$backend"
}
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
# Small host: pin P and D to different cores and stop idle engines from spinning (docs/usage.md).
export KVBRIDGE_ENGINE_SPIN_MS=2
VLLM_CPU_OMP_THREADS_BIND=0 $py -m kvbridge.integrations.vllm_serve serve "$model" "${common[@]}" \
    --port 8100 --kv-transfer-config "$(cfg kv_producer prefill-0)" > /tmp/kvbridge-example-P.log 2>&1 &
pids+=($!)
VLLM_CPU_OMP_THREADS_BIND=1 $py -m kvbridge.integrations.vllm_serve serve "$model" "${common[@]}" \
    --port 8200 --kv-transfer-config "$(cfg kv_consumer decode-0)" > /tmp/kvbridge-example-D.log 2>&1 &
pids+=($!)
echo "starting engines (logs: /tmp/kvbridge-example-{P,D}.log) …"
for port in 8100 8200; do
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        kill -0 "${pids[@]}" 2>/dev/null || { echo "an engine died; see the logs" >&2; exit 1; }
        sleep 1
    done
done
.venv/bin/kvbridge proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
    --mode auto --port 8000 &
pids+=($!)
sleep 2
echo "one request through the proxy:"
curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
    -d '{"model":"tiny","prompt":[5,6,7,8,9,10,11,12],"max_tokens":8}'
echo
echo "proxy on http://127.0.0.1:8000 — Ctrl-C to stop"
wait
