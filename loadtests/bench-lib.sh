# Sourced by the benchmark scripts beside it (from the repository's root, where it moves
# them): the build to measure, a scratch database and folder, one `cachet serve`, and a cleanup
# on exit that stops every job the script started in the background, drops the database and
# removes the folder.
#
#   bench_rates "$@"   SECS (the first argument, default 30) and RATES (the rest, default
#                      0.5 1 2) of a script that replays at rising rates
#   bench_init NAME    BIN, PG, DB (cachet_bench_NAME_<pid>), OUT, DATABASE_URL; the EXIT trap
#                      (it also calls bench_cleanup_more, where the script defines one)
#   bench_key TENANT   creates the tenant in the (migrated) database and prints a key of it
#   bench_serve PORT   `cachet serve` on 127.0.0.1:PORT (log: $OUT/serve.log), SERVE_PID; waits
#                      for /readyz
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bench_rates() {
  SECS=${1:-30}
  shift || true
  RATES=("$@")
  [ ${#RATES[@]} -gt 0 ] || RATES=(0.5 1 2)
}

bench_init() {
  BIN=${CACHET_BIN:-${CARGO_TARGET_DIR:-target}/release/cachet}
  [ -x "$BIN" ] || cargo build --release --locked --bin cachet
  PG=${BENCH_PG:-postgres://postgres@127.0.0.1:5432}
  DB=cachet_bench_${1}_$$
  OUT=$(mktemp -d)
  export DATABASE_URL=$PG/$DB
  trap bench_cleanup EXIT
}

bench_cleanup() {
  local jobs
  jobs=$(jobs -p)
  # shellcheck disable=SC2086 # one pid a word
  [ -z "$jobs" ] || kill $jobs 2>/dev/null || true
  wait 2>/dev/null || true
  if declare -F bench_cleanup_more >/dev/null; then bench_cleanup_more || true; fi
  psql "$PG/postgres" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$OUT"
}

bench_key() {
  $BIN admin tenant create "$1" >/dev/null
  $BIN admin key create --tenant "$1" 2>/dev/null
}

bench_serve() {
  CACHET_LISTEN=127.0.0.1:$1 $BIN serve >/dev/null 2>"$OUT/serve.log" &
  SERVE_PID=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$1/readyz" >/dev/null && break; sleep 0.1; done
}
