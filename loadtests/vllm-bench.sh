#!/usr/bin/env bash
# `make bench-vllm`: TTFT of vLLM's CPU build with a prefix its KV connector loads vs
# recomputed, at 1K / 4K / 7K prompt tokens (BENCH_SIZES), for Cachet's connector through the
# node's shared memory and over TCP, vLLM's own prefix-cache hit, no connector (the
# connector's cost on a miss) and vLLM's own offloading connector, with the loads' speed
# beside a plain copy and a crc32c pass of the same bytes, in one run
# (loadtests/vllm_bench.py). Needs Postgres; about 12 minutes on 2 cores.
#
#   loadtests/vllm-bench.sh [SCRIPT]   another measuring script in the same environment:
#   `make bench-vllm-routing` runs loadtests/vllm_routing_bench.py (multi-turn chats on two
#   vLLM instances behind the router, with and without their KV events; about 10 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/vllm-env.sh)
scripts/vllm-model.sh "$PY" >/dev/null
export CACHET_BIN=${CACHET_BIN:-${CARGO_TARGET_DIR:-target}/release/cachet}
[ -x "$CACHET_BIN" ] || cargo build --release --locked --bin cachet
export CACHET_VLLM_TEST_LOGS=${CACHET_VLLM_TEST_LOGS:-$(mktemp -d)}
echo "# $(date -u +%FT%TZ) $(nproc) cores; logs in $CACHET_VLLM_TEST_LOGS" >&2
exec "$PY" "${1:-loadtests/vllm_bench.py}"
