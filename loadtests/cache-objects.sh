#!/usr/bin/env bash
# A cache object against resending its content: one `cachet serve` (sim engine at time scale
# 1), a 32K-token object on sim-llama-8b (128 KiB of KV a token: 4 GiB held), then requests
# that alternate between naming the object (`cached_content`) and sending the same content
# with a breakpoint where the object ends. Both read the same cached blocks; what differs is
# what travels and what the gateway parses, renders and hashes. Prints, for each way, the
# request bytes on the wire and the time to first token (p50, max) measured by the client at
# the first streamed text delta. Everything runs on 127.0.0.1 and stops by itself.
#
#   loadtests/cache-objects.sh [requests per way]            (CACHET_BIN=… for another build)
#   BENCH_MODEL=sim-llama-8b BENCH_OBJECT_WORDS=32760        the model and the object's size
set -euo pipefail
. "$(dirname "$0")/bench-lib.sh"
bench_init objects
N=${1:-8}
MODEL=${BENCH_MODEL:-sim-llama-8b}
# About a token a word ("w123") in the sim engines' tokenizer: 32760 words ≈ 32K tokens.
WORDS=${BENCH_OBJECT_WORDS:-32760}
export CACHET_ENGINE=sim CACHET_SIM_TIME_SCALE=${BENCH_TIME_SCALE:-1}
export CACHET_DATA_DIR=$OUT/data RUST_LOG=warn
export CACHET_KV_BUDGET_BYTES=${BENCH_KV_BUDGET:-6442450944} CACHET_DRAM_CAPACITY_BYTES=${BENCH_DRAM:-6442450944}
$BIN migrate >/dev/null
KEY=$(bench_key objects)
bench_serve 18097
echo "# $(date -u +%FT%TZ) $(nproc) cores; $MODEL, an object of $WORDS words; $N requests each way; build $($BIN --version 2>/dev/null || echo "$BIN")"
python3 - "$KEY" "$MODEL" "$WORDS" "$N" <<'PY'
import http.client, json, statistics, sys, time

key, model, words, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
document = " ".join(f"w{i}" for i in range(words))
HEADERS = {"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"}


def post(path, body):
    c = http.client.HTTPConnection("127.0.0.1", 18097, timeout=600)
    c.request("POST", path, body=body, headers=HEADERS)
    return c, c.getresponse()


t = time.monotonic()
c, r = post("/v1/caches", json.dumps({"model": model, "system": document, "ttl": "1h"}))
obj = json.loads(r.read())
c.close()
if r.status != 200:
    sys.exit(f"creating the object failed: {r.status} {obj}")
print(f"object {obj['id']}: {obj['input_tokens']} tokens, created in {time.monotonic() - t:.2f} s")


def ttft(body):
    """Seconds to the first text delta, and the cache-read tokens of the answer."""
    t = time.monotonic()
    c, r = post("/v1/messages", body)
    if r.status != 200:
        sys.exit(f"request failed: {r.status} {r.read()[:300]!r}")
    first, read = None, None
    for line in r:
        if line.startswith(b"data: "):
            ev = json.loads(line[6:])
            if ev["type"] == "message_start":
                read = ev["message"]["usage"]["cache_read_input_tokens"]
            elif ev["type"] == "content_block_delta" and first is None:
                first = time.monotonic() - t
            elif ev["type"] == "message_stop":
                break
    c.close()
    return first, read


ways = {"by id": [], "content resent": []}
size = {}
for i in range(n):
    q = [{"role": "user", "content": f"question {i}: what does the document say?"}]
    bodies = {
        "by id": {"model": model, "max_tokens": 1, "stream": True, "cached_content": obj["id"], "messages": q},
        "content resent": {"model": model, "max_tokens": 1, "stream": True,
                           "system": [{"type": "text", "text": document, "cache_control": {"type": "ephemeral"}}],
                           "messages": q},
    }
    for way, b in bodies.items():
        raw = json.dumps(b).encode()
        size[way] = len(raw)
        s, read = ttft(raw)
        if read != obj["input_tokens"]:
            sys.exit(f"{way}: read {read} tokens from the cache, not the object's {obj['input_tokens']}")
        ways[way].append(s)

print("way\trequest bytes\tTTFT p50 ms\tTTFT max ms")
for way, xs in ways.items():
    print(f"{way}\t{size[way]}\t{statistics.median(xs) * 1e3:.1f}\t{max(xs) * 1e3:.1f}")
a, b = statistics.median(ways["by id"]), statistics.median(ways["content resent"])
print(f"by id / resent: bytes {size['by id'] / size['content resent']:.4f}, TTFT p50 {a / b:.3f}")
PY
