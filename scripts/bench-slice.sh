#!/usr/bin/env bash
# A short slice of every benchmark behind docs/benchmarks.md, so none can silently break:
# each command runs as documented, at a size that takes about a second, against the given
# build (make test passes its debug build). The figures mean nothing at this size; a
# benchmark that fails to run fails this script.
#
#   scripts/bench-slice.sh [path/to/cachet]        (make bench-slice)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(realpath "${1:-${CARGO_TARGET_DIR:-target}/debug/cachet}")
[ -x "$BIN" ] || { echo "bench-slice: no cachet binary at $BIN" >&2; exit 1; }
PG=${BENCH_PG:-postgres://postgres@127.0.0.1:5432}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
TMP=$(mktemp -d)
DB=cachet_bench_slice_$$
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  psql "$PG/postgres" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$TMP"
}
trap cleanup EXIT
step() { printf '\n== bench-slice: %s\n' "$*"; }

step "gateway cache hits (loadtests/gateway-hit.sh 1)"
CACHET_BIN=$BIN loadtests/gateway-hit.sh 1

step "tenant B beside a flooding tenant A (loadtests/fairness.sh 2)"
CACHET_BIN=$BIN loadtests/fairness.sh 2

step "long prompts within the memory bounds (loadtests/long-prompts.sh 2 1)"
CACHET_BIN=$BIN BENCH_TIME_SCALE=0 BENCH_KV_BUDGET=536870912 BENCH_DRAM=536870912 loadtests/long-prompts.sh 2 1

step "a 3-node cluster: peak RSS and hit ratio beside the simulation (loadtests/cluster.sh 2 1)"
CACHET_BIN=$BIN BENCH_TIME_SCALE=0 BENCH_TURN_BLOCKS=4 BENCH_KV_BUDGET=268435456 BENCH_DRAM=268435456 loadtests/cluster.sh 2 1

step "a fleet in simulated time (make bench-fleet, 60 requests)"
"$BIN" loadtest simulate-fleet --trace tests/data/conversation_trace_head200.jsonl --max-requests 60 \
  --workload rag --workload-requests 60 --instances 4 --split 1 --early-rejection both >/dev/null

step "the KV data path alone (loadtests/kv_data_path.py, two blocks)"
"$(scripts/vllm-env.sh)" loadtests/kv_data_path.py --geometry smollm2 --tokens 256 --runs 1 --bin "$BIN"

step "a cache object against resending its content (loadtests/cache-objects.sh 1)"
CACHET_BIN=$BIN BENCH_MODEL=sim-tiny BENCH_OBJECT_WORDS=400 BENCH_TIME_SCALE=0 loadtests/cache-objects.sh 1

step "fabric transfer"
$BIN loadtest transfer --size-mib 1 --iterations 2 --stripes 1 --stripes 2
step "prefix index"
$BIN loadtest index --blocks 20000 --prompt-tokens 4096 --lookups 20
step "block events"
$BIN loadtest events --blocks 2000 --rate 4000
step "ledger ingest"
$BIN loadtest ingest --events 2000 --producers 4 --database-url "$PG/postgres"
step "usage export"
$BIN loadtest export --rows 2000 --database-url "$PG/postgres"
step "admin dashboard"
$BIN loadtest dashboard --rows 20000 --tenants 4 --days 2 --requests 10 --concurrency 2 --database-url "$PG/postgres"

step "cache simulation"
$BIN loadtest simulate-cache --trace tests/data/conversation_trace_head200.jsonl --capacity-blocks 500 --policy lru
$BIN loadtest simulate-cache --workload chat --workload-requests 200 --capacity-bytes 512M --model sim-llama-8b

step "replayer against a bare server"
$BIN loadtest bare-server --listen 127.0.0.1:18092 --seconds 30 & PIDS+=($!)
for _ in $(seq 50); do curl -s -o /dev/null http://127.0.0.1:18092/ && break; sleep 0.1; done
$BIN loadtest generate --workload chat --workload-requests 200 --workload-rate 200 --out "$TMP/chat.jsonl"
$BIN loadtest replay --trace "$TMP/chat.jsonl" --url http://127.0.0.1:18092 --api-key k1,k2 \
  --out "$TMP/replay" --rate 200 --duration 1 --check-tokens 0 --quiet
test -s "$TMP/replay/report.html"

step "coalescing burst against cachet serve (sim engine)"
export DATABASE_URL=$PG/$DB
$BIN migrate >/dev/null
$BIN admin tenant create slice >/dev/null
KEY=$($BIN admin key create --tenant slice 2>/dev/null)
CACHET_ENGINE=sim CACHET_LISTEN=127.0.0.1:18093 CACHET_DATA_DIR=$TMP/serve RUST_LOG=warn $BIN serve & PIDS+=($!)
for _ in $(seq 100); do curl -sf http://127.0.0.1:18093/readyz >/dev/null && break; sleep 0.1; done
$BIN loadtest burst --url http://127.0.0.1:18093 --api-key "$KEY" --model sim-tiny --requests 4 \
  --prompt-tokens 512 --max-tokens 2 --rounds 1

echo
echo "bench-slice: every benchmark ran"
