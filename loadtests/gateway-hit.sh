#!/usr/bin/env bash
# Cache-hit throughput through the gateway (sim engine at zero compute cost, ~4K-token prompt)
# side by side with a bare axum handler returning a fixed body for the same POST, at 1 and 32
# connections. Everything runs on 127.0.0.1 and stops by itself.
#
#   make bench-gateway            (or: loadtests/gateway-hit.sh [seconds])
#   CACHET_BIN=path/to/cachet loadtests/gateway-hit.sh 1    (another build; `make bench-slice`)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
BIN=${CACHET_BIN:-${CARGO_TARGET_DIR:-target}/release/cachet}
[ -x "$BIN" ] || cargo build --release --locked --bin cachet
DB=cachet_bench_$$
export DATABASE_URL=${BENCH_PG:-postgres://postgres@127.0.0.1:5432}/$DB
export CACHET_ENGINE=sim CACHET_LISTEN=127.0.0.1:18081 CACHET_SIM_TIME_SCALE=0 CACHET_DATA_DIR=$(mktemp -d) RUST_LOG=warn
export CACHET_ENGINE_WORKERS=${BENCH_WORKERS:-8}
cleanup() {
  kill "${SERVE_PID:-}" "${BARE_PID:-}" 2>/dev/null || true
  wait 2>/dev/null || true
  psql "${BENCH_PG:-postgres://postgres@127.0.0.1:5432}/postgres" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT
$BIN migrate >/dev/null
$BIN admin tenant create bench >/dev/null
KEY=$($BIN admin key create --tenant bench 2>/dev/null)
[ -n "$KEY" ] || { echo "gateway-hit: could not create the bench key" >&2; exit 1; }
$BIN serve & SERVE_PID=$!
$BIN loadtest bare-server --listen 127.0.0.1:18090 --seconds $((SECS * 6 + 60)) & BARE_PID=$!
for _ in $(seq 100); do curl -sf http://127.0.0.1:18081/readyz >/dev/null && break; sleep 0.1; done
echo "# $(date -u +%FT%TZ) $(nproc) cores; ${SECS}s per run; sim-tiny, ~4096-token prompt, every request a cache hit"
$BIN loadtest http --url http://127.0.0.1:18090 --label bare-axum --seconds "$SECS" --concurrency 1 --concurrency 32
$BIN loadtest http --url http://127.0.0.1:18081 --api-key "$KEY" --label cachet --seconds "$SECS" --concurrency 1 --concurrency 32
