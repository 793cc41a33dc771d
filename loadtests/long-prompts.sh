#!/usr/bin/env bash
# Peak memory against the configured bounds while replaying long prompts at rising rates: a
# RAG workload over long documents (up to 120 documents of 2 blocks a question, 256 tokens a
# block: prompts of 1K to 62K tokens, 0.1 to 7.7 GiB of KV each) on sim-llama-8b (128 KiB of
# KV a token) against one `cachet serve` with a 4 GiB KV budget and a 4 GiB DRAM tier. For
# each rate: answers, 529s, TTFT, hit ratio and the server's peak RSS (sampled every 0.2 s).
# Everything runs on 127.0.0.1 and stops by itself.
#
#   loadtests/long-prompts.sh [seconds per rate] [rates…]     (CACHET_BIN=… for another build)
#   BENCH_DEFAULTS=1   the server at its own defaults (KV budget a quarter of the machine, 1 GiB
#                      DRAM tier, the disk tier): peak RSS must stay within the bounds it
#                      reports (cachet_memory_bound_bytes) + 5% (BENCH_RSS_MAX_PCT), else the
#                      run fails (make bench-memory)
#   BENCH_TRACE=FILE   replay a Mooncake-format trace instead of the RAG workload
set -euo pipefail
. "$(dirname "$0")/bench-lib.sh"
bench_rates "$@"
bench_init long
export CACHET_ENGINE=sim CACHET_SIM_TIME_SCALE=${BENCH_TIME_SCALE:-1}
export CACHET_DATA_DIR=$OUT/data RUST_LOG=warn
if [ "${BENCH_DEFAULTS:-0}" = 1 ]; then
  RSS_MAX_PCT=${BENCH_RSS_MAX_PCT:-105}
else
  RSS_MAX_PCT=${BENCH_RSS_MAX_PCT:-}
  export CACHET_KV_BUDGET_BYTES=${BENCH_KV_BUDGET:-4294967296}
  export CACHET_DRAM_CAPACITY_BYTES=${BENCH_DRAM:-4294967296}
  # DRAM only unless BENCH_DISK says otherwise: the figures are peak RSS against DRAM and KV bounds.
  export CACHET_DISK_CAPACITY_BYTES=${BENCH_DISK:-0}
fi
$BIN migrate >/dev/null
KEY=$(bench_key long)
bench_serve 18096
rss() { awk '/VmRSS/ {print int($2/1024)}' "/proc/$SERVE_PID/status"; }
# The bounds the server itself reports, by setting.
bound() { curl -sf http://127.0.0.1:18096/metrics | awk -v s="$1" '$1 == "cachet_memory_bound_bytes{setting=\""s"\"}" {print int($2/1048576)}'; }
BOUNDS=$(curl -sf http://127.0.0.1:18096/metrics | awk '/^cachet_memory_bound_bytes\{/ {s += $2} END {print int(s/1048576)}')
[ "${BOUNDS:-0}" -gt 0 ] || { echo "long-prompts: the server reports no memory bounds" >&2; exit 1; }
echo "# $(date -u +%FT%TZ) $(nproc) cores; ${SECS}s per rate; KV budget $(bound engine.kv_budget_bytes) MiB, DRAM tier $(bound fabric.dram_capacity_bytes) MiB, disk tier ${CACHET_DISK_CAPACITY_BYTES:-default}; bounds in all $BOUNDS MiB; idle RSS $(rss) MiB"
printf 'rate/s\tok\t529\tother errors\tTTFT p50 ms\tTTFT p99 ms\thit ratio\tpeak RSS MiB\tof the bounds\n'
WORST=0
# What is replayed: the RAG workload, or a Mooncake-format trace (BENCH_TRACE=file, its own
# 512-token blocks; its timestamps are ignored for the rate).
if [ -n "${BENCH_TRACE:-}" ]; then
  SOURCE=(--trace "$BENCH_TRACE")
else
  SOURCE=(--workload rag --turn-blocks 120 --block-tokens 256)
fi
for rate in "${RATES[@]}"; do
  : >"$OUT/rss"
  (while kill -0 "$SERVE_PID" 2>/dev/null; do rss >>"$OUT/rss"; sleep 0.2; done) & SAMPLER=$!
  $BIN loadtest replay --url http://127.0.0.1:18096 --api-key "$KEY" --model sim-llama-8b \
    "${SOURCE[@]}" --max-output-tokens 8 \
    --rate "$rate" --duration "$SECS" --drain-secs 120 --max-error-rate 1 --out "$OUT/r$rate" --quiet >/dev/null
  kill "$SAMPLER" 2>/dev/null || true
  wait "$SAMPLER" 2>/dev/null || true
  SAMPLER=
  peak=$(sort -n "$OUT/rss" | tail -1)
  [ "$peak" -gt "$WORST" ] && WORST=$peak
  python3 - "$OUT/r$rate/summary.json" "$rate" "$peak" "$BOUNDS" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
st = s.get("statuses", {})
r529 = int(st.get("529", 0))
other = s["errors"] - r529
if other:
    sys.exit(f"errors other than 529 at rate {sys.argv[2]}: {s['error_kinds']}")
print(f"{sys.argv[2]}\t{s['ok']}\t{r529}\t{other}\t{s['ttft'].get('p50_ms', 0):.0f}\t{s['ttft'].get('p99_ms', 0):.0f}\t{s['hit_ratio']:.3f}\t{sys.argv[3]}\t{100 * int(sys.argv[3]) / int(sys.argv[4]):.0f}%")
PY
done
kill -0 "$SERVE_PID" || { echo "long-prompts: the server died during the run" >&2; tail -20 "$OUT/serve.log" >&2; exit 1; }
echo "server alive after the run; RSS now $(rss) MiB"
if [ -n "$RSS_MAX_PCT" ] && [ $((WORST * 100)) -gt $((BOUNDS * RSS_MAX_PCT)) ]; then
  echo "long-prompts: peak RSS $WORST MiB is over ${RSS_MAX_PCT}% of the bounds ($BOUNDS MiB)" >&2
  exit 1
fi
