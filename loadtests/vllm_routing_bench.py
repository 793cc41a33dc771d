"""Routing by where the KV is, measured: TTFT of a multi-turn chat workload on two vLLM
instances (CPU build, one core each) behind `cachet router`, with the nodes following vLLM's
KV events (the conductor knows which engine's own cache holds each conversation) and
without (it knows only the fabric's copies, which two replicas put on both nodes). Same
workload, same seeds, a fresh cluster for each run. Run by `loadtests/vllm-bench.sh
loadtests/vllm_routing_bench.py` (`make bench-vllm-routing`); prints a Markdown table for
docs/benchmarks.md.

The workload: BENCH_SESSIONS conversations of BENCH_TURNS turns, each with its own system
prompt (about BENCH_SYSTEM_TOKENS tokens), each turn adding a user message and the model's
answer to the conversation, the breakpoint on the last message (every turn caches the whole
conversation so far). Two schedules:

- one at a time: the conversations' turns interleaved (A1 B1 … H1 A2 B2 …), one request in
  flight: a quiet fleet, where nothing but the caches tells the instances apart;
- BENCH_CONCURRENCY conversations at once, each one's turns back to back: a busy fleet, where
  the queue decides as much as the caches.
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


class Conversation:
    def __init__(self, s: int):
        self.s = s
        self.system = prompt_text(SYSTEM_TOKENS, seed=1000 + s)
        self.messages: list[dict] = []
        self.k = 0

    def next_turn(self, base: str, key: str, results: list) -> None:
        question = f"Question {self.k + 1} of conversation {self.s}: " + prompt_text(40, seed=self.s * 100 + self.k)
        self.messages.append({"role": "user", "content": [
            {"type": "text", "text": question, "cache_control": {"type": "ephemeral"}}]})
        r = turn(base, key, self.system, self.messages)
        results.append({"session": self.s, "turn": self.k, **r})
        # The last message keeps its breakpoint only while it is last.
        self.messages[-1] = {"role": "user", "content": question}
        self.messages.append({"role": "assistant", "content": r["text"] or "."})
        self.k += 1


def run(kv_events: bool, concurrency: int) -> list[dict]:
    cluster = t.VllmCluster("routebench", kv_events=kv_events)
    try:
        results: list[dict] = []
        if concurrency == 1:
            convs = [Conversation(s) for s in range(SESSIONS)]
            for _ in range(TURNS):
                for c in convs:
                    c.next_turn(cluster.base, cluster.key, results)
            return results
        queue = list(range(SESSIONS))
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    if not queue:
                        return
                    c = Conversation(queue.pop(0))
                for _ in range(TURNS):
                    c.next_turn(cluster.base, cluster.key, results)

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
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
    remote = sum(1 for r in later if "fabric_remote=0 " not in r["route"])
    same = sum(
        1 for r in later
        if r["node"] == next(x["node"] for x in rs if x["session"] == r["session"] and x["turn"] == r["turn"] - 1)
    )
    return (f"| {name} | {len(later)} | {statistics.median(ttft):.0f} | {pct(ttft, 99):.0f} | "
            f"{statistics.mean(ttft):.0f} | {same}/{len(later)} | {engine_hits}/{len(later)} | "
            f"{remote}/{len(later)} |")


def main() -> None:
    print(f"# {SESSIONS} conversations × {TURNS} turns, system ~{SYSTEM_TOKENS} tokens, "
          f"answers of {ANSWER_TOKENS} tokens", file=sys.stderr)
    runs = []
    for concurrency in (1, CONCURRENCY):
        for events in (False, True):
            runs.append((concurrency, events, run(kv_events=events, concurrency=concurrency)))
    print("| schedule | routing | turns after the first | TTFT p50 ms | TTFT p99 ms | "
          "TTFT mean ms | on the previous turn's instance | estimated with an engine-cache hit | "
          "estimated with blocks to pull from the peer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for concurrency, events, rs in runs:
        name = "with the engines' KV events" if events else "fabric index only"
        when = "one at a time" if concurrency == 1 else f"{concurrency} at once"
        print(f"| {when} " + row(name, rs))
    first = [r["ttft"] * 1000 for _, _, rs in runs for r in rs if r["turn"] == 0]
    print(f"\nFirst turns (cold everywhere, both runs): TTFT p50 {statistics.median(first):.0f} ms.")


if __name__ == "__main__":
    main()
