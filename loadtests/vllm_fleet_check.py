"""The fleet simulator against the real thing: two vLLM instances (CPU build, one core each)
beside one `cachet serve`, replaying a small generated workload at two loads (one below
saturation, one above), then `cachet loadtest simulate-fleet` on the same requests (their
arrival times, prompt tokens, shared prefix and the output lengths the real run produced),
two instances on one node, least-loaded routing (what the vLLM engine does among its
instances), the gateway's slots (`--gateway-slots`), and every request the instances served
before the load as warm-up (`--warm-up`). Prints TTFT p50 and time between tokens p50,
measured against predicted, then where the time went on each side. Run by
`loadtests/vllm-bench.sh loadtests/vllm_fleet_check.py` (`make bench-fleet-check`).

The profile is measured first, in the run, on the first instance as deployed (its connector
on, the other idle): a committed profile measured on another machine (or this one in another
hour) is not this machine's, and on 2-core VMs the same vLLM has run 4.5 times faster on one
day than on another. CHECK_NEIGHBOUR=1 also measures the second instance's effect on the
first while busy (`profile --neighbour`) and prints the simulator's figures with that term
beside them (about 3 minutes more; in two runs it made the predictions worse, see
docs/benchmarks.md).

The workload: CHECK_REQUESTS requests a load, Poisson arrivals; every prompt of a load is the
load's own system prompt of ~CHECK_SHARED_TOKENS tokens (cached after its first) and a private
question of ~CHECK_PRIVATE_TOKENS tokens; up to CHECK_OUTPUT answer tokens. Loads:
CHECK_LOADS, multiples of what the two instances serve one request at a time by the profile
(default 0.4 and 3), or CHECK_RATES in requests a second.
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
# Loads as multiples of what the two instances serve one request at a time (from the profile
# measured at the start of the run, so that "below" and "above saturation" hold on any
# machine); CHECK_RATES (requests a second) overrides them.
LOADS = [float(x) for x in os.environ.get("CHECK_LOADS", "0.4,3").split(",")]
RATES = [float(r) for r in os.environ["CHECK_RATES"].split(",")] if os.environ.get("CHECK_RATES") else None
BLOCK = 128
# cachet serve's generations at once on the model (engine.workers, default 8, for each of its
# two instances): the gateway's bound in front of them, which the simulator models with
# --gateway-slots.
SLOTS = int(os.environ.get("CHECK_GATEWAY_SLOTS", "16"))
NEIGHBOUR = os.environ.get("CHECK_NEIGHBOUR") == "1"
# vLLM's KV cache a server (scripts/vllm-serve.sh's default 1 GiB) in SmolLM2's f32 tokens.
KV_BYTES = 46080
ENGINE_CACHE_TOKENS = (1 << 30) // KV_BYTES


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


def run_load(base: str, key: str, rate: float, seed: int, origin: float) -> list[dict]:
    """CHECK_REQUESTS requests at `rate` (Poisson); each result's `arrival` is from the
    load's start, its `at` from `origin` (the run's first request)."""
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
        r["at"] = t0 - origin + arrivals[i]
        r["system"] = seed
        results[i] = r

    threads = [threading.Thread(target=one, args=(i,)) for i in range(REQUESTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [r for r in results if r is not None]


def trace_of(results: list[dict], shared_blocks: int) -> str:
    """The requests as a Mooncake trace for the simulator: arrival (ms from the run's first
    request), the prompt's real token count (in Mooncake's 512-token units, as the
    simulator's --block-tokens scales them), its system prompt's blocks first (each load has
    its own system prompt, shared by its requests), then private ones, the real output."""
    lines = []
    for i, r in enumerate(results):
        blocks = -(-r["prompt"] // BLOCK)
        ids = [r["system"] * 10**9 + k for k in range(min(shared_blocks, blocks))] + [100_000 + i * 100 + k for k in range(max(0, blocks - shared_blocks))]
        lines.append(json.dumps({"timestamp": r["at"] * 1000, "input_length": r["prompt"] * 512 // BLOCK,
                                 "output_length": max(1, r["output"]), "hash_ids": ids}))
    return "\n".join(lines) + "\n"


# vLLM's own per-request histograms (engine side): where a request's time went.
PHASES = ["vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
          "vllm:request_decode_time_seconds", "vllm:time_to_first_token_seconds",
          "vllm:e2e_request_latency_seconds"]
COUNTERS = ["vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count"]


def engine_stats(ports: list[int]) -> dict:
    """Sums over the instances of each phase histogram's _sum and _count, and the counters
    (one scrape an instance)."""
    out: dict[str, float] = {}
    names = [n + part for n in PHASES for part in ("_sum", "_count")] + COUNTERS
    for port in ports:
        text = t.scrape(f"http://127.0.0.1:{port}")
        for name in names:
            out[name] = out.get(name, 0.0) + t.series(text, name)
    return out


def cpu_seconds(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process in each session (the helpers
    start each server in its own session), split into vLLM's engine core and the rest."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    names = {sid: name for name, sid in groups.items()}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat[stat.rindex(")") + 2:].split()
        sid, secs = int(f[3]), (int(f[11]) + int(f[12])) / tick
        name = names.get(sid)
        if name is None:
            continue
        if name.startswith("vllm"):
            # The server (python), its engine core (scheduling) and its worker (the model).
            name += ":worker" if "Worker" in comm else ":core" if "Engine" in comm else ":api"
        out[name] = out.get(name, 0.0) + secs
    return out


def gateway_stats(base: str) -> dict:
    """Requests that waited for one of the gateway's engine slots, and their wait in all."""
    text = t.scrape(base)
    return {"queued": t.series(text, "cachet_gateway_engine_acquires_total", 'outcome="queued"'),
            "wait": t.series(text, "cachet_gateway_engine_wait_seconds_total")}


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def profile(port: int, neighbour: int | None, out: str) -> dict:
    """The cost profile of instance `port` as it is deployed here (its connector on; the
    instance at `neighbour`, if given, idle, then busy for the neighbour term), measured now:
    the simulator's figures come from this machine and this hour, not from a committed file
    measured elsewhere. Three lone prompts of each length: one VM's prefill times scatter by
    a fifth from one prompt to the next."""
    py = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                        capture_output=True, text=True).stdout.strip()
    r = subprocess.run([os.environ["CACHET_BIN"], "loadtest", "profile", "--url", f"http://127.0.0.1:{port}",
                        "--model", "smollm2", "--name", "fleet-check",
                        "--note", f"vLLM {py}'s CPU build, SmolLM2-135M at f32, one core of {os.cpu_count()}, "
                                  "its KV connector on, as the fleet check deploys it",
                        *[a for n in (128, 256, 512, 768, 1024, 1536, 2048) for a in ("--prefill-tokens", str(n))],
                        "--kv-bytes-per-token", str(KV_BYTES), "--load-bytes-per-sec", "4e9",
                        "--transfer-bytes-per-sec", "0.9e9", "--chunk-tokens", "2048", "--max-batch", "128",
                        "--engine-cache-tokens", str(ENGINE_CACHE_TOKENS), "--repeats", "3",
                        *(["--neighbour", f"http://127.0.0.1:{neighbour}"] if neighbour else []),
                        "--out", out],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"profile failed: {r.stderr}")
    print(r.stdout, file=sys.stderr)
    return json.load(open(out))


def lone_secs(p: dict, cached: int, prompt: int, output: int) -> float:
    """One request alone on an instance, by the profile: its prefill after `cached` tokens,
    then `output - 1` decode steps."""
    a, b = cached, prompt
    prefill = (b - a) / p["prefill_tokens_per_sec"] + p["prefill_per_kctx_ms"] * (b * b - a * a) / 2e6
    step = lambda ctx: (p["step_base_ms"] + p["step_per_seq_ms"] + p["step_per_kctx_ms"] * ctx / 1e3) / 1e3
    return p.get("request_overhead_ms", 0.0) / 1e3 + step(0) + prefill + (output - 1) * step(prompt)


def simulate(trace: str, profile_path: str, warm_up: int) -> dict:
    """The simulator on every request the instances saw so far (the warm-up and the loads
    before, which leave the caches as they found them), its figures over the last load's."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(trace)
        path = f.name
    out = path + ".json"
    subprocess.run([os.environ["CACHET_BIN"], "loadtest", "simulate-fleet", "--trace", path,
                    "--profile", profile_path, "--instances", "2", "--nodes", "1",
                    "--gateway-slots", str(SLOTS), "--warm-up", str(warm_up),
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
    rows, diag = [], []
    try:
        groups = {"serve": c.serve.pid, "client": os.getsid(0),
                  **{f"vllm{i}": p.pid for i, (p, _) in enumerate(c.vllms)}}
        logs = os.environ.get("CACHET_VLLM_TEST_LOGS", tempfile.gettempdir())
        profile_path = os.path.join(logs, "fleet-check-profile.json")
        prof = profile(c.ports[0], c.ports[1] if NEIGHBOUR else None, profile_path)
        # The profile the check compares with: without the neighbour term (which, measured,
        # is printed beside it).
        alone_path = os.path.join(logs, "fleet-check-profile-alone.json")
        with open(alone_path, "w") as f:
            json.dump({**prof, "neighbour_prefill_slowdown": 0.0, "neighbour_step_slowdown": 0.0}, f)
        # The shared system prompt's tokens as rendered (the blocks every request shares).
        origin = time.perf_counter()
        warm = stream(c.base, c.key, prompt_text(SHARED, 1), "Hi")
        warm["at"], warm["system"] = 0.0, 1
        seen = [warm]
        shared_blocks = max(0, (warm["prompt"] - 16) // BLOCK)
        lone = lone_secs(prof, shared_blocks * BLOCK, warm["prompt"] - 16 + PRIVATE, OUTPUT)
        rates = RATES or [round(x * 2 / lone, 3) for x in LOADS]
        print(f"# one request alone: {lone:.2f} s by the profile; loads {LOADS} of two instances' "
              f"{2 / lone:.2f} requests/s unbatched: {rates} requests/s", file=sys.stderr)
        for k, rate in enumerate(rates):
            before, cpu0, w0 = engine_stats(c.ports), cpu_seconds(groups), time.perf_counter()
            g0 = gateway_stats(c.base)
            results = run_load(c.base, c.key, rate, seed=11 + k, origin=origin)
            after, cpu1, wall = engine_stats(c.ports), cpu_seconds(groups), time.perf_counter() - w0
            g1 = gateway_stats(c.base)
            queued = g1["queued"] - g0["queued"]
            gateway_wait = 1e3 * (g1["wait"] - g0["wait"]) / max(1.0, queued)
            d = {k2: after[k2] - before.get(k2, 0.0) for k2 in after}
            phases = {n.split(":")[1].replace("_seconds", ""): 1e3 * d[n + "_sum"] / max(1.0, d[n + "_count"])
                      for n in PHASES}
            diag.append((rate, wall, phases, {k2: cpu1.get(k2, 0.0) - cpu0.get(k2, 0.0) for k2 in cpu1},
                         {n.split(":")[1]: d[n] for n in COUNTERS},
                         {"ttft_mean": statistics.mean([r["ttft"] * 1e3 for r in results if r["ttft"]]),
                          "prompt_mean": statistics.mean([r["prompt"] for r in results]),
                          "output_mean": statistics.mean([r["output"] for r in results])}))
            warm_up = len(seen)
            seen += results
            trace = trace_of(seen, shared_blocks)
            # Kept with the logs, to simulate again without the real run (--warm-up as here).
            with open(os.path.join(logs, f"fleet-check-{rate}.jsonl"), "w") as f:
                f.write(trace)
            with open(os.path.join(logs, f"fleet-check-{rate}-measured.json"), "w") as f:
                json.dump(results, f)
            real_ttft = p50([r["ttft"] * 1e3 for r in results if r["ttft"] is not None])
            real_tbt = p50([g * 1e3 for r in results for g in r["gaps"]])
            sim = simulate(trace, alone_path, warm_up)
            sim_nb = simulate(trace, profile_path, warm_up) if NEIGHBOUR else sim
            # Above saturation, the instances finish fewer requests a second than arrive.
            first = min(r["at"] for r in results)
            last = max(r["at"] + (r["ttft"] or 0) + sum(r["gaps"]) for r in results)
            served = len(results) / max(1e-9, last - first)
            rows.append((rate, served, len(results), real_ttft, sim["ttft_p50_ms"], real_tbt, sim["tbt_p50_ms"],
                         sim_nb["ttft_p50_ms"], sim_nb["tbt_p50_ms"]))
            diag[-1][5]["gateway_queued"] = queued
            diag[-1][5]["gateway_wait_mean"] = gateway_wait
            diag[-1][5]["sim_gateway_queued"] = sim["gateway_queued"]
            diag[-1][5]["sim_gateway_wait_mean"] = sim["gateway_wait_mean_ms"]
    finally:
        c.procs.stop_all()
        subprocess.run(["psql", f"{t.PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {c.db} WITH (FORCE)"],
                       capture_output=True)
    extra = ""
    if NEIGHBOUR:
        print(f"neighbour term: prefill +{100 * prof['neighbour_prefill_slowdown']:.0f}%, "
              f"an iteration's fixed part +{100 * prof['neighbour_step_slowdown']:.0f}% while the other instance is busy")
        extra = " with the neighbour term: TTFT | TBT |"
    print("| requests/s | served /s | requests | TTFT p50 ms measured | simulated | off by | time between tokens p50 ms measured | simulated | off by |" + extra)
    print("|---:" * (11 if NEIGHBOUR else 9) + "|")
    for rate, served, n, rt, st, rb, sb, stn, sbn in rows:
        print(f"| {rate} | {served:.2f} | {n} | {rt:.0f} | {st:.0f} | {100 * (st - rt) / rt:+.0f}% | {rb:.1f} | {sb:.1f} "
              f"| {100 * (sb - rb) / rb:+.0f}% |"
              + (f" {100 * (stn - rt) / rt:+.0f}% | {100 * (sbn - rb) / rb:+.0f}% |" if NEIGHBOUR else ""))
    # Where the time went, engine side (vLLM's histograms, means over the load's requests),
    # and the CPU each process took over the load's wall time.
    for rate, wall, phases, cpu, counters, client in diag:
        print(f"\n{rate} requests/s over {wall:.1f} s: client " + ", ".join(f"{k} {v:.0f}" for k, v in client.items()))
        print("  engine means ms: " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))
        print("  counters: " + ", ".join(f"{k} {v:.0f}" for k, v in counters.items()))
        print("  CPU s (share of wall): " + ", ".join(f"{k} {v:.1f} ({v / wall:.0%})" for k, v in sorted(cpu.items())))


if __name__ == "__main__":
    main()
