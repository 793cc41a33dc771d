"""Boots a real Cachet (the built `cachet` binary) against a fresh Postgres database and the
local Redis, with two tenants, for the official `anthropic` SDK to talk to."""

import os
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid

import anthropic
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("CACHET_BIN", os.path.join(ROOT, "target", "debug", "cachet"))
PG = os.environ.get("CACHET_TEST_PG", "postgres://postgres@127.0.0.1:5432")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cachet(env, *args):
    out = subprocess.run([BIN, *args], env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip()


@pytest.fixture(scope="session")
def server():
    db = f"cachet_sdk_{uuid.uuid4().hex}"
    port = _free_port()
    data = tempfile.mkdtemp(prefix="cachet-sdk-")
    env = dict(os.environ, DATABASE_URL=f"{PG}/{db}", CACHET_LISTEN=f"127.0.0.1:{port}",
               CACHET_DATA_DIR=data, CACHET_SIM_TIME_SCALE="0", RUST_LOG="warn",
               CACHET_MODEL_PATH=os.path.join(ROOT, ".cachet", "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    _cachet(env, "migrate")
    _cachet(env, "admin", "tenant", "create", "sdk-a")
    _cachet(env, "admin", "tenant", "create", "sdk-b")
    key_a = _cachet(env, "admin", "key", "create", "--tenant", "sdk-a")
    key_b = _cachet(env, "admin", "key", "create", "--tenant", "sdk-b")
    proc = subprocess.Popen([BIN, "serve"], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/readyz", timeout=1)
            break
        except Exception:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("cachet did not become ready")
    yield {"url": url, "key_a": key_a, "key_b": key_b, "env": env, "db": db}
    proc.terminate()
    proc.wait(timeout=30)
    subprocess.run(["psql", f"{PG}/postgres", "-qc", f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'],
                   capture_output=True)


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server["url"], api_key=server["key_a"], max_retries=0)


@pytest.fixture
def client_b(server):
    return anthropic.Anthropic(base_url=server["url"], api_key=server["key_b"], max_retries=0)


def words(prefix, n):
    return " ".join(f"{prefix}{i}" for i in range(n))


def total(u):
    return u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0)
