#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer) of what reads untrusted bytes: Messages
# request validation and rendering, the fabric transport's frames, the disk tier's segment
# records, the meter's spool lines. Each target runs for SECS seconds from its committed
# corpus (fuzz/corpus/<target>); a crash fails the run and leaves its input under
# fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh SECS [grow]
#
# `make test` runs a slice (new inputs go to a scratch directory, the corpus stays as
# committed); `make fuzz` runs long with `grow`, adding what it finds to the corpus.
set -euo pipefail
secs=${1:-20} mode=${2:-}
cd "$(dirname "$0")/.."
targets=(messages_request fabric_frames disk_segment spool_lines)

# cargo-fuzz from crates.io, once per machine (pinned: its flags must match libfuzzer-sys).
if ! cargo fuzz --version 2>/dev/null | grep -q '0.13.2'; then
  cargo install cargo-fuzz --version 0.13.2 --locked --quiet
fi
cd fuzz
# Its own target directory: other RUSTFLAGS than the main build, which must not be rebuilt.
export CARGO_TARGET_DIR="$PWD/target"
# No sanitizer: the code is safe Rust (what is unsafe is the GPU and RDMA paths, not built
# here); what is looked for is panics, overflows (debug assertions are on), hangs and
# unbounded allocation. That keeps the build on the pinned stable toolchain.
# The slice (`make test`) runs 15 s a target: built at opt-level 1 without line tables, it
# builds in much less time than the release profile the long runs keep (decision 0028).
if [ "$mode" != grow ]; then
  export CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_DEBUG=0
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! cargo fuzz build -s none --release --debug-assertions >"$log" 2>&1; then
  tail -40 "$log"; exit 1
fi
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  rm -rf "artifacts/$t"
  if [ "$mode" = grow ]; then
    dirs=("corpus/$t")
  else
    scratch=$(mktemp -d)
    dirs=("$scratch" "corpus/$t")
  fi
  echo "fuzz: $t for ${secs}s from $(ls "corpus/$t" | wc -l) corpus inputs"
  status=0
  cargo fuzz run -s none --release --debug-assertions "$t" "${dirs[@]}" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -max_len=65536 \
    -print_final_stats=1 >"$log" 2>&1 || status=$?
  grep -E '^stat::(number_of_executed_units|new_units_added)' "$log" | tr '\n' ' '; echo
  if [ "$status" != 0 ]; then
    grep -E -A30 'panicked|ERROR: libFuzzer|SUMMARY' "$log" | head -60
    echo "fuzz: $t failed (exit $status); its input is under fuzz/artifacts/$t/"
    exit 1
  fi
  if [ "$mode" = grow ]; then
    # Keep the smallest set of inputs that covers what the whole corpus covers.
    cargo fuzz cmin -s none --release --debug-assertions "$t" "corpus/$t" >"$log" 2>&1 \
      || { tail -20 "$log"; exit 1; }
    echo "fuzz: corpus/$t minimized to $(ls "corpus/$t" | wc -l) inputs"
  else
    rm -rf "$scratch"
  fi
done
echo "fuzz: ${#targets[@]} targets, ${secs}s each, no crash"
