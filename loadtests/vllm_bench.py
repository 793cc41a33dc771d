"""TTFT of vLLM (CPU build) with a prefix loaded by a KV connector vs recomputed, at several
prompt lengths, in one run: Cachet's connector behind `cachet serve` loading through the
node's shared memory and, with shared memory turned off, over TCP; vLLM's own prefix-cache hit
(the floor: nothing loaded at all); vLLM with no connector behind `cachet serve` (the
connector's cost on a request that hits nothing); and vLLM's own offloading connector (or, if
it does not run on the CPU backend, its example file connector) on the same prompts. Beside
them, the load's speed inside the connector (its own log) against a plain torch copy and one
crc32c pass of the same bytes on this machine. Run by loadtests/vllm-bench.sh
(`make bench-vllm`); prints Markdown tables for docs/benchmarks.md. Cachet's rows go through
`cachet serve`; no connector and vLLM's own connectors straight to vLLM (their rows compare
with Cachet's through the load's cost over vLLM's own hit, measured the same way in each).

Each "loaded" request runs after vLLM's own prefix cache is emptied (POST
/reset_prefix_cache), so the prefix can only come from the connector; vLLM's counters confirm
how many prompt tokens came from it. "vLLM's own hit" is the same request once more without
emptying it. Each hit is measured BENCH_REPEATS times (5), the median reported.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "vllm"))
import test_vllm as t  # noqa: E402  (process helpers shared with the end-to-end tests)

SIZES = [int(s) for s in os.environ.get("BENCH_SIZES", "1000,4000,7000").split(",")]
# Hits are cheap and this machine's timings drift by a quarter from one request to the next:
# each hit is measured this many times (loaded and vLLM's own alternating), the median kept.
REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))
# Rounds of the longest prompt that write every page of vLLM's 1 GiB KV cache (182 blocks of
# SmolLM2 at f32) before anything is measured.
WARM_ROUNDS = int(os.environ.get("BENCH_WARM_ROUNDS", "5"))
WORDS = (
    "freight parcel customs invoice route rail road depot warehouse tracking refund border "
    "schedule carrier pallet container weight volume express standard insurance claim driver "
    "station harbour ferry transit manifest declaration tariff delivery pickup label"
).split()


def prompt_text(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    # About 1.12 tokens a word with this vocabulary and its punctuation (measured).
    words = [rng.choice(WORDS) for _ in range(int(tokens / 1.12))]
    return " ".join(w + ("." if i % 12 == 11 else "") for i, w in enumerate(words))


def ttft_cachet(base: str, key: str, system: str) -> tuple[float, dict]:
    body = {
        "model": t.MODEL,
        "max_tokens": 1,
        "stream": True,
        # The breakpoint ends the prompt, so Cachet caches every full block of it, as vLLM's
        # own connectors do.
        "system": system,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Summarize the above in one word.",
                                                   "cache_control": {"type": "ephemeral"}}]}],
    }
    req = urllib.request.Request(
        f"{base}/v1/messages", data=json.dumps(body).encode(), method="POST",
        headers={"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"},
    )
    start = time.perf_counter()
    usage, first = None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        event = None
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "message_start":
                usage = json.loads(line[5:])["message"]["usage"]
            elif line.startswith("data:") and event == "content_block_delta" and first is None:
                first = time.perf_counter() - start
            elif event == "message_stop":
                break
    return (first if first is not None else time.perf_counter() - start), usage


def ttft_direct(port: int, system: str) -> float:
    body = {
        "model": "smollm2",
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": "Summarize the above in one word."}],
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            if raw.startswith(b"data:") and b'"content"' in raw:
                return time.perf_counter() - start
    return time.perf_counter() - start


def copy_and_checksum(nbytes: int, runs: int = 5) -> tuple[float, float]:
    """Seconds for a plain torch copy and one crc32c pass of `nbytes` on this machine (best
    of `runs`, pages touched first)."""
    import crc32c
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    view = memoryview(src.numpy())

    def best(f):
        out = []
        for _ in range(runs):
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
        return min(out)

    return best(lambda: dst.copy_(src)), best(lambda: crc32c.crc32c(view))


LOADED = re.compile(r"cachet: loaded (\d+) blocks \(([\d.]+) MB\) in ([\d.]+) ms over (\w+)")


def loads_logged(log: str, since: int) -> list[tuple[int, float, float, str]]:
    """(blocks, MB, ms, mode) of the loads the connector logged past byte `since` of its log."""
    with open(log) as f:
        f.seek(since)
        return [(int(m[1]), float(m[2]), float(m[3]), m[4]) for m in LOADED.finditer(f.read())]


def main() -> None:
    procs = t.Procs()
    out = {}
    db = f"cachet_vllm_bench_{os.getpid()}"
    try:
        api, fabric, vport = t.free_port(), t.free_port(), t.free_port()
        _, cfg = t.config_file(
            "cachet-vllm-bench-",
            f'listen = "127.0.0.1:{api}"\ndatabase_url = "{t.PG}/{db}"\nredis_url = ""\n'
            f'[fabric]\nlisten = "127.0.0.1:{fabric}"\ndram_capacity_bytes = 4294967296\n'
            f'[engine]\nkind = "sim"\n[[engine.vllm]]\nurl = "http://127.0.0.1:{vport}"\n',
        )
        env = {"CACHET_CONFIG": cfg, "CACHET_CLUSTER_TOKEN": t.TOKEN, "RUST_LOG": "warn"}
        t.cachet(["migrate"], env)
        serve, serve_log = procs.start("bench-serve", [t.BIN, "serve"], env)
        base = f"http://127.0.0.1:{api}"
        t.wait_until("cachet serve", lambda: t.http("GET", f"{base}/healthz", timeout=2)[0] == 200, 60, serve,
                     serve_log)
        prompts = {n: prompt_text(n, n) for n in SIZES}
        rows = {n: {} for n in SIZES}

        def vllm(name: str, connector: str, extra_env: dict | None = None):
            os.environ["CACHET_VLLM_CONNECTOR"] = connector
            # Whole prompts in one step, for every connector alike (vLLM's example connector
            # saves only a request's first chunk and fails to load a longer prompt).
            os.environ["CACHET_VLLM_ARGS"] = "--max-num-batched-tokens 8192"
            # Every core, explicitly: vLLM's automatic binding reserves a core for itself
            # without a connector and not with one, which would compare 1 core with 2.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
            p, log = t.start_vllm(procs, name, vport, fabric, env={"CACHET_TRANSFER_LOG": "1", **(extra_env or {})})
            t.wait_vllm(p, log, vport)
            ttft_direct(vport, prompt_text(200, 0))  # warm-up: first-request costs stay out
            return p, log

        def warm_kv(ask) -> None:
            """Every page of vLLM's KV cache written once, as on a server that has run a
            while: vLLM hands out blocks never used before first, and a load into one pays
            its page faults (measured: a few milliseconds a block here). A long prompt is
            computed once, then loaded again and again into new blocks (`ask` sends it)."""
            text = prompt_text(max(SIZES), 1)
            for _ in range(WARM_ROUNDS):
                ask(text)
                t.reset_vllm_cache(vport)

        # 1. Cachet's connector through shared memory, then over TCP (shared memory off).
        for label, extra in (("shm", {}), ("tcp", {"CACHET_SHARED_MEMORY": "0"})):
            p, log = vllm(f"bench-vllm-cachet-{label}", "on", extra)
            _, key = t.new_tenant(env, f"bench-cachet-{label}")
            warm_kv(lambda text: ttft_cachet(base, key, text))
            for n, text in prompts.items():
                miss, u = ttft_cachet(base, key, text)
                hits, owns, loads = [], [], []
                for _ in range(REPEATS):
                    t.reset_vllm_cache(vport)
                    before = t.external_hits(vport)
                    mark = os.path.getsize(log)
                    hit, u2 = ttft_cachet(base, key, text)
                    loads += loads_logged(log, mark)
                    hits.append(hit)
                    rows[n][f"{label}_external"] = t.external_hits(vport) - before
                    if label == "shm":
                        # The same request again, vLLM's own prefix cache holding it: no load.
                        owns.append(ttft_cachet(base, key, text)[0])
                if label == "shm":
                    rows[n]["own_hit"] = statistics.median(owns)
                    rows[n]["tokens"] = (u["input_tokens"] + u["cache_creation_input_tokens"]
                                         + u["cache_read_input_tokens"])
                    rows[n]["cachet_miss"] = miss
                    rows[n]["cachet_read"] = u2["cache_read_input_tokens"]
                rows[n][f"{label}_hit"] = statistics.median(hits)
                rows[n][f"{label}_loads"] = loads
            t.Procs.kill(p)
        # 2. No connector, straight to vLLM: the connector's cost on a miss (through the
        #    gateway, a vLLM without Cachet's connector would also wait for a report that never
        #    comes, 200 ms).
        p, _ = vllm("bench-vllm-plain", "off")
        for n, text in prompts.items():
            rows[n]["plain_miss"] = ttft_direct(vport, text)
        t.Procs.kill(p)
        # 3. vLLM's own offloading connector, else its example file connector.
        offload = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30}})
        other = "OffloadingConnector"
        try:
            p, _ = vllm("bench-vllm-offloading", offload)
        except AssertionError as e:
            # The root cause, not the engine's "see above".
            text = open(os.path.join(t.LOGS, "bench-vllm-offloading.log")).read()
            lines = [ln for ln in text.splitlines() if "Worker failed with error" in ln] or [
                ln for ln in str(e).splitlines() if "Error" in ln
            ]
            rows["offloading_error"] = (lines[0].split("RuntimeError: ", 1)[-1] if lines else str(e))[:300]
            kv = tempfile.mkdtemp(prefix="cachet-bench-example-kv-")
            other = "ExampleConnector"
            p, _ = vllm("bench-vllm-example", json.dumps({
                "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": kv}}))
        warm_kv(lambda text: ttft_direct(vport, text))
        for n, text in prompts.items():
            try:
                miss = ttft_direct(vport, text)
                hits, owns = [], []
                for _ in range(REPEATS):
                    t.reset_vllm_cache(vport)
                    before = t.external_hits(vport)
                    hits.append(ttft_direct(vport, text))
                    owns.append(ttft_direct(vport, text))
            except OSError as e:
                rows["other_error"] = f"{other} at {n} tokens: {e}"
                break
            rows[n]["other_miss"], rows[n]["other_hit"] = miss, statistics.median(hits)
            rows[n]["other_own"] = statistics.median(owns)
            rows[n]["other_external"] = t.external_hits(vport) - before
        t.Procs.kill(p)
        rows["other"] = other
        out = rows
    finally:
        procs.stop_all()
        subprocess.run(["psql", f"{t.PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"],
                       capture_output=True)
    other = out.pop("other")
    err = out.pop("offloading_error", None)
    other_err = out.pop("other_error", None)
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    print("Through `cachet serve` (Cachet's connector):\n")
    print("| prompt tokens | recomputed (ms) | loaded, shared memory (ms) | loaded, TCP (ms) "
          "| vLLM's own hit (ms) | shared memory / own hit | load's cost over own hit (ms) "
          "| tokens loaded (vLLM counter: shm, TCP) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in SIZES:
        r = out[n]
        print(
            f"| {r['tokens']} | {ms(r['cachet_miss'])} | {ms(r['shm_hit'])} | {ms(r['tcp_hit'])} "
            f"| {ms(r['own_hit'])} | {r['shm_hit'] / r['own_hit']:.2f}× | {ms(r['shm_hit'] - r['own_hit'])} "
            f"| {r['cachet_read']} ({r['shm_external']:.0f}, {r['tcp_external']:.0f}) |"
        )
    print(f"\nStraight to vLLM (no gateway): no connector, and {other}:\n")
    print(f"| prompt tokens | no connector (ms) | Cachet's connector's cost on a miss "
          f"| {other}: recomputed (ms) | {other}: loaded (ms) | {other}: vLLM's own hit (ms) "
          f"| {other}: loaded / own hit | {other}: load's cost over own hit (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in SIZES:
        r = out[n]
        print(
            f"| {r['tokens']} | {ms(r['plain_miss'])} | {r['cachet_miss'] / r['plain_miss'] - 1:+.1%} "
            + (f"| {ms(r['other_miss'])} | {ms(r['other_hit'])} | {ms(r['other_own'])} "
               f"| {r['other_hit'] / r['other_own']:.2f}× | {ms(r['other_hit'] - r['other_own'])} |"
               if "other_miss" in r else "| – | – | – | – | – |")
        )
    print("\nThe loads inside the connector (its log), beside a plain torch copy and one crc32c pass "
          "of the same bytes on this machine:\n")
    print("| prompt tokens | MB loaded | shared memory (ms) | GB/s | TCP (ms) | GB/s | torch copy (ms) "
          "| crc32c (ms) | shared memory / (copy + crc32c) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in SIZES:
        r = out[n]
        shm = [x for x in r["shm_loads"] if x[3] == "shm"]
        tcp = [x for x in r["tcp_loads"] if x[3] == "tcp"]
        if not shm or not tcp:
            print(f"| {r['tokens']} | – | loads not logged: {r['shm_loads']} {r['tcp_loads']} |")
            continue
        mb = shm[0][1]
        shm_ms, tcp_ms = statistics.median(x[2] for x in shm), statistics.median(x[2] for x in tcp)
        copy_s, crc_s = copy_and_checksum(int(mb * 1e6))
        print(f"| {r['tokens']} | {mb:.1f} | {shm_ms:.1f} | {mb / shm_ms:.2f} | {tcp_ms:.1f} | {mb / tcp_ms:.2f} "
              f"| {copy_s * 1e3:.1f} | {crc_s * 1e3:.1f} | {(copy_s + crc_s) * 1e3 / shm_ms:.0%} |")
    if err:
        print(f"\nOffloadingConnector did not start on the CPU backend: `{err}`")
    if other_err:
        print(f"\n{other_err}")


if __name__ == "__main__":
    main()
