#!/usr/bin/env bash
# `make run-vllm`: `make run`, plus a vLLM server (its CPU build) serving SmolLM2 with Cachet's
# KV connector, its KV kept in the service's fabric node. Clients name the model
# `smollm2-135m-instruct-vllm`; everything else is as `make run` (the reference engine too).
#
#   scripts/run-vllm.sh path/to/cachet
#
# Environment: CACHET_VLLM_PORT (8100), CACHET_FABRIC_LISTEN (127.0.0.1:7400, where the
# connector reaches the node), CACHET_CLUSTER_TOKEN (generated if unset: the connector and the
# node share it), VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE. vLLM's log: .cachet/vllm.log.
# CACHET_VLLM_SPLIT=1: two vLLM servers, prefill and decode apart (decision 0033): a prefill
# instance on CACHET_VLLM_PORT and a decode instance on the next port (log .cachet/vllm-decode.log),
# one core each.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:?usage: scripts/run-vllm.sh path/to/cachet}
PORT=${CACHET_VLLM_PORT:-8100}
export CACHET_FABRIC_LISTEN=${CACHET_FABRIC_LISTEN:-127.0.0.1:7400}
export CACHET_VLLM_URL=http://127.0.0.1:$PORT
export CACHET_CLUSTER_TOKEN=${CACHET_CLUSTER_TOKEN:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')}
mkdir -p .cachet
PORTS=("$PORT")
if [ "${CACHET_VLLM_SPLIT:-0}" = 1 ]; then
  PORTS+=($((PORT + 1)))
  export CACHET_VLLM_URL=http://127.0.0.1:$PORT,http://127.0.0.1:$((PORT + 1))
  export CACHET_VLLM_ROLES=prefill,decode
fi
PIDS=()
for i in "${!PORTS[@]}"; do
  LOG=.cachet/vllm.log
  [ "$i" = 0 ] || LOG=.cachet/vllm-decode.log
  echo "run-vllm: starting vLLM on 127.0.0.1:${PORTS[$i]} (log: $LOG; about 40 s)" >&2
  if [ "${#PORTS[@]}" -gt 1 ]; then
    VLLM_CPU_OMP_THREADS_BIND=$i setsid scripts/vllm-serve.sh "${PORTS[$i]}" "$CACHET_FABRIC_LISTEN" >"$LOG" 2>&1 &
  else
    setsid scripts/vllm-serve.sh "${PORTS[$i]}" "$CACHET_FABRIC_LISTEN" >"$LOG" 2>&1 &
  fi
  PIDS+=($!)
done
trap 'for p in "${PIDS[@]}"; do kill -- -$p 2>/dev/null || kill $p 2>/dev/null || true; done' EXIT
"$BIN" migrate >/dev/null
scripts/admin-user.sh "$BIN"
export CACHET_ADMIN_JWT_SECRET="${CACHET_ADMIN_JWT_SECRET:-$(scripts/admin-secret.sh)}"
KEY=$("$BIN" demo)
ADMIN=$("$BIN" billing token --role platform_admin --subject make-run --ttl-secs 86400)
for i in "${!PORTS[@]}"; do
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:${PORTS[$i]}/health" >/dev/null && break
    kill -0 "${PIDS[$i]}" 2>/dev/null || { echo "run-vllm: vLLM on ${PORTS[$i]} exited; see .cachet/vllm*.log" >&2; tail -20 .cachet/vllm*.log >&2; exit 1; }
    sleep 0.5
  done
done
scripts/print-examples.sh "$KEY" "$ADMIN"
SYSTEM="$(printf 'You are a friendly geography tutor who answers briefly and kindly. %.0s' $(seq 30))"
cat <<MSG
vLLM is up. Its model is "smollm2-135m-instruct-vllm"; its KV cache lives in Cachet's fabric
in whole 128-token blocks, so a cached prefix must be at least 128 tokens (run this twice: the
second reports cache_read_input_tokens > 0; restart vLLM and it is loaded from the fabric):

curl -s http://${CACHET_LISTEN:-127.0.0.1:8080}/v1/messages \\
  -H "x-api-key: $KEY" -H "anthropic-version: 2023-06-01" -H "content-type: application/json" \\
  -d '{"model": "smollm2-135m-instruct-vllm", "max_tokens": 48,
       "system": [{"type": "text", "text": "$SYSTEM", "cache_control": {"type": "ephemeral"}}],
       "messages": [{"role": "user", "content": "What is the capital of France?"}]}'

MSG
"$BIN" serve
