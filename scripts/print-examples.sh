#!/usr/bin/env bash
# Print ready-to-paste examples for the demo key.
KEY="$1"
ADMIN="${2:-}"
URL="http://${CACHET_LISTEN:-127.0.0.1:8080}"
SYSTEM="$(printf 'You are a friendly geography tutor who answers briefly. %.0s' $(seq 12))"
cat <<MSG

Cachet is starting on $URL
Models: smollm2-135m-instruct (real model), sim-tiny, sim-llama-8b, sim-llama-70b (cost models).
Demo API key: $KEY

curl (run it twice: the second answer reports cache_read_input_tokens > 0):

curl -s $URL/v1/messages \\
  -H "x-api-key: $KEY" -H "anthropic-version: 2023-06-01" -H "content-type: application/json" \\
  -d '{"model": "smollm2-135m-instruct", "max_tokens": 48,
       "system": [{"type": "text", "text": "$SYSTEM", "cache_control": {"type": "ephemeral"}}],
       "messages": [{"role": "user", "content": "What is the capital of France?"}]}'

Python (pip install anthropic):

import time, anthropic
client = anthropic.Anthropic(base_url="$URL", api_key="$KEY")
system = [{"type": "text", "text": "You are a friendly geography tutor who answers briefly. " * 12,
           "cache_control": {"type": "ephemeral"}}]
for call in (1, 2):
    start, first = time.perf_counter(), None
    with client.messages.stream(model="smollm2-135m-instruct", max_tokens=48, system=system,
                                messages=[{"role": "user", "content": "What is the capital of France?"}]) as s:
        for text in s.text_stream:
            first = first or time.perf_counter() - start
        m = s.get_final_message()
    print(f"call {call}: {m.content[0].text!r}")
    print(f"  time to first token {first * 1000:.0f} ms; usage {m.usage}")
r = client.messages.create(model="smollm2-135m-instruct", max_tokens=48, system=system,
                           messages=[{"role": "user", "content": "And of Italy?"}])
print(r.content[0].text, r.usage)

Admin console: $URL/admin  (user "admin", password in .cachet/admin-password;
more users: cachet admin user create --username NAME --role platform_admin|tenant_admin|finance)

Admin and finance APIs (a platform_admin token valid for a day; \`cachet billing token --help\` for
others; usage comes from rollups refreshed every minute):

curl -s "$URL/v1/billing/usage?from=\$(date -u +%Y-%m-%dT00:00:00Z)&to=2100-01-01T00:00:00Z&group_by=model" \\
  -H "authorization: Bearer $ADMIN"

MSG
