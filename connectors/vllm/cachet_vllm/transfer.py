"""Cachet's KV data path between a fabric node and an engine's paged KV cache.

Imports no vLLM: it takes the engine's per-layer KV tensors (CPU or CUDA) and moves whole
blocks between them and the node, so it can be tested and measured with torch alone
(tests/vllm/test_transfer.py, loadtests/kv_data_path.py).

- `PagedKV`: the paged KV cache as per-layer tensors with a block dimension, its layout
  checked once; a block's bytes (the fabric's format) are every layer's slice of the block,
  layers in model order, each slice as `select(block_dim, id)` lays it out. Copies move many
  blocks at once: one indexed copy per layer for a run of blocks (`index_copy_` /
  `index_select` with an index tensor of block ids), never a Python loop over blocks × layers.
- `KVTransfer`: loads and saves of a request's blocks. When the node is on this host (its
  Unix socket answers and hands over its shared-memory arena), a load leases the blocks in
  place and copies them straight from the arena into the paged KV, verifying each block's
  crc32c once, on a thread beside the copy; a save reserves room in the arena, copies the
  blocks straight into it, and commits (the node checksums and stores them: nothing is
  visible before the commit). Otherwise, or with shared memory turned off, blocks travel over
  the node's TCP wire (GET / PUT) through a bounded staging buffer.

Failures never raise out of `load` / `save`: a load reports how many leading blocks it
loaded (the caller has the rest recomputed), a save returns why it was not stored.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import torch

from .fabric import FabricConnection, FabricError, Leased, LocalConnection, checksum

log = logging.getLogger(__name__)

# The node places every arena extent at a multiple of this (cache-fabric/src/arena.rs).
ARENA_ALIGN = 4096
# Most bytes a TCP load or save stages at once.
TCP_STAGING_BYTES = 64 << 20
# How long after a failed attempt the node's Unix socket is tried again.
RETRY_LOCAL_SECS = 2.0


def footprint(n: int) -> int:
    """Bytes an extent of `n` bytes takes in the node's arena."""
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


class LayoutError(ValueError):
    """A KV cache these copies cannot address in place."""


def _copy_dtype(nbytes: int, device: torch.device) -> torch.dtype:
    """The widest integer type that divides a layer's block slice: copies move bytes, and
    on the CPU wide elements copy faster than narrow ones."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0:
            return dt
    return torch.uint8


class PagedKV:
    """An engine's paged KV cache, one tensor per layer in model order."""

    def __init__(self, layers: list[torch.Tensor], num_blocks: int | None = None, block_dim: int | None = None):
        if not layers:
            raise LayoutError("no KV layers")
        first = layers[0]
        for i, t in enumerate(layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise LayoutError(
                    f"layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}, layer 0 {tuple(first.shape)} "
                    f"{first.dtype} on {first.device}: every layer must have one shape, dtype and device"
                )
        if block_dim is None:
            dims = [d for d, n in enumerate(first.shape) if n == num_blocks] if num_blocks else [0]
            if not dims:
                raise LayoutError(f"no dimension of {tuple(first.shape)} has the {num_blocks} KV blocks")
            block_dim = dims[0]
        shape = tuple(first.shape)
        self.num_blocks = shape[block_dim]
        self.block_dim = block_dim
        outer = math.prod(shape[:block_dim])
        inner = math.prod(shape[block_dim + 1 :])
        self.layer_bytes = outer * inner * first.element_size()
        self.block_bytes = self.layer_bytes * len(layers)
        self.device = first.device
        self.dtype = first.dtype
        self._outer = outer
        self._cdt = _copy_dtype(inner * first.element_size(), first.device)
        self._inner = inner * first.element_size() // torch.empty(0, dtype=self._cdt).element_size()
        # Each layer as [outer, blocks, inner] elements of the copy dtype, the same memory:
        # `view` never copies, and refuses strides that cannot be seen this way.
        self._views = []
        for i, t in enumerate(layers):
            try:
                v = t.view(self._cdt) if t.dtype != self._cdt else t
                v = v.view(*shape[:block_dim], self.num_blocks, -1).view(outer, self.num_blocks, self._inner)
            except RuntimeError as e:
                raise LayoutError(
                    f"layer {i} ({tuple(t.shape)}, strides {t.stride()}) cannot be viewed as "
                    f"[outer, blocks, inner] in place: {e}"
                ) from e
            if v.data_ptr() != t.data_ptr():
                raise LayoutError(f"layer {i}: a view of it is not its own memory")
            self._views.append(v)
        self.layers = len(layers)

    def describe(self) -> str:
        return (
            f"{self.layers} layers of {self.num_blocks} blocks (block dim {self.block_dim}), "
            f"{self.layer_bytes} bytes a layer's block, {self.block_bytes} a block, {self.dtype} on {self.device}"
        )

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def _layer_slices(self, run: torch.Tensor, stride: int, k: int, layers: range | None = None):
        """Layer l of the k blocks of `run` (block j at `j * stride` bytes) as [outer, k,
        inner] elements of the copy dtype, each a view of `run` (every layer, or `layers`)."""
        blocks = run[: k * stride].view(k, stride)
        for l in layers if layers is not None else range(self.layers):
            part = blocks[:, l * self.layer_bytes : (l + 1) * self.layer_bytes]
            yield l, part.view(self._cdt).view(k, self._outer, self._inner).transpose(0, 1)

    def scatter(self, run: torch.Tensor, stride: int, block_ids: list[int], layers: range | None = None) -> None:
        """Copy the blocks of `run` (a uint8 CPU tensor, block j at `j * stride` bytes) into
        the KV blocks `block_ids`. On a device, `run` first goes over in one transfer, then
        one indexed copy per layer runs there (`index_copy_`); the caller synchronizes
        before it lets `run`'s memory go. On the CPU, where `index_copy_` moves element by
        element at about half a plain copy's speed, each stretch of consecutive block ids
        is one strided copy per layer (one per layer in all when vLLM gave the request
        consecutive blocks, as it does from a fresh free list). `layers`: only those layers (a
        load that overlaps the forward pass copies them in the order the model reads them)."""
        k = len(block_ids)
        if k == 0:
            return
        if self.device.type != "cpu":
            run = run[: k * stride].to(self.device, non_blocking=True)
            ids = self._ids(block_ids)
            for l, src in self._layer_slices(run, stride, k, layers):
                self._views[l].index_copy_(1, ids, src)
            return
        stretches = _stretches(block_ids)
        for l, src in self._layer_slices(run, stride, k, layers):
            dst = self._views[l]
            for j, b, n in stretches:
                dst[:, b : b + n].copy_(src[:, j : j + n])

    def gather(self, run: torch.Tensor, stride: int, block_ids: list[int]) -> None:
        """Copy the KV blocks `block_ids` into `run` (a uint8 CPU tensor, block j at
        `j * stride` bytes): one indexed copy per layer (on a device, into one staging
        buffer there, then one transfer back, waited for)."""
        k = len(block_ids)
        if k == 0:
            return
        ids = self._ids(block_ids)
        dst = run if self.device.type == "cpu" else torch.empty(k * stride, dtype=torch.uint8, device=self.device)
        for l, part in self._layer_slices(dst, stride, k):
            # Written in place through the strided view (checked by test_transfer.py).
            torch.index_select(self._views[l], 1, ids, out=part)
        if dst is not run:
            run[: k * stride].copy_(dst)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _stretches(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(index in the list, first id, count) of each stretch of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for j, b in enumerate(block_ids):
        if out and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((j, b, 1))
    return out


@dataclass
class Loaded:
    """What a load did: how many leading blocks are in the KV (checksums verified), how,
    and whether the node is to drop a corrupt one."""

    blocks: int
    mode: str
    corrupt: bool = False
    seconds: float = 0.0


def _runs(offsets: list[int], stride: int) -> list[tuple[int, int]]:
    """(start index, count) of the maximal runs of blocks lying side by side."""
    runs: list[tuple[int, int]] = []
    for i, off in enumerate(offsets):
        if runs and offsets[runs[-1][0]] + runs[-1][1] * stride == off:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _first_corrupt(view: memoryview, blocks: list[Leased], out: list) -> None:
    """The index of the first block whose bytes fail their checksum, into `out[0]`
    (crc32c releases the GIL on large buffers, so this runs beside the copies)."""
    for i, b in enumerate(blocks):
        if checksum(view[b.offset : b.offset + b.length]) != b.crc:
            out[0] = i
            return


class PendingLoad:
    """A load through shared memory under way: its blocks leased, their checksums being
    checked on a thread, its copies made layer by layer by whoever holds it."""

    def __init__(self, transfer: "KVTransfer", local: LocalConnection, lease: int, blocks: list[Leased],
                 block_ids: list[int], started: float):
        self._t = transfer
        self._local = local
        self._lease = lease
        self._started = started
        self.blocks = len(blocks)
        self._bad = [None]
        self._checker = threading.Thread(
            target=_first_corrupt, args=(memoryview(transfer._arena_map), blocks, self._bad), daemon=True
        )
        self._checker.start()
        offsets = [b.offset for b in blocks]
        self._runs = [(transfer._arena[offsets[start]:], block_ids[start : start + count])
                      for start, count in _runs(offsets, transfer._stride)]

    def copy_layers(self, layers: range) -> None:
        for run, ids in self._runs:
            self._t.kv.scatter(run, self._t._stride, ids, layers)

    def finish(self, copied: bool = True) -> Loaded:
        """Wait for the checksums (and the device's copies), then end the lease: how many
        leading blocks are in the KV, verified. `copied=False`: the copies did not all run,
        nothing counts as loaded."""
        t = self._t
        self._checker.join()
        try:
            t.kv.synchronize()
        finally:
            bad = self._bad[0]
            try:
                self._local.release(self._lease, bad)
            except FabricError as e:
                t._drop_local(e)
        if bad is not None:
            t._log.warning("cachet: block %d of a load failed its checksum in the arena; the node drops it and "
                           "vLLM recomputes from there", bad)
        n = 0 if not copied else bad if bad is not None else self.blocks
        return Loaded(n, "shm", corrupt=bad is not None, seconds=time.perf_counter() - self._started)


class KVTransfer:
    """Loads and saves between a paged KV cache and the fabric node at `addr` (TCP); over
    its shared-memory arena when the node is on this host and `shared_memory` allows."""

    def __init__(self, kv: PagedKV, addr: str, token: str, *, block_tokens: int,
                 shared_memory: bool = True, socket_path: str | None = None,
                 logger: logging.Logger | None = None):
        self.kv = kv
        self._log = logger or log
        self.block_tokens = block_tokens
        self._tcp = FabricConnection(addr, token)
        self._token = token
        self._shared_memory = shared_memory
        self._socket_path = socket_path
        self._local: LocalConnection | None = None
        self._arena_map = None
        self._arena: torch.Tensor | None = None
        self._retry_local_at = 0.0
        self._said: set[str] = set()
        self._stride = footprint(kv.block_bytes)

    # -- the node's Unix socket ------------------------------------------------------------

    def _once(self, what: str, msg: str, *args) -> None:
        if what not in self._said:
            self._said.add(what)
            self._log.warning(msg, *args)

    def _local_conn(self) -> LocalConnection | None:
        """The node's Unix socket with the arena mapped, when this host has it."""
        if not self._shared_memory:
            return None
        if self._local is not None:
            return self._local
        now = time.monotonic()
        if now < self._retry_local_at:
            return None
        self._retry_local_at = now + RETRY_LOCAL_SECS
        path = self._socket_path
        try:
            if not path:
                path = self._tcp.where()
            if not path:
                self._once("no-socket", "cachet: the fabric node serves no Unix socket; KV moves over TCP")
                return None
            if not os.path.exists(path):
                self._once("remote", "cachet: the fabric node's socket %s is not on this host; KV moves over TCP", path)
                return None
            conn = LocalConnection(path, self._token)
            arena = conn.connect()
        except FabricError as e:
            self._once("local-failed", "cachet: the fabric node's Unix socket: %s (tried again every %.0f s)",
                       e, RETRY_LOCAL_SECS)
            return None
        if arena is not self._arena_map:
            self._arena_map = arena
            self._arena = torch.frombuffer(arena, dtype=torch.uint8)
        self._said.discard("local-failed")
        self._log.info("cachet: KV moves through the fabric node's shared memory (%s, %d bytes mapped)", path, len(arena))
        self._local = conn
        return conn

    def _drop_local(self, e: Exception) -> None:
        self._log.warning("cachet: the fabric node's Unix socket failed (%s); reconnecting on the next transfer", e)
        if self._local is not None:
            self._local.close()
        self._local = None
        self._retry_local_at = 0.0

    @property
    def mode(self) -> str:
        return "shm" if self._local_conn() is not None else "tcp"

    # -- loads -----------------------------------------------------------------------------

    def load(self, scope: bytes, keys: list[bytes], block_ids: list[int]) -> Loaded:
        """Load the blocks `keys` into the KV blocks `block_ids` (same order): how many
        leading ones are there, checksums verified. Never raises for the node's sake."""
        pending = self.begin_load(scope, keys, block_ids)
        if isinstance(pending, Loaded):
            return pending
        pending.copy_layers(range(self.kv.layers))
        return pending.finish()

    def begin_load(self, scope: bytes, keys: list[bytes], block_ids: list[int]) -> "Loaded | PendingLoad":
        """Start a load: through shared memory, the blocks are leased and their checksums
        checked on a thread, and the copies are left to the caller, layer by layer
        (`PendingLoad.copy_layers`, then `finish`), so they can run beside the forward pass;
        over TCP (or with nothing to load) the load is done here, whole."""
        started = time.perf_counter()
        if not keys:
            return Loaded(0, "none")
        local = self._local_conn()
        try:
            if local is not None:
                lease, got = local.lease(scope, keys)
                if got:
                    return PendingLoad(self, local, lease, got[: self._usable(got, keys)], block_ids, started)
                done = Loaded(0, "shm")
            else:
                done = self._load_tcp(scope, keys, block_ids)
        except FabricError as e:
            if local is not None:
                self._drop_local(e)
            else:
                self._log.warning("cachet: load failed (%s); recomputing", e)
            done = Loaded(0, "shm" if local is not None else "tcp")
        done.seconds = time.perf_counter() - started
        return done

    def _usable(self, got, keys: list[bytes]) -> int:
        """How many leading blocks are the ones asked for, whole."""
        n = 0
        for b, key in zip(got, keys):
            length = b.length if isinstance(b, Leased) else len(b.data)
            if b.hash != key or length != self.kv.block_bytes or b.n_tokens != self.block_tokens:
                self._once("shape", "cachet: block of %d bytes / %d tokens, expected %d / %d; recomputing",
                           length, b.n_tokens, self.kv.block_bytes, self.block_tokens)
                break
            n += 1
        return n

    def _load_tcp(self, scope: bytes, keys: list[bytes], block_ids: list[int]) -> Loaded:
        per = max(1, TCP_STAGING_BYTES // self._stride)
        staging = bytearray(min(len(keys), per) * self._stride)
        run = torch.frombuffer(staging, dtype=torch.uint8)
        loaded = 0
        for start in range(0, len(keys), per):
            chunk = keys[start : start + per]
            got = self._tcp.get(scope, chunk, into=memoryview(staging), stride=self._stride)
            n = self._usable(got, chunk)
            # A block received outside the staging buffer (it did not fit) is not copied.
            inside = 0
            while inside < n and got[inside].in_place:
                inside += 1
            self.kv.scatter(run, self._stride, block_ids[start : start + inside])
            self.kv.synchronize()
            loaded += inside
            if inside < len(chunk):
                break
        return Loaded(loaded, "tcp")

    # -- saves -----------------------------------------------------------------------------

    def save(self, scope: bytes, ttl_ms: int, kind: int, existing: list[bytes],
             blocks: list[tuple[bytes, bytes | None, int]]) -> str | None:
        """Store one entry: `existing` keys the node holds, then `blocks` (key, parent key
        or None, KV block id) copied out of the paged KV. None when stored, else why not."""
        if not blocks:
            return None
        local = self._local_conn()
        try:
            if local is not None:
                return self._save_shared(local, scope, ttl_ms, kind, existing, blocks)
            return self._save_tcp(scope, ttl_ms, kind, existing, blocks)
        except FabricError as e:
            if local is not None:
                self._drop_local(e)
            return f"unreachable ({e})"

    def _save_shared(self, local, scope, ttl_ms, kind, existing, blocks) -> str | None:
        new = [(k, parent, self.block_tokens, self.kv.block_bytes) for k, parent, _ in blocks]
        reserved = local.reserve(scope, ttl_ms, kind, existing, new)
        if isinstance(reserved, str):
            return reserved
        rid, offsets = reserved
        try:
            if any(o != offsets[0] + i * self._stride for i, o in enumerate(offsets)):
                raise FabricError("the node reserved blocks that are not side by side")
            self.kv.gather(self._arena[offsets[0] :], self._stride, [b for _, _, b in blocks])
        except BaseException:
            try:
                local.abort(rid)
            except FabricError:
                pass
            raise
        return local.commit(rid)

    def _save_tcp(self, scope, ttl_ms, kind, existing, blocks) -> str | None:
        """PUT the entry in parts of at most `TCP_STAGING_BYTES` (a node takes frames of up
        to 1 GiB; an 8K-token prefix of an 8B model is that much): each part's blocks
        gathered into one staging buffer, the parts before it named as existing. A part
        refused stops the save; the parts stored stay, a valid shorter entry."""
        per = max(1, TCP_STAGING_BYTES // self._stride)
        staging = bytearray(min(len(blocks), per) * self._stride)
        run = torch.frombuffer(staging, dtype=torch.uint8)
        view = memoryview(staging)
        held = list(existing)
        for start in range(0, len(blocks), per):
            part = blocks[start : start + per]
            self.kv.gather(run, self._stride, [b for _, _, b in part])
            new = [
                (k, parent, self.block_tokens, self.kv.block_bytes,
                 lambda j=j: view[j * self._stride : j * self._stride + self.kv.block_bytes])
                for j, (k, parent, _) in enumerate(part)
            ]
            refused = self._tcp.put(scope, ttl_ms, kind, held, new)
            if refused:
                return refused
            held.extend(k for k, _, _ in part)
        return None

    # -- the rest --------------------------------------------------------------------------

    def report(self, tag, local_tokens: int, loaded_tokens: int, failed_tokens: int,
               load_bytes: int = 0, load_seconds: float = 0.0) -> None:
        self._tcp.report(tag, local_tokens, loaded_tokens, failed_tokens, load_bytes, load_seconds)

    def close(self) -> None:
        self._tcp.close()
        if self._local is not None:
            self._local.close()

