//! The DRAM tier of one fabric node: blocks with TTLs, per-tenant quotas, checksums and
//! eviction that always takes a chain's tail before its ancestors.
//!
//! Only *leaves* (blocks no stored block points to as its parent) are candidates for
//! eviction, so a child always goes before its parent: a child is useless without it.
//! Every operation touches a whole prefix from the root, so a parent never expires before
//! its children (to within [`EXPIRY_SLACK`]).
//!
//! Eviction order, when room is needed: expired blocks first; then, for a tenant over its
//! quota, that tenant's own leaves (paid or not); then, for node capacity, the leaves of
//! *best-effort* entries (automatic caching) by the [`policy`](crate::policy)'s key: extra
//! copies of blocks other nodes own first, then ordinary leaves, and *popular* leaves last
//! (an owner's copy of a block used at least [`STICKY_USES`] times recently, by the frequency
//! policy's estimate: with the extra copies gone first, it is the block's last replica, and
//! it stays while anything colder can go; it loses that standing once its uses fade). Blocks of
//! *paid* entries (explicit breakpoints, billed as cache writes) are never dropped for another
//! tenant's or entry's capacity: they stay for their TTL unless their own tenant's quota
//! forces them out. When nothing best-effort is left to take, DRAM pressure *demotes* paid
//! leaves to a lower tier that keeps paid blocks until they expire (the disk tier,
//! [`TierStore::keeps_paid`]), least recently used first; a write that still cannot find room
//! is refused (and not billed). A node with no such tier applies a default quota instead:
//! a tenant with no quota of its own holding more than its *fair share* (the capacity split
//! evenly between the tenants resident on the node) gives way, its leaves paid or not, to a
//! tenant writing within its share — so one tenant cannot lock the others out for an hour.
//!
//! Time is `tokio::time::Instant`, passed in by the caller (the request's start time), so
//! TTL behaviour is testable with paused time.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use cachet_common::{BlockHash, BlockMap, BlockSet, Scope, TenantId};
use tokio::time::Instant;

use crate::events::{EventSink, StoreEvent};
use crate::integrity::checksum;
use crate::policy::{EvictionPolicy, Ranking};
pub use crate::stats::RemovalReason;
use crate::tier::{TierBlock, TierStore};
use crate::{metrics, unix_ms};

/// A block offered for storage.
#[derive(Clone, Debug)]
pub struct PutBlock {
    pub hash: BlockHash,
    /// `None` for the first block of a chain.
    pub parent: Option<BlockHash>,
    pub n_tokens: u32,
    pub data: Bytes,
    pub checksum: u32,
}

impl PutBlock {
    pub fn new(hash: BlockHash, parent: Option<BlockHash>, n_tokens: u32, data: Bytes) -> Self {
        let checksum = checksum(&data);
        Self {
            hash,
            parent,
            n_tokens,
            data,
            checksum,
        }
    }
}

/// A block read back, checksum verified.
#[derive(Clone, Debug)]
pub struct FetchedBlock {
    pub hash: BlockHash,
    pub n_tokens: u32,
    pub data: Bytes,
}

/// What an entry write is: it decides what the entry's blocks may be evicted for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// Written at an explicit breakpoint: protected from capacity eviction for its TTL.
    Paid,
    /// Automatic caching: best effort, admitted and evicted by the eviction policy.
    BestEffort,
}

/// Why an entry write was refused; such a write is not billed as one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WriteRefused {
    #[error("tenant cache quota cannot hold the entry")]
    Quota,
    #[error("node capacity cannot hold the entry")]
    Capacity,
    #[error("block checksum mismatch on write")]
    Corrupt,
    #[error("a block's parent is not stored")]
    MissingParent,
    #[error("the entry ranks below every block it would displace")]
    NotAdmitted,
    #[error("a block with this hash is stored for another scope")]
    Conflict,
    #[error("no owner of a block could be reached")]
    Unavailable,
}

impl WriteRefused {
    pub fn as_str(self) -> &'static str {
        match self {
            WriteRefused::Quota => "quota",
            WriteRefused::Capacity => "capacity",
            WriteRefused::Corrupt => "corrupt",
            WriteRefused::MissingParent => "missing_parent",
            WriteRefused::NotAdmitted => "not_admitted",
            WriteRefused::Conflict => "conflict",
            WriteRefused::Unavailable => "unavailable",
        }
    }
}

struct Block {
    scope: Scope,
    parent: Option<BlockHash>,
    n_tokens: u32,
    data: Bytes,
    checksum: u32,
    ttl: Duration,
    expires_at: Instant,
    /// Eviction key (smallest goes first), from the policy at the last use.
    key: u64,
    /// The sequence number of the last use (to rank it again when the policy's setting
    /// moves).
    last_use: u64,
    /// Written or extended by a paid entry: never evicted for capacity.
    paid: bool,
    /// Stored blocks whose parent is this one.
    children: u32,
    /// Written as a replica (see [`Store::put_replica`]): its parent may live on another
    /// node, and its TTL is refreshed by the reads this node serves, not its parent's.
    replica: bool,
    /// An extra copy of a block this node does not own ([`Store::put_extra`]): capacity
    /// eviction takes such leaves before any other.
    extra: bool,
    /// Prefix reads that ended at this block (the tenant's most-read prefixes).
    reads: u32,
}

/// A stored block as [`Store::handoff`] lists it.
#[derive(Clone, Debug)]
pub struct Handoff {
    pub scope: Scope,
    pub block: PutBlock,
    /// Its TTL class, and how much of it is left.
    pub ttl: Duration,
    pub remaining: Duration,
    pub kind: EntryKind,
}

/// A block this node dropped as corrupt: what fetching it again from another owner needs
/// ([`Store::take_damaged`]). Its TTL and kind are the dropped copy's; a block found corrupt
/// in the lower tier, whose record cannot be trusted, is remembered as best effort with the
/// shortest TTL.
#[derive(Clone, Debug)]
pub struct Damaged {
    pub scope: Scope,
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub remaining: Duration,
    pub kind: EntryKind,
}

/// Damaged blocks remembered at most (the oldest are forgotten past this).
const DAMAGED: usize = 4096;

/// Store limits.
#[derive(Clone, Copy, Debug)]
pub struct StoreLimits {
    pub capacity_bytes: u64,
    pub policy: EvictionPolicy,
}

const TOMBSTONES: usize = 65_536;

/// Expiry is tracked to this precision: a refresh that moves a block's expiry by less does
/// not touch the expiry index (at thousands of reads a second of one prefix, almost every
/// refresh is such a move). A block may so live up to this much past its TTL, never less.
pub const EXPIRY_SLACK: Duration = Duration::from_secs(1);

/// Recent uses (the frequency policy's estimate) that make a block popular: its owner copy
/// is the last leaf capacity eviction takes. A block a peer pulls this often gets an extra
/// replica there too (`ClusterConfig::hot_reads` pulls, plus the write).
pub const STICKY_USES: u8 = 4;

/// Store turnovers (uses, in stored blocks; at least 1,024) after which a popular block
/// that has not been used since is an ordinary leaf again.
pub const STICKY_GRACE_TURNS: u64 = 2;

/// Whether a block is popular enough that its owner copy is kept last. Only a policy that
/// weighs frequency at all makes blocks popular: at horizon 0 (LRU, or the adaptive policy
/// where recency serves best) stickiness would keep the parents of trimmed chains, read on
/// every turn of a conversation, ahead of everything newer (docs/benchmarks.md, issue 15).
fn popular(ranking: &Ranking, hash: &BlockHash) -> bool {
    ranking.horizon_factor() > 0.0
        && ranking
            .estimate(hash)
            .is_some_and(|uses| uses >= STICKY_USES)
}

/// The DRAM block store. Not `Sync` by itself: the node wraps it in a mutex.
pub struct Store {
    limits: StoreLimits,
    blocks: BlockMap<Block>,
    used_bytes: u64,
    tenant_bytes: HashMap<TenantId, u64>,
    tenant_quota: HashMap<TenantId, u64>,
    /// Bytes reserved for a tenant: capacity eviction never takes its blocks below this.
    tenant_reserved: HashMap<TenantId, u64>,
    /// Leaves that capacity eviction may take (not paid), by key.
    leaves: BTreeSet<(u64, BlockHash)>,
    /// The subset of `leaves` that are extra copies: taken first.
    extra_leaves: BTreeSet<(u64, BlockHash)>,
    /// The subset of `leaves` that are popular owner copies: taken last.
    sticky_leaves: BTreeSet<(u64, BlockHash)>,
    /// Leaves of paid entries: demoted (never dropped) when nothing else can make room.
    paid_leaves: BTreeSet<(u64, BlockHash)>,
    /// Every leaf of each tenant, by key (quota eviction).
    tenant_leaves: HashMap<TenantId, BTreeSet<(u64, BlockHash)>>,
    ranking: Ranking,
    /// Where capacity evictions go instead of being dropped (the local-disk tier), and
    /// where a miss looks before giving up.
    lower: Option<Box<dyn TierStore>>,
    /// Where block stored / removed events go (to the cluster's index), if anywhere.
    events: Option<EventSink>,
    expiry: BTreeSet<(Instant, BlockHash)>,
    clock: u64,
    tombstones: BlockMap<RemovalReason>,
    tombstone_order: VecDeque<BlockHash>,
    /// For each parent hash that is *not* stored: how many stored blocks name it as parent
    /// (replicas arrive without their parents; a parent arriving later adopts them).
    orphans: BlockMap<u32>,
    /// Blocks dropped as corrupt, for the cluster to fetch again from another owner.
    damaged: VecDeque<Damaged>,
    /// Blocks each tenant lost, by reason (its administrators' cache view).
    removals: HashMap<TenantId, crate::stats::Evictions>,
    /// Reads the lower tier served (promoted, or read through).
    lower_reads: u64,
    /// Blocks still ranked under the adaptive policy's previous setting, re-ranked a batch
    /// at a time ([`REKEY_BATCH`]) so a move never holds the store for long.
    stale_keys: Vec<BlockHash>,
}

/// Blocks re-ranked per store operation after the adaptive policy moves.
const REKEY_BATCH: usize = 1024;

impl Store {
    pub fn new(limits: StoreLimits) -> Self {
        Self {
            limits,
            blocks: BlockMap::default(),
            used_bytes: 0,
            tenant_bytes: HashMap::new(),
            tenant_quota: HashMap::new(),
            tenant_reserved: HashMap::new(),
            leaves: BTreeSet::new(),
            extra_leaves: BTreeSet::new(),
            sticky_leaves: BTreeSet::new(),
            paid_leaves: BTreeSet::new(),
            tenant_leaves: HashMap::new(),
            ranking: Ranking::new(limits.policy),
            lower: None,
            events: None,
            expiry: BTreeSet::new(),
            clock: 0,
            tombstones: BlockMap::default(),
            tombstone_order: VecDeque::new(),
            orphans: BlockMap::default(),
            damaged: VecDeque::new(),
            removals: HashMap::new(),
            lower_reads: 0,
            stale_keys: Vec::new(),
        }
    }

    /// Demote capacity evictions to `tier` (local disk) and promote from it on a read.
    pub fn with_lower_tier(mut self, tier: Box<dyn TierStore>) -> Self {
        self.lower = Some(tier);
        self
    }

    /// Report every block this node starts or stops holding (in any tier) to `sink`.
    pub fn set_event_sink(&mut self, sink: EventSink) {
        self.events = Some(sink);
    }

    fn emit(&self, e: StoreEvent) {
        if let Some(s) = &self.events {
            s.emit(e);
        }
    }

    /// Blocks and bytes held by the lower tier, if there is one.
    pub fn lower_tier_usage(&self) -> Option<(usize, u64)> {
        self.lower.as_ref().map(|t| (t.len(), t.used_bytes()))
    }

    /// Block reads the lower tier has served since the store started.
    pub fn lower_tier_reads(&self) -> u64 {
        self.lower_reads
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }
    pub fn len(&self) -> usize {
        self.blocks.len()
    }
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
    pub fn tenant_bytes(&self, tenant: TenantId) -> u64 {
        self.tenant_bytes.get(&tenant).copied().unwrap_or(0)
    }

    /// Set (or clear, with `None`) a tenant's resident-bytes quota. Lowering it below the
    /// tenant's usage evicts that tenant's own least-recently-used blocks.
    /// Reserve bytes for a tenant (`None` or 0: none): other tenants' writes never evict its
    /// blocks for capacity while it holds no more than this. (Its own quota still applies;
    /// paid entries are never evicted for capacity whatever the reservations.)
    pub fn set_reservation(&mut self, tenant: TenantId, bytes: Option<u64>) {
        match bytes.filter(|b| *b > 0) {
            Some(b) => {
                self.tenant_reserved.insert(tenant, b);
            }
            None => {
                self.tenant_reserved.remove(&tenant);
            }
        }
    }

    /// The tenant that must give way for `writer`'s `incoming` bytes on a full node: the one
    /// holding the most among the *other* tenants over their fair share (the node's capacity
    /// split evenly between the tenants resident on it, the writer included), skipping
    /// tenants whose plan sets a quota, or a reservation that covers what they hold. Only a
    /// writer that stays within its own share after the write may make others give way (a
    /// tenant never loses its paid blocks to its own writes). `None` on a node with one tenant.
    fn over_fair_share(&self, writer: TenantId, incoming: u64) -> Option<TenantId> {
        let mut tenants = self.tenant_bytes.iter().filter(|(_, b)| **b > 0).count();
        if self.tenant_bytes(writer) == 0 {
            tenants += 1;
        }
        let share = self.limits.capacity_bytes / tenants.max(1) as u64;
        if self.tenant_bytes(writer) + incoming > share {
            return None;
        }
        self.tenant_bytes
            .iter()
            .filter(|(t, b)| {
                **t != writer
                    && **b > share
                    && !self.tenant_quota.contains_key(t)
                    && self.tenant_reserved.get(t).is_none_or(|r| *b > r)
            })
            .max_by_key(|(_, b)| **b)
            .map(|(t, _)| *t)
    }

    /// The best-effort leaf capacity eviction takes next: the lowest-ranked one that is not
    /// pinned and whose removal keeps its tenant at or above its reservation.
    /// Extra copies of blocks other nodes own go first, whatever their rank; popular owner
    /// copies go last.
    fn capacity_victim(&self, pinned: &BlockSet) -> Option<(u64, BlockHash)> {
        let takeable =
            |(_, h): &&(u64, BlockHash)| !pinned.contains(h) && self.reservation_allows(h);
        self.extra_leaves
            .iter()
            .find(takeable)
            .or_else(|| {
                self.leaves
                    .iter()
                    .filter(|l| !self.sticky_leaves.contains(l))
                    .find(takeable)
            })
            .or_else(|| self.sticky_leaves.iter().find(takeable))
            .copied()
    }

    /// Whether taking `hash` out of DRAM keeps its tenant at or above its reservation.
    fn reservation_allows(&self, hash: &BlockHash) -> bool {
        self.blocks.get(hash).is_none_or(|b| {
            let t = b.scope.tenant;
            let reserved = self.tenant_reserved.get(&t).copied().unwrap_or(0);
            self.tenant_bytes(t).saturating_sub(b.data.len() as u64) >= reserved
        })
    }

    /// Popular leaves whose uses faded become ordinary again; looks at the few least
    /// recently used ones each time capacity eviction runs, so the check is amortized.
    fn unstick_faded(&mut self) {
        let faded: Vec<(u64, BlockHash)> = self
            .sticky_leaves
            .iter()
            .take(4)
            .filter(|(_, h)| !self.is_sticky(h))
            .copied()
            .collect();
        for l in faded {
            self.sticky_leaves.remove(&l);
        }
    }

    pub fn set_quota(&mut self, tenant: TenantId, quota: Option<u64>) {
        match quota {
            Some(q) => {
                self.tenant_quota.insert(tenant, q);
                let pinned = BlockSet::default();
                while self.tenant_bytes(tenant) > q {
                    if !self.evict_one(Some(tenant), &pinned, RemovalReason::Quota) {
                        break;
                    }
                }
            }
            None => {
                self.tenant_quota.remove(&tenant);
            }
        }
    }

    /// Rank up to `budget` blocks again under the policy's current setting (after the
    /// adaptive policy moved): each as if its last use happened under it, so blocks ranked
    /// under the old setting neither outstay nor undercut the new one.
    fn rekey_some(&mut self, budget: usize) {
        let stored = self.blocks.len();
        for _ in 0..budget {
            let Some(hash) = self.stale_keys.pop() else {
                return;
            };
            let Some(b) = self.blocks.get(&hash) else {
                continue;
            };
            let (old, tenant, leaf, paid, extra) =
                (b.key, b.scope.tenant, b.children == 0, b.paid, b.extra);
            let key = self.ranking.rekey(&hash, b.last_use, stored);
            if key == old {
                continue;
            }
            if leaf {
                self.unset_leaf(tenant, old, hash);
            }
            if let Some(b) = self.blocks.get_mut(&hash) {
                b.key = key;
            }
            if leaf {
                self.set_leaf(tenant, key, hash, paid, extra);
            }
        }
    }

    /// The node's capacity in blocks of the mean size it holds (its capacity in bytes while
    /// it holds none): what the adaptive policy's shadow caches hold.
    fn capacity_blocks(&self) -> usize {
        let cap = self.limits.capacity_bytes;
        let per_block = self
            .used_bytes
            .checked_div(self.blocks.len() as u64)
            .unwrap_or(1);
        usize::try_from(cap / per_block.max(1)).unwrap_or(usize::MAX)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn live<'a>(&'a self, scope: &Scope, hash: &BlockHash, now: Instant) -> Option<&'a Block> {
        self.blocks
            .get(hash)
            .filter(|b| b.scope == *scope && b.expires_at > now)
    }

    /// Whether a live block of this scope is stored.
    pub fn contains(&self, scope: &Scope, hash: &BlockHash, now: Instant) -> bool {
        self.live(scope, hash, now).is_some()
    }

    /// How many leading hashes of `chain` are stored and live (in DRAM, or in the lower
    /// tier, whose expiry and scope are checked when the block is promoted).
    pub fn leading_present(&self, scope: &Scope, chain: &[BlockHash], now: Instant) -> usize {
        chain
            .iter()
            .take_while(|h| {
                self.contains(scope, h, now) || self.lower.as_ref().is_some_and(|t| t.contains(h))
            })
            .count()
    }

    /// Why a block is gone, if it was here recently.
    pub fn removal_reason(&self, hash: &BlockHash) -> Option<RemovalReason> {
        self.tombstones.get(hash).copied()
    }

    /// Read blocks in chain order, verifying each checksum and refreshing each block's TTL
    /// (from `now`, by its own TTL class). Stops at the first block that is missing or
    /// corrupt: a corrupt block is removed and never served.
    pub fn get_chain(
        &mut self,
        scope: &Scope,
        chain: &[BlockHash],
        now: Instant,
    ) -> Vec<FetchedBlock> {
        self.purge_expired(now);
        let capacity = self.capacity_blocks();
        if self.ranking.observe_chain(chain, capacity) {
            self.stale_keys = self.blocks.keys().copied().collect();
        }
        self.rekey_some(REKEY_BATCH);
        let mut out = Vec::with_capacity(chain.len());
        for (i, hash) in chain.iter().enumerate() {
            if self.lower.is_some() && self.live(scope, hash, now).is_none() {
                let parent = i.checked_sub(1).map(|p| chain[p]);
                if let Some(read_through) =
                    self.promote(scope, hash, Some(parent), &chain[..i], now)
                {
                    out.push(read_through);
                    continue;
                }
            }
            let Some(block) = self.live(scope, hash, now) else {
                metrics::BLOCK_READS.with_label_values(&["miss"]).inc();
                break;
            };
            if checksum(&block.data) != block.checksum {
                metrics::BLOCK_READS.with_label_values(&["corrupt"]).inc();
                tracing::error!(block = %hash, "checksum mismatch on read; dropping block");
                self.remove(hash, RemovalReason::Corrupt);
                break;
            }
            let fetched = FetchedBlock {
                hash: *hash,
                n_tokens: block.n_tokens,
                data: block.data.clone(),
            };
            let ttl = block.ttl;
            self.touch(hash, now + ttl, ttl, false);
            out.push(fetched);
        }
        metrics::BLOCK_READS
            .with_label_values(&["hit"])
            .inc_by(out.len() as u64);
        if let Some(last) = out.last()
            && let Some(b) = self.blocks.get_mut(&last.hash)
        {
            b.reads = b.reads.saturating_add(1);
        }
        out
    }

    /// Bring `hash` back from the lower tier into DRAM if it is there, of this scope, not
    /// expired, verified, and continues `parent` (`None`: any parent, a replica read by
    /// hash); making room evicts (and so demotes) other blocks, never one of `pinned`.
    /// When no room can be made (DRAM full of paid blocks, the lower tier too), the block
    /// stays where it is and is returned to be served from there (`Some`, verified).
    fn promote(
        &mut self,
        scope: &Scope,
        hash: &BlockHash,
        parent: Option<Option<BlockHash>>,
        pinned: &[BlockHash],
        now: Instant,
    ) -> Option<FetchedBlock> {
        let tier = self.lower.as_mut()?;
        if !tier.contains(hash) {
            return None;
        }
        let tb = match tier.get(hash) {
            Ok(Some(tb)) => tb,
            Ok(None) => return None,
            Err(e) => {
                tracing::error!(block = %hash, error = %e, "lower tier read failed; block dropped");
                metrics::TIER_MOVES
                    .with_label_values(&["promote_failed"])
                    .inc();
                if matches!(e, crate::tier::TierError::Corrupt(_)) {
                    self.note_damaged(Damaged {
                        scope: *scope,
                        hash: *hash,
                        parent: parent.flatten(),
                        remaining: Duration::from_secs(300),
                        kind: EntryKind::BestEffort,
                    });
                }
                return None;
            }
        };
        let wall = unix_ms();
        if tb.scope != *scope
            || parent.is_some_and(|p| p != tb.parent)
            || tb.expires_unix_ms <= wall
        {
            if tb.expires_unix_ms <= wall {
                tier.remove(hash);
            }
            return None;
        }
        let len = tb.data.len() as u64;
        let mut pinned: BlockSet = pinned.iter().copied().collect();
        pinned.insert(*hash);
        while self.used_bytes + len > self.limits.capacity_bytes {
            if !self.evict_one(None, &pinned, RemovalReason::Capacity) {
                metrics::TIER_MOVES
                    .with_label_values(&["read_through"])
                    .inc();
                self.lower_reads += 1;
                return Some(FetchedBlock {
                    hash: *hash,
                    n_tokens: tb.n_tokens,
                    data: tb.data,
                });
            }
        }
        if let Some(tier) = self.lower.as_mut() {
            tier.remove(hash);
        }
        let remaining = Duration::from_millis(tb.expires_unix_ms - wall);
        let put = PutBlock::new(*hash, tb.parent, tb.n_tokens, tb.data);
        let replica = parent.is_none();
        self.insert(scope, put, tb.ttl, now + remaining, tb.paid, replica, false);
        metrics::TIER_MOVES.with_label_values(&["promoted"]).inc();
        self.lower_reads += 1;
        None
    }

    /// One block by hash, whatever its parent (a replica, or a tail), checksum verified and
    /// TTL refreshed; promoted from the lower tier if it is there. A corrupt block is
    /// dropped and never served.
    pub fn get_block(
        &mut self,
        scope: &Scope,
        hash: &BlockHash,
        now: Instant,
    ) -> Option<FetchedBlock> {
        let (block, crc) = self.get_for_transfer(scope, hash, now)?;
        if checksum(&block.data) != crc {
            metrics::BLOCK_READS.with_label_values(&["corrupt"]).inc();
            tracing::error!(block = %hash, "checksum mismatch on read; dropping block");
            self.remove(hash, RemovalReason::Corrupt);
            return None;
        }
        Some(block)
    }

    /// Which of `hashes` are stored and live for `scope` (in DRAM or the lower tier).
    pub fn has(&self, scope: &Scope, hashes: &[BlockHash], now: Instant) -> Vec<bool> {
        hashes
            .iter()
            .map(|h| {
                self.contains(scope, h, now) || self.lower.as_ref().is_some_and(|t| t.contains(h))
            })
            .collect()
    }

    /// One block with its stored checksum, TTL refreshed, *without* verifying the bytes: for
    /// transfers whose receiver verifies the whole block end to end (a ranged pull cannot be
    /// checked range by range). A receiver that finds a mismatch re-reads through
    /// [`Store::get_chain`], which verifies and drops a block corrupt at rest.
    pub fn get_for_transfer(
        &mut self,
        scope: &Scope,
        hash: &BlockHash,
        now: Instant,
    ) -> Option<(FetchedBlock, u32)> {
        self.purge_expired(now);
        if self.lower.is_some()
            && self.live(scope, hash, now).is_none()
            && let Some(read_through) = self.promote(scope, hash, None, &[], now)
        {
            metrics::BLOCK_READS.with_label_values(&["hit"]).inc();
            let crc = checksum(&read_through.data);
            return Some((read_through, crc));
        }
        let block = self.live(scope, hash, now)?;
        let out = (
            FetchedBlock {
                hash: *hash,
                n_tokens: block.n_tokens,
                data: block.data.clone(),
            },
            block.checksum,
        );
        let ttl = block.ttl;
        self.touch(hash, now + ttl, ttl, false);
        metrics::BLOCK_READS.with_label_values(&["hit"]).inc();
        Some(out)
    }

    /// Every live DRAM block with what a replica write of it needs: for re-replication after
    /// a node failure and for handing blocks over when this node drains. The bytes are
    /// shared, not copied; blocks whose bytes fail their checksum are left out (and dropped).
    /// The lower tier's blocks come in batches from [`Store::lower_handoff`].
    pub fn handoff(&mut self, now: Instant) -> Vec<Handoff> {
        self.purge_expired(now);
        let corrupt: Vec<BlockHash> = self
            .blocks
            .iter()
            .filter(|(_, b)| checksum(&b.data) != b.checksum)
            .map(|(h, _)| *h)
            .collect();
        for h in &corrupt {
            tracing::error!(block = %h, "checksum mismatch found while handing off; dropping block");
            self.remove(h, RemovalReason::Corrupt);
        }
        self.blocks
            .iter()
            .map(|(h, b)| Handoff {
                scope: b.scope,
                block: PutBlock {
                    hash: *h,
                    parent: b.parent,
                    n_tokens: b.n_tokens,
                    data: b.data.clone(),
                    checksum: b.checksum,
                },
                ttl: b.ttl,
                remaining: b.expires_at.saturating_duration_since(now),
                kind: if b.paid {
                    EntryKind::Paid
                } else {
                    EntryKind::BestEffort
                },
            })
            .collect()
    }

    /// The hashes the lower tier holds that DRAM does not (what [`Store::lower_handoff`]
    /// reads, a batch at a time).
    pub fn lower_hashes(&self) -> Vec<BlockHash> {
        self.lower
            .as_ref()
            .map(|t| {
                t.hashes()
                    .into_iter()
                    .filter(|h| !self.blocks.contains_key(h))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Read lower-tier blocks from the front of `hashes` (verified; corrupt ones are dropped
    /// there, expired or vanished ones skipped) until about `budget` bytes are read; returns
    /// them and how many hashes were consumed. Repairs hold one batch in memory at a time,
    /// not the whole tier.
    pub fn lower_handoff(&mut self, hashes: &[BlockHash], budget: u64) -> (Vec<Handoff>, usize) {
        let Some(tier) = self.lower.as_mut() else {
            return (Vec::new(), hashes.len());
        };
        let wall = unix_ms();
        let (mut out, mut bytes, mut used) = (Vec::new(), 0u64, 0usize);
        for h in hashes {
            if bytes >= budget && !out.is_empty() {
                break;
            }
            used += 1;
            match tier.get(h) {
                Ok(Some(tb)) if tb.expires_unix_ms > wall => {
                    bytes += tb.data.len() as u64;
                    out.push(Handoff {
                        scope: tb.scope,
                        block: PutBlock::new(tb.hash, tb.parent, tb.n_tokens, tb.data),
                        ttl: tb.ttl,
                        remaining: Duration::from_millis(tb.expires_unix_ms - wall),
                        kind: if tb.paid {
                            EntryKind::Paid
                        } else {
                            EntryKind::BestEffort
                        },
                    });
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(block = %h, error = %e, "lower tier read failed while handing off")
                }
            }
        }
        (out, used)
    }

    /// Report every block held (DRAM and lower tier) as stored: a node that restarts with
    /// its disk tier re-announces what it still has (events are idempotent).
    pub fn announce_held(&self) {
        let Some(sink) = &self.events else {
            return;
        };
        for h in self.blocks.keys() {
            sink.emit(StoreEvent::Stored(*h));
        }
        if let Some(tier) = &self.lower {
            for h in tier.hashes() {
                sink.emit(StoreEvent::Stored(h));
            }
        }
    }

    /// Store an entry: `existing` blocks (already stored, in chain order) get their TTL
    /// extended, then `new` blocks (in chain order, each one's parent stored or earlier in
    /// `new`) are inserted. Evicts expired blocks, then the tenant's own lowest-ranked leaves
    /// past its quota, then best-effort leaves past the node capacity (see the module
    /// documentation); never a block of this entry. A best-effort entry whose first new block
    /// would rank below the leaf it displaces is not admitted. All or nothing: on refusal no
    /// new block of the entry stays.
    pub fn put_entry(
        &mut self,
        scope: &Scope,
        existing: &[BlockHash],
        new: Vec<PutBlock>,
        ttl: Duration,
        now: Instant,
        kind: EntryKind,
    ) -> Result<(), WriteRefused> {
        self.put(scope, existing, new, ttl, now, kind, false, false)
    }

    /// Store blocks this node holds as one of their owners (cluster placement puts each
    /// block of a chain on its own owners): like [`Store::put_entry`], except that a block's
    /// parent need not be stored here, `existing` blocks that are not stored here are
    /// skipped instead of refusing the write, and each new block is admitted on its own (a
    /// refusal of one keeps the others and reports the first refusal). Eviction still takes
    /// a locally stored chain's tail before its ancestors.
    pub fn put_replica(
        &mut self,
        scope: &Scope,
        existing: &[BlockHash],
        new: Vec<PutBlock>,
        ttl: Duration,
        now: Instant,
        kind: EntryKind,
    ) -> Result<(), WriteRefused> {
        // Blocks an owner holds are independent of each other (their chain may be spread
        // over several nodes), so each is admitted on its own: a large entry is not refused
        // whole because this node's DRAM holds only part of it at once (the rest demotes).
        self.put_each(scope, existing, new, ttl, now, kind, false)
    }

    /// Store extra copies of blocks this node does not own (a writer's own copies, hot
    /// blocks it reads often): replicas, best effort, and the first leaves capacity eviction
    /// takes. An owner's write of the same block later makes it an ordinary one.
    pub fn put_extra(
        &mut self,
        scope: &Scope,
        new: Vec<PutBlock>,
        ttl: Duration,
        now: Instant,
    ) -> Result<(), WriteRefused> {
        self.put_each(scope, &[], new, ttl, now, EntryKind::BestEffort, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn put_each(
        &mut self,
        scope: &Scope,
        existing: &[BlockHash],
        new: Vec<PutBlock>,
        ttl: Duration,
        now: Instant,
        kind: EntryKind,
        extra: bool,
    ) -> Result<(), WriteRefused> {
        let mut result = self.put(scope, existing, Vec::new(), ttl, now, kind, true, extra);
        for b in new {
            if let Err(e) = self.put(scope, &[], vec![b], ttl, now, kind, true, extra) {
                result = result.and(Err(e));
            }
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn put(
        &mut self,
        scope: &Scope,
        existing: &[BlockHash],
        new: Vec<PutBlock>,
        ttl: Duration,
        now: Instant,
        kind: EntryKind,
        replica: bool,
        extra: bool,
    ) -> Result<(), WriteRefused> {
        self.purge_expired(now);
        self.rekey_some(REKEY_BATCH);
        let present: Vec<BlockHash>;
        let existing = if replica {
            present = existing
                .iter()
                .filter(|h| self.contains(scope, h, now))
                .copied()
                .collect();
            &present[..]
        } else {
            existing
        };
        for b in &new {
            if checksum(&b.data) != b.checksum {
                return Err(refused(WriteRefused::Corrupt));
            }
        }
        if existing.iter().any(|h| !self.contains(scope, h, now)) {
            return Err(refused(WriteRefused::MissingParent));
        }
        let pinned: BlockSet = existing
            .iter()
            .chain(new.iter().map(|b| &b.hash))
            .copied()
            .collect();
        let incoming: u64 = new
            .iter()
            .filter(|b| !self.blocks.contains_key(&b.hash))
            .map(|b| b.data.len() as u64)
            .sum();
        let tenant = scope.tenant;
        if let Some(&quota) = self.tenant_quota.get(&tenant) {
            while self.tenant_bytes(tenant) + incoming > quota {
                if !self.evict_one(Some(tenant), &pinned, RemovalReason::Quota) {
                    return Err(refused(WriteRefused::Quota));
                }
            }
        }
        if kind == EntryKind::BestEffort
            && self.ranking.admits_selectively()
            && self.used_bytes + incoming > self.limits.capacity_bytes
            && let Some(first) = new.iter().find(|b| !self.blocks.contains_key(&b.hash))
        {
            let candidate =
                self.ranking
                    .prospective_key(&first.hash, self.clock + 1, self.blocks.len());
            let victim = self.capacity_victim(&pinned);
            if victim.is_some_and(|(key, _)| key > candidate) {
                // Seen, though not stored: the next use of these blocks ranks higher.
                for b in &new {
                    self.ranking.record(&b.hash, self.blocks.len());
                }
                return Err(refused(WriteRefused::NotAdmitted));
            }
        }
        while self.used_bytes + incoming > self.limits.capacity_bytes {
            if self.evict_one(None, &pinned, RemovalReason::Capacity) {
                continue;
            }
            // Nothing best-effort left and no tier below that keeps paid blocks: another
            // tenant holding more than its fair share gives way (its default quota), so one
            // tenant's paid writes cannot lock everyone else out of the node for their TTL.
            // (With such a tier, paid blocks move there instead and keep their TTL.)
            let over = if self.lower.as_ref().is_some_and(|t| t.keeps_paid()) {
                None
            } else {
                self.over_fair_share(tenant, incoming)
            };
            if !over.is_some_and(|t| self.evict_one(Some(t), &pinned, RemovalReason::Quota)) {
                return Err(refused(WriteRefused::Capacity));
            }
        }
        let expires = now + ttl;
        let paid = kind == EntryKind::Paid;
        for h in existing {
            if !extra {
                self.unmark_extra(h);
            }
            self.touch(h, expires, ttl, paid);
        }
        let mut inserted: Vec<BlockHash> = Vec::new();
        for b in new {
            if self.blocks.contains_key(&b.hash) {
                if self.contains(scope, &b.hash, now) {
                    if !extra {
                        self.unmark_extra(&b.hash);
                    }
                    self.touch(&b.hash, expires, ttl, paid);
                    continue;
                }
                // Expired blocks were purged above, so this one is live under another scope.
                // Keys put the scope in the hash's preimage, so only a faulty or hostile
                // peer sends this: refuse, and never touch the other scope's block.
                for h in inserted {
                    self.remove(&h, RemovalReason::Capacity);
                }
                return Err(refused(WriteRefused::Conflict));
            }
            if let Some(p) = &b.parent
                && !replica
                && !self.blocks.contains_key(p)
            {
                for h in inserted {
                    self.remove(&h, RemovalReason::Capacity);
                }
                return Err(refused(WriteRefused::MissingParent));
            }
            inserted.push(b.hash);
            self.insert(scope, b, ttl, expires, paid, replica, extra);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn insert(
        &mut self,
        scope: &Scope,
        b: PutBlock,
        ttl: Duration,
        expires_at: Instant,
        paid: bool,
        replica: bool,
        extra: bool,
    ) {
        let tick = self.tick();
        let key = self.ranking.use_key(&b.hash, tick, self.blocks.len() + 1);
        let len = b.data.len() as u64;
        if let Some(p) = b.parent {
            if let Some(parent) = self.blocks.get_mut(&p) {
                parent.children += 1;
                if parent.children == 1 {
                    let (k, t) = (parent.key, parent.scope.tenant);
                    self.unset_leaf(t, k, p);
                }
            } else {
                *self.orphans.entry(p).or_default() += 1;
            }
        }
        // Children that arrived before it (replicas) make it an inner block at once.
        let children = self.orphans.remove(&b.hash).unwrap_or(0);
        if children == 0 {
            self.set_leaf(scope.tenant, key, b.hash, paid, extra);
        }
        self.expiry.insert((expires_at, b.hash));
        self.used_bytes += len;
        *self.tenant_bytes.entry(scope.tenant).or_default() += len;
        self.tombstones.remove(&b.hash);
        self.blocks.insert(
            b.hash,
            Block {
                scope: *scope,
                parent: b.parent,
                n_tokens: b.n_tokens,
                data: b.data,
                checksum: b.checksum,
                ttl,
                expires_at,
                key,
                last_use: tick,
                paid,
                children,
                replica,
                extra,
                reads: 0,
            },
        );
        metrics::BLOCKS_WRITTEN.inc();
        metrics::BYTES_WRITTEN.inc_by(len);
        self.emit(StoreEvent::Stored(b.hash));
        self.publish_gauges(scope.tenant);
    }

    /// Mark used (a new eviction key); extend expiry to at least `expires_at` (within
    /// [`EXPIRY_SLACK`]) and the TTL class to at least `ttl`; `paid` marks it paid (a paid
    /// block stays paid).
    fn touch(&mut self, hash: &BlockHash, expires_at: Instant, ttl: Duration, paid: bool) {
        let stored = self.blocks.len();
        let Some(b) = self.blocks.get_mut(hash) else {
            return;
        };
        self.clock += 1;
        let key = self.ranking.use_key(hash, self.clock, stored);
        let old_key = b.key;
        b.key = key;
        b.last_use = self.clock;
        b.paid |= paid;
        if b.children == 0 {
            // The leaf sets, updated in place (fields, not methods: `b` is still borrowed).
            self.leaves.remove(&(old_key, *hash));
            self.extra_leaves.remove(&(old_key, *hash));
            self.sticky_leaves.remove(&(old_key, *hash));
            self.paid_leaves.remove(&(old_key, *hash));
            if b.paid {
                self.paid_leaves.insert((key, *hash));
            } else {
                self.leaves.insert((key, *hash));
                if b.extra {
                    self.extra_leaves.insert((key, *hash));
                } else if popular(&self.ranking, hash) {
                    self.sticky_leaves.insert((key, *hash));
                }
            }
            let set = self.tenant_leaves.entry(b.scope.tenant).or_default();
            set.remove(&(old_key, *hash));
            set.insert((key, *hash));
        }
        if expires_at >= b.expires_at + EXPIRY_SLACK || (expires_at > b.expires_at && ttl > b.ttl) {
            self.expiry.remove(&(b.expires_at, *hash));
            self.expiry.insert((expires_at, *hash));
            b.expires_at = expires_at;
        }
        b.ttl = b.ttl.max(ttl);
    }

    /// Evict the lowest-ranked leaf of `tenant` (any leaf), or else of anyone (a leaf that
    /// is not paid), skipping `pinned`.
    fn evict_one(
        &mut self,
        tenant: Option<TenantId>,
        pinned: &BlockSet,
        reason: RemovalReason,
    ) -> bool {
        if tenant.is_none() {
            self.unstick_faded();
        }
        let victim = match tenant {
            Some(t) => self
                .tenant_leaves
                .get(&t)
                .and_then(|s| s.iter().find(|(_, h)| !pinned.contains(h)).copied()),
            None => self.capacity_victim(pinned),
        };
        match victim {
            Some((_, h)) => {
                self.remove(&h, reason);
                true
            }
            None if tenant.is_none() => self.demote_paid(pinned),
            None => false,
        }
    }

    /// Make room by moving the least recently used paid leaf (not pinned, its tenant kept at
    /// its reservation) to a lower tier that keeps it until it expires. Never drops it: if
    /// there is no such tier, or it is full of unexpired paid blocks, nothing happens.
    fn demote_paid(&mut self, pinned: &BlockSet) -> bool {
        if !self.lower.as_ref().is_some_and(|t| t.keeps_paid()) {
            return false;
        }
        let victim = self
            .paid_leaves
            .iter()
            .find(|(_, h)| !pinned.contains(h) && self.reservation_allows(h))
            .copied();
        let Some((_, h)) = victim else {
            return false;
        };
        if !self.demote(&h) {
            return false;
        }
        self.forget(&h, RemovalReason::Capacity, true);
        true
    }

    fn purge_expired(&mut self, now: Instant) {
        while let Some(&(at, h)) = self.expiry.first() {
            if at > now {
                break;
            }
            self.remove(&h, RemovalReason::Expired);
        }
    }

    fn remove(&mut self, hash: &BlockHash, reason: RemovalReason) {
        let demoted = reason == RemovalReason::Capacity && self.demote(hash);
        self.forget(hash, reason, demoted);
    }

    /// Copy a stored block to the lower tier (with its remaining TTL and paid flag); whether
    /// the tier took it.
    fn demote(&mut self, hash: &BlockHash) -> bool {
        let (Some(b), Some(tier)) = (self.blocks.get(hash), self.lower.as_mut()) else {
            return false;
        };
        let remaining = b.expires_at.saturating_duration_since(Instant::now());
        let demoted = TierBlock {
            hash: *hash,
            scope: b.scope,
            parent: b.parent,
            n_tokens: b.n_tokens,
            ttl: b.ttl,
            expires_unix_ms: unix_ms() + remaining.as_millis() as u64,
            paid: b.paid,
            data: b.data.clone(),
        };
        match tier.put(demoted) {
            Ok(()) => {
                metrics::TIER_MOVES.with_label_values(&["demoted"]).inc();
                true
            }
            Err(e) => {
                if matches!(e, crate::tier::TierError::Full { .. }) {
                    tracing::debug!(block = %hash, error = %e, "lower tier full of paid blocks");
                } else {
                    tracing::warn!(block = %hash, error = %e, "demotion to the lower tier failed");
                }
                metrics::TIER_MOVES
                    .with_label_values(&["demote_failed"])
                    .inc();
                false
            }
        }
    }

    fn note_damaged(&mut self, d: Damaged) {
        if self.damaged.len() >= DAMAGED {
            self.damaged.pop_front();
        }
        self.damaged.push_back(d);
    }

    /// The blocks dropped as corrupt since the last call (see [`Damaged`]).
    pub fn take_damaged(&mut self) -> Vec<Damaged> {
        self.damaged.drain(..).collect()
    }

    /// Take a block out of DRAM (`demoted`: it is still held by the lower tier).
    fn forget(&mut self, hash: &BlockHash, reason: RemovalReason, demoted: bool) {
        let Some(b) = self.blocks.remove(hash) else {
            return;
        };
        if reason == RemovalReason::Corrupt {
            self.note_damaged(Damaged {
                scope: b.scope,
                hash: *hash,
                parent: b.parent,
                remaining: b.expires_at.saturating_duration_since(Instant::now()),
                kind: if b.paid {
                    EntryKind::Paid
                } else {
                    EntryKind::BestEffort
                },
            });
        }
        debug_assert!(
            !(b.paid && reason == RemovalReason::Capacity && !demoted),
            "a paid block was dropped for capacity"
        );
        // Still held (on disk) after a demotion; otherwise gone from this node.
        if !demoted {
            self.emit(StoreEvent::Removed(*hash));
        }
        self.expiry.remove(&(b.expires_at, *hash));
        let tenant = b.scope.tenant;
        self.unset_leaf(tenant, b.key, *hash);
        let len = b.data.len() as u64;
        self.used_bytes -= len;
        if let Some(tb) = self.tenant_bytes.get_mut(&tenant) {
            *tb -= len;
        }
        if let Some(p) = b.parent {
            if let Some(parent) = self.blocks.get_mut(&p) {
                parent.children -= 1;
                if parent.children == 0 {
                    let (k, t, paid, extra) =
                        (parent.key, parent.scope.tenant, parent.paid, parent.extra);
                    self.set_leaf(t, k, p, paid, extra);
                }
            } else if let Some(n) = self.orphans.get_mut(&p) {
                *n -= 1;
                if *n == 0 {
                    self.orphans.remove(&p);
                }
            }
        }
        // An inner block removed (expired or corrupt): its children wait for it as orphans.
        if b.children > 0 {
            self.orphans.insert(*hash, b.children);
        }
        if self.tombstone_order.len() >= TOMBSTONES
            && let Some(old) = self.tombstone_order.pop_front()
        {
            self.tombstones.remove(&old);
        }
        self.tombstones.insert(*hash, reason);
        self.tombstone_order.push_back(*hash);
        self.removals
            .entry(tenant)
            .or_default()
            .count(reason, demoted);
        metrics::EVICTIONS
            .with_label_values(&[match reason {
                RemovalReason::Expired => "expired",
                RemovalReason::Capacity => "capacity",
                RemovalReason::Quota => "quota",
                RemovalReason::Corrupt => "corrupt",
                RemovalReason::Purged => "purged",
            }])
            .inc();
        self.publish_gauges(tenant);
    }

    /// What `tenant` holds on this node: bytes per tier, blocks lost by reason, and its `top`
    /// most-read prefixes. Scans the node's blocks once (an administrator's view, not a hot
    /// path).
    pub fn tenant_stats(
        &self,
        tenant: TenantId,
        now: Instant,
        top: usize,
    ) -> crate::stats::TenantCacheStats {
        use crate::stats::{PrefixStat, TenantCacheStats, TierUsage};
        let mut dram = TierUsage {
            tier: "dram".into(),
            ..TierUsage::default()
        };
        let mut read: Vec<(u32, BlockHash)> = Vec::new();
        for (h, b) in self.blocks.iter().filter(|(_, b)| b.scope.tenant == tenant) {
            if b.expires_at <= now {
                continue;
            }
            dram.blocks += 1;
            dram.bytes += b.data.len() as u64;
            if b.reads > 0 {
                read.push((b.reads, *h));
            }
        }
        read.sort_unstable_by(|a, b| b.cmp(a));
        read.truncate(top);
        let top_prefixes = read
            .into_iter()
            .filter_map(|(reads, h)| {
                let b = self.blocks.get(&h)?;
                // The chain back to its first block, as far as this node holds it.
                let (mut tokens, mut bytes, mut at) = (0u64, 0u64, Some(h));
                while let Some(x) = at.and_then(|a| self.blocks.get(&a)) {
                    tokens += u64::from(x.n_tokens);
                    bytes += x.data.len() as u64;
                    at = x.parent;
                }
                Some(PrefixStat::new(
                    &h,
                    tokens,
                    bytes,
                    u64::from(reads),
                    b.expires_at.saturating_duration_since(now),
                    b.ttl,
                    b.paid,
                ))
            })
            .collect();
        let mut tiers = vec![dram];
        if let Some(t) = &self.lower {
            let (blocks, bytes) = t.tenant_usage(tenant);
            tiers.push(TierUsage {
                tier: t.name().to_string(),
                blocks: blocks as u64,
                bytes,
            });
        }
        TenantCacheStats {
            tiers,
            evictions: self.removals.get(&tenant).copied().unwrap_or_default(),
            top_prefixes,
            nodes: 1,
        }
    }

    /// Drop every block of `tenant` from every tier, and forget its quota, reservation and
    /// metrics (its tenant was deleted). Returns how many blocks went.
    pub fn purge_tenant(&mut self, tenant: TenantId) -> usize {
        let hashes: Vec<BlockHash> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.scope.tenant == tenant)
            .map(|(h, _)| *h)
            .collect();
        for h in &hashes {
            self.forget(h, RemovalReason::Purged, false);
        }
        let mut n = hashes.len();
        if let Some(t) = self.lower.as_mut() {
            let gone = t.remove_tenant(tenant);
            n += gone.len();
            for h in gone {
                self.emit(StoreEvent::Removed(h));
            }
        }
        self.tenant_quota.remove(&tenant);
        self.tenant_reserved.remove(&tenant);
        self.tenant_bytes.remove(&tenant);
        self.tenant_leaves.remove(&tenant);
        self.removals.remove(&tenant);
        let _ = metrics::TENANT_BYTES.remove_label_values(&[&tenant.to_string()]);
        n
    }

    fn set_leaf(&mut self, tenant: TenantId, key: u64, hash: BlockHash, paid: bool, extra: bool) {
        if paid {
            self.paid_leaves.insert((key, hash));
        } else {
            self.leaves.insert((key, hash));
            if extra {
                self.extra_leaves.insert((key, hash));
            } else if self.is_sticky(&hash) {
                self.sticky_leaves.insert((key, hash));
            }
        }
        self.tenant_leaves
            .entry(tenant)
            .or_default()
            .insert((key, hash));
    }

    /// An owner wrote this block: it is no longer an extra copy.
    fn unmark_extra(&mut self, hash: &BlockHash) {
        if let Some(b) = self.blocks.get_mut(hash)
            && b.extra
        {
            b.extra = false;
            let key = b.key;
            if self.extra_leaves.remove(&(key, *hash)) && self.is_sticky(hash) {
                self.sticky_leaves.insert((key, *hash));
            }
        }
    }

    /// Whether a stored block is kept last among leaves: popular, and used within the last
    /// two turnovers of the store ([`STICKY_GRACE_TURNS`]). The estimate alone fades too
    /// slowly (its counters halve every ten turnovers): the parent of a finished
    /// conversation, read on every turn, would outstay everything newer.
    fn is_sticky(&self, hash: &BlockHash) -> bool {
        let grace = STICKY_GRACE_TURNS * self.blocks.len().max(1024) as u64;
        popular(&self.ranking, hash)
            && self
                .blocks
                .get(hash)
                .is_some_and(|b| self.clock.saturating_sub(b.last_use) <= grace)
    }

    fn unset_leaf(&mut self, tenant: TenantId, key: u64, hash: BlockHash) {
        self.leaves.remove(&(key, hash));
        self.extra_leaves.remove(&(key, hash));
        self.sticky_leaves.remove(&(key, hash));
        self.paid_leaves.remove(&(key, hash));
        if let Some(set) = self.tenant_leaves.get_mut(&tenant) {
            set.remove(&(key, hash));
        }
    }

    /// The adaptive policy's step on [`crate::policy::LADDER`] and its moves so far
    /// (`None` under a fixed policy).
    pub fn adaptive_state(&self) -> Option<(usize, u64)> {
        self.ranking.adaptive_state()
    }

    /// Test hook: put the adaptive policy at `step`.
    #[doc(hidden)]
    pub fn set_adaptive_step_for_test(&mut self, step: usize) {
        self.ranking.set_adaptive_step_for_test(step);
    }

    /// The eviction policy in force.
    pub fn policy(&self) -> EvictionPolicy {
        self.ranking.policy()
    }

    /// Whether a block is stored as part of a paid entry.
    pub fn is_paid(&self, hash: &BlockHash) -> bool {
        self.blocks.get(hash).is_some_and(|b| b.paid)
    }

    fn publish_gauges(&self, tenant: TenantId) {
        metrics::RESIDENT_BYTES.set(self.used_bytes as i64);
        metrics::RESIDENT_BLOCKS.set(self.blocks.len() as i64);
        metrics::TENANT_BYTES
            .with_label_values(&[&tenant.to_string()])
            .set(self.tenant_bytes(tenant) as i64);
    }

    /// Test hook: flip one bit of a stored block's bytes, as a failing disk or DIMM would.
    #[doc(hidden)]
    pub fn corrupt_for_test(&mut self, hash: &BlockHash) -> bool {
        let Some(b) = self.blocks.get_mut(hash) else {
            return false;
        };
        let mut v = b.data.to_vec();
        if v.is_empty() {
            return false;
        }
        v[0] ^= 1;
        b.data = Bytes::from(v);
        true
    }

    /// Consistency check used by tests: every index agrees with the block map.
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut per_tenant: HashMap<TenantId, u64> = HashMap::new();
        let mut used = 0;
        for (h, b) in &self.blocks {
            used += b.data.len() as u64;
            *per_tenant.entry(b.scope.tenant).or_default() += b.data.len() as u64;
            let children = self
                .blocks
                .values()
                .filter(|c| c.parent == Some(*h))
                .count() as u32;
            assert_eq!(children, b.children, "child count of {h:?}");
            assert_eq!(
                self.leaves.contains(&(b.key, *h)),
                b.children == 0 && !b.paid,
                "evictable leaf set of {h:?}"
            );
            assert_eq!(
                self.tenant_leaves
                    .get(&b.scope.tenant)
                    .is_some_and(|s| s.contains(&(b.key, *h))),
                b.children == 0,
                "tenant leaf set of {h:?}"
            );
            if let Some(p) = b.parent.and_then(|p| self.blocks.get(&p))
                && !b.replica
            {
                assert!(!b.paid || p.paid, "a paid block's parent is paid");
            }
            assert!(self.expiry.contains(&(b.expires_at, *h)));
            if let Some(p) = b.parent.and_then(|p| self.blocks.get(&p))
                && !b.replica
            {
                // Within the expiry slack; an orphaned child is unreachable and expires within it.
                assert!(
                    p.expires_at + EXPIRY_SLACK >= b.expires_at,
                    "parent outlives child"
                );
            }
        }
        assert_eq!(used, self.used_bytes);
        let mut orphans: BlockMap<u32> = BlockMap::default();
        for b in self.blocks.values() {
            if let Some(p) = b.parent.filter(|p| !self.blocks.contains_key(p)) {
                *orphans.entry(p).or_default() += 1;
            }
        }
        assert_eq!(orphans, self.orphans, "orphan counts");
        let extra: BTreeSet<(u64, BlockHash)> = self
            .leaves
            .iter()
            .filter(|(_, h)| self.blocks.get(h).is_some_and(|b| b.extra))
            .copied()
            .collect();
        assert_eq!(extra, self.extra_leaves, "extra leaves");
        let paid: BTreeSet<(u64, BlockHash)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.children == 0 && b.paid)
            .map(|(h, b)| (b.key, *h))
            .collect();
        assert_eq!(paid, self.paid_leaves, "paid leaves");
        for l in &self.sticky_leaves {
            assert!(
                self.leaves.contains(l),
                "a sticky leaf is an evictable leaf"
            );
            assert!(
                !self.extra_leaves.contains(l),
                "an extra copy is never sticky"
            );
        }
        assert_eq!(
            self.leaves.len(),
            self.blocks
                .values()
                .filter(|b| b.children == 0 && !b.paid)
                .count()
        );
        for (t, bytes) in per_tenant {
            assert_eq!(self.tenant_bytes(t), bytes);
        }
    }
}

fn refused(r: WriteRefused) -> WriteRefused {
    metrics::WRITES_REFUSED
        .with_label_values(&[r.as_str()])
        .inc();
    r
}
