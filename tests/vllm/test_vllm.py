"""vLLM behind Cachet, end to end: a real vLLM CPU server with Cachet's KV connector.

Run by `make vllm-test` (scripts/vllm-test.sh) with the pinned vLLM environment's Python:

    CACHET_BIN=target/debug/cachet .cachet/vllm-venv/bin/python -m unittest -v tests/vllm/test_vllm.py

What it proves, each against real processes (Postgres, Redis, `cachet`, vLLM):

(a) a greedy answer through Cachet equals vLLM's own answer for the same messages, and once
    vLLM's own prefix cache is emptied, the prefix Cachet holds is loaded by the connector:
    vLLM's external-hit counter rises by exactly the cache read Cachet reports (a plain
    proxy reports no read and moves no counter);
(b) after vLLM restarts (its own cache empty), the prefix is loaded from the fabric and the
    answer is unchanged; the OpenAI wire, streamed, reports the same read;
(c) tenant B never reads tenant A's prefix, neither from the fabric nor from vLLM's cache;
(f) a block corrupted on its way to vLLM is recomputed, never served: same answer, no read;
(d) two instances, each with its own Cachet node: a prefix written by one is read by the
    other;
(e) vLLM killed mid-request: the client gets a clear error, the ledger one row, and the
    next request is served by the other instance;
(g) the same-host path (the node's Unix socket and shared-memory arena), which the
    connector uses by default: a byte flipped in a block in the arena is caught (recomputed,
    not billed); vLLM killed while it holds a lease, or while a save it reserved is being
    filled, leaves nothing behind (the node's arena metrics back where they were, no block
    of the unfinished save visible); the node restarted under a running vLLM (the first
    request recomputes, the next load through shared memory again); two vLLM instances of
    one model beside one node read each other's prefixes from the one arena;
(h) the same answers and loads with shared memory turned off (TCP), where a block corrupted
    on the wire is caught;
(i) vLLM short of KV blocks preempts requests whose prefixes the connector loaded: every
    answer equals the same request's answer alone;
(j) routing by where the KV is: two instances behind `cachet router`, each publishing its KV
    events to its node, the prefix's fabric blocks on both nodes (replicas): a prefix computed
    on one instance sends every next request with it to that instance (vLLM's own prefix-cache
    hits show it, the answer's `x-cachet-route` says why); once that instance's cache is reset
    the stream says so and the next request is routed by the fabric's copy (and loaded from
    it); a consumer written from docs/kv-events.md alone (tests/vllm/kv_consumer.py) rebuilds
    which instance holds which block, the engine's blocks being the fabric's keys, and no
    record carries a token id;
(k) prefill and decode apart: a prefill instance and a decode instance beside one node: the
    greedy answer equals the colocated one; the decode instance loads every full block the
    prefill instance computed and computes only the tail; one ledger row with the customer's
    own cache classes (the hand-over is not a cache read); the prefill instance killed
    mid-request, the request is served whole by the decode instance, one row.

Outside CI a missing prerequisite skips loudly; in CI it fails.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request
import uuid

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.path.abspath(os.environ.get("CACHET_BIN", os.path.join(ROOT, "target", "debug", "cachet")))
PG = os.environ.get("CACHET_TEST_PG", "postgres://postgres@127.0.0.1:5432")
REDIS = os.environ.get("CACHET_TEST_REDIS", "redis://127.0.0.1:6379")
TOKEN = "vllm-test-cluster-token-" + uuid.uuid4().hex[:12]
MODEL = "smollm2-135m-instruct-vllm"
LOGS = os.environ.get("CACHET_VLLM_TEST_LOGS") or tempfile.mkdtemp(prefix="cachet-vllm-test-")

# A system prompt of a few hundred tokens: two full 128-token blocks and some.
SYSTEM = (
    "You are the support assistant of Northwind Freight, a company that ships parcels across "
    "Europe. Answer briefly and politely. Parcels up to 30 kg ship by road; heavier ones by "
    "rail. Customs forms are needed for Switzerland and Norway. Tracking numbers start with "
    "NW and have ten digits. Refunds take five working days. "
) * 3
QUESTION = "What is the capital of France? Answer in one sentence."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p + 1 free too (vLLM's KV event publisher and its replay socket)."""
    for _ in range(100):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise AssertionError("no two consecutive free ports")


def need(cond: bool, why: str) -> None:
    if cond:
        return
    if os.environ.get("CI"):
        raise AssertionError(f"CI must have this: {why}")
    raise unittest.SkipTest(why)


def http(method: str, url: str, body=None, headers=None, timeout=180):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if body is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, dict(r.headers), (json.loads(raw) if raw and raw[:1] in b"{[" else raw)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, dict(e.headers), json.loads(raw)
        except ValueError:
            return e.code, dict(e.headers), raw


def wait_until(what: str, cond, timeout: float, proc=None, log=None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = open(log).read()[-4000:] if log else ""
            raise AssertionError(f"{what}: the process exited ({proc.returncode})\n{tail}")
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.3)
    tail = open(log).read()[-4000:] if log else ""
    raise AssertionError(f"{what}: not ready after {timeout} s\n{tail}")


def series(text: str, name: str, labels: str = "") -> float:
    """A Prometheus series of a scraped page, summed over those that match `labels`."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(base: str) -> str:
    """A server's /metrics page."""
    return http("GET", f"{base}/metrics")[2].decode()


def metric(port: int, name: str, labels: str = "") -> float:
    """One of vLLM's Prometheus counters (summed over the series that match `labels`)."""
    return series(scrape(f"http://127.0.0.1:{port}"), name, labels)


def cachet_metric(base: str, name: str, labels: str = "") -> float:
    """One of Cachet's own Prometheus series (summed over those that match `labels`)."""
    return series(scrape(base), name, labels)


def arena(base: str, state: str) -> float:
    return cachet_metric(base, "cachet_fabric_arena_bytes", f'state="{state}"')


def external_hits(port: int) -> float:
    return metric(port, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')


def local_hits(port: int) -> float:
    return metric(port, "vllm:prefix_cache_hits_total")


class Procs:
    """Processes a test started, stopped (their whole process group) at the end."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, args: list[str], env: dict) -> tuple[subprocess.Popen, str]:
        log = os.path.join(LOGS, f"{name}.log")
        with open(log, "ab") as out:
            p = subprocess.Popen(
                args, cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(p)
        return p, log

    @staticmethod
    def kill(p: subprocess.Popen, sig=signal.SIGKILL) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            self.kill(p, signal.SIGTERM)


def start_vllm(procs: Procs, name: str, port: int, fabric_port: int, cpus: str | None = None,
               args: str | None = None, env: dict | None = None):
    env = {
        "CACHET_CLUSTER_TOKEN": TOKEN,
        # Lets the test empty vLLM's own prefix cache (POST /reset_prefix_cache), loopback only.
        "VLLM_SERVER_DEV_MODE": "1",
        **(env or {}),
    }
    if cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    if args is not None:
        env["CACHET_VLLM_ARGS"] = args
    p, log = procs.start(
        name, [os.path.join(ROOT, "scripts", "vllm-serve.sh"), str(port), f"127.0.0.1:{fabric_port}"], env
    )
    return p, log


def wait_vllm(p, log, port: int) -> None:
    wait_until(
        f"vLLM on {port}",
        lambda: http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200,
        240,
        p,
        log,
    )


def cachet(args: list[str], env: dict) -> str:
    r = subprocess.run([BIN, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"cachet {' '.join(args)} failed: {r.stderr}")
    return r.stdout.strip()


def new_tenant(env: dict, name: str) -> tuple[str, str]:
    """(tenant id, API key)"""
    out = cachet(["admin", "tenant", "create", name], env)
    tenant = out.rsplit("id ", 1)[1].strip()
    key = cachet(["admin", "key", "create", "--tenant", name], env).splitlines()[-1].strip()
    return tenant, key


def psql(db_url: str, sql: str) -> str:
    r = subprocess.run(["psql", db_url, "-tAc", sql], capture_output=True, text=True, check=True)
    return r.stdout.strip()


def messages(base: str, key: str, system: str = SYSTEM, question: str = QUESTION, max_tokens=24, stream=False):
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": question}],
    }
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    if not stream:
        status, hdrs, r = http("POST", f"{base}/v1/messages", body, headers)
        assert status == 200, f"{status}: {r}"
        return r["content"][0]["text"], r["usage"], hdrs
    body["stream"] = True
    req = urllib.request.Request(
        f"{base}/v1/messages", data=json.dumps(body).encode(), method="POST",
        headers={**headers, "content-type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=180)


def vllm_chat(port: int, system: str = SYSTEM, question: str = QUESTION, max_tokens=24) -> str:
    status, _, r = http(
        "POST",
        f"http://127.0.0.1:{port}/v1/chat/completions",
        {
            "model": "smollm2",
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        },
    )
    assert status == 200, r
    return r["choices"][0]["message"]["content"]


def reset_vllm_cache(port: int) -> None:
    status, _, r = http("POST", f"http://127.0.0.1:{port}/reset_prefix_cache")
    assert status == 200, f"reset_prefix_cache: {status} {r}"


class CorruptingProxy:
    """Between a connector and its node: passes bytes both ways; when armed, flips one byte
    in the block data of the next GET answer (a block corrupted on the wire)."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.armed = threading.Event()
        self.corrupted = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.target))
            get_pending = threading.Event()
            threading.Thread(target=self._up, args=(c, s, get_pending), daemon=True).start()
            threading.Thread(target=self._down, args=(s, c, get_pending), daemon=True).start()

    @staticmethod
    def _recv_exact(s, n):
        buf = b""
        while len(buf) < n:
            k = s.recv(n - len(buf))
            if not k:
                raise OSError("closed")
            buf += k
        return buf

    def _up(self, c, s, get_pending):
        try:
            while True:
                head = self._recv_exact(c, 4)
                n = int.from_bytes(head, "little")
                body = self._recv_exact(c, n)
                if body[0] == 2 and self.armed.is_set():
                    self.armed.clear()
                    get_pending.set()
                s.sendall(head + body)
        except OSError:
            s.close()

    def _down(self, s, c, get_pending):
        # A GET answer: status(1) count(4), then per block a 48-byte header and its data.
        flip_at = None
        seen = 0
        try:
            while True:
                chunk = bytearray(s.recv(1 << 16))
                if not chunk:
                    break
                if get_pending.is_set() and flip_at is None:
                    flip_at, seen = 5 + 48 + 4096, 0
                    get_pending.clear()
                if flip_at is not None and seen <= flip_at < seen + len(chunk):
                    chunk[flip_at - seen] ^= 0xFF
                    self.corrupted += 1
                    flip_at = None
                seen += len(chunk)
                c.sendall(chunk)
        except OSError:
            pass
        c.close()


class LocalProxy:
    """Between a connector and its node's Unix socket: passes frames both ways, the arena's
    descriptor included (which it maps too). When told to, it flips one byte of the first
    block of the next LEASE answer in the arena itself (a block corrupted at rest, after the
    node's commit), or holds the node's next answer to an op (LEASE, RESERVE) and never
    passes it on, so the engine is caught holding what the node granted."""

    # How many bytes the node answers to each op, given the request.
    def __init__(self, node_socket: str):
        self.node_socket = node_socket
        self.path = os.path.join(tempfile.mkdtemp(prefix="cachet-local-proxy-"), "proxy.sock")
        self.corrupt_next_lease = threading.Event()
        self.corrupted = 0
        self.hold_op: int | None = None
        self.holding = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(c,), daemon=True).start()

    @staticmethod
    def _exact(s, n):
        return CorruptingProxy._recv_exact(s, n)

    def _frame(self, s) -> bytes:
        head = self._exact(s, 4)
        return head + self._exact(s, int.from_bytes(head, "little"))

    def _answer(self, u, body: bytes) -> bytes:
        op = body[0]
        status = self._exact(u, 1)
        if op == 5:  # HAS: one byte a hash
            return status + self._exact(u, int.from_bytes(body[33:37], "little"))
        if op == 12:  # LEASE
            head = self._exact(u, 12)
            return status + head + self._exact(u, 56 * int.from_bytes(head[8:12], "little"))
        if op == 14:  # RESERVE: offsets of its new blocks, or a refusal
            if status[0] == 0:
                n_existing = int.from_bytes(body[42:46], "little")
                at = 46 + 32 * n_existing
                return status + self._exact(u, 8 + 8 * int.from_bytes(body[at:at + 4], "little"))
            return status + self._exact(u, 1)
        if op == 15 and status[0] != 0:  # COMMIT refused: its reason
            return status + self._exact(u, 1)
        return status

    def _relay(self, c):
        u = socket.socket(socket.AF_UNIX)
        mapped = None
        try:
            u.connect(self.node_socket)
            u.sendall(self._frame(c))
            data, fds, _, _ = socket.recv_fds(u, 9, 1)
            while data[:1] == b"\x00" and len(data) < 9:
                data += u.recv(9 - len(data))
            if fds:
                mapped = mmap.mmap(fds[0], int.from_bytes(data[1:9], "little"))
            socket.send_fds(c, [data], fds)
            for fd in fds:
                os.close(fd)
            while True:
                body = self._frame(c)
                u.sendall(body)
                answer = self._answer(u, body[4:])
                op = body[4]
                if op == self.hold_op:
                    self.hold_op = None
                    self.holding.set()
                    c.recv(1)  # until the engine goes away
                    return
                if op == 12 and answer[0] == 0 and self.corrupt_next_lease.is_set() and mapped is not None:
                    count = int.from_bytes(answer[9:13], "little")
                    if count:
                        self.corrupt_next_lease.clear()
                        offset = int.from_bytes(answer[13 + 40 : 13 + 48], "little")
                        mapped[offset + 4096] ^= 0xFF
                        self.corrupted += 1
                c.sendall(answer)
        except OSError:
            pass
        finally:
            c.close()
            u.close()


def config_file(prefix: str, body: str) -> tuple[str, str]:
    """A fresh data directory and a cachet.toml in it: `body` after its data_dir line."""
    data = tempfile.mkdtemp(prefix=prefix)
    path = os.path.join(data, "cachet.toml")
    with open(path, "w") as f:
        f.write(f'data_dir = "{data}"\n' + body)
    return data, path


def have_prerequisites() -> None:
    need(os.path.exists(BIN), f"the cachet binary at {BIN} (cargo build)")
    need(shutil.which("psql") is not None, "psql (Postgres client)")
    need(
        os.path.exists(os.path.join(ROOT, ".cachet", "models", "smollm2-hf", "model.safetensors")),
        "the converted model (scripts/vllm-model.sh)",
    )


class OneNode:
    """`cachet serve` with one vLLM server beside it; the connector reaches the node's TCP
    port through a `CorruptingProxy` and its Unix socket through a `LocalProxy`. A mixin of
    the test classes below (not a test class itself)."""

    SHARED_MEMORY = True
    NAME = "single"

    @classmethod
    def setUpClass(cls):
        have_prerequisites()
        cls.procs = Procs()
        cls.db = f"cachet_vllm_test_{cls.NAME}_{os.getpid()}"
        cls.db_url = f"{PG}/{cls.db}"
        cls.api_port, cls.fabric_port, cls.vllm_port = free_port(), free_port(), free_port()
        cls.proxy = CorruptingProxy(cls.fabric_port)
        cls.data, cfg = config_file(
            f"cachet-vllm-{cls.NAME}-",
            f'listen = "127.0.0.1:{cls.api_port}"\n'
            f'database_url = "{cls.db_url}"\n'
            'redis_url = ""\n'
            f'[fabric]\nlisten = "127.0.0.1:{cls.fabric_port}"\n'
            '[engine]\nkind = "sim"\n'
            f'[[engine.vllm]]\nurl = "http://127.0.0.1:{cls.vllm_port}"\n',
        )
        cls.local = LocalProxy(os.path.join(cls.data, "fabric.sock"))
        cls.env = {"CACHET_CONFIG": cfg, "CACHET_CLUSTER_TOKEN": TOKEN, "RUST_LOG": "info"}
        # vLLM first (it takes ~30 s); its connector reaches the node through the proxies.
        cls.start_vllm("")
        cachet(["migrate"], cls.env)
        cls.tenant_a, cls.key_a = new_tenant(cls.env, "tenant-a")
        cls.tenant_b, cls.key_b = new_tenant(cls.env, "tenant-b")
        cls.start_serve()
        wait_vllm(cls.vllm, cls.vllm_log, cls.vllm_port)

    @classmethod
    def start_vllm(cls, suffix: str) -> None:
        cls.vllm, cls.vllm_log = start_vllm(
            cls.procs, f"vllm-{cls.NAME}{suffix}", cls.vllm_port, cls.proxy.port,
            env={"CACHET_FABRIC_SOCKET": cls.local.path, "CACHET_TRANSFER_LOG": "1",
                 "CACHET_SHARED_MEMORY": "1" if cls.SHARED_MEMORY else "0"},
        )

    @classmethod
    def start_serve(cls, suffix: str = "") -> None:
        cls.serve, cls.serve_log = cls.procs.start(f"serve-{cls.NAME}{suffix}", [BIN, "serve"], cls.env)
        cls.base = f"http://127.0.0.1:{cls.api_port}"
        wait_until("cachet serve", lambda: http("GET", f"{cls.base}/healthz", timeout=2)[0] == 200, 60,
                   cls.serve, cls.serve_log)

    @classmethod
    def tearDownClass(cls):
        cls.procs.stop_all()
        subprocess.run(["psql", f"{PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {cls.db} WITH (FORCE)"],
                       capture_output=True)

    def ledger(self, tenant: str) -> list[tuple]:
        """The tenant's usage rows, oldest first, once the meter has committed them."""
        time.sleep(0.5)
        rows = psql(
            self.db_url,
            "SELECT input_tokens, cache_write_5m_tokens, cache_read_tokens, status FROM usage_events "
            f"WHERE tenant_id = '{tenant}' ORDER BY started_at",
        )
        return [tuple(r.split("|")) for r in rows.splitlines() if r]

    def leases(self) -> float:
        return cachet_metric(self.base, "cachet_fabric_local_ops_total", 'op="lease",result="ok"')

    def check_same_answer_and_external_hits(self):
        own = vllm_chat(self.vllm_port)
        text, usage, _ = messages(self.base, self.key_a)
        self.assertEqual(text, own, "Cachet's greedy answer differs from vLLM's own")
        self.assertGreater(usage["cache_creation_input_tokens"], 0, usage)
        self.assertEqual(usage["cache_read_input_tokens"], 0, usage)
        written = usage["cache_creation_input_tokens"]
        self.assertEqual(written % 128, 0, "writes are whole vLLM blocks")
        # vLLM's own cache emptied: the prefix can only come from the fabric.
        reset_vllm_cache(self.vllm_port)
        before = external_hits(self.vllm_port)
        text2, usage2, _ = messages(self.base, self.key_a)
        self.assertEqual(text2, own)
        self.assertEqual(usage2["cache_read_input_tokens"], written, usage2)
        self.assertEqual(external_hits(self.vllm_port) - before, written,
                         "vLLM's external-hit counter must rise by the read Cachet billed")
        rows = self.ledger(self.tenant_a)
        self.assertEqual(int(rows[-1][2]), written, f"the ledger bills the read: {rows}")



class SingleInstance(OneNode, unittest.TestCase):
    """The connector beside its node, through shared memory (the default)."""

    def test_1_same_answer_and_external_hits(self):
        """(a), the prefix loaded through the node's shared memory"""
        leases = self.leases()
        self.check_same_answer_and_external_hits()
        self.assertGreater(self.leases(), leases, "the load went through the arena")

    def test_2_restart_loads_from_the_fabric(self):
        """(b), and the OpenAI wire streamed"""
        text, usage, _ = messages(self.base, self.key_a)  # written (or read) before the restart
        Procs.kill(self.vllm)
        type(self).start_vllm("-restarted")
        wait_vllm(self.vllm, self.vllm_log, self.vllm_port)
        self.assertEqual(external_hits(self.vllm_port), 0)
        text2, usage2, _ = messages(self.base, self.key_a)
        self.assertEqual(text2, text)
        self.assertGreater(usage2["cache_read_input_tokens"], 0, usage2)
        self.assertEqual(external_hits(self.vllm_port), usage2["cache_read_input_tokens"])
        # The OpenAI wire, streamed, after vLLM's own cache is emptied again.
        import openai

        reset_vllm_cache(self.vllm_port)
        client = openai.OpenAI(base_url=f"{self.base}/v1", api_key=self.key_a)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, last = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                last = chunk.usage
        self.assertEqual("".join(parts), text)
        self.assertIsNotNone(last)
        self.assertGreater(last.prompt_tokens_details.cached_tokens, 0, last)

    def test_3_tenants_never_share(self):
        """(c)"""
        messages(self.base, self.key_a)  # A's prefix is in the fabric and in vLLM's cache
        local, ext = local_hits(self.vllm_port), external_hits(self.vllm_port)
        text, usage, _ = messages(self.base, self.key_b)
        self.assertEqual(usage["cache_read_input_tokens"], 0, f"B read A's prefix: {usage}")
        self.assertEqual(local_hits(self.vllm_port), local, "B hit A's blocks in vLLM's own cache")
        self.assertEqual(external_hits(self.vllm_port), ext, "B loaded A's blocks")
        self.assertGreater(usage["cache_creation_input_tokens"], 0, "B writes its own entry")
        # A client's own cache_salt (OpenAI wire) is refused or ignored, never forwarded.
        status, _, r = http(
            "POST", f"{self.base}/v1/chat/completions",
            {"model": MODEL, "max_tokens": 4, "cache_salt": "x",
             "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]},
            {"authorization": f"Bearer {self.key_b}"},
        )
        self.assertIn(status, (200, 400), r)
        if status == 200:
            self.assertEqual(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, True,
                             "B's second request reads B's own prefix")

    def test_4_a_byte_flipped_in_the_arena_is_recomputed(self):
        """(g) a block corrupted at rest in the arena: caught, recomputed, not billed"""
        text, _, _ = messages(self.base, self.key_a)
        reset_vllm_cache(self.vllm_port)
        before = self.local.corrupted
        self.local.corrupt_next_lease.set()
        text2, usage2, _ = messages(self.base, self.key_a)
        self.assertEqual(self.local.corrupted, before + 1, "the proxy corrupted a block in the arena")
        self.assertEqual(text2, text, "a corrupted block changed the answer")
        self.assertEqual(usage2["cache_read_input_tokens"], 0, f"a corrupted block was billed as read: {usage2}")
        self.assertGreater(cachet_metric(self.base, "cachet_fabric_local_ops_total", 'result="corrupt"'), 0)
        # The node dropped the block; the request computed and saved it again; the next
        # request loads it intact.
        reset_vllm_cache(self.vllm_port)
        text3, usage3, _ = messages(self.base, self.key_a)
        self.assertEqual(text3, text)
        self.assertGreater(usage3["cache_read_input_tokens"], 0)

    def ask_in_background(self, key: str, system: str) -> None:
        """A request whose vLLM the test kills: its answer (an error) is not waited for."""
        threading.Thread(target=lambda: http(
            "POST", f"{self.base}/v1/messages",
            {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}],
             "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]},
            {"x-api-key": key, "anthropic-version": "2023-06-01"}), daemon=True).start()

    def test_8_vllm_killed_holding_a_lease(self):
        """(g) vLLM killed mid-load: no lease left, the arena as it was"""
        messages(self.base, self.key_a)  # the prefix is stored
        reset_vllm_cache(self.vllm_port)
        allocated = arena(self.base, "allocated")
        self.local.hold_op = 12
        self.ask_in_background(self.key_a, SYSTEM)
        self.assertTrue(self.local.holding.wait(120), "the load never leased")
        self.local.holding.clear()
        self.assertGreater(arena(self.base, "leased"), 0, "the lease shows while vLLM holds it")
        Procs.kill(self.vllm)
        wait_until("the dead engine's lease freed", lambda: arena(self.base, "leased") == 0, 10)
        self.assertEqual(arena(self.base, "allocated"), allocated, "the arena holds what it held before")
        type(self).start_vllm("-after-kill-1")
        wait_vllm(self.vllm, self.vllm_log, self.vllm_port)

    def test_9_vllm_killed_filling_a_save(self):
        """(g) a save interrupted by a kill: no half-written block visible, its room freed"""
        system = "You catalogue the minerals of a small museum, one drawer at a time. " * 18
        allocated = arena(self.base, "allocated")
        dropped = cachet_metric(self.base, "cachet_fabric_local_ops_total", 'op="reserve",result="dropped"')
        self.local.hold_op = 14
        self.ask_in_background(self.key_b, system)
        self.assertTrue(self.local.holding.wait(120), "the save never reserved")
        self.local.holding.clear()
        self.assertGreater(arena(self.base, "reserved"), 0, "the reservation shows while vLLM fills it")
        Procs.kill(self.vllm)
        wait_until("the dead engine's reservation freed", lambda: arena(self.base, "reserved") == 0, 10)
        self.assertEqual(arena(self.base, "allocated"), allocated)
        self.assertEqual(cachet_metric(self.base, "cachet_fabric_local_ops_total",
                                       'op="reserve",result="dropped"'), dropped + 1)
        type(self).start_vllm("-after-kill-2")
        wait_vllm(self.vllm, self.vllm_log, self.vllm_port)
        # Nothing of the unfinished save is readable: the same request reads nothing.
        own = vllm_chat(self.vllm_port, system=system)
        reset_vllm_cache(self.vllm_port)
        text, usage, _ = messages(self.base, self.key_b, system=system)
        self.assertEqual(text, own)
        self.assertEqual(usage["cache_read_input_tokens"], 0, usage)

    def test_99_node_restarted_under_a_running_vllm(self):
        """(g) loads fall back to recompute, then resume through shared memory"""
        text, _, _ = messages(self.base, self.key_a)
        Procs.kill(self.serve)
        type(self).start_serve("-restarted")
        # vLLM's connections to the old node are gone: the first request after the restart
        # is computed (the node lost its DRAM blocks anyway), answers the same, and saves.
        reset_vllm_cache(self.vllm_port)
        text1, usage1, _ = messages(self.base, self.key_a)
        self.assertEqual(text1, text)
        self.assertEqual(usage1["cache_read_input_tokens"], 0, usage1)
        leases = self.leases()
        deadline, read = time.time() + 60, 0
        while time.time() < deadline and not read:
            reset_vllm_cache(self.vllm_port)
            text2, usage2, _ = messages(self.base, self.key_a)
            self.assertEqual(text2, text)
            read = usage2["cache_read_input_tokens"]
        self.assertGreater(read, 0, "loads never resumed after the node's restart")
        self.assertGreater(self.leases(), leases, "the loads resumed through shared memory")


class SingleInstanceTCP(OneNode, unittest.TestCase):
    """The same with shared memory turned off (`CACHET_SHARED_MEMORY=0`): blocks over TCP."""

    SHARED_MEMORY = False
    NAME = "tcp"

    def test_1_same_answer_and_external_hits(self):
        """(h) (a) over TCP"""
        leases = self.leases()
        self.check_same_answer_and_external_hits()
        self.assertEqual(self.leases(), leases, "shared memory was turned off")

    def test_4_corrupt_block_recomputed(self):
        """(h) (f) a block corrupted on the wire"""
        text, _, _ = messages(self.base, self.key_a)
        reset_vllm_cache(self.vllm_port)
        before = self.proxy.corrupted
        self.proxy.armed.set()
        text2, usage2, _ = messages(self.base, self.key_a)
        self.assertEqual(self.proxy.corrupted, before + 1, "the proxy corrupted a block")
        self.assertEqual(text2, text, "a corrupted block changed the answer")
        self.assertEqual(usage2["cache_read_input_tokens"], 0, f"a corrupted block was billed as read: {usage2}")
        # The next request loads it intact.
        reset_vllm_cache(self.vllm_port)
        text3, usage3, _ = messages(self.base, self.key_a)
        self.assertEqual(text3, text)
        self.assertGreater(usage3["cache_read_input_tokens"], 0)


def preemptions(port: int) -> float:
    return metric(port, "vllm:num_preemptions_total")


class Preemption(unittest.TestCase):
    """vLLM short of KV blocks preempts requests whose prefixes the connector loaded: a
    preempted request is scheduled again from scratch, and its prefix must be loaded again
    into its new blocks (or recomputed), never left as whatever those blocks held."""

    # Three ~1.6K-token prompts (12 full blocks each), 450 tokens of answer each: 16 blocks a
    # request, 48 for the three at once, in a KV cache of 40 blocks. All three fit at first;
    # as they grow, vLLM preempts one, and the two left take its freed blocks (the prompt's
    # last ones among them), so when it is scheduled again its own prefix cache no longer
    # has its whole prompt and the connector loads the rest.
    BLOCKS = 40
    MAX_TOKENS = 450

    @classmethod
    def setUpClass(cls):
        have_prerequisites()
        cls.procs = Procs()
        cls.db = f"cachet_vllm_preempt_{os.getpid()}"
        cls.db_url = f"{PG}/{cls.db}"
        cls.api_port, cls.fabric_port, cls.vllm_port = free_port(), free_port(), free_port()
        _, cfg = config_file(
            "cachet-vllm-preempt-",
            f'listen = "127.0.0.1:{cls.api_port}"\n'
            f'database_url = "{cls.db_url}"\n'
            'redis_url = ""\n'
            f'[fabric]\nlisten = "127.0.0.1:{cls.fabric_port}"\n'
            '[engine]\nkind = "sim"\n'
            f'[[engine.vllm]]\nurl = "http://127.0.0.1:{cls.vllm_port}"\n',
        )
        cls.env = {"CACHET_CONFIG": cfg, "CACHET_CLUSTER_TOKEN": TOKEN, "RUST_LOG": "info"}
        cls.vllm, cls.vllm_log = start_vllm(
            cls.procs, "vllm-preempt", cls.vllm_port, cls.fabric_port,
            args=f"--num-gpu-blocks-override {cls.BLOCKS} --max-model-len 4096 --max-num-seqs 4",
        )
        cachet(["migrate"], cls.env)
        cls.tenant, cls.key = new_tenant(cls.env, "tenant-preempt")
        cls.serve, cls.serve_log = cls.procs.start("serve-preempt", [BIN, "serve"], cls.env)
        cls.base = f"http://127.0.0.1:{cls.api_port}"
        wait_until("cachet serve", lambda: http("GET", f"{cls.base}/healthz", timeout=2)[0] == 200, 60,
                   cls.serve, cls.serve_log)
        wait_vllm(cls.vllm, cls.vllm_log, cls.vllm_port)

    @classmethod
    def tearDownClass(cls):
        cls.procs.stop_all()
        subprocess.run(["psql", f"{PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {cls.db} WITH (FORCE)"],
                       capture_output=True)

    PROMPTS = [
        ("You are the archivist of a harbour town. Ships, cargo, tides and the names of captains "
         "fill the ledgers you keep, year after year, in careful handwriting. ") * 46,
        ("You teach chemistry to first-year students. Explain reactions, bonds, acids and bases "
         "with small experiments that can be done safely in a classroom. ") * 50,
        ("You are a gardener writing a monthly column. Soil, seeds, pruning, compost and the "
         "patience that every garden asks of the people who tend it. ") * 48,
    ]
    QUESTION = "Tell me a long and detailed story that uses what you know."

    def ask(self, system: str) -> tuple[str, dict]:
        text, usage, _ = messages(self.base, self.key, system=system, question=self.QUESTION,
                                  max_tokens=self.MAX_TOKENS)
        return text, usage

    def test_7_preempted_requests_answer_as_alone(self):
        """(item 1) every answer under preemption equals the same request's lone answer"""
        alone = []
        for system in self.PROMPTS:
            text, usage = self.ask(system)
            self.assertGreaterEqual(usage["cache_creation_input_tokens"], 10 * 128, usage)
            alone.append(text)
        # vLLM's own cache emptied: every prefix comes from the fabric through the connector.
        reset_vllm_cache(self.vllm_port)
        before_pre, before_ext = preemptions(self.vllm_port), external_hits(self.vllm_port)
        results: list = [None] * len(self.PROMPTS)

        def run(i: int) -> None:
            try:
                results[i] = self.ask(self.PROMPTS[i])
            except BaseException as e:  # surfaced below
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.PROMPTS))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        pre = preemptions(self.vllm_port) - before_pre
        self.assertGreater(pre, 0, "vLLM never preempted: the test proves nothing")
        self.assertGreater(external_hits(self.vllm_port) - before_ext, 0, "nothing loaded from the fabric")
        for i, ((text, usage), lone) in enumerate(zip(results, alone)):
            if text != lone:
                at = next((k for k, (a, b) in enumerate(zip(text, lone)) if a != b), min(len(text), len(lone)))
                self.fail(f"prompt {i}: answer under preemption differs from its lone answer at "
                          f"character {at} ({pre:.0f} preemptions)")
            self.assertGreater(usage["cache_read_input_tokens"], 0, usage)


def two_instances_beside_one_node(cls, name: str, roles: list[str] | None = None, env: dict | None = None,
                                  split_min_tokens: int = 128) -> None:
    """`cachet serve` with one model served by two vLLM servers beside its node (one core
    each), their roles given (default: both; with roles, prompts of `split_min_tokens` or more
    are split); sets the class's procs, db_url, ports, vllms, env, tenant, key and base."""
    have_prerequisites()
    cls.procs = Procs()
    cls.db = f"cachet_vllm_{name}_{os.getpid()}"
    cls.db_url = f"{PG}/{cls.db}"
    cls.api_port, cls.fabric_port = free_port(), free_port()
    cls.ports = [free_port(), free_port()]
    _, cfg = config_file(
        f"cachet-vllm-{name}-",
        f'listen = "127.0.0.1:{cls.api_port}"\n'
        f'database_url = "{cls.db_url}"\n'
        'redis_url = ""\n'
        f'[fabric]\nlisten = "127.0.0.1:{cls.fabric_port}"\n'
        '[engine]\nkind = "sim"\n'
        f'[[engine.vllm]]\nurl = "http://127.0.0.1:{cls.ports[0]}"\n'
        f'instances = ["http://127.0.0.1:{cls.ports[1]}"]\n'
        + (f"roles = {json.dumps(roles)}\nsplit_min_tokens = {split_min_tokens}\n" if roles else ""),
    )
    cls.env = {"CACHET_CONFIG": cfg, "CACHET_CLUSTER_TOKEN": TOKEN, "RUST_LOG": "info"}
    cls.vllms = [
        start_vllm(cls.procs, f"vllm-{name}-{i}", port, cls.fabric_port,
                   cpus=str(i % max(1, os.cpu_count() or 1)), env=env)
        for i, port in enumerate(cls.ports)
    ]
    cachet(["migrate"], cls.env)
    cls.tenant, cls.key = new_tenant(cls.env, f"tenant-{name}")
    cls.serve, cls.serve_log = cls.procs.start(f"serve-{name}", [BIN, "serve"], cls.env)
    cls.base = f"http://127.0.0.1:{cls.api_port}"
    wait_until("cachet serve", lambda: http("GET", f"{cls.base}/healthz", timeout=2)[0] == 200, 60,
               cls.serve, cls.serve_log)
    for (p, log), port in zip(cls.vllms, cls.ports):
        wait_vllm(p, log, port)


def computed(port: int) -> float:
    return metric(port, "vllm:prompt_tokens_by_source_total", 'source="local_compute"')


class SharedArena(unittest.TestCase):
    """One model served by two vLLM servers beside one node (`instances`: one per GPU on a
    real host, one core each here): both connectors map the node's one arena, and a prefix
    one instance saved, the other loads from it. Their loads are copied layer by layer beside
    the forward pass (`CACHET_OVERLAP_LOADS=1`, the default with the KV on a GPU), so that
    path runs here too."""

    @classmethod
    def setUpClass(cls):
        two_instances_beside_one_node(
            cls, "shared", env={"CACHET_TRANSFER_LOG": "1", "CACHET_OVERLAP_LOADS": "1"})

    @classmethod
    def tearDownClass(cls):
        cls.procs.stop_all()
        subprocess.run(["psql", f"{PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {cls.db} WITH (FORCE)"],
                       capture_output=True)

    SYSTEMS = [
        "You keep the lighthouse log of a northern island: weather, ships and lamp hours. " * 16,
        "You answer questions about the bus timetable of a small town and its villages. " * 16,
    ]

    def served(self) -> list[float]:
        return [metric(port, "vllm:request_success_total") for port in self.ports]

    def test_1_a_prefix_one_instance_saved_the_other_loads(self):
        """(g) two vLLM instances on one node share one arena"""
        own = vllm_chat(self.ports[0], system=self.SYSTEMS[0])
        before = self.served()
        text, usage, _ = messages(self.base, self.key, system=self.SYSTEMS[0])
        written = usage["cache_creation_input_tokens"]
        self.assertGreater(written, 0, usage)
        first = next(i for i, (a, b) in enumerate(zip(before, self.served())) if b > a)
        other = 1 - first
        # The next request goes to the instance that is not busy and took no turn yet.
        ext = external_hits(self.ports[other])
        text2, usage2, _ = messages(self.base, self.key, system=self.SYSTEMS[0])
        self.assertEqual(self.served()[other] - before[other], 1, "the second request went to the other instance")
        self.assertEqual((text, text2), (own, own))
        self.assertEqual(usage2["cache_read_input_tokens"], written, usage2)
        self.assertEqual(external_hits(self.ports[other]) - ext, written,
                         "the other instance loaded the prefix through its connector")
        self.assertEqual(cachet_metric(self.base, "cachet_fabric_local_connections"), 2,
                         "both workers hold the node's socket (and its arena)")

    def test_2_both_instances_load_at_once(self):
        """(g) concurrent loads from one arena on two instances: every answer as alone"""
        alone = [messages(self.base, self.key, system=sy)[0] for sy in self.SYSTEMS]
        for port in self.ports:
            reset_vllm_cache(port)
        ext = [external_hits(port) for port in self.ports]
        results: list = [None] * 4

        def run(i: int) -> None:
            try:
                results[i] = messages(self.base, self.key, system=self.SYSTEMS[i % 2])
            except BaseException as e:
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                raise r
            self.assertEqual(r[0], alone[i % 2])
            self.assertGreater(r[1]["cache_read_input_tokens"], 0, r[1])
        self.assertTrue(all(external_hits(port) > e for port, e in zip(self.ports, ext)),
                        "both instances loaded from the arena")


class VllmCluster:
    """A cluster: two `cachet node`s, each with its own vLLM server (one core each, publishing
    its KV events, which the node follows when `kv_events`), behind `cachet router`; the
    fabric keeps two replicas, so both nodes hold every saved block. Shared by (d), (e), (j)
    and `make bench-vllm-routing`."""

    def __init__(self, name: str, kv_events: bool = True):
        self.procs = Procs()
        self.db = f"cachet_{name}_{os.getpid()}"
        self.db_url = f"{PG}/{self.db}"
        self.prefix = f"{name}{os.getpid()}"
        data, cfg = config_file(
            f"cachet-{name}-",
            f'database_url = "{self.db_url}"\n'
            f'redis_url = "{REDIS}"\n'
            '[engine]\nkind = "sim"\n'
            '[cluster]\nreplicas = 2\ngroup_size = 2\n',
        )
        env = {"CACHET_CONFIG": cfg, "CACHET_CLUSTER_TOKEN": TOKEN, "RUST_LOG": "info"}
        self.env = env
        self.nodes = {}
        for i, n in enumerate(["n1", "n2"]):
            fabric, api, vllm, events = free_port(), free_port(), free_port(), free_port_pair()
            p, log = start_vllm(self.procs, f"{name}-vllm-{n}", vllm, fabric,
                                cpus=str(i % max(1, os.cpu_count() or 1)),
                                env={"CACHET_VLLM_KV_EVENTS": str(events)})
            self.nodes[n] = {"fabric": fabric, "api": api, "vllm": vllm, "events": events,
                             "vllm_proc": p, "vllm_log": log}
        cachet(["migrate"], env)
        self.tenant, self.key = new_tenant(env, f"{name}-tenant")
        for n, c in self.nodes.items():
            follow = {"CACHET_VLLM_KV_EVENTS": f"tcp://127.0.0.1:{c['events']}|tcp://127.0.0.1:{c['events'] + 1}"}
            c["proc"], c["log"] = self.procs.start(
                f"{name}-{n}",
                [BIN, "node", "--id", n, "--redis-prefix", self.prefix,
                 "--listen", f"127.0.0.1:{c['fabric']}", "--api-listen", f"127.0.0.1:{c['api']}"],
                {**env, "CACHET_VLLM_URL": f"http://127.0.0.1:{c['vllm']}",
                 **(follow if kv_events else {}),
                 "CACHET_DATA_DIR": os.path.join(data, n)},
            )
        gw = free_port()
        self.gateway, self.gateway_log = self.procs.start(
            f"{name}-gateway", [BIN, "router", "--redis-prefix", self.prefix],
            {**env, "CACHET_LISTEN": f"127.0.0.1:{gw}",
             # The gateway renders and counts tokens as the nodes do; it never calls vLLM.
             "CACHET_VLLM_URL": f"http://127.0.0.1:{self.nodes['n1']['vllm']}",
             "CACHET_DATA_DIR": os.path.join(data, "gw")},
        )
        self.base = f"http://127.0.0.1:{gw}"

        def ready():
            status, _, body = http("GET", f"{self.base}/readyz", timeout=2)
            text = json.dumps(body) if not isinstance(body, bytes) else body.decode()
            return status == 200 and '"n1"' in text and '"n2"' in text

        wait_until("cachet router with two nodes", ready, 90, self.gateway, self.gateway_log)
        for c in self.nodes.values():
            wait_vllm(c["vllm_proc"], c["vllm_log"], c["vllm"])

    def stop(self) -> None:
        self.procs.stop_all()
        subprocess.run(["psql", f"{PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {self.db} WITH (FORCE)"],
                       capture_output=True)
        keys = subprocess.run(["redis-cli", "-u", REDIS, "--scan", "--pattern", f"{self.prefix}:*"],
                              capture_output=True, text=True).stdout.split()
        if keys:
            subprocess.run(["redis-cli", "-u", REDIS, "del", *keys], capture_output=True)


class TwoInstances(unittest.TestCase):
    """(d), (e) on a `VllmCluster`."""

    @classmethod
    def setUpClass(cls):
        have_prerequisites()
        need(shutil.which("redis-cli") is not None, "redis-cli (Redis)")
        cls.cluster = VllmCluster("vllmcluster", kv_events=False)
        cls.nodes, cls.base, cls.db_url = cls.cluster.nodes, cls.cluster.base, cls.cluster.db_url
        cls.tenant, cls.key = cls.cluster.tenant, cls.cluster.key
        cls.tenant_d, cls.key_d = new_tenant(cls.cluster.env, "cluster-killed")

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    SYSTEM = "You answer questions about the solar system for a planetarium. " * 12

    def node_direct(self, node: str, key: str):
        """The same request sent straight to one node, as the routing gateway sends it."""
        body = {
            "model": MODEL,
            "max_tokens": 24,
            "system": [{"type": "text", "text": self.SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": QUESTION}],
        }
        status, _, r = http(
            "POST", f"http://127.0.0.1:{self.nodes[node]['api']}/v1/messages", body,
            {"x-api-key": key, "anthropic-version": "2023-06-01",
             "x-cachet-cluster-token": TOKEN, "x-cachet-request-id": str(uuid.uuid4())},
        )
        self.assertEqual(status, 200, r)
        return r["content"][0]["text"], r["usage"]

    def test_5_prefix_written_on_one_is_read_on_the_other(self):
        """(d)"""
        text, usage, hdrs = messages(self.base, self.key, system=self.SYSTEM)
        first = hdrs.get("x-cachet-node")
        self.assertIn(first, self.nodes, hdrs)
        self.assertGreater(usage["cache_creation_input_tokens"], 0, usage)
        other = next(n for n in self.nodes if n != first)
        before = external_hits(self.nodes[other]["vllm"])
        text2, usage2 = self.node_direct(other, self.key)
        self.assertEqual(text2, text)
        self.assertEqual(usage2["cache_read_input_tokens"], usage["cache_creation_input_tokens"], usage2)
        self.assertEqual(external_hits(self.nodes[other]["vllm"]) - before, usage2["cache_read_input_tokens"],
                         "the other instance's vLLM loaded the prefix through its connector")
        type(self).written = (text, usage["cache_creation_input_tokens"])

    def test_6_killed_instance(self):
        """(e)"""
        resp = messages(self.base, self.key_d, system=self.SYSTEM,
                        question="Write a long story about a lighthouse keeper.", max_tokens=400, stream=True)
        victim = resp.headers.get("x-cachet-node")
        self.assertIn(victim, self.nodes)
        survivor = next(n for n in self.nodes if n != victim)
        deltas, error, killed, event = 0, None, False, None
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "error":
                error = json.loads(line[5:])["error"]
                break
            elif line.startswith("data:") and event == "content_block_delta":
                deltas += 1
                if deltas == 5 and not killed:
                    Procs.kill(self.nodes[victim]["vllm_proc"])
                    killed = True
            elif event == "message_stop":
                break
        resp.close()
        self.assertTrue(killed, "the stream ended before vLLM could be killed")
        self.assertIsNotNone(error, "a stream cut by a dead vLLM must end with an error event")
        self.assertEqual(error["type"], "overloaded_error", error)
        self.assertIn("model server is unavailable", error["message"])
        # One ledger row for it, failed, with the output it had produced.
        deadline, rows = time.time() + 10, []
        while time.time() < deadline and not rows:
            rows = [r.split("|") for r in psql(
                self.db_url, f"SELECT status, output_tokens FROM usage_events WHERE tenant_id = '{self.tenant_d}'"
            ).splitlines() if r]
            time.sleep(0.25)
        time.sleep(1)
        rows = [r.split("|") for r in psql(
            self.db_url, f"SELECT status, output_tokens FROM usage_events WHERE tenant_id = '{self.tenant_d}'"
        ).splitlines() if r]
        self.assertEqual(len(rows), 1, rows)
        self.assertEqual(rows[0][0], "failed", rows)
        self.assertGreaterEqual(int(rows[0][1]), 5, rows)
        # A node whose vLLM is down answers 529 before doing any work, saying why, and records
        # nothing (the gateway then tries the next node under the same request id).
        status, hdrs, r = http(
            "POST", f"http://127.0.0.1:{self.nodes[victim]['api']}/v1/messages",
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}]},
            {"x-api-key": self.key_d, "anthropic-version": "2023-06-01",
             "x-cachet-cluster-token": TOKEN, "x-cachet-request-id": str(uuid.uuid4())},
        )
        self.assertEqual(status, 529, r)
        self.assertIn("model server is unavailable", r["error"]["message"])
        self.assertIn("retry-after", {k.lower() for k in hdrs})
        time.sleep(1)
        self.assertEqual(
            psql(self.db_url, f"SELECT count(*) FROM usage_events WHERE tenant_id = '{self.tenant_d}'"), "1",
            "a request the dead vLLM never saw must not be billed",
        )
        # The service goes on with the other instance: every request lands there.
        text, written = getattr(self, "written", (None, None))
        ok = 0
        for _ in range(3):
            t, usage, hdrs = messages(self.base, self.key, system=self.SYSTEM)
            self.assertEqual(hdrs.get("x-cachet-node"), survivor, hdrs)
            if text is not None:
                self.assertEqual(t, text)
                self.assertEqual(usage["cache_read_input_tokens"], written, usage)
            ok += 1
        self.assertEqual(ok, 3)
        # Each of those is billed once, retried or not (the dead node recorded nothing).
        deadline = time.time() + 10
        while time.time() < deadline:
            n = int(psql(self.db_url, f"SELECT count(*) FROM usage_events WHERE tenant_id = '{self.tenant}'"))
            if n >= 5:
                break
            time.sleep(0.25)
        time.sleep(1)
        n = int(psql(self.db_url, f"SELECT count(*) FROM usage_events WHERE tenant_id = '{self.tenant}'"))
        self.assertEqual(n, 5, "two requests before the kill, three after: one row each")


class PrefillDecodeSplit(unittest.TestCase):
    """(k) Prefill and decode apart: one model, a prefill instance and a decode instance
    beside one node (`roles = ["prefill", "decode"]`)."""

    # About 560 tokens: four full blocks and a tail.
    SYSTEM = ("You are the concierge of a mountain hotel: rooms, ski passes, the spa, "
              "dinner times and the shuttle to the station. ") * 20

    @classmethod
    def setUpClass(cls):
        two_instances_beside_one_node(cls, "split", roles=["prefill", "decode"])
        cls.prefill, cls.decode = cls.ports

    @classmethod
    def tearDownClass(cls):
        cls.procs.stop_all()
        subprocess.run(["psql", f"{PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {cls.db} WITH (FORCE)"],
                       capture_output=True)

    def rows(self) -> list[list[str]]:
        time.sleep(1)
        return [r.split("|") for r in psql(
            self.db_url,
            "SELECT status, input_tokens, cache_write_5m_tokens, cache_read_tokens, output_tokens "
            f"FROM usage_events WHERE tenant_id = '{self.tenant}' ORDER BY started_at",
        ).splitlines() if r]

    def test_1_prefilled_apart_answers_as_colocated(self):
        before = {p: (computed(p), external_hits(p), local_hits(p)) for p in self.ports}
        text, usage, _ = messages(self.base, self.key, system=self.SYSTEM)
        prompt = usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"]
        full = (prompt - 1) // 128 * 128
        # The decode instance loaded every full block the prefill instance computed, and
        # computed only the tail; the prefill instance computed the whole prompt.
        self.assertEqual(external_hits(self.decode) - before[self.decode][1], full)
        self.assertEqual(computed(self.decode) - before[self.decode][0], prompt - full)
        self.assertEqual(computed(self.prefill) - before[self.prefill][0], prompt)
        self.assertEqual(text, vllm_chat(self.decode, system=self.SYSTEM), "the greedy answer, as colocated")
        # Billed as the customer's breakpoint says: a 5-minute write of the system prompt's
        # full blocks, the rest input; the hand-over is not a cache read.
        self.assertEqual(usage["cache_read_input_tokens"], 0, usage)
        self.assertEqual(usage["cache_creation_input_tokens"] % 128, 0, usage)
        self.assertGreater(usage["cache_creation_input_tokens"], 0, usage)
        rows = self.rows()
        self.assertEqual(len(rows), 1, rows)
        self.assertEqual(rows[0][0], "completed", rows)
        self.assertEqual(int(rows[0][2]), usage["cache_creation_input_tokens"], rows)
        self.assertEqual(int(rows[0][3]), 0, rows)
        # The same request again reads what the first wrote, as colocated.
        text2, usage2, _ = messages(self.base, self.key, system=self.SYSTEM)
        self.assertEqual(text2, text)
        self.assertEqual(usage2["cache_read_input_tokens"], usage["cache_creation_input_tokens"], usage2)
        self.assertEqual(cachet_metric(self.base, "cachet_engine_split_total", 'outcome="split"'), 2)

    def test_2_a_prefill_instance_killed_mid_request_is_recomputed(self):
        long_system = ("The station master's notes on the winter timetable, platform by platform. "
                       "Trains leave on the hour and on the half hour; the last one at midnight. ") * 60
        expected = vllm_chat(self.decode, system=long_system)
        reset_vllm_cache(self.decode)
        rows_before = len(self.rows())
        out = {}
        log = self.vllms[0][1]

        def posts() -> int:
            with open(log, errors="replace") as f:
                return f.read().count("POST /v1/completions")

        sent = posts()

        def ask():
            try:
                out["answer"] = messages(self.base, self.key, system=long_system)
            except BaseException as e:  # shown by the assertion below
                out["error"] = repr(e)

        th = threading.Thread(target=ask)
        th.start()
        # Kill the prefill instance while it is prefilling (a ~2,700-token prompt takes it
        # seconds on one core; vLLM logs the request as its stream starts).
        wait_until("the prefill instance taking the request", lambda: "error" in out or posts() > sent, 30)
        self.assertNotIn("error", out)
        time.sleep(1)
        Procs.kill(self.vllms[0][0])
        th.join(timeout=300)
        self.assertIn("answer", out, f"the request was answered: {out.get('error')}")
        text, usage, _ = out["answer"]
        self.assertEqual(text, expected)
        rows = self.rows()
        self.assertEqual(len(rows) - rows_before, 1, rows)
        self.assertEqual(rows[-1][0], "completed", rows)
        self.assertGreaterEqual(cachet_metric(self.base, "cachet_engine_split_total", 'outcome="prefill_failed"'), 1)
        # With the prefill instance gone, requests are served whole by the decode instance.
        text, _, _ = messages(self.base, self.key, system=self.SYSTEM, question="And the spa?")
        self.assertTrue(text)


class RoutedByEngineCache(unittest.TestCase):
    """(j) Routing by the engines' own caches, on a `VllmCluster`."""

    # About 420 tokens: three full 128-token blocks shared by every question.
    SYSTEM = ("You are the archivist of the Lisbon maritime museum. Visitors ask about ships, "
              "navigators, maps and the museum's opening hours; answer in two sentences. ") * 14
    QUESTIONS = [
        "Who was Vasco da Gama?",
        "When does the museum open on Sundays?",
        "What is an astrolabe?",
        "Which ship is the oldest in the collection?",
    ]

    @classmethod
    def setUpClass(cls):
        have_prerequisites()
        need(shutil.which("redis-cli") is not None, "redis-cli (Redis)")
        sys.path.insert(0, os.path.dirname(__file__))
        from kv_consumer import KvConsumer

        cls.cluster = VllmCluster("vllmevents")
        cls.nodes, cls.base, cls.key = cls.cluster.nodes, cls.cluster.base, cls.cluster.key
        cls.gateway, cls.gateway_log = cls.cluster.gateway, cls.cluster.gateway_log
        host, port = REDIS.removeprefix("redis://").split("/")[0].split(":")
        cls.consumer = KvConsumer(host, int(port), cls.cluster.prefix)
        cls.consumer.start()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()
        cls.consumer.close()

    def consume_until(self, what: str, cond, timeout: float = 20) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.consumer.poll(200)
            if cond():
                return
        raise AssertionError(f"the KV event stream never showed {what}; holdings: "
                             f"{ {k: len(v) for k, v in self.consumer.holdings.items()} }")

    def ask(self, question: str):
        text, usage, hdrs = messages(self.base, self.key, system=self.SYSTEM, question=question)
        return text, usage, hdrs.get("x-cachet-node"), hdrs.get("x-cachet-route") or ""

    def router_engine_blocks(self) -> float:
        return cachet_metric(self.base, "cachet_gateway_engine_cache_blocks")

    def test_1_the_instance_holding_the_prefix_gets_every_next_request(self):
        _, usage, first, why = self.ask(self.QUESTIONS[0])
        self.assertIn(first, self.nodes, why)
        self.assertGreater(usage["cache_creation_input_tokens"], 0, usage)
        other = next(n for n in self.nodes if n != first)
        # The stream shows the engine's blocks under Cachet's keys: the same keys both nodes'
        # stores hold (the saved prefix, two replicas).
        self.consume_until(
            f"{first}'s engine holding the prefix",
            lambda: len(self.consumer.held(f"{first}/0", "ENGINE")
                        & self.consumer.held(first, "DRAM") & self.consumer.held(other, "DRAM")) >= 3,
        )
        self.assertEqual(self.consumer.held(f"{other}/0", "ENGINE"), set())
        wait_until("the router seeing the engine's blocks", lambda: self.router_engine_blocks() >= 3, 20,
                   self.gateway, self.gateway_log)
        for q in self.QUESTIONS[1:]:
            hits = local_hits(self.nodes[first]["vllm"])
            _, usage, node, why = self.ask(q)
            self.assertEqual(node, first, f"routed elsewhere: {why}")
            self.assertTrue(why.startswith("engine_cache=384 "), why)
            self.assertGreaterEqual(local_hits(self.nodes[first]["vllm"]) - hits, 384,
                                    "vLLM's own prefix cache served the prefix")
            self.assertGreaterEqual(usage["cache_read_input_tokens"], 384, usage)
        type(self).first = first

    def test_2_a_reset_cache_is_in_the_stream_and_the_fabric_copy_routes(self):
        first = getattr(type(self), "first", None)
        if first is None:
            self.skipTest("needs test_1's prefix")
        other = next(n for n in self.nodes if n != first)
        reset_vllm_cache(self.nodes[first]["vllm"])
        # vLLM publishes the events of a step at the step's end; an idle vLLM holds its
        # AllBlocksCleared until it next runs one. Any request does (here one sent to vLLM
        # directly, with nothing of Cachet's: its blocks are no one's in the stream).
        vllm_chat(self.nodes[first]["vllm"], system="Say hi.", question="Hi", max_tokens=1)
        self.consume_until(f"{first}'s engine cache cleared",
                           lambda: not self.consumer.held(f"{first}/0", "ENGINE"))
        wait_until("the router seeing the cleared cache", lambda: self.router_engine_blocks() == 0, 20,
                   self.gateway, self.gateway_log)
        served = {n: external_hits(c["vllm"]) for n, c in self.nodes.items()}
        # vLLM's own publishers, as a router following vLLM directly sees them.
        import zmq

        ctx = zmq.Context.instance()
        subs = {}
        for n, c in self.nodes.items():
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{c['events']}")
            subs[n] = sub
        time.sleep(0.5)  # a SUB socket receives only once its subscription has arrived
        _, usage, node, why = self.ask("How long is a caravel?")
        self.assertTrue(why.startswith("engine_cache=0 fabric_local=384 "), why)
        self.assertEqual(usage["cache_read_input_tokens"], 384, usage)
        self.assertEqual(external_hits(self.nodes[node]["vllm"]) - served[node], 384,
                         "the prefix was loaded from the node's fabric copy")
        # The connector told vLLM's publisher about the three blocks it loaded from Cachet.
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        loaded = []
        deadline = time.time() + 10
        while time.time() < deadline and not loaded:
            if subs[node].poll(200):
                _topic, _seq, payload = subs[node].recv_multipart()
                batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
                loaded += [e for e in batch.events if getattr(e, "medium", None) == "CACHET_FABRIC"]
        for sub in subs.values():
            sub.close(linger=0)
        self.assertEqual(len(loaded), 1, "one BlockStored for the request's load")
        self.assertEqual(len(loaded[0].block_hashes), 3)
        # The fabric's copies are still on both nodes.
        self.consumer.poll(200)
        self.assertGreaterEqual(len(self.consumer.held(first, "DRAM") & self.consumer.held(other, "DRAM")), 3)

    def test_3_no_record_carries_tokens(self):
        self.consumer.poll(200)
        self.assertTrue(self.consumer.records, "the consumer saw batches")
        engine = [e for b in self.consumer.records for e in b["events"] if e["medium"] == "ENGINE"]
        self.assertTrue(engine, "engine events were published")
        for b in self.consumer.records:
            text = json.dumps(b)
            self.assertNotIn("token_ids", text)
            self.assertNotIn("extra_keys", text)
            for e in b["events"]:
                for h in e.get("block_hashes", []):
                    self.assertEqual(len(h), 64, "Cachet's 32-byte keys, hex")

    def test_4_nodes_announce_their_stages_and_the_router_weighs_them(self):
        # Each node's heartbeat record carries its vLLM model's stages: one decoding instance
        # (role both), no prefill one; a node that answered several requests of more than two
        # tokens has measured its time between tokens against the batch.
        def stages(node: str) -> dict:
            out = subprocess.run(["redis-cli", "-u", REDIS, "GET", f"{self.cluster.prefix}:node:{node}"],
                                 capture_output=True, text=True, check=True).stdout.strip()
            return json.loads(out)["stages"][MODEL]

        for _ in range(4):
            self.ask("Name one navigator.")
        wait_until("a node announcing its measured time between tokens",
                   lambda: any(stages(n).get("step") for n in self.nodes), 10, self.gateway, self.gateway_log)
        for n in self.nodes:
            self.assertEqual((stages(n)["prefill_instances"], stages(n)["decode_instances"]), (0, 1), stages(n))
        line = next(stages(n)["step"] for n in self.nodes if stages(n).get("step"))
        self.assertGreater(line["base_ms"] + line["per_seq_ms"], 0, line)
        # The router's estimate names the time between tokens on a node that measured it (the
        # conversation's node, which answered most), and its gauge shows the estimate.
        whys = [self.ask(q)[3] for q in ("Name one map.", "Name one ship.")]
        self.assertTrue(any(re.search(r" tbt_ms=\d+$", w) for w in whys), whys)
        self.assertGreater(cachet_metric(self.base, "cachet_gateway_conductor_tbt_seconds"), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
