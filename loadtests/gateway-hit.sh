#!/usr/bin/env bash
# Cache-hit throughput through the gateway (sim engine at zero compute cost, ~4K-token prompt)
# side by side with a bare axum handler returning a fixed body for the same POST, at 1 and 32
# connections. Everything runs on 127.0.0.1 and stops by itself.
#
#   make bench-gateway            (or: loadtests/gateway-hit.sh [seconds])
#   CACHET_BIN=path/to/cachet loadtests/gateway-hit.sh 1    (another build; `make bench-slice`)
set -euo pipefail
. "$(dirname "$0")/bench-lib.sh"
bench_init gateway
SECS=${1:-10}
export CACHET_ENGINE=sim CACHET_SIM_TIME_SCALE=0 CACHET_DATA_DIR=$OUT/data RUST_LOG=warn
export CACHET_ENGINE_WORKERS=${BENCH_WORKERS:-8}
$BIN migrate >/dev/null
KEY=$(bench_key bench)
[ -n "$KEY" ] || { echo "gateway-hit: could not create the bench key" >&2; exit 1; }
$BIN loadtest bare-server --listen 127.0.0.1:18090 --seconds $((SECS * 6 + 60)) &
bench_serve 18081
echo "# $(date -u +%FT%TZ) $(nproc) cores; ${SECS}s per run; sim-tiny, ~4096-token prompt, every request a cache hit"
$BIN loadtest http --url http://127.0.0.1:18090 --label bare-axum --seconds "$SECS" --concurrency 1 --concurrency 32
$BIN loadtest http --url http://127.0.0.1:18081 --api-key "$KEY" --label cachet --seconds "$SECS" --concurrency 1 --concurrency 32
