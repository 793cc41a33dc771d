//! Prometheus metrics of the cache fabric (`cachet_fabric_*`), registered in the default
//! registry. The per-tenant series are removed with `forget_tenant`.

use std::sync::LazyLock;

use cachet_common::metrics::{
    gauge, histogram, int_counter, int_counter_vec, int_gauge, int_gauge_vec,
};
use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

pub static PREFIX_LOOKUPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_prefix_lookups_total",
        "Prefix lookups by result (hit: some prefix was read)",
        &["result"],
    )
});

pub static BLOCK_READS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_block_reads_total",
        "Block reads by result (hit, miss, corrupt)",
        &["result"],
    )
});

pub static EVICTION_STEP: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_fabric_eviction_step",
        "The adaptive eviction policy's current setting: its step on the ladder of horizon factors (0 = LRU; policy::LADDER)",
    )
});

pub static EVICTION_MOVES: LazyLock<IntCounter> = LazyLock::new(|| {
    int_counter(
        "cachet_fabric_eviction_moves_total",
        "Moves of the adaptive eviction policy between horizon factors",
    )
});

pub static BLOCKS_WRITTEN: LazyLock<IntCounter> =
    LazyLock::new(|| int_counter("cachet_fabric_blocks_written_total", "New blocks stored"));

pub static BYTES_WRITTEN: LazyLock<IntCounter> = LazyLock::new(|| {
    int_counter(
        "cachet_fabric_written_bytes_total",
        "Bytes of new blocks stored",
    )
});

pub static WRITES_REFUSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_writes_refused_total",
        "Entry writes the fabric could not hold, by reason",
        &["reason"],
    )
});

pub static EVICTIONS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_evictions_total",
        "Blocks removed, by reason (expired, capacity, quota, corrupt)",
        &["reason"],
    )
});

pub static RECEIVING_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_fabric_receiving_bytes",
        "Bytes of peers' writes being received and stored now (bounded by \
         fabric.receive_budget_bytes)",
    )
});

pub static RESIDENT_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_fabric_resident_bytes",
        "Bytes of KV held in the DRAM tier",
    )
});

pub static TIER_BYTES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    int_gauge_vec(
        "cachet_fabric_tier_bytes",
        "Bytes of KV used and the capacity, by tier (dram; lower: the disk tier under it)",
        &["tier", "state"],
    )
});

pub static RESIDENT_BLOCKS: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_fabric_resident_blocks",
        "Blocks held in the DRAM tier",
    )
});

pub static TENANT_BYTES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    int_gauge_vec(
        "cachet_fabric_tenant_resident_bytes",
        "Bytes of KV held per tenant",
        &["tenant_id"],
    )
});

/// Drop a deleted tenant's series so label cardinality stays bounded.
pub fn forget_tenant(tenant: &str) {
    let _ = TENANT_BYTES.remove_label_values(&[tenant]);
}
pub static TIER_MOVES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_tier_moves_total",
        "Blocks moved between DRAM and the lower (disk) tier: demoted, promoted, read_through, written_through (long holds copied as they are written), and failures",
        &["move"],
    )
});

pub static EVENTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_block_events_total",
        "Block stored/removed events: published (by nodes), dropped (channel full or Redis away), applied (by index followers)",
        &["outcome"],
    )
});

pub static KV_EVENTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_kv_events_total",
        "KV events of the documented stream (instances, media): published, dropped, resyncs (snapshots published); from engines: unmapped (no connector named the block), unreadable, gaps (filled from replay or cleared)",
        &["outcome"],
    )
});

pub static INDEX_STALENESS: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "cachet_fabric_index_staleness_seconds",
        "Prefix index staleness: from a block event on a node to its application in an index",
        &[
            0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
        ],
    )
});

pub static REMOTE_BLOCKS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_remote_blocks_total",
        "Blocks a cluster read asked owners for, by outcome (hit, miss, error, late: \
             not fetched before the recompute deadline)",
        &["outcome"],
    )
});

pub static REPLICA_PUSHES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_replica_pushes_total",
        "Blocks pushed to their owners, by why (write, repair: restoring R after a \
             membership change, drain: handed over on shutdown, hot: an extra replica of a \
             hot block, heal: a block dropped as corrupt fetched again) and outcome",
        &["why", "outcome"],
    )
});

pub static RDMA: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_rdma_total",
        "RDMA pulls by outcome (read: blocks arrived by RDMA READ; fallback: the pull \
             failed and went over TCP; too_large: a block larger than the receive region went over \
             TCP; pool_full: a serving node staged only part of a chain)",
        &["outcome"],
    )
});

pub static RDMA_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    int_counter(
        "cachet_fabric_rdma_read_bytes_total",
        "Block bytes that arrived by RDMA READ",
    )
});

pub static PULL_BYTES_PER_SEC: LazyLock<Gauge> = LazyLock::new(|| {
    gauge(
        "cachet_fabric_pull_bytes_per_second",
        "Measured bandwidth of this node's block pulls from peers (moving average over reads \
         of at least 256 KiB of remote blocks), announced to routing gateways",
    )
});

pub static ARENA_BYTES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    int_gauge_vec(
        "cachet_fabric_arena_bytes",
        "The same-host shared-memory arena: its capacity, bytes allocated (stored, leased or reserved), bytes leased to engines' loads, bytes reserved by engines' saves not yet committed",
        &["state"],
    )
});

pub static LOCAL_OPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    int_counter_vec(
        "cachet_fabric_local_ops_total",
        "Same-host engine operations on the node's Unix socket, by op (lease, release, reserve, commit, abort) and result (ok, refused, corrupt, dropped: undone because the engine went away)",
        &["op", "result"],
    )
});

pub static LOCAL_CONNECTIONS: LazyLock<IntGauge> = LazyLock::new(|| {
    int_gauge(
        "cachet_fabric_local_connections",
        "Engine connections open on the node's Unix socket",
    )
});

pub static ARENA_STAGED_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    int_counter(
        "cachet_fabric_arena_staged_bytes_total",
        "Bytes of blocks copied into the arena for an engine's load (blocks a peer, the disk tier or an in-process engine had put on the heap)",
    )
});
