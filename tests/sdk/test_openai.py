"""OpenAI's Chat Completions wire through the official `openai` SDK: the same cache, the same
ledger classes, OpenAI's shapes."""

import uuid

import anthropic
import openai
import pytest

from conftest import total, words

MODEL = "sim-tiny"


def unique(n=200):
    return words(f"o{uuid.uuid4().hex[:6]}x", n)


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=server["key_a"], max_retries=0)


@pytest.fixture
def oai_b(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=server["key_b"], max_retries=0)


def chat(system, question="What does it say?"):
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_a_repeat_reads_what_the_first_wrote(oai):
    msgs = chat(unique())
    a = oai.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=12)
    b = oai.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=12)
    assert a.object == "chat.completion" and a.id.startswith("chatcmpl-")
    assert a.choices[0].message.role == "assistant" and a.choices[0].message.content
    assert a.choices[0].finish_reason in ("stop", "length")
    ua, ub = a.usage, b.usage
    # prompt_tokens counts every prompt token; cached and written are parts of it.
    assert ua.prompt_tokens_details.cached_tokens == 0
    assert ua.prompt_tokens_details.cache_write_tokens > 0
    assert ua.prompt_tokens_details.cache_write_tokens <= ua.prompt_tokens
    assert ub.prompt_tokens_details.cached_tokens == ua.prompt_tokens_details.cache_write_tokens
    assert ub.prompt_tokens_details.cached_tokens <= ub.prompt_tokens
    assert ub.prompt_tokens == ua.prompt_tokens
    assert ua.total_tokens == ua.prompt_tokens + ua.completion_tokens
    # Greedy: the same answer.
    assert a.choices[0].message.content == b.choices[0].message.content


def test_streamed_with_usage(oai):
    msgs = chat(unique())
    stream = oai.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10,
                                         stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    assert text and finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0
    assert usage.prompt_tokens_details.cache_write_tokens > 0
    plain = oai.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10)
    assert plain.choices[0].message.content == text
    assert plain.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens_details.cache_write_tokens


def test_errors_in_openai_shape(oai, server):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=chat("x"), n=2)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "n"
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    assert "image_url" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="no-such-model", messages=chat("x"))
    assert e.value.body["param"] == "model"
    bad = openai.OpenAI(base_url=server["url"] + "/v1", api_key="sk-cachet-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=chat("x"))
    assert e.value.status_code == 401


def test_the_same_prompt_cache_key_in_two_tenants_shares_nothing(oai, oai_b):
    msgs = chat(unique())
    a = oai.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4, prompt_cache_key="shared")
    b = oai_b.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4, prompt_cache_key="shared")
    assert a.usage.prompt_tokens_details.cache_write_tokens > 0
    assert b.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cache_write_tokens == a.usage.prompt_tokens_details.cache_write_tokens


def test_one_cache_behind_both_apis(oai, client):
    system = unique()
    question = "What does it say?"
    # Written through Messages, read through Chat Completions.
    m = client.messages.create(model=MODEL, max_tokens=8, system=system,
                               messages=[{"role": "user", "content": question}],
                               cache_control={"type": "ephemeral"})
    c = oai.chat.completions.create(model=MODEL, messages=chat(system, question), max_completion_tokens=8)
    assert m.usage.cache_creation_input_tokens > 0
    assert c.usage.prompt_tokens == total(m.usage)
    assert c.usage.prompt_tokens_details.cached_tokens == m.usage.cache_creation_input_tokens
    assert c.choices[0].message.content == m.content[0].text
    # And the other way round.
    system2 = unique()
    c2 = oai.chat.completions.create(model=MODEL, messages=chat(system2, question), max_completion_tokens=8)
    m2 = client.messages.create(model=MODEL, max_tokens=8, system=system2,
                                messages=[{"role": "user", "content": question}],
                                cache_control={"type": "ephemeral"})
    assert m2.usage.cache_read_input_tokens == c2.usage.prompt_tokens_details.cache_write_tokens > 0


def test_explicit_mode_caches_only_marked_parts(oai):
    doc = unique()
    marked = [{"type": "text", "text": doc, "prompt_cache_breakpoint": {"mode": "explicit"}}]
    msgs = [{"role": "system", "content": marked}, {"role": "user", "content": "q1"}]
    a = oai.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4,
                                    extra_body={"prompt_cache_options": {"mode": "explicit"}})
    msgs[1]["content"] = "a different question"
    b = oai.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4,
                                    extra_body={"prompt_cache_options": {"mode": "explicit"}})
    assert a.usage.prompt_tokens_details.cache_write_tokens > 0
    assert b.usage.prompt_tokens_details.cached_tokens == a.usage.prompt_tokens_details.cache_write_tokens
    # Explicit mode with nothing marked caches nothing.
    plain = [{"role": "system", "content": unique()}, {"role": "user", "content": "q"}]
    n = oai.chat.completions.create(model=MODEL, messages=plain, max_completion_tokens=4,
                                    extra_body={"prompt_cache_options": {"mode": "explicit"}})
    assert n.usage.prompt_tokens_details.cache_write_tokens == 0
