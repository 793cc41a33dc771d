//! The fabric's client API: what the gateway and the engine side use to read and write KV.
//!
//! A client is either *local* (one node in the same process: `cachet serve`) or a cluster
//! member's (`cachet node`): the same calls then read blocks from and write them to their
//! owners through [`crate::cluster::Cluster`]. Callers do not change.

use std::sync::Arc;
use std::time::Duration;

use cachet_common::{BlockHash, Scope, TenantId};
use tokio::time::Instant;

use crate::cluster::Cluster;
use crate::keys::PrefixKeys;
use crate::node::{FabricNode, MissReason, PrefixRead};
use crate::store::{EntryKind, Holding, PutBlock, Released, WriteRefused};

/// The name a lone node (`cachet serve`) goes by where nodes are named.
pub const LOCAL_NODE: &str = "local";

/// How long blocks pulled for an engine's own connector stay on the pulling node.
pub const STAGED_TTL: Duration = Duration::from_secs(300);

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
        let read = match &self.cluster {
            Some(c) => c.read_prefix(scope, keys, upto, now).await,
            None => self.read_local(scope, keys, upto, now),
        };
        tracing::debug!(tokens = read.tokens, "fabric prefix read");
        read
    }

    fn read_local(&self, scope: Scope, keys: &PrefixKeys, upto: usize, now: Instant) -> PrefixRead {
        let b = keys.block_size;
        let mut store = self.node.store();
        let max_full = (upto / b).min(keys.blocks.len());
        let full = store.leading_present(&scope, &keys.blocks[..max_full], now);
        let mut best = full * b;
        for tail in keys.tails.iter().rev() {
            if tail.offset <= upto
                && tail.offset > best
                && tail.offset / b <= full
                && store.has(&scope, &[tail.hash], now)[0]
            {
                best = tail.offset;
                break;
            }
        }
        let links = keys.chain_to(best).unwrap_or_default();
        let hashes: Vec<BlockHash> = links.iter().map(|l| l.hash).collect();
        let read = store.read_chain(&scope, &hashes, now);
        drop(store);
        // Checksums are verified outside the lock: the store is shared by every request.
        let (blocks, corrupt) = read.verify();
        if let Some(hash) = corrupt {
            self.node.store().drop_corrupt(&hash);
        }
        PrefixRead::new(links, blocks)
    }

    /// How many leading tokens of `keys` (full blocks, ending at or before `upto`) this node
    /// holds, without reading them or refreshing their TTLs: what an engine's own connector
    /// beside the node will find (it reads them itself, which refreshes them).
    pub fn held_prefix(&self, scope: Scope, keys: &PrefixKeys, upto: usize, now: Instant) -> usize {
        let b = keys.block_size;
        let max_full = (upto / b).min(keys.blocks.len());
        self.node
            .store()
            .leading_present(&scope, &keys.blocks[..max_full], now)
            * b
    }

    /// Before an engine's own connector beside this node reads `keys`: the leading full
    /// blocks it will find here (ending at or before `upto`), after pulling, in a cluster,
    /// those this node lacks from their owners into its own tiers (best-effort copies that
    /// live [`STAGED_TTL`]). Nothing is refreshed that the connector does not then read.
    pub async fn stage_prefix(
        &self,
        scope: Scope,
        keys: &PrefixKeys,
        upto: usize,
        now: Instant,
    ) -> usize {
        let b = keys.block_size;
        let full = upto / b * b;
        let local = self.held_prefix(scope, keys, full, now);
        let Some(c) = &self.cluster else {
            return local;
        };
        if local >= full {
            return local;
        }
        let read = c.read_prefix(scope, keys, full, now).await;
        let pulled: Vec<PutBlock> = read
            .links
            .iter()
            .zip(read.blocks)
            .filter(|(l, _)| l.end > local && l.end - l.start == b)
            .map(|(l, blk)| PutBlock::new(blk.hash, l.parent, blk.n_tokens, blk.data))
            .collect();
        if !pulled.is_empty() {
            let n = pulled.len();
            if let Err(e) =
                self.node
                    .store()
                    .put_extra(&scope, pulled, STAGED_TTL, EntryKind::BestEffort, now)
            {
                tracing::warn!(
                    blocks = n,
                    reason = e.as_str(),
                    "could not stage pulled blocks"
                );
            }
        }
        self.held_prefix(scope, keys, full, now)
    }

    /// After an engine's own connector wrote the entry ending at `offset` into this node:
    /// in a cluster, push its blocks to their owners too (as [`FabricClient::write_entry`]
    /// does for blocks the gateway writes), so that any node can serve the prefix. A lone
    /// node has nothing to do.
    pub async fn replicate_written(
        &self,
        scope: Scope,
        keys: &PrefixKeys,
        offset: usize,
        ttl: Duration,
        now: Instant,
        kind: EntryKind,
    ) -> Result<(), WriteRefused> {
        let Some(c) = &self.cluster else {
            return Ok(());
        };
        let links = keys.chain_to(offset).ok_or(WriteRefused::MissingParent)?;
        let hashes: Vec<BlockHash> = links.iter().map(|l| l.hash).collect();
        let blocks = self.node.store().get_chain(&scope, &hashes, now);
        if blocks.len() < links.len() {
            return Err(WriteRefused::MissingParent);
        }
        let fresh = blocks
            .into_iter()
            .zip(&links)
            .map(|(blk, l)| PutBlock::new(blk.hash, l.parent, blk.n_tokens, blk.data))
            .collect();
        c.write_entry(scope, &[], fresh, ttl, now, kind).await
    }

    /// What an engine's own connector reported about request `tag` (waiting up to `wait`
    /// for it; see [`crate::reports`]).
    pub async fn connector_report(
        &self,
        tag: u128,
        wait: Duration,
    ) -> Option<crate::reports::ConnectorReport> {
        self.node.reports().take_within(tag, wait).await
    }

    /// Write the entry ending at `offset`: the blocks of `keys.chain_to(offset)` that are in
    /// `new` are stored, the others must already be stored and get their TTL extended.
    /// `kind` says whether it was paid for (explicit breakpoint) or is best effort.
    pub async fn write_entry(
        &self,
        scope: Scope,
        keys: &PrefixKeys,
        offset: usize,
        new: &[PutBlock],
        holding: Holding,
        now: Instant,
    ) -> Result<(), WriteRefused> {
        let Holding { ttl, kind } = holding;
        let links = keys.chain_to(offset).ok_or(WriteRefused::MissingParent)?;
        let mut existing = Vec::new();
        let mut fresh = Vec::new();
        for l in &links {
            match new.iter().find(|b| b.hash == l.hash) {
                Some(b) => fresh.push(b.clone()),
                None => existing.push(l.hash),
            }
        }
        let blocks = fresh.len();
        let written = match &self.cluster {
            Some(c) => c.write_entry(scope, &existing, fresh, ttl, now, kind).await,
            None => self
                .node
                .store()
                .put_entry(&scope, &existing, fresh, ttl, now, kind),
        };
        tracing::debug!(
            offset,
            new_blocks = blocks,
            refused = written.err().map(|r| r.as_str()),
            "fabric entry written"
        );
        written
    }

    /// Hold blocks already stored (a cache object's, by their hashes) as `holding` says, on
    /// this node and, in a cluster, on their owners: an extension of their hold. Blocks no
    /// longer stored are skipped (a request naming the object computes them again).
    pub async fn hold_blocks(
        &self,
        scope: Scope,
        hashes: &[BlockHash],
        holding: Holding,
    ) -> Result<(), WriteRefused> {
        let Holding { ttl, kind } = holding;
        let now = Instant::now();
        match &self.cluster {
            Some(c) => {
                c.write_entry(scope, hashes, Vec::new(), ttl, now, kind)
                    .await
            }
            None => self
                .node
                .store()
                .put_replica(&scope, hashes, Vec::new(), ttl, now, kind),
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

    /// At start: drop what this node's disk tier kept of `tenant` from before
    /// `before_unix_ms` (a cache purge it missed while it was down).
    pub fn purge_tenant_written_before(&self, tenant: TenantId, before_unix_ms: u64) -> usize {
        self.node
            .purge_tenant_written_before(tenant, before_unix_ms)
    }

    /// Release a deleted cache object's hold on `blocks` in this node's tiers (each with
    /// until when other live objects of the scope hold it, Unix ms): see
    /// [`crate::store::Store::release`]. Every node releases its own (the change feed tells
    /// each one).
    pub fn release(&self, scope: Scope, blocks: &[(BlockHash, Option<u64>)]) -> Released {
        self.node.store().release(&scope, blocks, Instant::now())
    }

    /// This node's name in the cluster (`local` for a lone node).
    pub fn node_id(&self) -> String {
        match &self.cluster {
            Some(c) => c.id().to_string(),
            None => LOCAL_NODE.to_string(),
        }
    }

    /// The nodes this one knows to be live (itself included).
    pub fn live_nodes(&self) -> Vec<String> {
        match &self.cluster {
            Some(c) => {
                let mut ids: Vec<String> = c
                    .view()
                    .membership
                    .members()
                    .iter()
                    .map(|m| m.id.clone())
                    .collect();
                let me = c.id().to_string();
                if !ids.contains(&me) {
                    ids.push(me);
                }
                ids.sort();
                ids
            }
            None => vec![LOCAL_NODE.to_string()],
        }
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
