"""Cache objects (`/v1/caches`) through the official SDKs: the endpoints through their raw
request helpers, `cached_content` through `extra_body`, on both wires."""

import uuid

import anthropic
import openai
import pytest

from conftest import total, words

MODEL = "sim-tiny"


def unique(n=200):
    return words(f"c{uuid.uuid4().hex[:6]}x", n)


def create(client, **body):
    return client.post("/v1/caches", body={"model": MODEL, **body}, cast_to=object)


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=server["key_a"], max_retries=0)


def test_create_use_by_id_list_extend_delete(client):
    system, doc = unique(), unique(120)
    obj = create(client, system=system, messages=[{"role": "user", "content": doc}], ttl="3h",
                 display_name="contract")
    assert obj["id"].startswith("cache_") and obj["type"] == "cache_object"
    assert obj["display_name"] == "contract" and obj["input_tokens"] > 300
    question = "Which clause matters most?"
    by_id = client.messages.create(
        model=MODEL, max_tokens=12,
        messages=[{"role": "user", "content": question}],
        extra_body={"cached_content": obj["id"]},
    )
    sent = client.messages.create(
        model=MODEL, max_tokens=12, system=system,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": doc, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": question}]}],
    )
    assert by_id.usage.cache_read_input_tokens == obj["input_tokens"]
    assert by_id.usage.cache_creation_input_tokens == 0
    assert sent.usage.cache_read_input_tokens == obj["input_tokens"]
    assert by_id.content[0].text == sent.content[0].text
    assert total(by_id.usage) == total(sent.usage)
    assert by_id.to_dict()["cachet"]["cached_content"]["id"] == obj["id"]

    listed = client.get("/v1/caches", cast_to=object, options={"params": {"limit": 100}})
    assert obj["id"] in [o["id"] for o in listed["data"]]
    assert listed["first_id"] == listed["data"][0]["id"]
    got = client.get(f"/v1/caches/{obj['id']}", cast_to=object)
    assert got["expires_at"] == obj["expires_at"]
    ext = client.patch(f"/v1/caches/{obj['id']}", body={"ttl": "20h"}, cast_to=object)
    assert ext["expires_at"] > obj["expires_at"]
    with pytest.raises(anthropic.BadRequestError, match="max_cache_ttl_secs"):
        client.patch(f"/v1/caches/{obj['id']}", body={"ttl": "30d"}, cast_to=object)

    gone = client.delete(f"/v1/caches/{obj['id']}", cast_to=object)
    assert (gone["id"], gone["type"]) == (obj["id"], "cache_object_deleted")
    # Every byte of the object's KV is accounted for: freed, or held by the request above
    # that sent the same content with its own breakpoint; every node has released it.
    assert gone["bytes_freed"] + gone["bytes_held"] > 0
    assert gone["nodes_pending"] == []
    with pytest.raises(anthropic.NotFoundError):
        client.get(f"/v1/caches/{obj['id']}", cast_to=object)
    with pytest.raises(anthropic.NotFoundError, match=obj["id"]):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": question}],
                               extra_body={"cached_content": obj["id"]})


def test_another_tenant_can_neither_see_nor_use_an_object(client, client_b):
    obj = create(client, system=unique())
    with pytest.raises(anthropic.NotFoundError):
        client_b.get(f"/v1/caches/{obj['id']}", cast_to=object)
    with pytest.raises(anthropic.NotFoundError):
        client_b.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                 extra_body={"cached_content": obj["id"]})
    with pytest.raises(anthropic.NotFoundError):
        client_b.delete(f"/v1/caches/{obj['id']}", cast_to=object)
    ids = [o["id"] for o in client_b.get("/v1/caches", cast_to=object)["data"]]
    assert obj["id"] not in ids
    # Still the owner's.
    assert client.get(f"/v1/caches/{obj['id']}", cast_to=object)["id"] == obj["id"]


def test_the_openai_wire_names_an_object_in_extra_body(oai, client):
    system = unique()
    obj = oai.post("/caches", body={"model": MODEL, "system": system, "ttl": 900}, cast_to=object)
    q = [{"role": "user", "content": "Summarize."}]
    by_id = oai.chat.completions.create(model=MODEL, messages=q, max_completion_tokens=10, temperature=0,
                                        extra_body={"cached_content": obj["id"]})
    sent = oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system}, *q],
                                       max_completion_tokens=10, temperature=0)
    assert by_id.usage.prompt_tokens_details.cached_tokens == obj["input_tokens"]
    assert sent.usage.prompt_tokens_details.cached_tokens >= obj["input_tokens"]
    assert by_id.usage.prompt_tokens == sent.usage.prompt_tokens
    assert by_id.choices[0].message.content == sent.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="system"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "x"}, *q],
                                    max_completion_tokens=4, extra_body={"cached_content": obj["id"]})
    # The object is the same one on the Anthropic wire.
    assert client.get(f"/v1/caches/{obj['id']}", cast_to=object)["input_tokens"] == obj["input_tokens"]
