#!/usr/bin/env bash
# Start a vLLM server (its CPU build) serving SmolLM2 with Cachet's KV connector, which keeps
# its KV in the Cachet fabric node at FABRIC_ADDR (the node's cluster token comes from
# CACHET_CLUSTER_TOKEN). Installs the pinned environment and converts the model first if
# needed (scripts/vllm-env.sh, scripts/vllm-model.sh).
#
#   scripts/vllm-serve.sh PORT FABRIC_ADDR
#
# Environment: VLLM_CPU_OMP_THREADS_BIND (cores to pin to, e.g. "0" or "1"; vLLM's default:
# all), VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, default 1), CACHET_VLLM_BLOCK_SIZE (default
# 128), CACHET_VLLM_CONNECTOR=off (serve without the connector: the baseline benchmarks use)
# or a whole --kv-transfer-config JSON (another connector), CACHET_VLLM_KV_EVENTS=PORT (publish
# vLLM's KV events on tcp://*:PORT, replay on PORT+1: the node beside it follows them with
# CACHET_VLLM_KV_EVENTS=tcp://127.0.0.1:PORT|tcp://127.0.0.1:PORT+1), CACHET_VLLM_ARGS (more
# arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:?usage: scripts/vllm-serve.sh PORT FABRIC_ADDR}
FABRIC=${2:?usage: scripts/vllm-serve.sh PORT FABRIC_ADDR}
PY=$(scripts/vllm-env.sh)
MODEL=$(scripts/vllm-model.sh "$PY")
export PYTHONPATH="$PWD/connectors/vllm${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# vLLM's usage reporting would try the network; nothing outside is reachable here.
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
BLOCK=${CACHET_VLLM_BLOCK_SIZE:-128}
KV=()
case "${CACHET_VLLM_CONNECTOR:-on}" in
  on) KV=(--kv-transfer-config "{\"kv_connector\":\"CachetConnector\",\"kv_connector_module_path\":\"cachet_vllm.connector\",\"kv_role\":\"kv_both\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"fabric_addr\":\"$FABRIC\"}}") ;;
  off) ;;
  *) KV=(--kv-transfer-config "$CACHET_VLLM_CONNECTOR") ;;
esac
EVENTS=()
if [ -n "${CACHET_VLLM_KV_EVENTS:-}" ]; then
  P=$CACHET_VLLM_KV_EVENTS
  EVENTS=(--kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$P\",\"replay_endpoint\":\"tcp://*:$((P + 1))\"}")
fi
exec "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name smollm2 \
  --host 127.0.0.1 --port "$PORT" --dtype float32 --enforce-eager --max-model-len 8192 \
  --block-size "$BLOCK" "${KV[@]}" "${EVENTS[@]}" ${CACHET_VLLM_ARGS:-}
