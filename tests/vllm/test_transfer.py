"""The connector's data path (connectors/vllm/cachet_vllm/transfer.py) with CPU tensors against
a real fabric node (`cachet loadtest fabric-node`: the node's TCP wire and its Unix socket with
the shared-memory arena), no vLLM. Run by `make vllm-test` with the pinned environment's
Python:

    CACHET_BIN=target/debug/cachet .cachet/vllm-venv/bin/python -m unittest -v tests/vllm/test_transfer.py

What it proves:
- a block's bytes are the fabric's format whichever way they travel: saved through shared
  memory and read over TCP, saved over TCP and loaded through shared memory, each equal to
  every layer's `select(block_dim, id)` laid end to end;
- loads and saves of scattered block ids land where they belong, for a block dimension
  first (vLLM's CPU layout) and second (K/V first);
- a layout the copies cannot address in place is refused at start;
- a byte flipped in the arena is caught: the load stops before that block, the node drops it;
- the node restarted under a running transfer: loads fail soft (0 blocks, no exception),
  then resume through shared memory;
- a save the node cannot hold answers why, and leaves nothing visible.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "connectors", "vllm"))
sys.path.insert(0, ROOT)

from cachet_vllm.fabric import FabricConnection, LocalConnection  # noqa: E402
from tests.vllm.test_vllm import need  # noqa: E402  (skips loudly outside CI, fails in it)
from cachet_vllm.transfer import KVTransfer, LayoutError, PagedKV  # noqa: E402

BIN = os.path.abspath(os.environ.get("CACHET_BIN", os.path.join(ROOT, "target", "debug", "cachet")))
TOKEN = "transfer-test-" + uuid.uuid4().hex[:8]
BLOCK_TOKENS = 16


class Node:
    """`cachet loadtest fabric-node` on a free port, with its Unix socket in a temp dir."""

    def __init__(self, dram_bytes: int = 64 << 20, port: int = 0, sock: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="cachet-transfer-")
        self.sock = sock or os.path.join(self.dir, "fabric.sock")
        self.dram_bytes = dram_bytes
        self.start(port)

    def start(self, port: int = 0) -> None:
        self.log = open(os.path.join(self.dir, "node.log"), "ab")
        self.proc = subprocess.Popen(
            [BIN, "loadtest", "fabric-node", "--listen", f"127.0.0.1:{port}", "--socket", self.sock,
             "--dram-bytes", str(self.dram_bytes)],
            env={**os.environ, "CACHET_CLUSTER_TOKEN": TOKEN}, stdout=subprocess.PIPE, stderr=self.log,
        )
        for line in self.proc.stdout:
            line = line.decode().strip()
            if line.startswith("listening on "):
                self.addr = line.removeprefix("listening on ")
                return
        raise AssertionError(f"the fabric node did not start: {open(self.log.name).read()[-2000:]}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


def scope() -> bytes:
    return uuid.uuid4().bytes + uuid.uuid4().bytes


def keys(n: int) -> list[bytes]:
    return [uuid.uuid4().bytes * 2 for _ in range(n)]


def chain(ks: list[bytes]) -> list[tuple[bytes, bytes | None]]:
    return [(k, ks[i - 1] if i else None) for i, k in enumerate(ks)]


def layers(block_dim: int = 0, n_layers: int = 4, num_blocks: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if block_dim == 0:
        shape = (num_blocks, 2, BLOCK_TOKENS, 32)  # vLLM's CPU layout: [blocks, heads, tokens, 2 × head dim]
    else:
        shape = (2, num_blocks, BLOCK_TOKENS, 2, 16)  # K/V first: [2, blocks, tokens, heads, head dim]
    return [torch.randn(shape, generator=g) for _ in range(n_layers)]


def block_bytes(ls: list[torch.Tensor], block_dim: int, b: int) -> bytes:
    """The fabric's format of block `b`, written the obvious way."""
    return b"".join(bytes(t.select(block_dim, b).contiguous().view(-1).view(torch.uint8).tolist()) for t in ls)


class Transfer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        need(os.path.exists(BIN), f"the cachet binary at {BIN} (cargo build)")
        cls.node = Node()

    @classmethod
    def tearDownClass(cls):
        cls.node.stop()

    def transfer(self, ls, block_dim=0, shared_memory=True, node=None) -> KVTransfer:
        node = node or self.node
        kv = PagedKV(ls, num_blocks=ls[0].shape[block_dim], block_dim=block_dim)
        t = KVTransfer(kv, node.addr, TOKEN, block_tokens=BLOCK_TOKENS, shared_memory=shared_memory)
        self.addCleanup(t.close)
        return t

    def save(self, t: KVTransfer, s: bytes, ks: list[bytes], ids: list[int], existing=()) -> str | None:
        return t.save(s, 300_000, 0, list(existing), [(k, p, b) for (k, p), b in zip(chain(ks), ids)])

    def test_blocks_keep_the_fabrics_format_both_ways(self):
        for block_dim in (0, 1):
            with self.subTest(block_dim=block_dim):
                src = layers(block_dim, seed=1)
                s, ks, ids = scope(), keys(3), [3, 7, 1]
                shm = self.transfer(src, block_dim)
                self.assertEqual(shm.mode, "shm")
                self.assertIsNone(self.save(shm, s, ks, ids))
                # Read back over TCP, whole blocks in the fabric's format.
                tcp_client = FabricConnection(self.node.addr, TOKEN)
                self.addCleanup(tcp_client.close)
                got = tcp_client.get(s, ks)
                self.assertEqual([bytes(b.data) for b in got], [block_bytes(src, block_dim, b) for b in ids])
                # Saved over TCP, loaded through shared memory (and the other way round).
                s2, ks2 = scope(), keys(3)
                tcp = self.transfer(src, block_dim, shared_memory=False)
                self.assertEqual(tcp.mode, "tcp")
                self.assertIsNone(self.save(tcp, s2, ks2, ids))
                for loader, ss, kk in ((shm, s2, ks2), (tcp, s, ks)):
                    dst = [torch.zeros_like(t) for t in src]
                    into = self.transfer(dst, block_dim, shared_memory=loader is shm)
                    done = into.load(ss, kk, [0, 9, 4])
                    self.assertEqual((done.blocks, done.mode), (3, into.mode))
                    for a, b in zip([0, 9, 4], ids):
                        self.assertEqual(block_bytes(dst, block_dim, a), block_bytes(src, block_dim, b))
                    untouched = [i for i in range(16) if i not in (0, 9, 4)]
                    self.assertTrue(all(bool((t.select(block_dim, i) == 0).all()) for t in dst for i in untouched),
                                    "a load wrote outside its blocks")

    def test_a_load_reads_the_longest_stored_prefix(self):
        src = layers(seed=2)
        s, ks = scope(), keys(4)
        t = self.transfer(src)
        self.assertIsNone(self.save(t, s, ks[:2], [5, 6]))
        dst = [torch.zeros_like(x) for x in src]
        done = self.transfer(dst).load(s, ks, [1, 2, 3, 4])
        self.assertEqual(done.blocks, 2)
        self.assertEqual(block_bytes(dst, 0, 2), block_bytes(src, 0, 6))
        # Another tenant's scope reads nothing of it.
        self.assertEqual(self.transfer(dst).load(scope(), ks, [1, 2, 3, 4]).blocks, 0)

    def test_a_byte_flipped_in_the_arena_is_caught(self):
        src = layers(seed=3)
        s, ks = scope(), keys(3)
        t = self.transfer(src)
        self.assertIsNone(self.save(t, s, ks, [0, 1, 2]))
        # The test maps the arena as an engine would, finds block 1 and flips a byte of it.
        spy = LocalConnection(self.node.sock, TOKEN)
        arena = spy.connect()
        lease, leased = spy.lease(s, ks)
        spy.release(lease)
        arena[leased[1].offset + 1000] ^= 0xFF
        dst = [torch.zeros_like(x) for x in src]
        done = self.transfer(dst).load(s, ks, [7, 8, 9])
        self.assertEqual((done.blocks, done.corrupt), (1, True))
        self.assertEqual(block_bytes(dst, 0, 7), block_bytes(src, 0, 0))
        # The node dropped the corrupt block: the next load stops before it.
        self.assertEqual(FabricConnection(self.node.addr, TOKEN).has(s, ks), [True, False, True])
        self.assertEqual(self.transfer(dst).load(s, ks, [7, 8, 9]).blocks, 1)
        spy.close()

    def test_a_layout_that_cannot_be_copied_in_place_is_refused(self):
        ls = layers()
        with self.assertRaises(LayoutError):
            PagedKV([t.transpose(1, 2) for t in ls], num_blocks=16)
        with self.assertRaises(LayoutError):
            PagedKV([ls[0], ls[1][:, :1]], num_blocks=16)
        with self.assertRaises(LayoutError):
            PagedKV(ls, num_blocks=17)

    def test_a_save_the_node_cannot_hold_answers_why(self):
        small = Node(dram_bytes=32 << 10)
        try:
            src = layers(seed=4)
            s, ks = scope(), keys(3)
            for shared_memory in (True, False):
                t = self.transfer(src, shared_memory=shared_memory, node=small)
                self.assertEqual(self.save(t, s, ks, [0, 1, 2]), "capacity")
                self.assertEqual(FabricConnection(small.addr, TOKEN).has(s, ks), [False] * 3)
        finally:
            small.stop()

    def test_the_node_restarted_under_a_transfer(self):
        restarting = Node()
        try:
            src = layers(seed=5)
            t = self.transfer(src, node=restarting)
            s, ks = scope(), keys(2)
            self.assertIsNone(self.save(t, s, ks, [0, 1]))
            port = int(restarting.addr.rsplit(":", 1)[1])
            restarting.stop()
            dst = [torch.zeros_like(x) for x in src]
            into = self.transfer(dst, node=restarting)
            self.assertEqual(into.load(s, ks, [2, 3]).blocks, 0, "a dead node: nothing loaded, nothing raised")
            self.assertIsNotNone(self.save(t, s, ks, [0, 1]))
            restarting.start(port)
            time.sleep(2.1)  # the transfer retries the socket after RETRY_LOCAL_SECS
            self.assertIsNone(self.save(t, s, ks, [0, 1]), "saves resume")
            done = into.load(s, ks, [2, 3])
            self.assertEqual((done.blocks, done.mode), (2, "shm"), "loads resume through shared memory")
            self.assertEqual(block_bytes(dst, 0, 3), block_bytes(src, 0, 1))
        finally:
            restarting.stop()

    @unittest.skipUnless(torch.cuda.is_available() or os.environ.get("CACHET_EXPECT_GPU"), "no CUDA device")
    def test_cuda_tensors_round_trip(self):
        src = [t.cuda() for t in layers(seed=6)]
        s, ks = scope(), keys(3)
        self.assertIsNone(self.save(self.transfer(src), s, ks, [2, 4, 6]))
        dst = [torch.zeros_like(t) for t in src]
        self.assertEqual(self.transfer(dst).load(s, ks, [1, 3, 5]).blocks, 3)
        for a, b in zip([1, 3, 5], [2, 4, 6]):
            for x, y in zip(dst, src):
                self.assertTrue(bool((x[a] == y[b]).all()))


if __name__ == "__main__":
    unittest.main(verbosity=2)
