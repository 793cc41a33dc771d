"""Prefill and decode apart, measured: TTFT and time between tokens of a mix of long-prompt
requests and short chats on two vLLM instances (CPU build, one core each) beside one node,
colocated (both instances do both) and split (one prefill instance, one decode instance), in
one run, the same requests in each. Run by `loadtests/vllm-bench.sh
loadtests/vllm_split_bench.py` (`make bench-vllm-split`); prints a Markdown table for
docs/benchmarks.md.

The mix: BENCH_CHATS short chats (a ~150-token prompt, BENCH_CHAT_TOKENS answer tokens) sent
two at a time back to back, and, beside them, a long prompt (~BENCH_LONG_TOKENS tokens, a few
answer tokens) every BENCH_LONG_EVERY seconds, each one new (nothing cached). Three layouts:
both instances colocated; split with every prompt of a block or more prefilled apart; split
with only prompts of 1,024 tokens or more prefilled apart (the default `split_min_tokens`).
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

CHATS = int(os.environ.get("BENCH_CHATS", "24"))
CHAT_TOKENS = int(os.environ.get("BENCH_CHAT_TOKENS", "48"))
LONG_TOKENS = int(os.environ.get("BENCH_LONG_TOKENS", "3000"))
LONG_EVERY = float(os.environ.get("BENCH_LONG_EVERY", "6"))


def stream(base: str, key: str, system: str, question: str, max_tokens: int) -> dict:
    body = {
        "model": t.MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": question}],
    }
    req = urllib.request.Request(
        f"{base}/v1/messages", data=json.dumps(body).encode(), method="POST",
        headers={"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"},
    )
    start = time.perf_counter()
    times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        event = None
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "content_block_delta":
                times.append(time.perf_counter() - start)
            elif event == "message_stop":
                break
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] if times else time.perf_counter() - start, "gaps": gaps}


class Cluster:
    """`cachet serve` with two vLLM instances of one model, with the roles given; prompts
    of `split_min_tokens` or more are split."""

    def __init__(self, roles, split_min_tokens: int):
        self.roles, self.split_min_tokens = roles, split_min_tokens

    def __enter__(self):
        t.two_instances_beside_one_node(self, "splitbench", roles=self.roles,
                                        split_min_tokens=self.split_min_tokens)
        return self

    def __exit__(self, *exc):
        self.procs.stop_all()
        import subprocess
        subprocess.run(["psql", f"{t.PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {self.db} WITH (FORCE)"],
                       capture_output=True)


def run(roles, split_min_tokens: int) -> tuple[list[dict], list[dict]]:
    with Cluster(roles, split_min_tokens) as c:
        # Warm both instances (first requests compile and allocate).
        for i in range(2):
            stream(c.base, c.key, prompt_text(200, seed=9000 + i), "Hello.", 4)
        chats, longs = [], []
        done = threading.Event()
        todo = list(range(CHATS))
        lock = threading.Lock()

        def chatter():
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                chats.append(stream(c.base, c.key, prompt_text(150, seed=i), f"Chat {i}: say something.",
                                    CHAT_TOKENS))

        def longer():
            n = 0
            while not done.wait(LONG_EVERY if n else 1.0):
                longs.append(stream(c.base, c.key, prompt_text(LONG_TOKENS, seed=5000 + n),
                                    "Summarize in one word.", 4))
                n += 1

        threads = [threading.Thread(target=chatter) for _ in range(2)]
        lt = threading.Thread(target=longer)
        lt.start()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        done.set()
        lt.join()
        return chats, longs


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def main() -> None:
    print(f"# {CHATS} chats of {CHAT_TOKENS} tokens two at a time; a {LONG_TOKENS}-token prompt every "
          f"{LONG_EVERY:g} s", file=sys.stderr)
    rows = []
    for name, roles, least in (
        ("colocated (both, both)", None, 0),
        ("split, every prompt of a block or more", ["prefill", "decode"], 128),
        ("split, prompts of 1,024 tokens or more (the default)", ["prefill", "decode"], 1024),
    ):
        chats, longs = run(roles, least)
        ttft = [r["ttft"] * 1000 for r in chats]
        tbt = [g * 1000 for r in chats for g in r["gaps"]]
        lttft = [r["ttft"] * 1000 for r in longs]
        rows.append(f"| {name} | {len(chats)} | {pct(ttft, 50):.0f} | {pct(ttft, 99):.0f} | {pct(tbt, 50):.1f} | "
                    f"{pct(tbt, 99):.1f} | {len(longs)} | {pct(lttft, 50):.0f} | {pct(lttft, 99):.0f} |")
    print("| instances | chats | chat TTFT p50 ms | chat TTFT p99 ms | chat time between tokens p50 ms | "
          "p99 ms | long prompts | long TTFT p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
