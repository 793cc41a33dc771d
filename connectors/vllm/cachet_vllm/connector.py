"""`CachetConnector`: vLLM keeps its KV in a Cachet fabric node.

Loaded by vLLM with

    --kv-transfer-config '{"kv_connector": "CachetConnector",
                           "kv_connector_module_path": "cachet_vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"fabric_addr": "127.0.0.1:7400"}}'

and the node's cluster token in the environment (`CACHET_CLUSTER_TOKEN`). Other keys of
`kv_connector_extra_config`: `shared_memory` (default true; false, or the environment's
`CACHET_SHARED_MEMORY=0`, moves KV over TCP even beside the node), `fabric_socket` (the
node's Unix socket; by default the node says where it is), `overlap_loads` (`auto`: loads
through shared memory are copied layer by layer beside the forward pass where the KV is on a
device, before it on the CPU; `true` / `false`; or `CACHET_OVERLAP_LOADS`).

The connector acts only on requests whose `kv_transfer_params` carry a `cachet` object, which
the Cachet gateway sets: the tenant scope, one block key per full vLLM block of the prompt,
the write boundaries (in blocks, with their TTL and kind), a tag that names the request to the
node, and the key space (dtype, layout and block size the keys were computed for). Keys are
Cachet's own (cache-fabric/src/keys.rs): the connector never hashes tokens itself.

Scheduler side: how many leading blocks the node holds (HAS: no TTL refresh), which vLLM
blocks to fill, which newly computed blocks to save once each write boundary is computed; a
preempted request that comes back has its prefix planned for loading again. Worker side:
the data path is `transfer.py` (no vLLM there): the blocks are loaded into the paged KV (from
the node's shared-memory arena when it is on this host: leased before the forward pass and
copied layer by layer beside it, each attention layer waiting for its own; else over TCP
before the forward pass; every crc32c verified once); after it the new blocks of each write
boundary are saved
(reserved in the arena, filled, committed; or PUT over TCP). A block that cannot be loaded
(missing, corrupt, wrong size, node down) is reported through
`get_block_ids_with_load_errors`, so vLLM recomputes it; the node is told (REPORT) how many
tokens the request really did not prefill, which is what the gateway bills as a cache read.
"""

from __future__ import annotations


import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger
from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .fabric import KIND_BEST_EFFORT, KIND_PAID, FabricConnection, FabricError, scope_bytes
from .transfer import KVTransfer, LayoutError, Loaded, PagedKV, PendingLoad

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
    # The load for the current scheduling of the request is planned (reset on preemption).
    reported: bool = False
    # Preempted at least once: loads are planned again on resumption, but the first load's
    # figures are what the node was told (the gateway bills them).
    resumed: bool = False
    # vLLM's own hash of each full block (as its KV events carry it) and the prompt's tokens:
    # what the node's map and vLLM's publisher are told, when KV events are on.
    engine_hashes: list = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


@dataclass
class LoadWork:
    req_id: str
    tag: uuid.UUID
    scope: bytes
    local_tokens: int
    # (key, vLLM block id) in chain order.
    blocks: list[tuple[bytes, int]]
    # Whether the node is told what loaded (a preempted request's reload is not: the gateway
    # bills the first load).
    report: bool = True


@dataclass
class SaveWork:
    req_id: str
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


def _flag(value: Any, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "off", "no")
    return bool(value)


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
        self._addr, self._token = addr, token
        self._shared_memory = _flag(os.environ.get("CACHET_SHARED_MEMORY"), _flag(extra.get("shared_memory"), True))
        self._socket_path = extra.get("fabric_socket") or os.environ.get("CACHET_FABRIC_SOCKET") or None
        # Loads through shared memory copied layer by layer beside the forward pass: by
        # default where the KV is on a device (copy engines beside the compute), not on the CPU.
        overlap = os.environ.get("CACHET_OVERLAP_LOADS") or extra.get("overlap_loads")
        self._overlap_setting = None if overlap in (None, "auto") else _flag(overlap, False)
        self._overlap = False
        # Each load and save logged with its size and speed (the benchmarks read them).
        self._log_transfers = _flag(os.environ.get("CACHET_TRANSFER_LOG"), False)
        self._block_size = vllm_config.cache_config.block_size
        layout = getattr(kv_cache_config, "kv_cache_layout", None) or "LBHNC"
        model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self._space = key_space(
            model_dtype, str(vllm_config.cache_config.cache_dtype), layout, self._block_size
        )
        self._reqs: dict[str, ReqState] = {}
        # vLLM publishes KV events: the node is told vLLM's name of every block it has a key
        # for (MAP), and vLLM's publisher which blocks were loaded from Cachet (take_events).
        events = getattr(vllm_config, "kv_events_config", None)
        self._events = bool(events is not None and getattr(events, "enable_kv_cache_events", False))
        self._loaded_events: dict[str, tuple[ReqState, int, int]] = {}
        # Worker side.
        self._transfer: KVTransfer | None = None
        self._load_errors: set[int] = set()
        # Requests whose load failed in this step: what the step computes for them sits on
        # top of blocks that were never filled, so none of it is saved.
        self._failed_loads: set[str] = set()
        # This step's loads through shared memory, copied layer by layer beside the forward
        # pass: the copier thread, one event a layer, and whether a copy failed.
        self._pending: list[tuple[LoadWork, PendingLoad]] = []
        self._copier: threading.Thread | None = None
        self._layers_copied: list[threading.Event] = []
        self._copy_failed = False
        self._layer_index: dict[str, int] = {}
        logger.info("cachet: connector (%s) on fabric node %s, key space %s", role.name, addr, self._space)

    # ==== scheduler side =====================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        params = Params.parse(request.kv_transfer_params, self._space)
        if params is None:
            return 0, False
        bs = self._block_size
        prompt_len = len(request.prompt_token_ids or [])
        st = self._reqs.get(request.request_id)
        if st is None or not st.reported:
            # New, or asked again because the last step had no room to schedule it.
            first_sight = st is None
            st = ReqState(params, prompt_len, local=num_computed_tokens)
            self._reqs[request.request_id] = st
            if self._events and first_sight:
                self._map_blocks(request, st)
        else:
            # Its load ran, then vLLM preempted it and schedules it again from scratch (its
            # blocks were freed): the prefix is loaded again, planned afresh; what it saved
            # and what the node was told stay.
            st.local, st.resumed, st.reported = num_computed_tokens, True, False
        # vLLM computes at least the prompt's last token itself.
        loadable = min(len(params.keys), (prompt_len - 1) // bs)
        try:
            st.held = self._fabric.leading_held(params.scope, params.keys[:loadable])
        except FabricError as e:
            logger.warning("cachet: lookup failed (%s); computing the prompt", e)
            st.held = 0
        st.planned = max(0, st.held * bs - num_computed_tokens)
        return st.planned, False

    def _map_blocks(self, request: "Request", st: ReqState) -> None:
        """Tell the node vLLM's hash of each full block the request has a Cachet key for,
        before vLLM computes or loads any of them (so its KV events can be translated)."""
        hashes = list(getattr(request, "block_hashes", None) or [])
        n = min(len(hashes), len(st.params.keys))
        if len(hashes) != st.prompt_len // self._block_size:
            # Hashes at another granularity than the connector's blocks: not mapped.
            return
        st.engine_hashes = [maybe_convert_block_hash(h) for h in hashes[:n]]
        st.tokens = list(request.prompt_token_ids or [])
        pairs = [
            (h.to_bytes(8, "big") if isinstance(h, int) else bytes(h), st.params.keys[i])
            for i, h in enumerate(st.engine_hashes)
        ]
        try:
            self._fabric.map_blocks(pairs)
        except FabricError as e:
            logger.warning("cachet: could not tell the node vLLM's block hashes (%s)", e)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is not None:
            st.planned = num_external_tokens
            if not st.resumed:
                st.loaded = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = CachetMetadata()
        bs = self._block_size
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None or st.reported:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_load(new.req_id, st, meta)
            end = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._plan_saves(new.req_id, st, end, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if new_ids is not None:
                if resumed:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            if resumed and not st.reported:
                # A preempted request comes back among the cached requests with new blocks
                # and `num_computed_tokens` counting the tokens this connector promised
                # (scheduler.py: a resumed request's prefix is looked up again): they must
                # be loaded into its new blocks before this step runs, or vLLM attends to
                # blocks nobody filled.
                self._plan_load(req_id, st, meta)
            if st.next_write >= len(st.params.writes):
                continue
            end = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan_saves(req_id, st, end, meta)
        return meta

    def _plan_load(self, req_id: str, st: ReqState, meta: CachetMetadata) -> None:
        """The blocks the node holds past vLLM's own prefix hit, into the request's blocks."""
        bs = self._block_size
        first = st.local // bs
        last = (st.local + st.planned) // bs
        st.load_block_ids = st.block_ids[first:last]
        meta.loads.append(
            LoadWork(
                req_id,
                st.params.tag,
                st.params.scope,
                st.local,
                [(st.params.keys[i], st.block_ids[i]) for i in range(first, last)],
                report=not st.resumed,
            )
        )
        st.reported = True
        if self._events and st.engine_hashes and last > first:
            self._loaded_events[req_id] = (st, first, min(last, len(st.engine_hashes)))

    def _plan_saves(self, req_id: str, st: ReqState, computed_end: int, meta: CachetMetadata) -> None:
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
                    req_id,
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
        bs = self._block_size
        for req_id, st in self._reqs.items():
            for i, b in enumerate(st.load_block_ids):
                if b in bad:
                    loaded = self._loaded_events.get(req_id)
                    if loaded is not None:
                        self._loaded_events[req_id] = (st, loaded[1], loaded[1] + i)
                    if not st.resumed:
                        st.loaded = min(st.loaded, i * bs)
                    # vLLM computes the blocks from this one again: the node lacks them (a
                    # corrupt block was dropped, a missing one is gone), and the worker did
                    # not save what this step computed on top of them; the writes are
                    # planned again from here and save the blocks once they are recomputed.
                    st.held = min(st.held, st.local // bs + i)
                    st.saved_upto = min(st.saved_upto, st.held)
                    st.next_write = 0
                    break

    def take_events(self):
        """The blocks this step loaded from Cachet's fabric, for vLLM's own KV event
        publisher (routers that follow vLLM's events learn the instance reached them): one
        `BlockStored` per request, medium `CACHET_FABRIC` (Cachet's node skips it: it
        publishes its own tiers itself). vLLM's prefix cache then reports the same blocks
        as its own, as for any computed block."""
        loaded, self._loaded_events = self._loaded_events, {}
        bs = self._block_size
        for st, first, last in loaded.values():
            if last <= first:
                continue
            yield BlockStored(
                block_hashes=st.engine_hashes[first:last],
                parent_block_hash=st.engine_hashes[first - 1] if first else None,
                token_ids=st.tokens[first * bs : last * bs],
                block_size=bs,
                lora_id=None,
                medium="CACHET_FABRIC",
                lora_name=None,
            )

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
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        try:
            kv = PagedKV([kv_caches[n] for n in names], num_blocks)
        except LayoutError as e:
            # A clear refusal at start, not wrong bytes later.
            raise RuntimeError(
                f"cachet: vLLM's KV cache (layout {self._space}) cannot be loaded or saved in place: {e}"
            ) from e
        self._transfer = KVTransfer(
            kv, self._addr, self._token, block_tokens=self._block_size,
            shared_memory=self._shared_memory, socket_path=self._socket_path, logger=logger,
        )
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._overlap = self._overlap_setting if self._overlap_setting is not None else kv.device.type != "cpu"
        logger.info(
            "cachet: %s; shared memory %s; loads %s the forward pass",
            kv.describe(), "allowed" if self._shared_memory else "off",
            "overlap" if self._overlap else "precede",
        )

    def _log(self, msg: str, *args) -> None:
        (logger.info if self._log_transfers else logger.debug)(msg, *args)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Start this step's loads. Over TCP a load is done here, and through shared memory
        too where copies and the forward pass share the CPU's cores (measured: overlapping
        them there gains nothing, docs/benchmarks.md). With the KV on a device (or
        `overlap_loads` on), the blocks are leased here and copied layer by layer on a
        thread, beside the forward pass: each attention layer waits for its own layer
        (`wait_for_layer_load`), and the step's end (`wait_for_save`) waits for the
        checksums and settles the loads."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, CachetMetadata) or self._transfer is None:
            return
        for work in meta.loads:
            if not work.blocks:
                self._settle(work, None)
                continue
            started = self._transfer.begin_load(
                work.scope, [k for k, _ in work.blocks], [b for _, b in work.blocks]
            )
            if isinstance(started, PendingLoad) and not self._overlap:
                started.copy_layers(range(self._transfer.kv.layers))
                self._settle(work, started.finish())
            elif isinstance(started, PendingLoad):
                self._pending.append((work, started))
            else:
                self._settle(work, started)
        if self._pending:
            self._layers_copied = [threading.Event() for _ in range(self._transfer.kv.layers)]
            self._copier = threading.Thread(target=self._copy_layers, daemon=True)
            self._copier.start()

    def _copy_layers(self) -> None:
        """The pending loads' copies, one layer at a time in model order, each layer
        signalled as soon as it is in the KV. A failure signals every layer (nothing
        waits forever) and fails the loads."""
        try:
            for l, done in enumerate(self._layers_copied):
                for _, pending in self._pending:
                    pending.copy_layers(range(l, l + 1))
                done.set()
        except BaseException as e:  # the loads are recomputed; nothing may hang the step
            logger.warning("cachet: copying loaded KV failed (%s); recomputing", e)
            self._copy_failed = True
            for done in self._layers_copied:
                done.set()

    def _finish_loads(self) -> None:
        """The step's end: every pending load's copies and checksums done, its lease
        released, its outcome settled."""
        if self._copier is not None:
            self._copier.join()
            self._copier = None
        pending, self._pending = self._pending, []
        failed, self._copy_failed = self._copy_failed, False
        for work, p in pending:
            done = p.finish(copied=not failed)
            done.mode = "shm beside the forward pass (lease to release)"
            self._settle(work, done)
        self._layers_copied = []

    def _settle(self, work: LoadWork, done: "Loaded | None") -> None:
        """A load's outcome: its failed blocks reported to vLLM (recomputed), the node told
        what loaded."""
        bs = self._block_size
        ok = 0
        if work.blocks and done is not None:
            ok = done.blocks
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
                self._failed_loads.add(work.req_id)
            if ok:
                mb = ok * self._transfer.kv.block_bytes / 1e6
                if "beside" not in done.mode:
                    self._log(
                        "cachet: loaded %d blocks (%.1f MB) in %.2f ms over %s (%.2f GB/s)",
                        ok, mb, done.seconds * 1e3, done.mode, mb / 1e3 / max(done.seconds, 1e-9),
                    )
                else:
                    self._log("cachet: loaded %d blocks (%.1f MB) over %s, %.2f ms", ok, mb, done.mode,
                              done.seconds * 1e3)
        if not work.report:
            return
        try:
            load_bytes = ok * self._transfer.kv.block_bytes if done is not None else 0
            self._transfer.report(work.tag, work.local_tokens, ok * bs, (len(work.blocks) - ok) * bs,
                                  load_bytes, done.seconds if done is not None else 0.0)
        except FabricError as e:
            logger.warning("cachet: could not report request %s (%s)", work.tag, e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._layers_copied:
            return
        i = self._layer_index.get(layer_name)
        if i is not None:
            self._layers_copied[i].wait()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        # Blocks are saved whole (every layer) in wait_for_save, once the step has run.
        return

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, CachetMetadata) or self._transfer is None:
            return
        self._finish_loads()
        failed, self._failed_loads = self._failed_loads, set()
        for work in meta.saves:
            if work.req_id in failed:
                logger.info("cachet: not saving %d blocks computed after a failed load; "
                            "they are saved once vLLM computes them again", len(work.blocks))
                continue
            started = time.perf_counter()
            refused = self._transfer.save(work.scope, work.ttl_ms, work.kind, work.existing, work.blocks)
            if refused:
                logger.info("cachet: node did not store %d blocks: %s", len(work.blocks), refused)
            else:
                secs = time.perf_counter() - started
                mb = len(work.blocks) * self._transfer.kv.block_bytes / 1e6
                self._log(
                    "cachet: saved %d blocks (%.1f MB) in %.2f ms over %s (%.2f GB/s)",
                    len(work.blocks), mb, secs * 1e3, self._transfer.mode, mb / 1e3 / max(secs, 1e-9),
                )

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Normally settled by wait_for_save already; not when vLLM defers that (a draft
        # model's forward), and these errors are due now.
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        self._fabric.close()
        if self._transfer is not None:
            self._transfer.close()
