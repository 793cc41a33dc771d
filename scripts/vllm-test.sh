#!/usr/bin/env bash
# `make vllm-test`: vLLM behind Cachet, end to end (tests/vllm/test_vllm.py), against a real vLLM
# CPU server with Cachet's KV connector. Installs the pinned environment (reused when its pins
# match) and converts the model first. Logs go to $CACHET_VLLM_TEST_LOGS (default: a temporary
# directory, printed on failure).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/vllm-env.sh)
scripts/vllm-model.sh "$PY" >/dev/null
export CACHET_BIN=${CACHET_BIN:-${CARGO_TARGET_DIR:-target}/debug/cachet}
export CACHET_VLLM_TEST_LOGS=${CACHET_VLLM_TEST_LOGS:-$(mktemp -d)}
if ! "$PY" -m unittest -v tests/vllm/test_transfer.py tests/vllm/test_vllm.py; then
  echo "vllm-test: logs in $CACHET_VLLM_TEST_LOGS" >&2
  for f in "$CACHET_VLLM_TEST_LOGS"/*.log; do
    echo "==== $f (last 40 lines)" >&2
    tail -40 "$f" >&2
  done
  exit 1
fi
