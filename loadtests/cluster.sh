#!/usr/bin/env bash
# A 3-node cluster (`cachet node` × 3 with engines, `cachet router`) on sim-llama-8b (128 KiB of
# KV a token, time scale 1), each node with its own KV budget and DRAM tier, replaying a
# synthetic workload at rising rates. For each rate: answers, 529s, TTFT, the measured hit
# ratio beside `simulate-cache`'s for the same requests at the cluster's capacity (the nodes'
# DRAM tiers together, divided by the replicas each block has) and `simulate-fleet`'s (three
# nodes with Cachet's conductor and pool on the same requests), and every node's peak RSS
# (sampled every 0.2 s) against its configured bounds. Everything runs on 127.0.0.1 and stops
# by itself.
#
#   loadtests/cluster.sh [seconds per rate] [rates…]     (CACHET_BIN=… for another build)
#   BENCH_WORKLOAD=rag|chat|agent|scan   the workload (default rag: 1K–62K-token prompts)
#   BENCH_REPLICAS=1|2   copies of each block (default 2)
#   BENCH_KV_BUDGET, BENCH_DRAM   bytes per node (default 1 GiB each)
#   BENCH_RECEIVE   bytes of peers' writes a node receives at once (default 256 MiB)
set -euo pipefail
. "$(dirname "$0")/bench-lib.sh"
bench_rates "$@"
bench_init cluster
BUDGET=${BENCH_KV_BUDGET:-1073741824}
DRAM=${BENCH_DRAM:-1073741824}
RECEIVE=${BENCH_RECEIVE:-268435456}
REPLICAS=${BENCH_REPLICAS:-2}
WORKLOAD=${BENCH_WORKLOAD:-rag}
PREFIX=bench$$
export REDIS_URL=${BENCH_REDIS:-redis://127.0.0.1:6379}
export CACHET_CLUSTER_TOKEN=bench-cluster-token-$$
export CACHET_ENGINE=sim CACHET_SIM_TIME_SCALE=${BENCH_TIME_SCALE:-1} RUST_LOG=warn
export CACHET_KV_BUDGET_BYTES=$BUDGET CACHET_DRAM_CAPACITY_BYTES=$DRAM CACHET_DISK_CAPACITY_BYTES=0
export CACHET_RECEIVE_BUDGET_BYTES=$RECEIVE
cat >"$OUT/cachet.toml" <<EOF
[cluster]
replicas = $REPLICAS
group_size = 3
EOF
export CACHET_CONFIG=$OUT/cachet.toml
bench_cleanup_more() {
  redis-cli -u "$REDIS_URL" --scan --pattern "$PREFIX:*" 2>/dev/null | xargs -r redis-cli -u "$REDIS_URL" del >/dev/null 2>&1
}
$BIN migrate >/dev/null
KEY=$(bench_key cluster-bench)
NODES=()
for n in 1 2 3; do
  CACHET_DATA_DIR=$OUT/data-n$n $BIN node --id n$n --redis-prefix "$PREFIX" \
    --listen 127.0.0.1:$((17500 + n)) --api-listen 127.0.0.1:$((18500 + n)) \
    >"$OUT/n$n.out" 2>"$OUT/n$n.log" &
  NODES+=($!)
done
CACHET_LISTEN=127.0.0.1:18097 CACHET_DATA_DIR=$OUT/data-gw $BIN router --redis-prefix "$PREFIX" \
  >"$OUT/gw.out" 2>"$OUT/gw.log" &
for _ in $(seq 300); do
  [ "$(curl -sf http://127.0.0.1:18097/readyz 2>/dev/null | grep -o '"n[123]"' | sort -u | wc -l)" = 3 ] && break
  sleep 0.1
done
curl -sf http://127.0.0.1:18097/readyz >/dev/null || { echo "cluster: the gateway is not ready" >&2; cat "$OUT/gw.log" >&2; exit 1; }
rss() { awk '/VmRSS/ {print int($2/1024)}' "/proc/$1/status" 2>/dev/null; }
# A node that died fails the run (its RSS would otherwise read as nothing).
alive() {
  local n
  for n in 0 1 2; do
    kill -0 "${NODES[$n]}" 2>/dev/null \
      || { echo "cluster: node n$((n + 1)) died" >&2; tail -20 "$OUT/n$((n + 1)).log" >&2; exit 1; }
  done
}
SIM=$((3 * DRAM / REPLICAS))
echo "# $(date -u +%FT%TZ) $(nproc) cores; ${SECS}s per rate; workload $WORKLOAD; 3 nodes, each: KV budget $((BUDGET >> 20)) MiB, DRAM tier $((DRAM >> 20)) MiB; $REPLICAS replicas; simulated at $((SIM >> 20)) MiB; idle RSS $(rss "${NODES[0]}")/$(rss "${NODES[1]}")/$(rss "${NODES[2]}") MiB"
printf 'rate/s\tok\t529\tother errors\tTTFT p50 ms\tTTFT p99 ms\thit ratio\tsimulated\tfleet simulated\tpeak RSS n1/n2/n3 MiB\n'
for rate in "${RATES[@]}"; do
  for n in 0 1 2; do : >"$OUT/rss$n"; done
  (while true; do for n in 0 1 2; do rss "${NODES[$n]}" >>"$OUT/rss$n"; done; sleep 0.2; done) & SAMPLER=$!
  $BIN loadtest replay --url http://127.0.0.1:18097 --api-key "$KEY" --model sim-llama-8b \
    --workload "$WORKLOAD" --turn-blocks "${BENCH_TURN_BLOCKS:-120}" --block-tokens 256 --max-output-tokens 8 \
    --rate "$rate" --duration "$SECS" --drain-secs 120 --simulate-capacity-bytes "$SIM" \
    --max-error-rate 1 --out "$OUT/r$rate" --quiet >/dev/null
  kill "$SAMPLER" 2>/dev/null || true
  wait "$SAMPLER" 2>/dev/null || true
  SAMPLER=
  alive
  peaks=$(for n in 0 1 2; do sort -n "$OUT/rss$n" | tail -1; done | paste -sd/)
  # The fleet simulator on the same requests, in the order sent: three nodes, the pool at
  # their DRAM over the replicas, sim engines (no prefix cache of their own).
  SENT=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["sent"])' "$OUT/r$rate/summary.json")
  # The trace's timestamps are at the generator's 4 requests/s; the replay sent at $rate.
  $BIN loadtest simulate-fleet --trace "$OUT/r$rate/trace.jsonl" --max-requests "$SENT" --block-tokens 256 \
    --speed "$(python3 -c "print($rate / 4.0)")" \
    --instances 3 --routing pool --replicas "$REPLICAS" --dram-tokens $((DRAM / 131072)) \
    --engine-cache-tokens 0 --early-rejection off --model sim-llama-8b --json "$OUT/r$rate/fleet.json" >/dev/null 2>&1
  python3 - "$OUT/r$rate/summary.json" "$rate" "$peaks" "$OUT/r$rate/fleet.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
st = s.get("statuses", {})
r529 = int(st.get("529", 0))
other = s["errors"] - r529
if other:
    sys.exit(f"errors other than 529 at rate {sys.argv[2]}: {s['error_kinds']}")
sim = (s.get("simulated") or {}).get("token_hit_ratio")
sim = f"{sim:.3f}" if sim is not None else "-"
fleet = json.load(open(sys.argv[4]))[0]["hit_ratio"]
print(f"{sys.argv[2]}\t{s['ok']}\t{r529}\t{other}\t{s['ttft'].get('p50_ms', 0):.0f}\t{s['ttft'].get('p99_ms', 0):.0f}\t{s['hit_ratio']:.3f}\t{sim}\t{fleet:.3f}\t{sys.argv[3]}")
PY
done
echo "bounds per node: $(((BUDGET + DRAM + RECEIVE) >> 20)) MiB (KV budget + DRAM tier + receive budget); RSS after the run: $(rss "${NODES[0]}")/$(rss "${NODES[1]}")/$(rss "${NODES[2]}") MiB"
