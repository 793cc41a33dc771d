"""A consumer of Cachet's KV event stream written from docs/kv-events.md alone, as a router
someone else wrote would be: it speaks RESP to Redis itself (no Cachet code, no client
library) and rebuilds which instance holds which block on which medium.

    c = KvConsumer("127.0.0.1", 6379, "cachet")
    c.start()            # positions at the stream's end, asks every node for a resync
    c.poll(timeout_ms)   # applies what came; asks a node whose batches were lost to resync
    c.holdings[(instance, medium)] -> set of block hashes (hex)
"""

from __future__ import annotations

import json
import socket

# Every field a record may carry (docs/kv-events.md): anything else is a format change.
BATCH_FIELDS = {"node", "epoch", "seq", "ts_ms", "events"}
EVENT_FIELDS = {
    "BlockStored": {"type", "instance", "medium", "block_hashes", "parent_block_hash", "block_size",
                    "engine_medium"},
    "BlockRemoved": {"type", "instance", "medium", "block_hashes"},
    "AllBlocksCleared": {"type", "instance", "medium"},
}
MEDIA = {"ENGINE", "DRAM", "DISK", "GPU"}


class Resp:
    """Just enough RESP2 to send commands and read their replies."""

    def __init__(self, host: str, port: int):
        self.sock = socket.create_connection((host, port), timeout=30)
        self.buf = b""

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n + 2:]
        return out

    def _reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise RuntimeError(f"unexpected reply {line!r}")

    def call(self, *args):
        out = b"*%d\r\n" % len(args)
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out += b"$%d\r\n%s\r\n" % (len(a), a)
        self.sock.sendall(out)
        return self._reply()


class KvConsumer:
    def __init__(self, host: str, port: int, prefix: str):
        self.redis = Resp(host, port)
        self.stream = f"{prefix}:kv-events"
        self.resync = f"{prefix}:kv-resync"
        self.last_id = "0-0"
        self.seqs: dict[str, tuple[str, int]] = {}
        self.holdings: dict[tuple[str, str], set[str]] = {}
        self.records: list[dict] = []
        self.resyncs_asked = 0

    def start(self) -> None:
        tail = self.redis.call("XREVRANGE", self.stream, "+", "-", "COUNT", 1)
        if tail:
            self.last_id = tail[0][0].decode()
        self.ask_resync("*")

    def ask_resync(self, node: str) -> None:
        self.redis.call("XADD", self.resync, "*", "node", node)
        self.resyncs_asked += 1

    def poll(self, timeout_ms: int = 200) -> int:
        reply = self.redis.call("XREAD", "COUNT", 500, "BLOCK", timeout_ms, "STREAMS", self.stream, self.last_id)
        applied = 0
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self.last_id = entry_id.decode()
                kv = dict(zip(fields[::2], fields[1::2]))
                batch = json.loads(kv[b"batch"])
                self.apply(batch)
                applied += 1
        return applied

    def apply(self, batch: dict) -> None:
        assert set(batch) <= BATCH_FIELDS, f"undocumented batch fields: {set(batch) - BATCH_FIELDS}"
        self.records.append(batch)
        node, epoch, seq = batch["node"], batch["epoch"], batch["seq"]
        prev = self.seqs.get(node)
        # A first sight mid-epoch is a gap, unless the batch starts a snapshot.
        snapshot = bool(batch["events"]) and batch["events"][0]["type"] == "AllBlocksCleared"
        gap = (prev is not None and prev[0] == epoch and seq != prev[1] + 1) or (
            prev is None and seq != 0 and not snapshot)
        self.seqs[node] = (epoch, seq)
        for e in batch["events"]:
            kind = e["type"]
            assert kind in EVENT_FIELDS, f"undocumented event type {kind}"
            assert set(e) <= EVENT_FIELDS[kind], f"undocumented fields in {kind}: {set(e) - EVENT_FIELDS[kind]}"
            assert e["medium"] in MEDIA, e["medium"]
            key = (e["instance"], e["medium"])
            if kind == "BlockStored":
                self.holdings.setdefault(key, set()).update(e["block_hashes"])
            elif kind == "BlockRemoved":
                self.holdings.setdefault(key, set()).difference_update(e["block_hashes"])
            else:
                self.holdings[key] = set()
        if gap:
            self.ask_resync(node)

    def held(self, instance: str, medium: str) -> set[str]:
        return self.holdings.get((instance, medium), set())

    def close(self) -> None:
        self.redis.sock.close()
