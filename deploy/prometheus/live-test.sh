#!/usr/bin/env bash
# A real Prometheus (Debian's `prometheus`) scrapes a running `cachet serve` and evaluates
# cachet-alerts.yml: every rule evaluates without error, the recording rules see the
# server's own series, and two alerts go pending for real: CachetTtftOverSlo (the server's
# TTFT target set to 1 ms, so every answer misses it) and CachetTargetDown (the server
# stopped). Everything on 127.0.0.1; stops by itself.
#
#   deploy/prometheus/live-test.sh        (CACHET_BIN=… for another build; default the debug one)
set -euo pipefail
export CACHET_BIN=${CACHET_BIN:-${CARGO_TARGET_DIR:-target}/debug/cachet}
. "$(dirname "$0")/../../loadtests/bench-lib.sh"
command -v prometheus >/dev/null || { echo "live-test: prometheus is not installed (apt-get install prometheus)" >&2; exit 1; }
bench_init prom
PORT=$((20000 + $$ % 10000))
PROM_PORT=$((PORT + 1))
cat >"$OUT/cachet.toml" <<TOML
[cluster]
ttft_slo_ms = 1
TOML
cat >"$OUT/prometheus.yml" <<YML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - $PWD/deploy/prometheus/cachet-alerts.yml
scrape_configs:
  - job_name: cachet-serve
    static_configs:
      - targets: ['127.0.0.1:$PORT']
YML
export CACHET_CONFIG=$OUT/cachet.toml CACHET_DATA_DIR=$OUT/data CACHET_ENGINE=sim
$BIN migrate >/dev/null 2>&1 || true
KEY=$(bench_key prom)
bench_serve "$PORT"
prometheus --config.file="$OUT/prometheus.yml" --storage.tsdb.path="$OUT/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" >"$OUT/prometheus.log" 2>&1 &
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PROM_PORT/-/ready" >/dev/null && break; sleep 0.2; done
# Answers for the TTFT histogram, a few seconds apart so rate() has samples to work with.
for i in $(seq 12); do
  curl -sf "http://127.0.0.1:$PORT/v1/messages" -H "x-api-key: $KEY" \
    -H 'anthropic-version: 2023-06-01' -H 'content-type: application/json' \
    -d "{\"model\":\"sim-llama-8b\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\",\"content\":\"question $i: how far is the moon?\"}]}" >/dev/null
  sleep 0.5
done
check() {
  python3 - "$PROM_PORT" "$1" <<'PY'
import json, sys, time, urllib.error, urllib.parse, urllib.request
port, stage = sys.argv[1], sys.argv[2]
def get(path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.load(r)["data"]
deadline = time.time() + 60
while True:
    rules = [r for g in get("/api/v1/rules")["groups"] for r in g["rules"]]
    alerts = {a["labels"]["alertname"]: a for a in get("/api/v1/alerts")["alerts"]}
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    if stage == "up":
        p99 = get("/api/v1/query?query=cachet:time_to_first_token:p99_5m")["result"]
        ok = (not bad and len(rules) >= 16 and p99
              and "CachetTtftOverSlo" in alerts and "CachetTargetDown" not in alerts)
    else:
        ok = not bad and alerts.get("CachetTargetDown", {}).get("state") in ("pending", "firing")
    if ok:
        break
    if time.time() > deadline:
        sys.exit(f"live-test ({stage}): rules in error {bad}; alerts {sorted(alerts)}")
    time.sleep(1)
if stage == "up":
    # Every query of the Grafana dashboard runs on this Prometheus; the request path's
    # return the server's series.
    dash = json.load(open("deploy/grafana/cachet.json"))
    queries = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    empty = []
    for title, expr in queries:
        q = urllib.parse.quote(expr)
        try:
            if not get(f"/api/v1/query?query={q}")["result"]:
                empty.append(title)
        except urllib.error.HTTPError as e:
            sys.exit(f"live-test: the dashboard's {title!r} does not run: {e.read().decode()}")
    for must in ("Requests a second by status", "TTFT p99 by model, and the target",
                 "Prompt tokens a second by class", "KV bytes by tier"):
        if must in empty:
            sys.exit(f"live-test: the dashboard's {must!r} shows nothing for a running server")
    print(f"live-test: the dashboard's {len(queries)} queries run ({len(empty)} empty on one "
          f"idle server: {', '.join(empty)})")
    print(f"live-test: {len(rules)} rules evaluated without error; TTFT p99 "
          f"{float(p99[0]['value'][1]) * 1e3:.1f} ms for {p99[0]['metric'].get('model')}; "
          f"CachetTtftOverSlo {alerts['CachetTtftOverSlo']['state']}")
else:
    print(f"live-test: server stopped; CachetTargetDown {alerts['CachetTargetDown']['state']}")
PY
}
check up
kill "$SERVE_PID"
wait "$SERVE_PID" 2>/dev/null || true
check down
