"""Prompt caching through the official anthropic SDK."""

import uuid

import anthropic
import pytest

from conftest import total, words

MODEL = "sim-tiny"
EPH = {"type": "ephemeral"}
EPH_1H = {"type": "ephemeral", "ttl": "1h"}


def unique(n=200):
    return words(f"u{uuid.uuid4().hex[:6]}x", n)


def test_system_breakpoint_written_then_read(client):
    system = [{"type": "text", "text": unique(), "cache_control": EPH}]
    msgs = [{"role": "user", "content": "What does the system prompt say?"}]
    first = client.messages.create(model=MODEL, max_tokens=16, system=system, messages=msgs)
    second = client.messages.create(model=MODEL, max_tokens=16, system=system, messages=msgs)
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens > 0
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    assert total(first.usage) == total(second.usage)
    assert first.content[0].text == second.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens")


def test_tool_breakpoint_caches_tools(client):
    tools = [{"name": "search", "description": unique(120), "input_schema": {"type": "object", "properties": {}},
              "cache_control": EPH}]
    msgs = [{"role": "user", "content": "find it"}]
    a = client.messages.create(model=MODEL, max_tokens=8, tools=tools, messages=msgs)
    b = client.messages.create(model=MODEL, max_tokens=8, tools=tools, messages=[{"role": "user", "content": "other"}])
    assert a.usage.cache_creation_input_tokens > 0
    assert b.usage.cache_read_input_tokens == a.usage.cache_creation_input_tokens


def test_message_breakpoint_and_moving_marker(client):
    long_q = unique(150)
    turn1 = [{"role": "user", "content": [{"type": "text", "text": long_q, "cache_control": EPH}]}]
    a = client.messages.create(model=MODEL, max_tokens=8, messages=turn1)
    turn2 = [
        {"role": "user", "content": [{"type": "text", "text": long_q}]},
        {"role": "assistant", "content": a.content[0].text},
        {"role": "user", "content": [{"type": "text", "text": "and then?", "cache_control": EPH}]},
    ]
    b = client.messages.create(model=MODEL, max_tokens=8, messages=turn2)
    assert b.usage.cache_read_input_tokens == a.usage.cache_creation_input_tokens
    assert b.usage.cache_creation_input_tokens > 0


def test_automatic_caching(client):
    msgs = [{"role": "user", "content": unique(120)}]
    a = client.messages.create(model=MODEL, max_tokens=8, messages=msgs, cache_control=EPH)
    b = client.messages.create(model=MODEL, max_tokens=8, messages=msgs, cache_control=EPH)
    assert a.usage.cache_creation_input_tokens > 0
    assert b.usage.cache_read_input_tokens == a.usage.cache_creation_input_tokens


def test_one_hour_and_five_minute_mixing(client):
    tools = [{"name": "t", "description": unique(60), "input_schema": {"type": "object"}, "cache_control": EPH_1H}]
    system = [{"type": "text", "text": unique(80), "cache_control": EPH}]
    r = client.messages.create(model=MODEL, max_tokens=8, tools=tools, system=system,
                               messages=[{"role": "user", "content": "hi"}])
    cc = r.usage.cache_creation
    assert cc.ephemeral_1h_input_tokens > 0 and cc.ephemeral_5m_input_tokens > 0
    assert r.usage.cache_creation_input_tokens == cc.ephemeral_1h_input_tokens + cc.ephemeral_5m_input_tokens
    assert total(r.usage) == r.model_extra["cachet"]["prompt_tokens"]


def test_usage_arithmetic_in_streaming(client):
    system = [{"type": "text", "text": unique(), "cache_control": EPH}]
    msgs = [{"role": "user", "content": "stream it"}]
    client.messages.create(model=MODEL, max_tokens=8, system=system, messages=msgs)
    events = list(client.messages.create(model=MODEL, max_tokens=12, system=system, messages=msgs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0].message.usage
    delta = events[-2].usage
    assert start.cache_read_input_tokens > 0
    assert (delta.input_tokens, delta.cache_creation_input_tokens, delta.cache_read_input_tokens) == \
        (start.input_tokens, start.cache_creation_input_tokens, start.cache_read_input_tokens)
    with client.messages.stream(model=MODEL, max_tokens=12, system=system, messages=msgs) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].text == text
    assert final.usage.cache_read_input_tokens == start.cache_read_input_tokens
    assert final.usage.output_tokens == delta.output_tokens


def test_second_tenant_never_reads_the_first_tenants_cache(client, client_b):
    system = [{"type": "text", "text": unique(), "cache_control": EPH}]
    msgs = [{"role": "user", "content": "same prompt"}]
    client.messages.create(model=MODEL, max_tokens=8, system=system, messages=msgs)
    again = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=msgs)
    assert again.usage.cache_read_input_tokens > 0
    other = client_b.messages.create(model=MODEL, max_tokens=8, system=system, messages=msgs)
    assert other.usage.cache_read_input_tokens == 0


def test_count_tokens_matches_usage(client):
    system = [{"type": "text", "text": unique(50)}]
    msgs = [{"role": "user", "content": "count"}]
    n = client.messages.count_tokens(model=MODEL, system=system, messages=msgs).input_tokens
    r = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=msgs)
    assert n == total(r.usage)


def bad(client, **kw):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, **kw)
    assert e.value.status_code == 400
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["request_id"].startswith("req_")
    return body["error"]["message"]


def test_exact_400_texts(client):
    b = lambda text, cc: {"type": "text", "text": text, "cache_control": cc}
    five = [b(f"s{i}", EPH) for i in range(5)]
    assert bad(client, system=five, messages=[{"role": "user", "content": "x"}]) == \
        "A maximum of 4 blocks with cache_control may be provided. Found 5."
    assert bad(client, system=five[:4], cache_control=EPH, messages=[{"role": "user", "content": "x"}]) == \
        "A maximum of 4 blocks with cache_control may be provided. Found 5."
    assert bad(client, system=[b("a", EPH)], messages=[{"role": "user", "content": [b("q", EPH_1H)]}]) == (
        "messages.0.content.0.cache_control.ttl: a ttl='1h' cache_control block must not come after a ttl='5m' "
        "cache_control block. Note that blocks are processed in the following order: `tools`, `system`, `messages`.")
    assert bad(client, messages=[{"role": "user", "content": [b("q", {"type": "ephemeral", "ttl": "2h"})]}]) == \
        "messages.0.content.0.cache_control.ttl: Input should be '5m' or '1h'"
    assert bad(client, messages=[{"role": "user", "content": [b("", EPH)]}]) == \
        "messages.0.content.0.text: cache_control cannot be set for empty text blocks"
    thinking = {"type": "thinking", "thinking": "hmm", "signature": "sig", "cache_control": EPH}
    assert bad(client, messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [thinking]},
                                 {"role": "user", "content": "r"}]) == \
        "messages.1.content.0.thinking.cache_control: Extra inputs are not permitted"
    assert bad(client, messages=[]) == "messages: List should have at least 1 item after validation, not 0"


def test_unknown_model_and_auth_errors(server):
    c = anthropic.Anthropic(base_url=server["url"], api_key=server["key_a"], max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="claude-nope", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["message"].startswith("model: unknown model 'claude-nope'")
    bad_key = anthropic.Anthropic(base_url=server["url"], api_key="sk-cachet-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert [m.id for m in c.models.list().data] == ["smollm2-135m-instruct", "sim-tiny", "sim-llama-8b", "sim-llama-70b"]
