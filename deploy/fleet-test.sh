#!/usr/bin/env bash
# `make fleet-test`: the serve compose (deploy/compose.serve.yaml) answering the README's SDK
# example; then the 3-node compose (deploy/compose.cluster.yaml) from the images `make
# image` built; requests through the router; one node's container killed while they run;
# then every answered request must have its ledger row (the killed node's journal is replayed
# when its container starts again on the same volume), and no request may fail that
# recomputing on another node could serve. Stops and removes everything it started.
#
#   deploy/fleet-test.sh [requests]      (default 60; CACHET_ENGINE=reference for the real model)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-60}
PODMAN=scripts/podman.sh
VENV=.cachet/compose-venv
if [ ! -x "$VENV/bin/podman-compose" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check podman-compose==1.2.0
fi
PROJECT=cachet-fleet-$$
export PODMAN_COMPOSE_PROVIDER= CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/podman/containers.conf}
compose() {
  "$VENV/bin/podman-compose" --podman-path "$PWD/scripts/podman.sh" -p "$PROJECT" \
    -f deploy/compose.cluster.yaml "$@"
}
export POSTGRES_PASSWORD=fleet-$RANDOM-$RANDOM CACHET_CLUSTER_TOKEN=fleet-test-token-$RANDOM-$RANDOM
export POSTGRES_IMAGE=localhost/cachet-test-services:latest REDIS_IMAGE=localhost/cachet-test-services:latest
export CACHET_ENGINE=${CACHET_ENGINE:-sim} RUST_LOG=warn
export CACHET_PORT=$((21000 + $$ % 5000))
LOGS=$(mktemp -d)
cleanup() {
  compose logs >"$LOGS/compose.log" 2>&1 || true
  compose down -v >/dev/null 2>&1 || true
  serve_compose down -v >/dev/null 2>&1 || true
  echo "fleet-test: logs in $LOGS/compose.log"
}
trap cleanup EXIT

# First the one-process compose, with the real model: the README's SDK example, as written
# there, twice (the second call reads what the first wrote).
serve_compose() {
  "$VENV/bin/podman-compose" --podman-path "$PWD/scripts/podman.sh" -p "$PROJECT-serve" \
    -f deploy/compose.serve.yaml "$@"
}
CACHET_ENGINE= serve_compose up -d >"$LOGS/serve-up.log" 2>&1 || { cat "$LOGS/serve-up.log" >&2; exit 1; }
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$CACHET_PORT/readyz" >/dev/null && break; sleep 1; done
SERVE=$($PODMAN ps --filter "label=io.podman.compose.project=$PROJECT-serve" --filter "label=com.docker.compose.service=cachet" --format '{{.Names}}' | head -1)
$PODMAN exec "$SERVE" cachet admin tenant create readme >/dev/null
SKEY=$($PODMAN exec "$SERVE" cachet admin key create --tenant readme 2>/dev/null)
python3 - README.md "http://127.0.0.1:$CACHET_PORT" "$SKEY" >"$LOGS/example.py" <<'PY'
import re, sys
readme, url, key = sys.argv[1:]
code = re.search(r"```python\n(import anthropic\n.*?)```", open(readme).read(), re.S).group(1)
code = code.replace('base_url="http://127.0.0.1:8080"', f'base_url="{url}"')
print(re.sub(r'api_key="sk-cachet-[^"]*"', f'api_key="{key}"', code))
print("assert r.content[0].text.strip(), r")
print("import json; print(json.dumps(r.usage.model_dump()))")
PY
first=$(.venv/bin/python "$LOGS/example.py" | tail -1)
second=$(.venv/bin/python "$LOGS/example.py" | tail -1)
python3 - "$first" "$second" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert a["cache_creation_input_tokens"] > 0, a
assert b["cache_read_input_tokens"] > 0, b
print(f"fleet-test: the serve compose answered the README's example: wrote {a['cache_creation_input_tokens']}, then read {b['cache_read_input_tokens']} cached tokens")
PY
serve_compose down -v >/dev/null 2>&1

compose up -d >"$LOGS/up.log" 2>&1 || { cat "$LOGS/up.log" >&2; exit 1; }
URL=http://127.0.0.1:$CACHET_PORT
for _ in $(seq 300); do
  [ "$(curl -sf "$URL/readyz" 2>/dev/null | grep -o '"n[123]"' | sort -u | wc -l)" = 3 ] && break
  sleep 1
done
curl -sf "$URL/readyz" | grep -q '"n3"' || { echo "fleet-test: the router never saw 3 nodes" >&2; curl -s "$URL/readyz" >&2; exit 1; }
container() { $PODMAN ps --filter "label=io.podman.compose.project=$PROJECT" --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1; }
ROUTER=$(container router)
$PODMAN exec "$ROUTER" cachet admin tenant create fleet >/dev/null
KEY=$($PODMAN exec "$ROUTER" cachet admin key create --tenant fleet 2>/dev/null)
VICTIM=$(container node2)
echo "fleet-test: 3 nodes up behind the router on $URL; $N requests, node2 ($VICTIM) killed a third of the way"
python3 - "$URL" "$KEY" "$N" "$VICTIM" "$LOGS/answered" <<'PY'
import json, subprocess, sys, threading, time, urllib.error, urllib.request
url, key, n, victim, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
model = "sim-llama-8b"
system = "You answer questions about the solar system. " * 40
answered, failed, lock = [], [], threading.Lock()
def one(i):
    body = json.dumps({"model": model, "max_tokens": 8,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": f"question {i}: how far is planet {i % 9}?"}]}).encode()
    req = urllib.request.Request(f"{url}/v1/messages", data=body, headers={
        "x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            json.load(r)
            with lock:
                answered.append(r.headers["request-id"])
    except urllib.error.HTTPError as e:
        with lock:
            failed.append((i, e.code, e.read()[:200]))
    except Exception as e:
        with lock:
            failed.append((i, None, str(e)))
threads = []
for i in range(n):
    if i == n // 3:
        subprocess.run(["scripts/podman.sh", "kill", victim], check=True, capture_output=True)
        print(f"fleet-test: killed {victim} after {i} requests were sent")
    t = threading.Thread(target=one, args=(i,))
    t.start()
    threads.append(t)
    time.sleep(0.15)
for t in threads:
    t.join()
open(out, "w").write("\n".join(answered) + "\n")
# 529 (overloaded, retry) is an answer a client can act on; anything else is a failure.
bad = [f for f in failed if f[1] != 529]
print(f"fleet-test: {len(answered)} answered, {len(failed) - len(bad)} answered 529, {len(bad)} failed")
if bad:
    sys.exit(f"fleet-test: requests failed with a node down: {bad[:5]}")
if not answered:
    sys.exit("fleet-test: nothing was answered")
PY
# The killed node comes back on its volume and replays what it journaled.
compose start node2 >/dev/null 2>&1
PG=$(container postgres)
for _ in $(seq 120); do
  missing=0
  while read -r rid; do
    id=${rid#req_}
    n=$($PODMAN exec "$PG" psql -U postgres -d cachet -tAc "SELECT count(*) FROM usage_events WHERE replace(request_id::text, '-', '') = '$id'")
    [ "$n" = 1 ] || missing=$((missing + 1))
  done <"$LOGS/answered"
  [ "$missing" = 0 ] && break
  sleep 1
done
rows=$($PODMAN exec "$PG" psql -U postgres -d cachet -tAc "SELECT count(*) FROM usage_events")
if [ "$missing" != 0 ]; then
  echo "fleet-test: $missing answered requests have no ledger row ($rows rows)" >&2
  exit 1
fi
echo "fleet-test: every one of $(wc -l <"$LOGS/answered") answered requests has its ledger row ($rows rows in all)"
