#!/usr/bin/env bash
# Run make targets one after another, stop at the first that fails, and print how long each
# took (the CI log's last lines say where the suite's time goes).
# Usage: scripts/steps.sh TARGET...
set -uo pipefail
cd "$(dirname "$0")/.."
declare -a done_steps=()
summary() {
  echo "== time per step (s)"
  printf '   %s\n' "${done_steps[@]}"
}
for step in "$@"; do
  start=$(date +%s)
  echo "== make $step ($(date -u +%H:%M:%S))"
  ${MAKE:-make} --no-print-directory "$step"
  rc=$?
  done_steps+=("$(printf '%-12s %5d%s' "$step" $(( $(date +%s) - start )) "$([ $rc -eq 0 ] || echo '  FAILED')")")
  if [ $rc -ne 0 ]; then summary; exit $rc; fi
done
summary
