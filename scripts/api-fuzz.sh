#!/usr/bin/env bash
# Schema-driven API fuzzing: schemathesis generates requests for every operation in
# openapi/openapi.json and runs them against a real `cachet serve` (sim engine, a fresh
# database, a tenant with a key, a platform admin); any 5xx, dropped connection, or answer
# whose content type the document does not declare for its status fails. The document is
# first validated against the OpenAPI specification.
#
#   scripts/api-fuzz.sh CACHET_BIN ST_BIN [MAX_EXAMPLES]
#
# `make test` runs a short slice (20 examples per operation); `make fuzz-api` a long one.
set -euo pipefail
bin=$1 st=$2 examples=${3:-20}
cd "$(dirname "$0")/.."
db="cachet_apifuzz_$$"
dir=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export DATABASE_URL="postgres://postgres@127.0.0.1:5432/$db" REDIS_URL=redis://127.0.0.1:6379 \
  CACHET_DATA_DIR="$dir" CACHET_LISTEN="127.0.0.1:$port" CACHET_ENGINE=sim \
  CACHET_ADMIN_JWT_SECRET="api-fuzz-secret-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')" \
  CACHET_ADMIN_UI_DIR=/nonexistent
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT

# The document itself, against the OpenAPI specification's schema (3.1): what a generated
# client reads before it calls anything.
"$(dirname "$st")/python" -m openapi_spec_validator openapi/openapi.json

"$bin" migrate >/dev/null
"$bin" admin tenant create fuzz-tenant >/dev/null 2>&1
key=$("$bin" admin key create --tenant fuzz-tenant 2>/dev/null | tail -1)
pw="api-fuzz-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
echo "$pw" | "$bin" admin user create --username fuzz-root --role platform_admin --password-file - >/dev/null 2>&1
"$bin" serve >"$dir/serve.log" 2>&1 &
pid=$!
for _ in $(seq 100); do curl -sf "127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
token=$(curl -sf -X POST "127.0.0.1:$port/v1/admin/login" -H 'content-type: application/json' \
  -d "{\"username\":\"fuzz-root\",\"password\":\"$pw\"}" | python3 -c 'import sys,json; print(json.load(sys.stdin)["access_token"])')
# Both credentials work before anything is fuzzed: a broken key or token would fuzz only
# the 401 path.
[ -n "$key" ] && [ -n "$token" ] || { echo "api-fuzz: no key or admin token" >&2; exit 1; }
code=$(curl -s -o /dev/null -w '%{http_code}' "127.0.0.1:$port/v1/models" -H "x-api-key: $key" -H "anthropic-version: 2023-06-01")
[ "$code" = 200 ] || { echo "api-fuzz: the API key is refused ($code)" >&2; exit 1; }
code=$(curl -s -o /dev/null -w '%{http_code}' "127.0.0.1:$port/v1/admin/tenants" -H "Authorization: Bearer $token")
[ "$code" = 200 ] || { echo "api-fuzz: the admin token is refused ($code)" >&2; exit 1; }

run() {
  "$st" run openapi/openapi.json --url "http://127.0.0.1:$port" --checks not_a_server_error,content_type_conformance \
    --max-examples "$examples" --workers 1 --seed 1 "$@"
}
status=0
# The Messages API and cache objects with an API key; the admin and finance APIs with an admin token (a request
# carrying both would be refused for its two keys); login, refresh, logout and health bare.
run -H "x-api-key: $key" -H "anthropic-version: 2023-06-01" --include-path-regex '^/v1/(messages|models|caches)' || status=1
run -H "Authorization: Bearer $token" --exclude-path-regex '^/v1/(messages|models|caches)|/login|/logout|/refresh' || status=1
run --include-path-regex '/login|/logout|/refresh|^/healthz|^/readyz|^/openapi' || status=1
if grep -q panicked "$dir/serve.log"; then
  echo "cachet serve panicked during the run:" >&2
  grep -A20 panicked "$dir/serve.log" >&2
  status=1
fi
kill "$pid" && wait "$pid" 2>/dev/null || true
pid=
exit $status
