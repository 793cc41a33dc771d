"""`CachetConnector`: vLLM keeps its KV in a Cachet fabric node.

Loaded by vLLM with

    --kv-transfer-config '{"kv_connector": "CachetConnector",
                           "kv_connector_module_path": "cachet_vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"fabric_addr": "127.0.0.1:7400"}}'

and the node's cluster token in the environment (`CACHET_CLUSTER_TOKEN`).

The connector acts only on requests whose `kv_transfer_params` carry a `cachet` object, which
the Cachet gateway sets: the tenant scope, one block key per full vLLM block of the prompt,
the write boundaries (in blocks, with their TTL and kind), a tag that names the request to the
node, and the key space (dtype, layout and block size the keys were computed for). Keys are
Cachet's own (cache-fabric/src/keys.rs): the connector never hashes tokens itself.

Scheduler side: how many leading blocks the node holds (HAS: no TTL refresh), which vLLM
blocks to fill, which newly computed blocks to save once each write boundary is computed.
Worker side: GET the blocks (TTLs refreshed; every crc32c verified) and copy them into the
paged KV before the forward pass; after it, PUT the new blocks of each boundary. A block that
cannot be loaded (missing, corrupt, wrong size, node down) is reported through
`get_block_ids_with_load_errors`, so vLLM recomputes it; the node is told (REPORT) how many
tokens the request really did not prefill, which is what the gateway bills as a cache read.
"""

from __future__ import annotations


import os
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .fabric import KIND_BEST_EFFORT, KIND_PAID, FabricConnection, FabricError, scope_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's logging configuration (level, format) applies to it.
logger = init_logger(f"vllm.{__name__}")


def key_space(model_dtype: str, cache_dtype: str, layout: str, block_size: int) -> str:
    """What, besides the tokens, decides a block's bytes: part of every key the gateway
    computes for this engine (its `kv_dtype` field), checked here on every request."""
    return f"vllm/{model_dtype}/{cache_dtype}/{layout}/{block_size}"


@dataclass
class Write:
    end_block: int
    ttl_ms: int
    kind: int


@dataclass
class Params:
    """The `cachet` object of a request's kv_transfer_params."""

    scope: bytes
    keys: list[bytes]
    writes: list[Write]
    tag: uuid.UUID

    @staticmethod
    def parse(raw: Any, expected_space: str) -> "Params | None":
        if not isinstance(raw, dict) or "cachet" not in raw:
            return None
        c = raw["cachet"]
        try:
            if c.get("kv_space") != expected_space:
                logger.warning(
                    "cachet: request keys are for %r but this engine stores %r; not caching it",
                    c.get("kv_space"),
                    expected_space,
                )
                return None
            keys = [bytes.fromhex(k) for k in c["keys"]]
            if any(len(k) != 32 for k in keys):
                raise ValueError("a key is 32 bytes")
            writes = sorted(
                (
                    Write(
                        int(w["end_block"]),
                        int(w["ttl_ms"]),
                        KIND_BEST_EFFORT if w.get("kind") == "best_effort" else KIND_PAID,
                    )
                    for w in c.get("writes", [])
                ),
                key=lambda w: w.end_block,
            )
            return Params(scope_bytes(c["scope"]), keys, writes, uuid.UUID(hex=c["tag"]))
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("cachet: malformed kv_transfer_params (%s); not caching this request", e)
            return None


@dataclass
class ReqState:
    """The scheduler's view of one request."""

    params: Params
    prompt_len: int
    # Tokens vLLM's own prefix cache had (salted per tenant by the gateway).
    local: int = 0
    # Leading blocks the node held when asked.
    held: int = 0
    # Tokens planned to load, and those that really loaded (failures subtracted).
    planned: int = 0
    loaded: int = 0
    load_block_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Blocks stored by this request's writes so far, and the next write to plan.
    saved_upto: int = 0
    next_write: int = 0
    reported: bool = False


@dataclass
class LoadWork:
    tag: uuid.UUID
    scope: bytes
    local_tokens: int
    # (key, vLLM block id) in chain order.
    blocks: list[tuple[bytes, int]]


@dataclass
class SaveWork:
    scope: bytes
    ttl_ms: int
    kind: int
    existing: list[bytes]
    # (key, parent key or None, vLLM block id)
    blocks: list[tuple[bytes, bytes | None, int]]


@dataclass
class CachetMetadata(KVConnectorMetadata):
    loads: list[LoadWork] = field(default_factory=list)
    saves: list[SaveWork] = field(default_factory=list)


def _layer_order(name: str) -> tuple:
    return tuple(int(n) if n.isdigit() else n for n in re.split(r"(\d+)", name))


class CachetConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        addr = extra.get("fabric_addr") or os.environ.get("CACHET_FABRIC_ADDR", "127.0.0.1:7400")
        token = os.environ.get(extra.get("token_env", "CACHET_CLUSTER_TOKEN"), "")
        self._fabric = FabricConnection(addr, token)
        self._block_size = vllm_config.cache_config.block_size
        layout = getattr(kv_cache_config, "kv_cache_layout", None) or "LBHNC"
        model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self._space = key_space(
            model_dtype, str(vllm_config.cache_config.cache_dtype), layout, self._block_size
        )
        self._reqs: dict[str, ReqState] = {}
        # Worker side.
        self._layers: list[torch.Tensor] = []
        self._block_dim = 0
        self._block_bytes = 0
        self._load_errors: set[int] = set()
        logger.info("cachet: connector (%s) on fabric node %s, key space %s", role.name, addr, self._space)

    # ==== scheduler side =====================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        params = Params.parse(request.kv_transfer_params, self._space)
        if params is None:
            return 0, False
        bs = self._block_size
        prompt_len = len(request.prompt_token_ids or [])
        st = ReqState(params, prompt_len, local=num_computed_tokens)
        self._reqs[request.request_id] = st
        # vLLM computes at least the prompt's last token itself.
        loadable = min(len(params.keys), (prompt_len - 1) // bs)
        try:
            st.held = self._fabric.leading_held(params.scope, params.keys[:loadable])
        except FabricError as e:
            logger.warning("cachet: lookup failed (%s); computing the prompt", e)
            st.held = 0
        st.planned = max(0, st.held * bs - num_computed_tokens)
        return st.planned, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is not None:
            st.planned = num_external_tokens
            st.loaded = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = CachetMetadata()
        bs = self._block_size
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None or st.reported:
                continue
            st.block_ids = list(new.block_ids[0])
            first = st.local // bs
            last = (st.local + st.planned) // bs
            st.load_block_ids = st.block_ids[first:last]
            meta.loads.append(
                LoadWork(
                    st.params.tag,
                    st.params.scope,
                    st.local,
                    [(st.params.keys[i], st.block_ids[i]) for i in range(first, last)],
                )
            )
            st.reported = True
            end = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._plan_saves(st, end, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None or st.next_write >= len(st.params.writes):
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            end = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan_saves(st, end, meta)
        return meta

    def _plan_saves(self, st: ReqState, computed_end: int, meta: CachetMetadata) -> None:
        """The writes whose blocks are all computed once this step runs: each is one entry,
        its blocks past what the node already holds (or this request already stored)."""
        p = st.params
        complete = min(computed_end, st.prompt_len) // self._block_size
        while st.next_write < len(p.writes):
            w = p.writes[st.next_write]
            end = min(w.end_block, len(p.keys))
            if end > complete or end > len(st.block_ids):
                return
            st.next_write += 1
            start = max(st.held, st.saved_upto)
            if end <= start:
                continue
            meta.saves.append(
                SaveWork(
                    p.scope,
                    w.ttl_ms,
                    w.kind,
                    p.keys[:start],
                    [(p.keys[i], p.keys[i - 1] if i else None, st.block_ids[i]) for i in range(start, end)],
                )
            )
            st.saved_upto = end

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        for st in self._reqs.values():
            for i, b in enumerate(st.load_block_ids):
                if b in bad:
                    st.loaded = min(st.loaded, i * self._block_size)
                    break

    def request_finished(self, request: "Request", block_ids: list[int]):
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        # Saves run synchronously in the step that computes their blocks: nothing to wait for.
        return False, {
            "cachet": {
                "local_tokens": st.local,
                "loaded_tokens": st.loaded,
                "failed_tokens": st.planned - st.loaded,
                "saved_tokens": max(0, st.saved_upto - st.held) * self._block_size,
            }
        }

    # ==== worker side ========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = sorted(kv_caches, key=_layer_order)
        self._layers = [kv_caches[n] for n in names]
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        t = self._layers[0]
        dims = [d for d, n in enumerate(t.shape) if n == num_blocks] if num_blocks else [0]
        self._block_dim = dims[0] if dims else 0
        self._block_bytes = sum(
            layer.select(self._block_dim, 0).numel() * layer.element_size() for layer in self._layers
        )
        logger.info(
            "cachet: %d KV layers, each %s (%s), block dim %d: %d bytes a block",
            len(self._layers),
            tuple(t.shape),
            t.dtype,
            self._block_dim,
            self._block_bytes,
        )

    def _block_bytes_of(self, block_id: int) -> memoryview:
        """One vLLM block of every layer, layers in model order: one copy out of the pool."""
        parts = [
            layer.select(self._block_dim, block_id).contiguous().view(-1).view(torch.uint8)
            for layer in self._layers
        ]
        return memoryview(torch.cat(parts).numpy())

    def _write_block(self, block_id: int, data: memoryview) -> None:
        # `data` is the receive buffer itself (writable): viewed, not copied.
        src = torch.frombuffer(data, dtype=torch.uint8)
        off = 0
        for layer in self._layers:
            dst = layer.select(self._block_dim, block_id)
            n = dst.numel() * dst.element_size()
            dst.copy_(src[off : off + n].view(dst.dtype).view(dst.shape))
            off += n

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, CachetMetadata):
            return
        bs = self._block_size
        for work in meta.loads:
            ok = 0
            started = time.perf_counter()
            if work.blocks:
                try:
                    got = self._fabric.get(work.scope, [k for k, _ in work.blocks])
                except FabricError as e:
                    logger.warning("cachet: load failed (%s); recomputing", e)
                    got = []
                for blk, (_, block_id) in zip(got, work.blocks):
                    if len(blk.data) != self._block_bytes or blk.n_tokens != bs:
                        logger.warning(
                            "cachet: block of %d bytes / %d tokens, expected %d / %d; recomputing",
                            len(blk.data),
                            blk.n_tokens,
                            self._block_bytes,
                            bs,
                        )
                        break
                    self._write_block(block_id, blk.data)
                    ok += 1
                failed = [b for _, b in work.blocks[ok:]]
                if failed:
                    logger.warning(
                        "cachet: %d of %d blocks loaded (the rest missing, corrupt or unreachable); "
                        "vLLM recomputes %d",
                        ok,
                        len(work.blocks),
                        len(failed),
                    )
                    self._load_errors.update(failed)
            if work.blocks:
                logger.debug(
                    "cachet: loaded %d of %d blocks (%.1f MB) in %.1f ms",
                    ok,
                    len(work.blocks),
                    ok * self._block_bytes / 1e6,
                    (time.perf_counter() - started) * 1e3,
                )
            try:
                self._fabric.report(work.tag, work.local_tokens, ok * bs, (len(work.blocks) - ok) * bs)
            except FabricError as e:
                logger.warning("cachet: could not report request %s (%s)", work.tag, e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        # Blocks are saved whole (every layer) in wait_for_save, once the step has run.
        return

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, CachetMetadata):
            return
        bs = self._block_size
        for work in meta.saves:
            started = time.perf_counter()
            new = [
                (k, parent, bs, self._block_bytes, lambda b=b: self._block_bytes_of(b))
                for k, parent, b in work.blocks
            ]
            try:
                refused = self._fabric.put(work.scope, work.ttl_ms, work.kind, work.existing, new)
            except FabricError as e:
                logger.warning("cachet: save failed (%s); the prefix stays uncached", e)
                continue
            if refused:
                logger.info("cachet: node refused %d blocks: %s", len(new), refused)
            else:
                logger.debug(
                    "cachet: saved %d blocks (%.1f MB) in %.1f ms",
                    len(new),
                    len(new) * self._block_bytes / 1e6,
                    (time.perf_counter() - started) * 1e3,
                )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        self._fabric.close()
