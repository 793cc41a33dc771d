//! The fabric's client API: what the gateway and the engine side use to read and write KV.
//!
//! A client is either *local* (one node in the same process: `cachet serve`) or a cluster
//! member's (`cachet node`): the same calls then read blocks from and write them to their
//! owners through [`crate::cluster::Cluster`]. Callers do not change.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cachet_common::{BlockHash, Scope, TenantId};
use tokio::time::Instant;

use crate::cluster::Cluster;
use crate::keys::{ChainLink, PrefixKeys};
use crate::metrics;
use crate::policy::EvictionPolicy;
use crate::store::{
    EntryKind, FetchedBlock, PutBlock, RemovalReason, Store, StoreLimits, WriteRefused,
};

/// Node configuration.
#[derive(Clone, Copy, Debug)]
pub struct NodeConfig {
    pub dram_capacity_bytes: u64,
    pub eviction: EvictionPolicy,
}

/// One fabric node: the tiers it holds. Cheap to share.
pub struct FabricNode {
    store: Mutex<Store>,
    /// The registered pool peers READ this node's blocks from (feature `rdma`).
    #[cfg(feature = "rdma")]
    rdma: std::sync::OnceLock<Arc<crate::rdma::pull::Export>>,
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
        Arc::new(Self {
            store: Mutex::new(store),
            #[cfg(feature = "rdma")]
            rdma: std::sync::OnceLock::new(),
        })
    }

    /// Serve RDMA reads of this node's blocks from `export` (once; later calls are
    /// ignored). Peers' `RCONNECT` is refused until then, and they read over TCP.
    #[cfg(feature = "rdma")]
    pub fn export_rdma(&self, export: Arc<crate::rdma::pull::Export>) {
        let _ = self.rdma.set(export);
    }

    #[cfg(feature = "rdma")]
    pub(crate) fn rdma_export(&self) -> Option<Arc<crate::rdma::pull::Export>> {
        self.rdma.get().cloned()
    }

    fn dram(config: NodeConfig) -> Store {
        Store::new(StoreLimits {
            capacity_bytes: config.dram_capacity_bytes,
            policy: config.eviction,
        })
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

    /// Direct access for tests and fault injection.
    #[doc(hidden)]
    pub fn with_store<R>(&self, f: impl FnOnce(&mut Store) -> R) -> R {
        f(&mut self.store())
    }
}

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

/// A handle to the fabric. Cloning is cheap.
#[derive(Clone)]
pub struct FabricClient {
    node: Arc<FabricNode>,
    cluster: Option<Arc<Cluster>>,
}

impl FabricClient {
    pub fn local(node: Arc<FabricNode>) -> Self {
        Self {
            node,
            cluster: None,
        }
    }

    /// The client of a cluster member: `cluster`'s node is the local one.
    pub fn clustered(node: Arc<FabricNode>, cluster: Arc<Cluster>) -> Self {
        Self {
            node,
            cluster: Some(cluster),
        }
    }

    /// Read the longest cached prefix of `keys` ending at or before `upto`: at any full-block
    /// boundary, or at any tail offset present in `keys`. Checksums are verified and TTLs
    /// refreshed; a block that fails either stops the prefix there.
    pub async fn read_prefix(
        &self,
        scope: Scope,
        keys: &PrefixKeys,
        upto: usize,
        now: Instant,
    ) -> PrefixRead {
        if let Some(c) = &self.cluster {
            return c.read_prefix(scope, keys, upto, now).await;
        }
        let b = keys.block_size;
        let mut store = self.node.store();
        let max_full = (upto / b).min(keys.blocks.len());
        let full = store.leading_present(&scope, &keys.blocks[..max_full], now);
        let mut best = full * b;
        for tail in keys.tails.iter().rev() {
            if tail.offset <= upto
                && tail.offset > best
                && tail.offset / b <= full
                && store.contains(&scope, &tail.hash, now)
            {
                best = tail.offset;
                break;
            }
        }
        let links = keys.chain_to(best).unwrap_or_default();
        let hashes: Vec<BlockHash> = links.iter().map(|l| l.hash).collect();
        let blocks = store.get_chain(&scope, &hashes, now);
        drop(store);
        PrefixRead::new(links, blocks)
    }

    /// Write the entry ending at `offset`: the blocks of `keys.chain_to(offset)` that are in
    /// `new` are stored, the others must already be stored and get their TTL extended.
    /// `kind` says whether it was paid for (explicit breakpoint) or is best effort.
    #[allow(clippy::too_many_arguments)]
    pub async fn write_entry(
        &self,
        scope: Scope,
        keys: &PrefixKeys,
        offset: usize,
        new: &[PutBlock],
        ttl: Duration,
        now: Instant,
        kind: EntryKind,
    ) -> Result<(), WriteRefused> {
        let links = keys.chain_to(offset).ok_or(WriteRefused::MissingParent)?;
        let mut existing = Vec::new();
        let mut fresh = Vec::new();
        for l in &links {
            match new.iter().find(|b| b.hash == l.hash) {
                Some(b) => fresh.push(b.clone()),
                None => existing.push(l.hash),
            }
        }
        match &self.cluster {
            Some(c) => c.write_entry(scope, &existing, fresh, ttl, now, kind).await,
            None => self
                .node
                .store()
                .put_entry(&scope, &existing, fresh, ttl, now, kind),
        }
    }

    /// Explain a miss at `offset` (the first block of its chain that is not stored).
    pub async fn miss_reason(
        &self,
        scope: Scope,
        keys: &PrefixKeys,
        offset: usize,
        now: Instant,
    ) -> MissReason {
        let Some(links) = keys.chain_to(offset) else {
            return MissReason::NeverWritten;
        };
        let store = self.node.store();
        for l in &links {
            if !store.contains(&scope, &l.hash, now) {
                return store
                    .removal_reason(&l.hash)
                    .map(MissReason::Removed)
                    .unwrap_or(MissReason::NeverWritten);
            }
        }
        MissReason::NeverWritten
    }

    /// Apply a tenant's resident-bytes quota (`None`: unlimited). In a cluster the quota
    /// counts one copy of each block: each node of the tenant's shard group holds at most
    /// `quota × R / G` of the tenant's bytes (copies included), so the cluster holds at most
    /// `R × quota` bytes of the tenant, one copy of each at most `quota` (see
    /// docs/decisions/0009-cluster-roles.md).
    pub async fn set_tenant_quota(&self, tenant: TenantId, bytes: Option<u64>) {
        let bytes = bytes.map(|q| self.per_node_share(tenant, q));
        self.node.store().set_quota(tenant, bytes);
    }

    /// Reserve fabric bytes for a tenant (`None`: none), counted like the quota: one copy
    /// of each block, so each node of a cluster reserves `bytes × R / G`.
    pub async fn set_tenant_reservation(&self, tenant: TenantId, bytes: Option<u64>) {
        let bytes = bytes.map(|b| self.per_node_share(tenant, b));
        self.node.store().set_reservation(tenant, bytes);
    }

    /// Set (or clear) a tenant's replication factor (a cluster member's; ignored by a
    /// single node).
    pub fn set_tenant_replicas(&self, tenant: TenantId, replicas: Option<usize>) {
        if let Some(c) = &self.cluster {
            c.set_tenant_replicas(tenant, replicas);
        }
    }

    /// What `tenant` holds on this node.
    pub fn tenant_stats(&self, tenant: TenantId, top: usize) -> crate::stats::TenantCacheStats {
        self.node.tenant_stats(tenant, top)
    }

    /// Drop every block of `tenant` from this node's tiers.
    pub fn purge_tenant(&self, tenant: TenantId) -> usize {
        self.node.purge_tenant(tenant)
    }

    /// This node's share of a cluster-wide tenant budget (all of it when not clustered).
    fn per_node_share(&self, tenant: TenantId, bytes: u64) -> u64 {
        match &self.cluster {
            Some(c) => {
                let group = c.view().membership.len().min(c.config().group_size).max(1) as u64;
                let r = (c.replicas(tenant) as u64).clamp(1, group);
                bytes.saturating_mul(r) / group
            }
            None => bytes,
        }
    }

    pub async fn tenant_bytes(&self, tenant: TenantId) -> u64 {
        self.node.store().tenant_bytes(tenant)
    }
}
