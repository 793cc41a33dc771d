#!/usr/bin/env bash
# `make bench-vllm-routing`: TTFT p50/p99 of a multi-turn chat workload on two vLLM instances
# (CPU build, one core each) behind `cachet router`, routed with the nodes following vLLM's KV
# events and without, one fresh cluster each, in one run (loadtests/vllm_routing_bench.py).
# Needs Postgres and Redis; about 10 minutes on 2 cores (four runs: one request at a time and
# two at once, each with and without the events).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/vllm-env.sh)
scripts/vllm-model.sh "$PY" >/dev/null
export CACHET_BIN=${CACHET_BIN:-${CARGO_TARGET_DIR:-target}/release/cachet}
[ -x "$CACHET_BIN" ] || cargo build --release --locked --bin cachet
export CACHET_VLLM_TEST_LOGS=${CACHET_VLLM_TEST_LOGS:-$(mktemp -d)}
echo "# $(date -u +%FT%TZ) $(nproc) cores; logs in $CACHET_VLLM_TEST_LOGS" >&2
exec "$PY" loadtests/vllm_routing_bench.py
