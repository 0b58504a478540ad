#!/usr/bin/env bash
# The hand-off issue's numbers (wake on arrival), in one command; results go to $OUT.
#
#   benchmarks/wake_on_arrival.sh [OUT]        (default OUT: /tmp/kvbridge-wake-<date>)
#
# 1. kvbridge bench handoff, nixl and shm: two engine pairs, wake on arrival on and off
#    (KVBRIDGE_WAKE_ON_ARRIVAL=0), interleaved sequential push and pull requests: every step of
#    the hand-off side by side, hand-off minus wire, paired differences, idle CPU; then nixl
#    with direct arrival on and off (KVBRIDGE_DIRECT_ARRIVAL=0, --against nodirect).
# 2. kvbridge bench e2e, kvbridge's two configurations: bar 1, push hand-off p50 minus wire time
#    <= 2 ms sequential ("hand-off minus wire time" lines).
# 3. kvbridge bench serve, kvbridge pull and push at rising rates, with wake on arrival on, then
#    off: bar 2, push TTFT p50 <= 1/3 of pull's at the highest rate both sustain (last lines of
#    each table), and where the time goes at each rate ("hand-off steps").
# 4. kvbridge bench transfer and descriptors: item 3, kvbridge against raw NIXL on the same
#    buffers, requests built ahead as the connector builds them (--ahead) and built in the timed
#    call, 300 paired reps; shm against memcpy; item 2, the per-transfer descriptor cost.
#
# Every engine's whole process tree is pinned to its core (--pin-engines): on a 2-core host the
# other engine's API server and threads otherwise run on P's core during its prefill, which is
# host contention, not hand-off latency (docs/results/2026-12-04-wake-on-arrival.md).
# About 55 minutes on a quiet 2-core host; meant for one (the numbers of a busy host are noise).
set -uo pipefail  # a failed run is reported in its table; the others still run
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/kvbridge-wake-$(date +%Y%m%d-%H%M%S)}
KVB=${KVB:-.venv/bin/kvbridge}
mkdir -p "$OUT"
echo "results in $OUT; load $(cut -d' ' -f1-3 /proc/loadavg)"
for backend in nixl shm; do
  "$KVB" bench handoff --backend "$backend" --requests 40 --pin-engines \
    --output "$OUT/handoff-$backend.json" \
    --log-dir "$OUT/handoff-$backend-logs" | tee "$OUT/handoff-$backend.txt"
done
"$KVB" bench handoff --backend nixl --requests 40 --pin-engines --against nodirect \
  --output "$OUT/handoff-nixl-nodirect.json" --log-dir "$OUT/handoff-nixl-nodirect-logs" \
  | tee "$OUT/handoff-nixl-nodirect.txt"
"$KVB" bench e2e --configs kvbridge-nixl,kvbridge-shm --pin-engines --output "$OUT/e2e.json" \
  --log-dir "$OUT/e2e-logs" | tee "$OUT/e2e.txt"
RATES=4,8,16,24,32
"$KVB" bench serve --setups kvbridge-pull,kvbridge-push --rates "$RATES" --num-prompts 64 \
  --pin-engines --no-progress --no-plots --out "$OUT/serve-wake" | tee "$OUT/serve-wake.txt"
KVBRIDGE_WAKE_ON_ARRIVAL=0 "$KVB" bench serve --setups kvbridge-pull,kvbridge-push \
  --rates "$RATES" --num-prompts 64 --pin-engines --no-progress --no-plots \
  --out "$OUT/serve-nowake" \
  | tee "$OUT/serve-nowake.txt"
for ahead in --ahead ""; do
  UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} "$KVB" bench transfer --backend nixl --block-kib 256 \
    --total-mib 64 --reps 300 $ahead | tee "$OUT/transfer-nixl${ahead}.txt"
done
"$KVB" bench transfer --backend shm --block-kib 256 1024 --reps 120 | tee "$OUT/transfer-shm.txt"
UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} "$KVB" bench descriptors | tee "$OUT/descriptors.txt"
echo "done: $OUT; load $(cut -d' ' -f1-3 /proc/loadavg)"
