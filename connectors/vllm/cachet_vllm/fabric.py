"""A client for a Cachet fabric node's TCP wire (cache-fabric/src/transport.rs).

Frames are length-prefixed little-endian binary; every connection opens with HELLO and the
cluster token. The connector uses four operations:

    HAS    5  which of a chain's blocks the node holds (no side effect: TTLs are not refreshed)
    GET    2  the longest stored prefix of a chain, each block with its crc32c (TTLs refreshed)
    PUT    3  store an entry: blocks already held ("existing") plus new blocks with their parents
    REPORT 10 what a request read from the fabric and from vLLM's own prefix cache, so the
              gateway bills what was really loaded

A connection is used by one thread at a time; every call either completes or raises
`FabricError`, after which the connection is closed and the next call reconnects.
"""

from __future__ import annotations

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


def checksum(data) -> int:
    return crc32c.crc32c(data)


def scope_bytes(scope_hex: str) -> bytes:
    """A scope (tenant and workspace ids) as the wire carries it: 32 bytes."""
    raw = bytes.fromhex(scope_hex)
    if len(raw) != 32:
        raise ValueError("a scope is 32 bytes (64 hex digits)")
    return raw


class FabricConnection:
    """One connection to a node, reconnecting on the next call after a failure."""

    def __init__(self, addr: str, token: str, timeout: float = 10.0):
        host, _, port = addr.rpartition(":")
        self._addr = (host or "127.0.0.1", int(port))
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

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        try:
            s = socket.create_connection(self._addr, timeout=self._timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            body = struct.pack("<BH", OP_HELLO, len(self._token)) + self._token
            s.sendall(struct.pack("<I", len(body)) + body)
            status = self._recv_exact(s, 1)[0]
        except OSError as e:
            raise FabricError(f"connecting to {self._addr[0]}:{self._addr[1]}: {e}") from e
        if status != OK:
            s.close()
            raise FabricError(f"{self._addr[0]}:{self._addr[1]} refused the cluster token")
        self._sock = s
        return s

    @staticmethod
    def _recv_exact(s: socket.socket, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = s.recv_into(view[got:], n - got)
            if k == 0:
                raise FabricError("the node closed the connection")
            got += k
        return buf

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

    # -- operations -----------------------------------------------------------------------

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

    def get(self, scope: bytes, hashes: list[bytes]) -> list[Block]:
        """The longest stored prefix of `hashes`. Every block's checksum is verified here; the
        first one that fails ends the list (the caller recomputes from there)."""
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
                data = self._recv_exact(s, length)
                # Read every block off the wire (the connection stays usable), keep the good prefix.
                if bad or bh != hashes[i] or checksum(data) != crc:
                    bad = True
                    continue
                blocks.append(Block(bh, n_tokens, memoryview(data)))
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

        def answer(s):
            status = self._recv_exact(s, 1)[0]
            if status == OK:
                return None
            if status == REFUSED:
                code = self._recv_exact(s, 1)[0]
                return REFUSALS.get(code, f"refused ({code})")
            raise FabricError(f"PUT answered status {status}")

        return self._call(parts(), answer, total)

    def report(self, tag: uuid.UUID, local_tokens: int, loaded_tokens: int, failed_tokens: int) -> None:
        """Tell the node (and so the gateway beside it) what request `tag` did not prefill."""
        body = struct.pack("<B", OP_REPORT) + tag.bytes + struct.pack(
            "<III", local_tokens, loaded_tokens, failed_tokens
        )

        def answer(s):
            status = self._recv_exact(s, 1)[0]
            if status != OK:
                raise FabricError(f"REPORT answered status {status}")

        self._call([body], answer)
