//! A fabric node's part in the cluster: where blocks belong, reading them from their owners,
//! writing them to their owners, and restoring `R` copies when membership changes.
//!
//! - **View.** [`Cluster::follow_membership`] polls the live node records in Redis
//!   ([`crate::membership`]) and keeps a [`Membership`] with each node's address; every
//!   process computes the same owners from it ([`crate::placement`]).
//! - **Write** ([`Cluster::write_entry`]): the writing node keeps the entry's blocks itself
//!   and pushes each block to its `R` owners (replica writes: an owner holds blocks whose
//!   parents live elsewhere). The entry counts as written once every new block is held by at
//!   least one owner; otherwise the write is refused and not billed.
//! - **Read** ([`Cluster::read_prefix`]): the chain's blocks are taken from the local store
//!   or pulled from an owner, many at once; the owner is chosen by power of two choices on
//!   the pulls in flight to each, the other owners tried if it fails or lacks the block.
//!   Every block is checksum-verified. Whatever has not arrived by a deadline derived from
//!   the cost of recomputing the prompt is recomputed instead: a fabric fault costs latency,
//!   never a failed or wrong answer.
//! - **Repair** ([`Cluster::repair`]): after a membership change each node checks, for the
//!   blocks it holds, that every current owner holds them too (one `HAS` per owner and
//!   scope) and pushes the missing ones: a dead node's blocks get back to `R` copies, a new
//!   node receives the blocks it now owns. [`Cluster::drain`] does the same with this node
//!   left out, before a graceful stop.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use cachet_common::{BlockHash, Scope, TenantId};
use futures::StreamExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::keys::{ChainLink, PrefixKeys};
use crate::membership::{self, NodeRecord};
use crate::metrics;
use crate::node::{FabricNode, PrefixRead};
use crate::placement::{Member, Membership};
use crate::popularity::Popularity;
use crate::store::{EntryKind, FetchedBlock, Handoff, PutBlock, WriteRefused};
use crate::transport::{RemoteEntry, Transport};

/// How a node places, reads and repairs.
#[derive(Clone, Copy, Debug)]
pub struct ClusterConfig {
    /// Nodes in a tenant's shard group (`G`).
    pub group_size: usize,
    /// Owners of each block (`R`).
    pub replicas: usize,
    /// Block pulls in flight per read.
    pub fetch_window: usize,
    /// What recomputing one prompt token costs: a read waits for remote blocks at most
    /// this times the prompt's length (and at least `min_deadline`).
    pub recompute_per_token: Duration,
    pub min_deadline: Duration,
    /// A block this node pulls this many times within `hot_window` is hot: the node keeps
    /// an extra replica of it (so a hot block spreads to every node that reads it, up to the
    /// whole group). Extra replicas are best effort: capacity eviction drops them before any
    /// other block (`Store::put_extra`).
    pub hot_reads: u32,
    pub hot_window: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            group_size: 4,
            replicas: 2,
            fetch_window: 16,
            recompute_per_token: Duration::from_micros(2_500),
            min_deadline: Duration::from_millis(20),
            hot_reads: 3,
            hot_window: Duration::from_secs(60),
        }
    }
}

/// The members this node knows of, with their fabric addresses.
#[derive(Clone, Debug, Default)]
pub struct View {
    pub membership: Membership,
    addrs: HashMap<String, String>,
}

impl View {
    pub fn from_records(records: &[NodeRecord]) -> Self {
        Self {
            membership: Membership::new(
                records
                    .iter()
                    .map(|r| Member::new(r.id.clone(), r.rack.clone()))
                    .collect(),
            ),
            addrs: records
                .iter()
                .map(|r| (r.id.clone(), r.addr.clone()))
                .collect(),
        }
    }

    pub fn addr(&self, id: &str) -> Option<&str> {
        self.addrs.get(id).map(String::as_str)
    }

    fn without(&self, id: &str) -> View {
        let mut v = self.clone();
        v.membership = Membership::new(
            v.membership
                .members()
                .iter()
                .filter(|m| m.id != id)
                .cloned()
                .collect(),
        );
        v.addrs.remove(id);
        v
    }
}

/// What a repair or drain did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Blocks held here that some owner lacked.
    pub missing: usize,
    pub pushed: usize,
    pub failed: usize,
}

/// How this node reaches its peers: with the `rdma` feature, reads go by RDMA READ once
/// [`Cluster::enable_rdma`] is called (TCP otherwise and whenever RDMA fails).
#[cfg(feature = "rdma")]
type Wire = crate::rdma::pull::RdmaTransport;
#[cfg(not(feature = "rdma"))]
type Wire = crate::transport::TcpTransport;

/// Lower-tier bytes a repair or drain reads into memory at a time.
pub const REPAIR_BATCH_BYTES: u64 = 64 << 20;

/// This node's membership in the cluster.
pub struct Cluster {
    me: String,
    local: Arc<FabricNode>,
    transport: Wire,
    config: ClusterConfig,
    view: RwLock<Arc<View>>,
    changes: tokio::sync::watch::Sender<u64>,
    inflight: Mutex<HashMap<String, Arc<AtomicUsize>>>,
    picks: AtomicUsize,
    popularity: Mutex<Popularity<BlockHash, Instant>>,
    /// Tenants whose plan sets their own replication factor (others use `config.replicas`).
    tenant_replicas: RwLock<HashMap<TenantId, usize>>,
    /// Bytes per second of peer pulls, a moving average over reads that pulled enough to say
    /// (announced for the routing gateway's transfer estimate).
    pull_rate: Mutex<Option<f64>>,
}

/// A read that pulled fewer remote bytes than this says nothing reliable about bandwidth.
const PULL_SAMPLE_MIN_BYTES: u64 = 256 << 10;

enum Fetched {
    Hit(FetchedBlock),
    Miss,
}

impl Cluster {
    pub fn new(
        me: impl Into<String>,
        local: Arc<FabricNode>,
        token: impl Into<Arc<str>>,
        config: ClusterConfig,
    ) -> Arc<Self> {
        Arc::new(Self {
            me: me.into(),
            local,
            transport: Wire::new(token),
            config,
            view: RwLock::new(Arc::new(View::default())),
            changes: tokio::sync::watch::channel(0).0,
            inflight: Mutex::new(HashMap::new()),
            picks: AtomicUsize::new(0),
            popularity: Mutex::new(Popularity::default()),
            tenant_replicas: RwLock::new(HashMap::new()),
            pull_rate: Mutex::new(None),
        })
    }

    /// Bytes per second this node has measured pulling blocks from peers (moving average
    /// over reads of at least 256 KiB of remote blocks); `None` until it has.
    pub fn pull_bytes_per_sec(&self) -> Option<f64> {
        *self.pull_rate.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn observe_pull(&self, bytes: u64, took: Duration) {
        if bytes < PULL_SAMPLE_MIN_BYTES || took.is_zero() {
            return;
        }
        let sample = bytes as f64 / took.as_secs_f64();
        let mut rate = self.pull_rate.lock().unwrap_or_else(|p| p.into_inner());
        let next = match *rate {
            Some(r) => r * 0.75 + sample * 0.25,
            None => sample,
        };
        *rate = Some(next);
        metrics::PULL_BYTES_PER_SEC.set(next);
    }

    /// Pull blocks from peers by RDMA READ over `device` (peers that export no pool are
    /// read over TCP).
    #[cfg(feature = "rdma")]
    pub fn enable_rdma(&self, device: Arc<crate::rdma::verbs::Device>) {
        self.transport.enable(device);
    }

    pub fn id(&self) -> &str {
        &self.me
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    pub fn view(&self) -> Arc<View> {
        self.view.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replace the view; returns whether the set of members changed (and if so, tells
    /// [`Cluster::changes`] watchers).
    pub fn set_view(&self, view: View) -> bool {
        let mut cur = self.view.write().unwrap_or_else(|p| p.into_inner());
        let changed =
            cur.membership.members() != view.membership.members() || cur.addrs != view.addrs;
        if changed {
            *cur = Arc::new(view);
            self.changes.send_modify(|n| *n += 1);
            // RDMA connections to the peers are opened now, off any read's path; those to
            // nodes that left are closed.
            #[cfg(feature = "rdma")]
            {
                let peers: Vec<&str> = cur
                    .addrs
                    .iter()
                    .filter(|(id, _)| **id != self.me)
                    .map(|(_, addr)| addr.as_str())
                    .collect();
                self.transport.retain_peers(&peers);
                for addr in peers {
                    self.transport.warm(addr);
                }
            }
        }
        changed
    }

    /// Open an RDMA connection to every peer in the view that has none yet, and wait for
    /// them (tests; a node relies on the background ones [`Cluster::set_view`] starts).
    #[cfg(feature = "rdma")]
    pub async fn connect_rdma(&self) -> Vec<Result<(), String>> {
        let view = self.view();
        let mut out = Vec::new();
        for (id, addr) in &view.addrs {
            if *id != self.me {
                out.push(self.transport.connect_now(addr).await);
            }
        }
        out
    }

    /// Bumped on every membership change.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// How many owners each block of `tenant` has: its own replication factor, else the
    /// cluster's.
    pub fn replicas(&self, tenant: TenantId) -> usize {
        self.tenant_replicas
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&tenant)
            .copied()
            .unwrap_or(self.config.replicas)
    }

    /// Set (or, with `None`, clear) a tenant's replication factor. A change counts as a
    /// membership change: repairs then give its blocks their new owners (an owner no longer
    /// one keeps its copy as an ordinary block until evicted).
    pub fn set_tenant_replicas(&self, tenant: TenantId, replicas: Option<usize>) {
        let changed = {
            let mut m = self
                .tenant_replicas
                .write()
                .unwrap_or_else(|p| p.into_inner());
            match replicas.map(|r| r.max(1)) {
                Some(r) => m.insert(tenant, r) != Some(r),
                None => m.remove(&tenant).is_some(),
            }
        };
        if changed {
            self.changes.send_modify(|n| *n += 1);
        }
    }

    /// The owners of a block (ids), best first.
    pub fn owners(&self, view: &View, tenant: TenantId, hash: &BlockHash) -> Vec<String> {
        view.membership
            .owners(tenant, hash, self.config.group_size, self.replicas(tenant))
            .into_iter()
            .map(|m| m.id.clone())
            .collect()
    }

    /// Keep the view current from Redis until `stop` (polls every `every`; a Redis error
    /// keeps the last view).
    pub async fn follow_membership(
        self: Arc<Self>,
        mut conn: impl redis::aio::ConnectionLike + Send,
        prefix: String,
        every: Duration,
        stop: CancellationToken,
    ) {
        let mut tick = cachet_common::tick::Ticker::new(every, stop);
        while tick.next().await {
            if let Err(e) = self.refresh(&mut conn, &prefix).await {
                tracing::warn!(error = %e, "reading cluster membership failed");
            }
        }
    }

    /// Read the membership once and adopt it.
    pub async fn refresh(
        &self,
        conn: &mut (impl redis::aio::ConnectionLike + Send),
        prefix: &str,
    ) -> redis::RedisResult<()> {
        let records = membership::live_nodes(conn, prefix).await?;
        if self.set_view(View::from_records(&records)) {
            tracing::info!(
                nodes = ?records.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
                "cluster membership changed"
            );
        }
        Ok(())
    }

    fn load(&self, id: &str) -> Arc<AtomicUsize> {
        self.inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    /// Remote owners in the order to try them: the less loaded of two (power of two
    /// choices on pulls in flight from here), then the rest.
    fn candidates(&self, view: &View, tenant: TenantId, hash: &BlockHash) -> Vec<String> {
        let mut owners: Vec<String> = self
            .owners(view, tenant, hash)
            .into_iter()
            .filter(|o| *o != self.me)
            .collect();
        if owners.len() >= 2 {
            let n = owners.len();
            let pick = self.picks.fetch_add(1, Ordering::Relaxed);
            let a = pick % n;
            let b = (a + 1 + (pick / n) % (n - 1)) % n;
            let (la, lb) = (
                self.load(&owners[a]).load(Ordering::Relaxed),
                self.load(&owners[b]).load(Ordering::Relaxed),
            );
            owners.swap(0, if lb < la { b } else { a });
        }
        owners
    }

    /// One block: from the local store, else from an owner. Never an error: a block that
    /// cannot be had is a miss (and is recomputed).
    async fn fetch(&self, view: &View, scope: Scope, hash: BlockHash, now: Instant) -> Fetched {
        self.fetch_counted(view, scope, hash, now, &AtomicU64::new(0))
            .await
    }

    /// [`Cluster::fetch`], adding the bytes of a block pulled from a peer to `remote`.
    async fn fetch_counted(
        &self,
        view: &View,
        scope: Scope,
        hash: BlockHash,
        now: Instant,
        remote: &AtomicU64,
    ) -> Fetched {
        if let Some(b) = self.local.store().get_block(&scope, &hash, now) {
            return Fetched::Hit(b);
        }
        for owner in self.candidates(view, scope.tenant, &hash) {
            let Some(addr) = view.addr(&owner) else {
                continue;
            };
            let load = self.load(&owner);
            load.fetch_add(1, Ordering::Relaxed);
            let got = self.transport.get_block(addr, scope, hash).await;
            load.fetch_sub(1, Ordering::Relaxed);
            match got {
                Ok(Some(b)) => {
                    metrics::REMOTE_BLOCKS.with_label_values(&["hit"]).inc();
                    remote.fetch_add(b.data.len() as u64, Ordering::Relaxed);
                    self.keep_if_hot(scope, &b, now);
                    return Fetched::Hit(b);
                }
                Ok(None) => metrics::REMOTE_BLOCKS.with_label_values(&["miss"]).inc(),
                Err(e) => {
                    metrics::REMOTE_BLOCKS.with_label_values(&["error"]).inc();
                    tracing::warn!(node = %owner, error = %e, "block pull failed; trying another owner");
                }
            }
        }
        Fetched::Miss
    }

    /// Keep an extra, best-effort replica of a block pulled often enough to be hot.
    fn keep_if_hot(&self, scope: Scope, b: &FetchedBlock, now: Instant) {
        let pulls = self
            .popularity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record(b.hash, now, self.config.hot_window);
        if pulls < self.config.hot_reads as f64 {
            return;
        }
        // Its parent may live elsewhere; the replica is found by hash.
        let put = PutBlock::new(b.hash, None, b.n_tokens, b.data.clone());
        let kept = self.local.store().put_extra(
            &scope,
            vec![put],
            self.config.hot_window,
            EntryKind::BestEffort,
            now,
        );
        metrics::REPLICA_PUSHES
            .with_label_values(&["hot", if kept.is_ok() { "ok" } else { "refused" }])
            .inc();
    }

    /// How long a read may wait for remote blocks: about what recomputing them costs.
    fn deadline(&self, start: Instant, tokens: usize) -> Instant {
        start
            + self
                .config
                .min_deadline
                .max(self.config.recompute_per_token * tokens as u32)
    }

    /// The longest prefix of `keys` (ending at or before `upto`) available in the cluster.
    pub async fn read_prefix(
        &self,
        scope: Scope,
        keys: &PrefixKeys,
        upto: usize,
        now: Instant,
    ) -> PrefixRead {
        let b = keys.block_size;
        let max_full = (upto / b).min(keys.blocks.len());
        let full_links = keys.chain_to(max_full * b).unwrap_or_default();
        let deadline = self.deadline(now, upto);
        let view = self.view();
        let mut blocks: Vec<FetchedBlock> = Vec::new();
        let remote = AtomicU64::new(0);
        let pull_started = Instant::now();
        {
            let view = &view;
            let remote = &remote;
            let hashes: Vec<BlockHash> = full_links.iter().map(|l| l.hash).collect();
            let mut pulls = futures::stream::iter(hashes)
                .map(move |h| self.fetch_counted(view, scope, h, now, remote))
                .buffered(self.config.fetch_window.max(1));
            loop {
                match tokio::time::timeout_at(deadline, pulls.next()).await {
                    Ok(Some(Fetched::Hit(block))) => blocks.push(block),
                    Ok(Some(Fetched::Miss)) | Ok(None) => break,
                    Err(_) => {
                        metrics::REMOTE_BLOCKS.with_label_values(&["late"]).inc();
                        tracing::warn!(
                            fetched = blocks.len(),
                            "fabric read past its deadline; recomputing the rest"
                        );
                        break;
                    }
                }
            }
        }
        self.observe_pull(remote.into_inner(), pull_started.elapsed());
        let full = blocks.len();
        let mut links: Vec<ChainLink> = full_links.into_iter().take(full).collect();
        // A tail inside the next block extends the prefix past the last full block.
        for tail in keys.tails.iter().rev() {
            if tail.offset > upto || tail.offset <= full * b || tail.offset / b > full {
                continue;
            }
            if Instant::now() >= deadline {
                break;
            }
            let fetch = self.fetch(&view, scope, tail.hash, now);
            if let Ok(Fetched::Hit(block)) = tokio::time::timeout_at(deadline, fetch).await
                && let Some(link) = keys.chain_to(tail.offset).and_then(|c| c.last().copied())
            {
                links.push(link);
                blocks.push(block);
                break;
            }
        }
        PrefixRead::new(links, blocks)
    }

    /// Write an entry: keep its blocks here and push each to its owners. Succeeds once every
    /// block in `fresh` is held by at least one owner (this node counts when it is one).
    pub async fn write_entry(
        &self,
        scope: Scope,
        existing: &[BlockHash],
        fresh: Vec<PutBlock>,
        ttl: Duration,
        now: Instant,
        kind: EntryKind,
    ) -> Result<(), WriteRefused> {
        let view = self.view();
        // The writer keeps every block; those it does not own are extra replicas, best
        // effort (capacity eviction drops them first), whatever the entry's kind.
        let (owned, extra): (Vec<PutBlock>, Vec<PutBlock>) = fresh.iter().cloned().partition(|b| {
            view.membership.is_empty()
                || self.owners(&view, scope.tenant, &b.hash).contains(&self.me)
        });
        let local = self
            .local
            .store()
            .put_replica(&scope, existing, owned, ttl, now, kind);
        if !extra.is_empty() {
            let _ = self.local.store().put_extra(&scope, extra, ttl, kind, now);
        }
        if view.membership.is_empty() {
            // Not in a cluster view yet (or alone): this node's copy is all there is.
            return local;
        }
        let mut per_owner: HashMap<String, RemoteEntry> = HashMap::new();
        let mut held: HashMap<BlockHash, bool> = HashMap::new();
        let blocks = existing
            .iter()
            .map(|h| (*h, None))
            .chain(fresh.iter().map(|b| (b.hash, Some(b))));
        for (hash, block) in blocks {
            let owners = self.owners(&view, scope.tenant, &hash);
            if block.is_some() {
                held.insert(hash, local.is_ok() && owners.contains(&self.me));
            }
            for owner in owners.into_iter().filter(|o| *o != self.me) {
                let e = per_owner.entry(owner).or_insert_with(|| RemoteEntry {
                    scope,
                    existing: vec![],
                    new: vec![],
                    ttl,
                    kind,
                    replica: true,
                    handoff: false,
                });
                match block {
                    Some(b) => e.new.push(b.clone()),
                    None => e.existing.push(hash),
                }
            }
        }
        let pushes = per_owner.into_iter().map(|(owner, entry)| {
            let view = &view;
            async move {
                let r = match view.addr(&owner) {
                    Some(addr) => self.transport.put_entry(addr, &entry).await,
                    None => Ok(Err(WriteRefused::Unavailable)),
                };
                (owner, entry, r)
            }
        });
        let mut refusal = None;
        for (owner, entry, r) in futures::future::join_all(pushes).await {
            let outcome = match &r {
                Ok(Ok(())) => {
                    for b in &entry.new {
                        held.insert(b.hash, true);
                    }
                    "ok"
                }
                Ok(Err(why)) => {
                    refusal.get_or_insert(*why);
                    "refused"
                }
                Err(e) => {
                    tracing::warn!(node = %owner, error = %e, "pushing blocks to an owner failed");
                    "error"
                }
            };
            if !entry.new.is_empty() {
                metrics::REPLICA_PUSHES
                    .with_label_values(&["write", outcome])
                    .inc_by(entry.new.len() as u64);
            }
        }
        if held.values().all(|h| *h) {
            Ok(())
        } else {
            Err(local.err().or(refusal).unwrap_or(WriteRefused::Unavailable))
        }
    }

    /// Make every owner (under the current view) of every block held here hold it too.
    pub async fn repair(&self) -> RepairReport {
        self.push_to_owners(&self.view(), "repair").await
    }

    /// Hand every block held here to its owners in the cluster without this node (before a
    /// graceful stop, after leaving the membership).
    pub async fn drain(&self) -> RepairReport {
        let view = self.view().without(&self.me);
        self.push_to_owners(&view, "drain").await
    }

    /// Push what this node holds to the owners under `view` that lack it: DRAM blocks in one
    /// go (their bytes are shared), then the lower tier [`REPAIR_BATCH_BYTES`] at a time, so
    /// a repair never holds the whole disk tier in memory.
    async fn push_to_owners(&self, view: &View, why: &'static str) -> RepairReport {
        let held = self.local.store().handoff(Instant::now());
        let mut total = self.push_batch(view, why, held).await;
        let lower = self.local.store().lower_hashes();
        let mut next = 0;
        while next < lower.len() {
            let (batch, used) = self
                .local
                .store()
                .lower_handoff(&lower[next..], REPAIR_BATCH_BYTES);
            next += used.max(1);
            let r = self.push_batch(view, why, batch).await;
            total.missing += r.missing;
            total.pushed += r.pushed;
            total.failed += r.failed;
        }
        if total.missing > 0 {
            tracing::info!(
                why,
                missing = total.missing,
                pushed = total.pushed,
                failed = total.failed,
                "replicas restored"
            );
        }
        total
    }

    async fn push_batch(&self, view: &View, why: &'static str, held: Vec<Handoff>) -> RepairReport {
        let mut per_owner: HashMap<(String, Scope), Vec<Handoff>> = HashMap::new();
        for h in held {
            for owner in self.owners(view, h.scope.tenant, &h.block.hash) {
                if owner != self.me {
                    per_owner
                        .entry((owner, h.scope))
                        .or_default()
                        .push(h.clone());
                }
            }
        }
        let jobs = per_owner
            .into_iter()
            .map(|((owner, scope), blocks)| async move {
                let mut report = RepairReport::default();
                let Some(addr) = view.addr(&owner) else {
                    return report;
                };
                let hashes: Vec<BlockHash> = blocks.iter().map(|h| h.block.hash).collect();
                let present = match self.transport.has(addr, scope, &hashes).await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(node = %owner, error = %e, "owner unreachable during {why}");
                        report.failed = blocks.len();
                        return report;
                    }
                };
                for (h, there) in blocks.into_iter().zip(present) {
                    if there {
                        continue;
                    }
                    report.missing += 1;
                    let entry = RemoteEntry {
                        scope,
                        existing: vec![],
                        new: vec![h.block],
                        ttl: h.remaining.max(Duration::from_secs(1)),
                        kind: h.kind,
                        replica: true,
                        handoff: true,
                    };
                    let outcome = match self.transport.put_entry(addr, &entry).await {
                        Ok(Ok(())) => {
                            report.pushed += 1;
                            "ok"
                        }
                        Ok(Err(_)) => {
                            report.failed += 1;
                            "refused"
                        }
                        Err(_) => {
                            report.failed += 1;
                            "error"
                        }
                    };
                    metrics::REPLICA_PUSHES
                        .with_label_values(&[why, outcome])
                        .inc();
                }
                report
            });
        let mut total = RepairReport::default();
        for r in futures::future::join_all(jobs).await {
            total.missing += r.missing;
            total.pushed += r.pushed;
            total.failed += r.failed;
        }
        total
    }

    /// Fetch again, from another owner, the blocks this node dropped as corrupt and owns: a
    /// corrupt copy would otherwise leave its block one copy short until the next membership
    /// change. Returns how many were restored.
    pub async fn heal(&self) -> usize {
        let damaged = self.local.store().take_damaged();
        if damaged.is_empty() {
            return 0;
        }
        let view = self.view();
        let mut healed = 0;
        for d in damaged {
            if d.remaining.is_zero() {
                continue;
            }
            let owners = self.owners(&view, d.scope.tenant, &d.hash);
            if !owners.contains(&self.me) {
                continue;
            }
            let mut outcome = "unavailable";
            for owner in owners.iter().filter(|o| **o != self.me) {
                let Some(addr) = view.addr(owner) else {
                    continue;
                };
                let Ok(Some(b)) = self.transport.get_block(addr, d.scope, d.hash).await else {
                    continue;
                };
                let put = PutBlock::new(d.hash, d.parent, b.n_tokens, b.data);
                let kept = self.local.store().put_replica(
                    &d.scope,
                    &[],
                    vec![put],
                    d.remaining,
                    Instant::now(),
                    d.kind,
                );
                outcome = if kept.is_ok() {
                    healed += 1;
                    "ok"
                } else {
                    "refused"
                };
                break;
            }
            metrics::REPLICA_PUSHES
                .with_label_values(&["heal", outcome])
                .inc();
            if outcome != "ok" {
                tracing::warn!(block = %d.hash, outcome, "a block dropped as corrupt could not be fetched again");
            }
        }
        healed
    }

    /// Heal (see [`Cluster::heal`]) every `every`, until `stop`.
    pub async fn run_healing(self: Arc<Self>, every: Duration, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            self.heal().await;
        }
    }

    /// Repair after every membership change (and once at start), until `stop`. A repair
    /// that could not reach an owner is retried after `retry`.
    pub async fn run_repairs(self: Arc<Self>, retry: Duration, stop: CancellationToken) {
        let mut changes = self.changes();
        loop {
            let report = self.repair().await;
            let wait = if report.failed > 0 {
                tokio::time::sleep(retry)
            } else {
                tokio::time::sleep(Duration::from_secs(365 * 86_400))
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                r = changes.changed() => if r.is_err() { return },
                _ = wait => {}
            }
        }
    }
}
