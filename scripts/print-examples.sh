#!/usr/bin/env bash
# Print ready-to-paste examples for the demo key.
KEY="$1"
URL="http://${CACHET_LISTEN:-127.0.0.1:8080}"
cat <<MSG

Cachet is starting on $URL (models: sim-tiny, sim-llama-8b, sim-llama-70b).
Demo API key: $KEY

curl (run it twice: the second answer reports cache_read_input_tokens > 0):

curl -s $URL/v1/messages \\
  -H "x-api-key: $KEY" -H "anthropic-version: 2023-06-01" -H "content-type: application/json" \\
  -d '{"model": "sim-tiny", "max_tokens": 64,
       "system": [{"type": "text", "text": "$(printf 'You are a caching expert. %.0s' $(seq 40))", "cache_control": {"type": "ephemeral"}}],
       "messages": [{"role": "user", "content": "What does a prompt cache save?"}]}'

Python (pip install anthropic):

import anthropic
client = anthropic.Anthropic(base_url="$URL", api_key="$KEY")
system = [{"type": "text", "text": "You are a caching expert. " * 40, "cache_control": {"type": "ephemeral"}}]
for i in range(2):
    r = client.messages.create(model="sim-tiny", max_tokens=64, system=system,
                               messages=[{"role": "user", "content": "What does a prompt cache save?"}])
    print(r.content[0].text)
    print(r.usage)
with client.messages.stream(model="sim-tiny", max_tokens=64, system=system,
                            messages=[{"role": "user", "content": "And streaming?"}]) as s:
    for text in s.text_stream:
        print(text, end="", flush=True)
    print("\n", s.get_final_message().usage)

MSG
