"""Routing by where the KV is, measured: TTFT of a multi-turn chat workload on two vLLM
instances (CPU build, one core each) behind `cachet router`, with the nodes following vLLM's
KV events (the conductor knows which engine's own cache holds each conversation) and
without (it knows only the fabric's copies, which two replicas put on both nodes). Same
workload, same seeds, a fresh cluster for each run. Run by loadtests/vllm-routing-bench.sh
(`make bench-vllm-routing`); prints a Markdown table for docs/benchmarks.md.

The workload: BENCH_SESSIONS conversations of BENCH_TURNS turns, each with its own system
prompt (about BENCH_SYSTEM_TOKENS tokens), each turn adding a user message and the model's
answer to the conversation, the breakpoint on the last message (every turn caches the whole
conversation so far). BENCH_CONCURRENCY conversations run at once, each one's turns in order.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "vllm"))
sys.path.insert(0, os.path.dirname(__file__))
import test_vllm as t  # noqa: E402  (process helpers shared with the end-to-end tests)
from vllm_bench import prompt_text  # noqa: E402

SESSIONS = int(os.environ.get("BENCH_SESSIONS", "8"))
TURNS = int(os.environ.get("BENCH_TURNS", "5"))
SYSTEM_TOKENS = int(os.environ.get("BENCH_SYSTEM_TOKENS", "700"))
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "2"))
ANSWER_TOKENS = 24


def turn(base: str, key: str, system: str, messages: list[dict]) -> dict:
    body = {
        "model": t.MODEL,
        "max_tokens": ANSWER_TOKENS,
        "stream": True,
        "system": system,
        "messages": messages,
    }
    req = urllib.request.Request(
        f"{base}/v1/messages", data=json.dumps(body).encode(), method="POST",
        headers={"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"},
    )
    start = time.perf_counter()
    out = {"text": "", "ttft": None}
    with urllib.request.urlopen(req, timeout=600) as r:
        out["node"] = r.headers.get("x-cachet-node")
        out["route"] = r.headers.get("x-cachet-route") or ""
        event = None
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "content_block_delta":
                if out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - start
                out["text"] += json.loads(line[5:])["delta"].get("text", "")
            elif event == "message_stop":
                break
    out["ttft"] = out["ttft"] if out["ttft"] is not None else time.perf_counter() - start
    return out


def conversation(base: str, key: str, s: int, results: list) -> None:
    system = prompt_text(SYSTEM_TOKENS, seed=1000 + s)
    messages: list[dict] = []
    for k in range(TURNS):
        question = f"Question {k + 1} of conversation {s}: " + prompt_text(40, seed=s * 100 + k)
        messages.append({"role": "user", "content": [
            {"type": "text", "text": question, "cache_control": {"type": "ephemeral"}}]})
        r = turn(base, key, system, messages)
        results.append({"session": s, "turn": k, **r})
        # The last message keeps its breakpoint only while it is last.
        messages[-1] = {"role": "user", "content": question}
        messages.append({"role": "assistant", "content": r["text"] or "."})


def run(kv_events: bool) -> list[dict]:
    cluster = t.EventsCluster("routebench", kv_events=kv_events)
    try:
        results: list[dict] = []
        queue = list(range(SESSIONS))
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    if not queue:
                        return
                    s = queue.pop(0)
                conversation(cluster.base, cluster.key, s, results)

        threads = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return results
    finally:
        cluster.stop()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def row(name: str, rs: list[dict]) -> str:
    later = [r for r in rs if r["turn"] > 0]
    ttft = [r["ttft"] * 1000 for r in later]
    engine_hits = sum(1 for r in later if not r["route"].startswith("engine_cache=0 "))
    same = sum(
        1 for r in later
        if r["node"] == next(x["node"] for x in rs if x["session"] == r["session"] and x["turn"] == r["turn"] - 1)
    )
    return (f"| {name} | {len(later)} | {statistics.median(ttft):.0f} | {pct(ttft, 99):.0f} | "
            f"{statistics.mean(ttft):.0f} | {same}/{len(later)} | {engine_hits}/{len(later)} |")


def main() -> None:
    print(f"# {SESSIONS} conversations × {TURNS} turns, system ~{SYSTEM_TOKENS} tokens, "
          f"{CONCURRENCY} at once, answers of {ANSWER_TOKENS} tokens", file=sys.stderr)
    without = run(kv_events=False)
    with_events = run(kv_events=True)
    print("| routing | turns after the first | TTFT p50 ms | TTFT p99 ms | TTFT mean ms | "
          "on the previous turn's instance | estimated with an engine-cache hit |")
    print("|---|---|---|---|---|---|---|")
    print(row("fabric index only", without))
    print(row("with the engines' KV events", with_events))
    first = [r["ttft"] * 1000 for r in without + with_events if r["turn"] == 0]
    print(f"\nFirst turns (cold everywhere, both runs): TTFT p50 {statistics.median(first):.0f} ms.")


if __name__ == "__main__":
    main()
