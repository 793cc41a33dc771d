#!/usr/bin/env bash
# Tenant B's time to first token alone, then beside a tenant A that floods the same model
# (sim-llama-8b at time scale 1: 60 µs a prompt token, 12 ms an output token), against one
# `cachet serve` with 8 engine workers. Both replay synthetic chat workloads with Poisson
# arrivals; A offers about three times what the workers can serve. Prints B's TTFT p50/p99 in
# both runs and A's throughput. Everything runs on 127.0.0.1 and stops by itself.
#
#   loadtests/fairness.sh [seconds]            (CACHET_BIN=path/to/cachet for another build)
#   BENCH_B_RATE=1 BENCH_B_WORKLOAD=chat       B's offered rate and workload shape
set -euo pipefail
. "$(dirname "$0")/bench-lib.sh"
bench_init fair
SECS=${1:-30}
export CACHET_ENGINE=sim CACHET_SIM_TIME_SCALE=1 CACHET_DATA_DIR=$OUT/data RUST_LOG=warn
export CACHET_ENGINE_WORKERS=8
$BIN migrate >/dev/null
KEY_A=$(bench_key tenant-a)
KEY_B=$(bench_key tenant-b)
bench_serve 18095
URL=http://127.0.0.1:18095
# 64 output tokens: 0.77 s of decode a request; 8 workers serve about 10 requests/s.
common=(--url "$URL" --model sim-llama-8b --block-tokens 64 --max-output-tokens 64 --quiet)
b_run() {
  $BIN loadtest replay "${common[@]}" --api-key "$KEY_B" --workload-seed 2 --rate "${BENCH_B_RATE:-1}" \
    --workload "${BENCH_B_WORKLOAD:-chat}" --duration "$SECS" --out "$OUT/$1" >/dev/null
}
pick() { python3 -c "import json,sys; s=json.load(open('$OUT/$1/summary.json')); print($2)"; }
echo "# $(date -u +%FT%TZ) $(nproc) cores; ${SECS}s per run; build $($BIN --version 2>/dev/null || echo "$BIN")"
b_run b-alone
# A is refused much of what it offers (that is the point): its run fails only if nothing of it
# was answered. B, at its modest rate, must not be refused (the default error rate).
$BIN loadtest replay "${common[@]}" --api-key "$KEY_A" --workload chat --workload-seed 1 --rate 30 \
  --duration $((SECS + 10)) --drain-secs 5 --max-error-rate 1 --out "$OUT/a" >/dev/null 2>"$OUT/a.err" & A_PID=$!
sleep 5
b_run b-beside-a
wait "$A_PID" || { echo "fairness: the flooding replay failed:" >&2; cat "$OUT/a.err" >&2; exit 1; }
kill -0 "$SERVE_PID" || { echo "fairness: the server died during the run" >&2; tail -20 "$OUT/serve.log" >&2; exit 1; }
printf 'run\tB ok\tB errors\tB TTFT p50 ms\tB TTFT p99 ms\n'
for r in b-alone b-beside-a; do
  printf '%s\t%s\t%s\t%s\t%s\n' "$r" "$(pick $r "s['ok']")" "$(pick $r "s['errors']")" \
    "$(pick $r "round(s['ttft']['p50_ms'],1)")" "$(pick $r "round(s['ttft']['p99_ms'],1)")"
done
printf 'A (flooding): ok %s, errors %s, %s req/s\n' "$(pick a "s['ok']")" "$(pick a "s['errors']")" \
  "$(pick a "round(s['throughput']['requests_per_sec'],2)")"
