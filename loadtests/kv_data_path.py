"""The KV data path alone: a prefix saved to and loaded from a real fabric node through the
connector's transfer module (connectors/vllm/cachet_vllm/transfer.py), beside a plain copy
and one crc32c pass of the same bytes on the same machine. Needs only torch, the module and
the `cachet` binary (the node is `cachet loadtest fabric-node`), so it runs as well on a GPU
machine (`--device cuda`: the KV tensors live there, and the plain copy is a pinned
host-to-device copy of the same bytes).

    python loadtests/kv_data_path.py [--geometry llama3-8b|smollm2] [--tokens 8192] [--device cpu|cuda]

Prints a Markdown table (docs/benchmarks.md, "The KV data path").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "connectors", "vllm"))

import crc32c  # noqa: E402

from cachet_vllm.transfer import KVTransfer, PagedKV  # noqa: E402

# name: (layers, per-layer block shape after the block dimension, dtype, tokens a block)
GEOMETRIES = {
    # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16: 128 KiB a token; vLLM's CPU layout.
    "llama3-8b": (32, (8, 128, 2 * 128), torch.bfloat16, 128),
    # SmolLM2-135M as the vLLM CPU benchmarks serve it: 30 layers, 3 KV heads of 64, f32.
    "smollm2": (30, (3, 128, 2 * 64), torch.float32, 128),
}


def node(bin_path: str, dram: int, token: str):
    d = tempfile.mkdtemp(prefix="cachet-kv-bench-")
    sock = os.path.join(d, "fabric.sock")
    p = subprocess.Popen(
        [bin_path, "loadtest", "fabric-node", "--socket", sock, "--dram-bytes", str(dram)],
        env={**os.environ, "CACHET_CLUSTER_TOKEN": token}, stdout=subprocess.PIPE,
    )
    for line in p.stdout:
        line = line.decode().strip()
        if line.startswith("listening on "):
            return p, line.removeprefix("listening on ")
    raise SystemExit("the fabric node did not start")


def timed(f, runs: int) -> list[float]:
    f()  # warm: first touches of the pages stay out
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        f()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama3-8b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bin", default=os.environ.get("CACHET_BIN", os.path.join(ROOT, "target", "release", "cachet")))
    a = ap.parse_args()
    n_layers, inner, dtype, bt = GEOMETRIES[a.geometry]
    n = a.tokens // bt
    dev = torch.device(a.device)
    layers = [torch.randn((n + 8, *inner), dtype=torch.float32).to(dtype).to(dev) for _ in range(n_layers)]
    dst = [torch.zeros_like(t) for t in layers]
    kv, kv_dst = PagedKV(layers, n + 8), PagedKV(dst, n + 8)
    total = n * kv.block_bytes
    token = uuid.uuid4().hex
    # Room for one prefix and a quarter: each save evicts the one before it and reuses its
    # pages, as a node that has run a while does (a fresh arena's pages are taken from the
    # kernel on first write, a one-time cost the warm-up rounds pay).
    proc, addr = node(a.bin, int(total * 1.25) + (64 << 20), token)
    rows = []
    try:
        ids = list(range(4, 4 + n))
        # vLLM hands a new request consecutive blocks from a fresh free list, scattered ones
        # after churn: both are measured (the scattered ones in reverse order).
        consecutive = list(range(8, 8 + n))
        scattered = list(range(n + 7, 7, -1))[:n]

        for mode, shm, ids_dst in (("shared memory", True, consecutive),
                                   ("shared memory, scattered blocks", True, scattered),
                                   ("TCP", False, consecutive)):
            src_t = KVTransfer(kv, addr, token, block_tokens=bt, shared_memory=shm)
            dst_t = KVTransfer(kv_dst, addr, token, block_tokens=bt, shared_memory=shm)
            assert (src_t.mode == "shm") == shm, src_t.mode
            saves, loads = [], []
            warm = 2
            for r in range(a.runs + warm):
                scope = uuid.uuid4().bytes * 2
                keys = [uuid.uuid4().bytes * 2 for _ in range(n)]
                blocks = [(k, keys[i - 1] if i else None, b) for i, (k, b) in enumerate(zip(keys, ids))]
                start = time.perf_counter()
                refused = src_t.save(scope, 300_000, 1, [], blocks)
                saved = time.perf_counter() - start
                assert refused is None, refused
                done = dst_t.load(scope, keys, ids_dst)
                assert done.blocks == n, done
                if r >= warm:
                    saves.append(saved)
                    loads.append(done.seconds)
            for t in (src_t, dst_t):
                t.close()
            rows.append((f"load over {mode}", statistics.median(loads)))
            if ids_dst is consecutive:
                rows.append((f"save over {mode}", statistics.median(saves)))
        # Correctness of the last load: every block where it belongs.
        for a_id, b_id in ((consecutive[0], ids[0]), (consecutive[-1], ids[-1])):
            assert all(bool((x[a_id] == y[b_id]).all()) for x, y in zip(dst, layers))

        # The same bytes, the plain way.
        host = torch.empty(total, dtype=torch.uint8)
        host.random_(0, 255)
        if dev.type == "cuda":
            pinned = host.pin_memory()
            target = torch.empty(total, dtype=torch.uint8, device=dev)

            def copy():
                target.copy_(pinned, non_blocking=True)
                torch.cuda.synchronize()

            copy_name = "pinned host → device copy of the same bytes"
        else:
            target = torch.empty_like(host)

            def copy():
                target.copy_(host)

            copy_name = "torch copy of the same bytes"
        view = memoryview(host.numpy())
        copy_s = statistics.median(timed(copy, a.runs))
        crc_s = statistics.median(timed(lambda: crc32c.crc32c(view), a.runs))
    finally:
        proc.kill()
        proc.wait()

    gb = total / 1e9
    print(f"{a.geometry}, {a.tokens} tokens ({n} blocks of {bt}, {gb:.2f} GB), {torch.get_num_threads()} torch "
          f"threads, device {dev}\n")
    print("| path | ms | GB/s | share of copy + one checksum |")
    print("|---|---:|---:|---:|")
    both = copy_s + crc_s
    for name, s in [(copy_name, copy_s), ("crc32c pass (the `crc32c` package)", crc_s),
                    ("copy + one checksum pass", both)] + rows:
        print(f"| {name} | {s * 1e3:.1f} | {gb / s:.2f} | {both / s:.0%} |")


if __name__ == "__main__":
    main()
