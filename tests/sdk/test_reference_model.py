"""The real model (SmolLM2-135M-Instruct) through the official SDK: a sensible answer, a cache
read on the second call, the same answer with and without the cached prefix."""

import time

MODEL = "smollm2-135m-instruct"
SYSTEM = [{"type": "text", "cache_control": {"type": "ephemeral"},
           "text": "You are a helpful geography tutor. " * 12 + "Answer in one short sentence."}]


def ttft(client, question):
    start = time.perf_counter()
    first = None
    with client.messages.stream(model=MODEL, max_tokens=24, system=SYSTEM,
                                messages=[{"role": "user", "content": question}]) as s:
        for _ in s.text_stream:
            if first is None:
                first = time.perf_counter() - start
        final = s.get_final_message()
    return first, final


def test_real_model_answers_and_reuses_its_prefix(client):
    _, cold = ttft(client, "What is the capital of France?")
    _, warm = ttft(client, "What is the capital of France?")
    assert "Paris" in cold.content[0].text
    assert cold.usage.cache_creation_input_tokens > 0
    assert warm.usage.cache_read_input_tokens == cold.usage.cache_creation_input_tokens
    assert warm.content[0].text == cold.content[0].text, "a cached prefix never changes a greedy answer"
