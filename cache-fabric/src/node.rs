//! One fabric node: its tiers (the DRAM store over an optional disk or GPU tier) behind a
//! lock, what a prefix read of them found, and (feature `rdma`) the registered pool peers
//! READ its blocks from. The bottom of the fabric's layering: [`crate::transport`] and
//! `rdma` (feature `rdma`) serve peers from a node, [`crate::cluster`] joins nodes over a transport,
//! and [`crate::client`] is the API on top (node ← transport ← cluster ← client).

use std::sync::{Arc, Mutex, MutexGuard};

use cachet_common::TenantId;
use tokio::time::Instant;

use crate::keys::ChainLink;
use crate::metrics;
use crate::policy::EvictionPolicy;
use crate::stats::RemovalReason;
use crate::store::{FetchedBlock, Store, StoreLimits};

/// Peers' writes a node receives at once, by default (`fabric.receive_budget_bytes`).
pub const DEFAULT_RECEIVE_BYTES: u64 = 256 << 20;

/// The receive budget's unit.
const RECEIVE_UNIT: u64 = 64 << 10;

fn units(bytes: u64) -> usize {
    usize::try_from(bytes.div_ceil(RECEIVE_UNIT))
        .unwrap_or(usize::MAX >> 4)
        .min(usize::MAX >> 4)
}

/// A peer's write being received: its share of the receive budget.
pub(crate) struct Receiving<'a> {
    _permit: tokio::sync::SemaphorePermit<'a>,
    bytes: i64,
}

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        metrics::RECEIVING_BYTES.sub(self.bytes);
    }
}

/// Node configuration.
#[derive(Clone, Copy, Debug)]
pub struct NodeConfig {
    pub dram_capacity_bytes: u64,
    pub eviction: EvictionPolicy,
}

/// One fabric node: the tiers it holds. Cheap to share.
pub struct FabricNode {
    store: Mutex<Store>,
    /// Bytes of peers' writes (PUTs) being received at once, in [`RECEIVE_UNIT`]s.
    receive: tokio::sync::Semaphore,
    receive_units: std::sync::atomic::AtomicUsize,
    /// What engines with their own KV connector report about each request's prefill.
    reports: crate::reports::Reports,
    engine_map: Arc<crate::kv_events::EngineMap>,
    /// The registered pool peers READ this node's blocks from (feature `rdma`).
    #[cfg(feature = "rdma")]
    rdma: std::sync::OnceLock<Arc<crate::rdma::Export>>,
    /// The shared-memory arena engines on this host map ([`crate::arena`]), once opened.
    arena: std::sync::OnceLock<crate::arena::Arena>,
    /// Where this node's Unix socket for engines on its host is ([`crate::local`]).
    local_socket: std::sync::OnceLock<std::path::PathBuf>,
}

impl FabricNode {
    pub fn new(config: NodeConfig) -> Arc<Self> {
        Self::wrap(Self::dram(config))
    }

    /// A node whose DRAM tier demotes capacity evictions to a local-disk tier in `dir`
    /// (recovered if it exists) and promotes from it on reads.
    pub fn with_disk(
        config: NodeConfig,
        dir: impl Into<std::path::PathBuf>,
        disk_capacity_bytes: u64,
    ) -> Result<Arc<Self>, crate::tier::TierError> {
        let disk = crate::tier::DiskTier::open(dir, disk_capacity_bytes)?;
        Ok(Self::wrap(
            Self::dram(config).with_lower_tier(Box::new(disk)),
        ))
    }

    /// A node whose DRAM tier demotes to `lower` (any [`crate::tier::TierStore`]: the disk
    /// tier, or GPU memory with the `cuda` feature).
    pub fn with_lower_tier(
        config: NodeConfig,
        lower: Box<dyn crate::tier::TierStore>,
    ) -> Arc<Self> {
        Self::wrap(Self::dram(config).with_lower_tier(lower))
    }

    fn wrap(store: Store) -> Arc<Self> {
        let units = units(DEFAULT_RECEIVE_BYTES);
        Arc::new(Self {
            store: Mutex::new(store),
            receive: tokio::sync::Semaphore::new(units),
            receive_units: std::sync::atomic::AtomicUsize::new(units),
            reports: crate::reports::Reports::default(),
            engine_map: Arc::default(),
            #[cfg(feature = "rdma")]
            rdma: std::sync::OnceLock::new(),
            arena: std::sync::OnceLock::new(),
            local_socket: std::sync::OnceLock::new(),
        })
    }

    /// Open the shared-memory arena engines on this host map, as large as the DRAM tier
    /// (its pages are taken as they are first written); the arena already open if there is
    /// one. Open it before the node stores anything: from then on, what the arena holds
    /// outside the store counts against the DRAM capacity.
    pub fn open_arena(&self) -> std::io::Result<crate::arena::Arena> {
        if let Some(a) = self.arena.get() {
            return Ok(a.clone());
        }
        let mut store = self.store();
        if let Some(a) = self.arena.get() {
            return Ok(a.clone());
        }
        let arena = crate::arena::Arena::new(store.capacity_bytes())?;
        store.set_arena(arena.clone());
        let _ = self.arena.set(arena.clone());
        Ok(arena)
    }

    /// The shared-memory arena, if it is open.
    pub fn arena(&self) -> Option<&crate::arena::Arena> {
        self.arena.get()
    }

    pub(crate) fn set_local_socket(&self, path: std::path::PathBuf) {
        let _ = self.local_socket.set(path);
    }

    /// The Unix socket engines on this host reach the node on, if it serves one.
    pub fn local_socket(&self) -> Option<std::path::PathBuf> {
        self.local_socket.get().cloned()
    }

    /// Serve RDMA reads of this node's blocks from `export` (once; later calls are
    /// ignored). Peers' `RCONNECT` is refused until then, and they read over TCP.
    #[cfg(feature = "rdma")]
    pub fn export_rdma(&self, export: Arc<crate::rdma::Export>) {
        let _ = self.rdma.set(export);
    }

    #[cfg(feature = "rdma")]
    pub(crate) fn rdma_export(&self) -> Option<Arc<crate::rdma::Export>> {
        self.rdma.get().cloned()
    }

    fn dram(config: NodeConfig) -> Store {
        Store::new(StoreLimits {
            capacity_bytes: config.dram_capacity_bytes,
            policy: config.eviction,
        })
    }

    /// Bound the bytes of peers' writes this node receives at once (default
    /// [`DEFAULT_RECEIVE_BYTES`]; set it before the node serves): a PUT waits, reading
    /// nothing more, until its frame fits, so a burst of replica writes cannot grow the
    /// process past its bounds. A frame larger than the whole bound waits for all of it.
    pub fn set_receive_budget(&self, bytes: u64) {
        let new = units(bytes);
        let old = self
            .receive_units
            .swap(new, std::sync::atomic::Ordering::SeqCst);
        if new > old {
            self.receive.add_permits(new - old);
        } else {
            self.receive.forget_permits(old - new);
        }
    }

    /// Room for a peer's write of `bytes` (all of the budget if it is larger), held while
    /// the write is received and stored.
    pub(crate) async fn receiving(&self, bytes: usize) -> Receiving<'_> {
        let total = self.receive_units.load(std::sync::atomic::Ordering::SeqCst);
        let want = units(bytes as u64).clamp(1, total.max(1)) as u32;
        let permit = self
            .receive
            .acquire_many(want)
            .await
            .expect("the node's receive semaphore is never closed");
        let held = bytes as i64;
        metrics::RECEIVING_BYTES.add(held);
        Receiving {
            _permit: permit,
            bytes: held,
        }
    }

    /// Connector reports (see [`crate::reports`]): the transport puts them, the gateway
    /// beside this node takes them.
    pub fn reports(&self) -> &crate::reports::Reports {
        &self.reports
    }

    /// Engines' block hashes → Cachet's keys (see [`crate::kv_events`]): the transport
    /// learns them from connectors (MAP), the engines' event followers translate with them.
    pub fn engine_map(&self) -> &Arc<crate::kv_events::EngineMap> {
        &self.engine_map
    }

    /// Report the blocks this node stores and drops to `sink` (see [`crate::events`]).
    pub fn set_event_sink(&self, sink: crate::events::EventSink) {
        self.store().set_event_sink(sink);
    }

    pub(crate) fn store(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock leaves indexes possibly inconsistent but memory-safe;
        // serving from them is better than failing every later request.
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What `tenant` holds on this node, with its `top` most-read prefixes.
    pub fn tenant_stats(&self, tenant: TenantId, top: usize) -> crate::stats::TenantCacheStats {
        self.store().tenant_stats(tenant, Instant::now(), top)
    }

    /// Drop every block of `tenant` from every tier of this node (its tenant was deleted);
    /// how many blocks went.
    pub fn purge_tenant(&self, tenant: TenantId) -> usize {
        self.store().purge_tenant(tenant)
    }

    /// At start: drop what the disk tier kept of `tenant` from before `before_unix_ms` (a
    /// purge this node missed while it was down).
    pub fn purge_tenant_written_before(&self, tenant: TenantId, before_unix_ms: u64) -> usize {
        self.store()
            .purge_tenant_written_before(tenant, before_unix_ms)
    }

    /// Direct access for tests and fault injection.
    #[doc(hidden)]
    pub fn with_store<R>(&self, f: impl FnOnce(&mut Store) -> R) -> R {
        f(&mut self.store())
    }

    /// Copy long holds to the tier below as they are written ([`Store::write_through`]),
    /// [`WRITE_THROUGH_BATCH`] bytes per hold of the store's lock, off the async threads,
    /// until `stop`.
    pub async fn run_write_through(
        self: Arc<Self>,
        every: std::time::Duration,
        stop: tokio_util::sync::CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.cancelled() => return,
            }
            loop {
                let node = self.clone();
                let written = tokio::task::spawn_blocking(move || {
                    node.with_store(|s| s.write_through(WRITE_THROUGH_BATCH))
                })
                .await
                .unwrap_or(0);
                if written == 0 || stop.is_cancelled() {
                    break;
                }
            }
        }
    }
}

/// Bytes written through to the tier below per hold of the store's lock.
pub const WRITE_THROUGH_BATCH: u64 = 8 << 20;

/// The result of a prefix read.
#[derive(Clone, Debug, Default)]
pub struct PrefixRead {
    /// Tokens covered by `blocks`, from the start of the prompt.
    pub tokens: usize,
    /// The chain read, in order, with the token range each block covers.
    pub links: Vec<ChainLink>,
    pub blocks: Vec<FetchedBlock>,
}

impl PrefixRead {
    /// The read of `blocks` along `links` (links past the last block are dropped), counted in
    /// the lookup metric.
    pub(crate) fn new(mut links: Vec<ChainLink>, blocks: Vec<FetchedBlock>) -> Self {
        links.truncate(blocks.len());
        let tokens = links.last().map(|l| l.end).unwrap_or(0);
        metrics::PREFIX_LOOKUPS
            .with_label_values(&[if tokens > 0 { "hit" } else { "miss" }])
            .inc();
        Self {
            tokens,
            links,
            blocks,
        }
    }
}

/// Why there was no entry at an offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissReason {
    NeverWritten,
    Removed(RemovalReason),
}

impl MissReason {
    pub fn as_str(self) -> &'static str {
        match self {
            MissReason::NeverWritten => "not_cached",
            MissReason::Removed(r) => r.as_str(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> Arc<FabricNode> {
        FabricNode::new(NodeConfig {
            dram_capacity_bytes: 1 << 20,
            eviction: EvictionPolicy::Lru,
        })
    }

    #[tokio::test]
    async fn peers_writes_wait_for_room_in_the_receive_budget() {
        let n = node();
        n.set_receive_budget(256 << 10);
        let first = n.receiving(192 << 10).await;
        // 64 KiB is left: a second 64 KiB write fits, a third waits until the first is stored.
        let second = n.receiving(64 << 10).await;
        let third = n.receiving(100 << 10);
        tokio::pin!(third);
        assert!(futures::poll!(&mut third).is_pending());
        drop(second);
        assert!(
            futures::poll!(&mut third).is_pending(),
            "100 KiB does not fit in the 64 KiB freed"
        );
        drop(first);
        let _third = third.await;
    }

    #[tokio::test]
    async fn a_write_larger_than_the_budget_takes_all_of_it_and_still_goes() {
        let n = node();
        n.set_receive_budget(128 << 10);
        let big = n.receiving(10 << 20).await;
        let small = n.receiving(1);
        tokio::pin!(small);
        assert!(futures::poll!(&mut small).is_pending());
        drop(big);
        let _small = small.await;
        // Raising the budget adds room at once.
        n.set_receive_budget(1 << 20);
        let _more = n.receiving(512 << 10).await;
    }
}
