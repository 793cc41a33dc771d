"""A client for a Cachet fabric node's wire (cache-fabric/src/transport.rs over TCP,
cache-fabric/src/local.rs over the node's Unix socket). No vLLM here.

Frames are length-prefixed little-endian binary; every connection opens with HELLO and the
cluster token. Over TCP (any host):

    HAS    5  which of a chain's blocks the node holds (no side effect: TTLs are not refreshed)
    GET    2  the longest stored prefix of a chain, each block with its crc32c (TTLs refreshed)
    PUT    3  store an entry: blocks already held ("existing") plus new blocks with their parents
    REPORT 10 what a request read from the fabric and from vLLM's own prefix cache, so the
              gateway bills what was really loaded
    WHERE  11 the node's Unix socket for engines on its host, if it serves one

Over the node's Unix socket (same host only: HELLO's answer carries the descriptor of the
node's shared-memory arena, which the caller maps once), HAS and REPORT as above, and:

    LEASE   12 where the longest stored prefix of a chain lies in the arena, each block with
               its crc32c (TTLs refreshed); the blocks stay there until RELEASE
    RELEASE 13 a lease is done (naming the first block whose checksum failed, if one did)
    RESERVE 14 room in the arena for an entry's new blocks, side by side
    COMMIT  15 the reserved blocks are filled: store them (checksummed by the node)
    ABORT   16 give the room back

A connection is used by one thread at a time; every call either completes or raises
`FabricError`, after which the connection is closed and the next call reconnects (a node
that left leases or reservations behind frees them when the connection closes).
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import uuid
from dataclasses import dataclass
from typing import Callable

import crc32c

OP_HELLO = 1
OP_GET = 2
OP_PUT = 3
OP_HAS = 5
OP_REPORT = 10
OP_WHERE = 11
OP_LEASE = 12
OP_RELEASE = 13
OP_RESERVE = 14
OP_COMMIT = 15
OP_ABORT = 16
OP_MAP = 17
# RELEASE's "no block was corrupt".
NONE_CORRUPT = 0xFFFFFFFF
OK = 0
DENIED = 1
REFUSED = 2

KIND_PAID = 0
KIND_BEST_EFFORT = 1

# WriteRefused codes (cache-fabric/src/transport.rs `refused_code`).
REFUSALS = {
    1: "quota",
    2: "capacity",
    3: "corrupt",
    4: "missing_parent",
    5: "not_admitted",
    6: "conflict",
    7: "unavailable",
}


class FabricError(Exception):
    """The node could not be reached or answered something unexpected."""


@dataclass
class Block:
    hash: bytes
    n_tokens: int
    data: memoryview
    # Received into the caller's buffer at its place (`get(into=...)`).
    in_place: bool = False


def checksum(data) -> int:
    return crc32c.crc32c(data)


def scope_bytes(scope_hex: str) -> bytes:
    """A scope (tenant and workspace ids) as the wire carries it: 32 bytes."""
    raw = bytes.fromhex(scope_hex)
    if len(raw) != 32:
        raise ValueError("a scope is 32 bytes (64 hex digits)")
    return raw


@dataclass
class Leased:
    """A block of a lease: where it lies in the arena and the checksum to verify."""

    hash: bytes
    n_tokens: int
    crc: int
    offset: int
    length: int


class _Connection:
    """One connection to a node, reconnecting on the next call after a failure."""

    def __init__(self, token: str, timeout: float):
        self._token = token.encode()
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def _hello(self) -> bytes:
        body = struct.pack("<BH", OP_HELLO, len(self._token)) + self._token
        return struct.pack("<I", len(body)) + body

    def _open(self) -> socket.socket:
        raise NotImplementedError

    def _connect(self) -> socket.socket:
        if self._sock is None:
            self._sock = self._open()
        return self._sock

    @staticmethod
    def _recv_exact(s: socket.socket, n: int) -> bytearray:
        buf = bytearray(n)
        _Connection._recv_into(s, memoryview(buf))
        return buf

    @staticmethod
    def _recv_into(s: socket.socket, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            k = s.recv_into(view[got:], n - got)
            if k == 0:
                raise FabricError("the node closed the connection")
            got += k

    def _call(self, parts, answer, total: int | None = None):
        """Send one request frame (its parts concatenated on the wire; an iterable, made as it
        is sent when `total` gives the frame's length) and read the answer with
        `answer(sock)`; any failure closes the connection."""
        with self._lock:
            s = self._connect()
            try:
                if total is None:
                    parts = list(parts)
                    total = sum(len(p) for p in parts)
                s.sendall(struct.pack("<I", total))
                sent = 0
                for p in parts:
                    s.sendall(p)
                    sent += len(p)
                if sent != total:
                    raise FabricError(f"frame of {sent} bytes, {total} announced")
                return answer(s)
            except (OSError, FabricError, struct.error) as e:
                self.close()
                if isinstance(e, FabricError):
                    raise
                raise FabricError(f"fabric call failed: {e}") from e

    def _stored(self, op: str):
        """An answer reader for a write: None when stored, else the node's reason."""

        def answer(s):
            status = self._recv_exact(s, 1)[0]
            if status == OK:
                return None
            if status == REFUSED:
                code = self._recv_exact(s, 1)[0]
                return REFUSALS.get(code, f"refused ({code})")
            raise FabricError(f"{op} answered status {status}")

        return answer

    # -- operations both wires have ---------------------------------------------------------

    def has(self, scope: bytes, hashes: list[bytes]) -> list[bool]:
        body = struct.pack("<B", OP_HAS) + scope + struct.pack("<I", len(hashes)) + b"".join(hashes)

        def answer(s):
            head = self._recv_exact(s, 1 + len(hashes))
            if head[0] != OK:
                raise FabricError(f"HAS answered status {head[0]}")
            return [b == 1 for b in head[1:]]

        return self._call([body], answer)

    def leading_held(self, scope: bytes, hashes: list[bytes]) -> int:
        """How many leading blocks of the chain the node holds."""
        n = 0
        for held in self.has(scope, hashes):
            if not held:
                break
            n += 1
        return n

    def report(self, tag: uuid.UUID, local_tokens: int, loaded_tokens: int, failed_tokens: int,
               load_bytes: int = 0, load_seconds: float = 0.0) -> None:
        """Tell the node (and so the gateway beside it) what request `tag` did not prefill,
        and how fast its load went (the node's load rate, which routing estimates with)."""
        body = struct.pack("<B", OP_REPORT) + tag.bytes + struct.pack(
            "<IIIQQ", local_tokens, loaded_tokens, failed_tokens, load_bytes,
            max(0, int(load_seconds * 1e6)),
        )

        def answer(s):
            status = self._recv_exact(s, 1)[0]
            if status != OK:
                raise FabricError(f"REPORT answered status {status}")

        self._call([body], answer)


    def map_blocks(self, pairs: list[tuple[bytes, bytes]]) -> None:
        """Tell the node the engine's names of blocks whose Cachet keys it has: (the engine
        hash as its KV events carry it, the 32-byte key), so the node can publish what the
        engine's own cache holds in Cachet's keys."""
        parts = [struct.pack("<BI", OP_MAP, len(pairs))]
        for h, key in pairs:
            parts.append(struct.pack("<B", len(h)) + h + key)

        def answer(s):
            status = self._recv_exact(s, 1)[0]
            if status != OK:
                raise FabricError(f"MAP answered status {status}")

        self._call(parts, answer)


class FabricConnection(_Connection):
    """A node over TCP (any host)."""

    def __init__(self, addr: str, token: str, timeout: float = 10.0):
        super().__init__(token, timeout)
        host, _, port = addr.rpartition(":")
        self._addr = (host or "127.0.0.1", int(port))

    def _open(self) -> socket.socket:
        try:
            s = socket.create_connection(self._addr, timeout=self._timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(self._hello())
            status = self._recv_exact(s, 1)[0]
        except OSError as e:
            raise FabricError(f"connecting to {self._addr[0]}:{self._addr[1]}: {e}") from e
        if status != OK:
            s.close()
            raise FabricError(f"{self._addr[0]}:{self._addr[1]} refused the cluster token")
        return s

    def where(self) -> str:
        """The node's Unix socket for engines on its host (empty: it serves none)."""

        def answer(s):
            head = self._recv_exact(s, 3)
            if head[0] != OK:
                raise FabricError(f"WHERE answered status {head[0]}")
            (n,) = struct.unpack_from("<H", head, 1)
            return bytes(self._recv_exact(s, n)).decode()

        return self._call([struct.pack("<B", OP_WHERE)], answer)

    def get(self, scope: bytes, hashes: list[bytes], into: memoryview | None = None,
            stride: int = 0) -> list[Block]:
        """The longest stored prefix of `hashes`. Every block's checksum is verified here; the
        first one that fails ends the list (the caller recomputes from there). With `into`,
        block i is received at `into[i * stride:]` when it fits there (one buffer the caller
        copies from in bulk), else into a buffer of its own."""
        body = struct.pack("<B", OP_GET) + scope + struct.pack("<I", len(hashes)) + b"".join(hashes)

        def answer(s):
            head = self._recv_exact(s, 5)
            if head[0] != OK:
                raise FabricError(f"GET answered status {head[0]}")
            (count,) = struct.unpack_from("<I", head, 1)
            if count > len(hashes):
                raise FabricError("GET answered more blocks than asked for")
            blocks = []
            bad = False
            for i in range(count):
                h = self._recv_exact(s, 48)
                bh = bytes(h[:32])
                n_tokens, crc, length = struct.unpack_from("<IIQ", h, 32)
                in_place = into is not None and length <= stride and (i + 1) * stride <= len(into)
                if in_place:
                    data = into[i * stride : i * stride + length]
                    self._recv_into(s, data)
                else:
                    data = memoryview(self._recv_exact(s, length))
                # Read every block off the wire (the connection stays usable), keep the good prefix.
                if bad or bh != hashes[i] or checksum(data) != crc:
                    bad = True
                    continue
                blocks.append(Block(bh, n_tokens, data, in_place))
            return blocks

        return self._call([body], answer)

    def put(
        self,
        scope: bytes,
        ttl_ms: int,
        kind: int,
        existing: list[bytes],
        new: list[tuple[bytes, bytes | None, int, int, Callable[[], memoryview]]],
    ) -> str | None:
        """Store an entry; `new` is (hash, parent or None, tokens, length, make the data).
        Each block's bytes are made just before they are sent and dropped after, so a save
        holds one block at a time however long the prompt. Returns None when stored, else
        the node's reason for refusing."""
        head = (
            struct.pack("<B", OP_PUT) + scope + struct.pack("<QBI", ttl_ms, kind, len(existing))
            + b"".join(existing) + struct.pack("<I", len(new))
        )
        total = len(head) + sum(32 + 33 + 16 + length for _, _, _, length, _ in new)

        def parts():
            yield head
            for h, parent, n_tokens, length, make in new:
                data = make()
                if len(data) != length:
                    raise FabricError(f"a block of {len(data)} bytes, {length} announced")
                flag = b"\x01" + parent if parent is not None else b"\x00" + bytes(32)
                yield h + flag + struct.pack("<IIQ", n_tokens, checksum(data), length)
                yield data

        return self._call(parts(), self._stored("PUT"), total)


class LocalConnection(_Connection):
    """A node on this host, over its Unix socket: blocks move through its shared-memory
    arena, which `arena` maps (None until connected). A new connection (the node restarted)
    maps the new arena; the old mapping stays valid for as long as something views it."""

    def __init__(self, path: str, token: str, timeout: float = 10.0):
        super().__init__(token, timeout)
        self._path = path
        self.arena: mmap.mmap | None = None

    def _open(self) -> socket.socket:
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self._timeout)
            s.connect(self._path)
            s.sendall(self._hello())
            data, fds, _, _ = socket.recv_fds(s, 9, 1)
        except OSError as e:
            raise FabricError(f"connecting to {self._path}: {e}") from e
        try:
            if not data or data[0] != OK:
                raise FabricError(f"{self._path} refused the cluster token")
            while len(data) < 9:
                more = s.recv(9 - len(data))
                if not more:
                    raise FabricError("the node closed the connection")
                data += more
            if len(fds) != 1:
                raise FabricError(f"{self._path} sent no arena")
            (size,) = struct.unpack_from("<Q", data, 1)
            self.arena = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                # Huge pages where the host allows them for shared memory (as the node asks).
                try:
                    self.arena.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
        except (FabricError, OSError, ValueError) as e:
            s.close()
            raise e if isinstance(e, FabricError) else FabricError(f"mapping the arena: {e}") from e
        finally:
            for fd in fds:
                os.close(fd)
        return s

    def connect(self) -> mmap.mmap:
        """Connect now (if not connected) and return the arena's mapping."""
        with self._lock:
            try:
                self._connect()
            except FabricError:
                self.close()
                raise
        assert self.arena is not None
        return self.arena

    def lease(self, scope: bytes, hashes: list[bytes]) -> tuple[int, list[Leased]]:
        """Where the longest stored prefix of `hashes` lies in the arena (TTLs refreshed):
        the lease's id and its blocks, which stay in place until `release`."""
        body = struct.pack("<B", OP_LEASE) + scope + struct.pack("<I", len(hashes)) + b"".join(hashes)

        def answer(s):
            head = self._recv_exact(s, 13)
            if head[0] != OK:
                raise FabricError(f"LEASE answered status {head[0]}")
            lease, count = struct.unpack_from("<QI", head, 1)
            if count > len(hashes):
                raise FabricError("LEASE answered more blocks than asked for")
            raw = self._recv_exact(s, 56 * count)
            blocks = []
            for i in range(count):
                n_tokens, crc, offset, length = struct.unpack_from("<IIQQ", raw, 56 * i + 32)
                blocks.append(Leased(bytes(raw[56 * i : 56 * i + 32]), n_tokens, crc, offset, length))
            return lease, blocks

        return self._call([body], answer)

    def release(self, lease: int, corrupt: int | None = None) -> None:
        """The lease is done; `corrupt`: the index of its first block whose checksum failed."""
        body = struct.pack("<BQI", OP_RELEASE, lease, NONE_CORRUPT if corrupt is None else corrupt)
        self._call([body], self._ok("RELEASE"))

    def reserve(self, scope: bytes, ttl_ms: int, kind: int, existing: list[bytes],
                new: list[tuple[bytes, bytes | None, int, int]]) -> tuple[int, list[int]] | str:
        """Room in the arena for an entry's `new` blocks (hash, parent or None, tokens,
        length), side by side: the reservation's id and each block's offset, or the node's
        reason for refusing."""
        parts = [
            struct.pack("<B", OP_RESERVE), scope, struct.pack("<QBI", ttl_ms, kind, len(existing)),
            *existing, struct.pack("<I", len(new)),
        ]
        for h, parent, n_tokens, length in new:
            flag = b"\x01" + parent if parent is not None else b"\x00" + bytes(32)
            parts.append(h + flag + struct.pack("<IQ", n_tokens, length))

        def answer(s):
            status = self._recv_exact(s, 1)[0]
            if status == REFUSED:
                code = self._recv_exact(s, 1)[0]
                return REFUSALS.get(code, f"refused ({code})")
            if status != OK:
                raise FabricError(f"RESERVE answered status {status}")
            raw = self._recv_exact(s, 8 + 8 * len(new))
            values = struct.unpack(f"<Q{len(new)}Q", raw)
            return values[0], list(values[1:])

        return self._call(parts, answer)

    def commit(self, reservation: int) -> str | None:
        """Store the reserved blocks (filled by the caller): None, or the node's reason for
        refusing (the room is given back either way)."""

        return self._call([struct.pack("<BQ", OP_COMMIT, reservation)], self._stored("COMMIT"))

    def abort(self, reservation: int) -> None:
        self._call([struct.pack("<BQ", OP_ABORT, reservation)], self._ok("ABORT"))

    def _ok(self, op: str):
        def answer(s):
            status = self._recv_exact(s, 1)[0]
            if status != OK:
                raise FabricError(f"{op} answered status {status}")

        return answer
