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
//! copies of blocks other nodes own first (any of them, not only leaves: an owner holds the
//! block, so a gap here costs a pull, never a hit), then ordinary leaves, and *popular*
//! leaves last (an owner's copy of a block used at least [`STICKY_USES`] times recently, by the frequency
//! policy's estimate: with the extra copies gone first, it is the block's last replica, and
//! it stays while anything colder can go; it loses that standing once its uses fade). Blocks of
//! *paid* entries (explicit breakpoints, billed as cache writes) are never dropped for another
//! tenant's or entry's capacity: they stay for their TTL unless their own tenant's quota
//! forces them out. When nothing best-effort is left to take, DRAM pressure *demotes* paid
//! leaves to a lower tier that keeps paid blocks until they expire (the disk tier,
//! [`TierStore::keeps_paid`]), least recently used first; a write that still cannot find room
//! is refused (and not billed) unless a default quota applies: a tenant with no quota of its
//! own holding more than its *fair share* (the capacity split evenly between the tenants
//! resident on the node; with a tier below that keeps paid blocks, the capacity of DRAM and
//! that tier together) gives way, its blocks paid or not, to a tenant writing within its
//! share — so one tenant cannot lock the others out for an hour, or a day.
//!
//! Time is `tokio::time::Instant`, passed in by the caller (the request's start time), so
//! TTL behaviour is testable with paused time.

//!
//! The store splits along its seams: `eviction` (what leaves when room is needed, under
//! the [`policy`](crate::policy)), `entries` (blocks in and out, the leaf sets, expiry,
//! stats), `tiers` (demotion and promotion with the tier below, handoff); this file holds
//! the types and the read and write API.

mod arena;
mod entries;
mod eviction;
mod tiers;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use cachet_common::{BlockHash, BlockMap, BlockSet, Scope, TenantId};
use tokio::time::Instant;

use crate::events::{EventSink, StoreEvent};
use crate::integrity::checksum;
use crate::kv_events::Medium;
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

/// Blocks read by [`Store::read_chain`], their checksums not yet verified.
#[must_use = "verify the blocks before using them"]
pub struct ChainRead {
    /// Each block with the checksum to verify (`None`: verified as the lower tier read it).
    blocks: Vec<(FetchedBlock, Option<u32>)>,
}

impl ChainRead {
    /// The blocks up to the first whose bytes fail their checksum, and that block's hash:
    /// the caller drops it from the store ([`Store::drop_corrupt`]). Corrupt bytes are never
    /// returned.
    pub fn verify(self) -> (Vec<FetchedBlock>, Option<BlockHash>) {
        let (blocks, corrupt) = self.checked();
        (blocks.into_iter().map(|(b, _)| b).collect(), corrupt)
    }

    /// [`ChainRead::verify`], each block with its verified checksum (what a peer is sent,
    /// so that serving a block costs one pass over its bytes, not two).
    pub fn verify_with_checksums(self) -> (Vec<(FetchedBlock, u32)>, Option<BlockHash>) {
        let (blocks, corrupt) = self.checked();
        let with = blocks
            .into_iter()
            .map(|(b, crc)| {
                let crc = crc.unwrap_or_else(|| checksum(&b.data));
                (b, crc)
            })
            .collect();
        (with, corrupt)
    }

    /// The blocks unverified, each with the checksum its reader verifies as it copies the
    /// bytes (an engine on the node's host reading them in the shared-memory arena: one
    /// pass over the bytes on their way to it, not two). A block the lower tier verified as
    /// it read it has its checksum computed here.
    pub fn for_reader(self) -> Vec<(FetchedBlock, u32)> {
        metrics::BLOCK_READS
            .with_label_values(&["hit"])
            .inc_by(self.blocks.len() as u64);
        self.blocks
            .into_iter()
            .map(|(b, crc)| {
                let crc = crc.unwrap_or_else(|| checksum(&b.data));
                (b, crc)
            })
            .collect()
    }

    /// The blocks up to the first corrupt one, each with its checksum (`None` for those the
    /// lower tier verified as it read them), and the corrupt one's hash.
    fn checked(self) -> (Vec<(FetchedBlock, Option<u32>)>, Option<BlockHash>) {
        let mut out = Vec::with_capacity(self.blocks.len());
        let mut corrupt = None;
        for (block, crc) in self.blocks {
            if crc.is_some_and(|c| checksum(&block.data) != c) {
                metrics::BLOCK_READS.with_label_values(&["corrupt"]).inc();
                corrupt = Some(block.hash);
                break;
            }
            out.push((block, crc));
        }
        metrics::BLOCK_READS
            .with_label_values(&["hit"])
            .inc_by(out.len() as u64);
        (out, corrupt)
    }
}

/// Which copy of its blocks a write stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Copy {
    /// An entry written here: every block's parent must be stored here too.
    Own,
    /// An owner's replica ([`Store::put_replica`]): parents may live on another node.
    Replica,
    /// An extra copy of blocks this node does not own ([`Store::put_extra`]): a replica that
    /// capacity eviction takes first.
    Extra,
}

/// How an entry's blocks are held: for how long, of which kind, as which copy.
#[derive(Clone, Copy, Debug)]
struct Terms {
    ttl: Duration,
    kind: EntryKind,
    copy: Copy,
    checksums: Checksums,
    /// Whether the write holds its blocks as an entry (a breakpoint's, a read's), which a
    /// deleted object's release leaves in place: every write but an object's, and an extra
    /// copy of an object's blocks (best effort as it is, its hold is still the object's).
    shared: bool,
}

impl Terms {
    /// A write whose checksums came with it (verified under the lock).
    fn sent(ttl: Duration, kind: EntryKind, copy: Copy) -> Self {
        let checksums = Checksums::Verify;
        Terms {
            ttl,
            kind,
            copy,
            checksums,
            shared: kind != EntryKind::Object,
        }
    }
}

/// Whether a write's checksums are checked against its bytes under the store's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Checksums {
    /// Sent by the writer: verified before anything is stored.
    Verify,
    /// Computed from these very bytes by the caller, outside the lock (a committed
    /// reservation in the arena, [`Store::commit_reserved`]).
    Computed,
}

/// How long an entry's blocks are held and of which kind (an entry write's terms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holding {
    /// From the write (or a read), refreshed by every read.
    pub ttl: Duration,
    pub kind: EntryKind,
}

/// What an entry write is: it decides what the entry's blocks may be evicted for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// Written at an explicit breakpoint: protected from capacity eviction for its TTL.
    Paid,
    /// Automatic caching: best effort, admitted and evicted by the eviction policy.
    BestEffort,
    /// A cache object's hold: paid, kept until the object's expiry, never refreshed by
    /// reads, and released when the object is deleted ([`Store::release`]). The other
    /// holds of its blocks (entries written at breakpoints, reads) are kept apart, so a
    /// release brings each block back to what they alone need.
    Object,
}

impl EntryKind {
    /// Whether blocks held so are kept from capacity eviction for their TTL.
    pub fn is_paid(self) -> bool {
        self != EntryKind::BestEffort
    }
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

/// A refused write is a cache result (`quota`, `capacity`, …), not a failed request; where a
/// caller must answer with it (an entry it was asked to hold), the code says whose it is.
impl cachet_common::error::ServiceError for WriteRefused {
    fn error_code(&self) -> cachet_common::error::ErrorCode {
        use cachet_common::error::ErrorCode;
        match self {
            WriteRefused::Quota => ErrorCode::RateLimit,
            WriteRefused::Capacity | WriteRefused::NotAdmitted | WriteRefused::Unavailable => {
                ErrorCode::Overloaded
            }
            WriteRefused::MissingParent => ErrorCode::Conflict,
            WriteRefused::Corrupt | WriteRefused::Conflict => ErrorCode::Api,
        }
    }
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
    /// The holds other than cache objects' ([`EntryKind::Object`]): what deleting an
    /// object brings the block back to.
    shared: Shared,
}

/// The holds of a block other than cache objects': their longest TTL class (reads refresh
/// by it) and until when they keep the block (`expires_at` is the later of this and the
/// objects' holds).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shared {
    pub ttl: Duration,
    pub until: Instant,
}

impl Shared {
    /// The shared part of a write held for `ttl` until `expires`: none for an object's hold
    /// (`shared` false, [`Terms::shared`]).
    fn of(shared: bool, ttl: Duration, expires: Instant, now: Instant) -> Self {
        if shared {
            Shared {
                ttl,
                until: expires,
            }
        } else {
            Shared {
                ttl: Duration::ZERO,
                until: now,
            }
        }
    }
}

/// What releasing a deleted cache object's blocks did on one node ([`Store::release`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Blocks (and their bytes) dropped from every tier: nothing else held them.
    pub blocks_freed: u64,
    pub bytes_freed: u64,
    /// Blocks (and bytes) still held by other entries of the scope, now only as long as
    /// those need.
    pub blocks_held: u64,
    pub bytes_held: u64,
}

impl std::ops::AddAssign for Released {
    fn add_assign(&mut self, o: Self) {
        self.blocks_freed += o.blocks_freed;
        self.bytes_freed += o.bytes_freed;
        self.blocks_held += o.blocks_held;
        self.bytes_held += o.bytes_held;
    }
}

impl Block {
    /// The kind of hold a copy of this block elsewhere gets (a handoff, a damaged block
    /// fetched again): a cache object's when an object's hold outlasts the others (a
    /// release there then drops it whole), else the entries'.
    fn kind(&self) -> EntryKind {
        if !self.paid {
            EntryKind::BestEffort
        } else if self.expires_at > self.shared.until + EXPIRY_SLACK {
            EntryKind::Object
        } else {
            EntryKind::Paid
        }
    }
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
/// every turn of a conversation, ahead of everything newer (docs/benchmarks.md, "The
/// adaptive policy").
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
    /// Extra copies of blocks other nodes own (not paid), leaves or not, by key: capacity
    /// eviction takes them first, wherever they sit in a chain. Their owners hold the chain,
    /// and a read here pulls a block it lacks from them; an extra copy kept only because an
    /// owned block under it was still wanted would hold capacity that a whole chain's
    /// worth of owned blocks could use.
    extras: BTreeSet<(u64, BlockHash)>,
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
    /// Blocks of long holds to copy to the tier below while they stay in DRAM
    /// ([`Store::write_through`]), in the order written, each once.
    through: VecDeque<BlockHash>,
    through_queued: BlockSet,
    /// Blocks a deleted cache object released here lately, and when: a handoff of one of
    /// them (a peer's repair that read it before its own release) is not taken back.
    released: BlockMap<Instant>,
    released_order: VecDeque<BlockHash>,
    /// The same-host arena, where the node has one: what it holds outside the store
    /// (leased blocks evicted since, reservations) counts against the capacity.
    arena: Option<crate::arena::Arena>,
    /// Bytes of the arena that stored blocks take ([`crate::arena::footprint`]s).
    arena_bytes: u64,
    /// Bytes reserved per tenant for writes not yet committed ([`Store::reserve`]): they
    /// count against the tenant's quota like stored bytes.
    pending: HashMap<TenantId, u64>,
}

/// How long a released block refuses handoffs: longer than a repair round takes.
pub const RELEASED_WINDOW: Duration = Duration::from_secs(600);
/// Released blocks remembered at most (the oldest are forgotten past this).
const RELEASED: usize = 65_536;

/// Holds longer than this (and every cache object's) are written through to a tier below
/// that keeps paid blocks, so that a restart keeps them: an hour is the longest TTL class a
/// request's breakpoint has; longer holds are OpenAI's 24h retention (automatic caching's,
/// so best effort, billed as a 1h write) and cache objects.
pub const WRITE_THROUGH_OVER: Duration = Duration::from_secs(3600);

/// Blocks waiting to be written through at most (32 bytes each); past it, long holds are
/// not copied until the writer catches up.
const THROUGH_BACKLOG: usize = 1 << 20;

/// Whether a write held so is copied to the tier below as soon as it is written.
pub fn writes_through(kind: EntryKind, ttl: Duration) -> bool {
    kind == EntryKind::Object || ttl > WRITE_THROUGH_OVER
}

/// Blocks re-ranked per store operation after the adaptive policy moves.
const REKEY_BATCH: usize = 1024;

impl Store {
    pub fn new(limits: StoreLimits) -> Self {
        let store = Self {
            limits,
            blocks: BlockMap::default(),
            used_bytes: 0,
            tenant_bytes: HashMap::new(),
            tenant_quota: HashMap::new(),
            tenant_reserved: HashMap::new(),
            leaves: BTreeSet::new(),
            extras: BTreeSet::new(),
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
            through: VecDeque::new(),
            through_queued: BlockSet::default(),
            released: BlockMap::default(),
            released_order: VecDeque::new(),
            arena: None,
            arena_bytes: 0,
            pending: HashMap::new(),
        };
        store.publish_tier_gauges();
        store
    }

    /// Demote capacity evictions to `tier` (local disk) and promote from it on a read.
    pub fn with_lower_tier(mut self, tier: Box<dyn TierStore>) -> Self {
        self.lower = Some(tier);
        self.publish_tier_gauges();
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

    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// The DRAM tier's capacity.
    pub fn capacity_bytes(&self) -> u64 {
        self.limits.capacity_bytes
    }

    /// What capacity eviction keeps under the capacity: the stored bytes, plus what the
    /// arena holds outside the store (blocks leased to an engine and evicted since,
    /// reservations not yet committed).
    pub fn occupied_bytes(&self) -> u64 {
        let outside = self
            .arena
            .as_ref()
            .map_or(0, |a| a.used().saturating_sub(self.arena_bytes));
        self.used_bytes + outside
    }

    /// The bytes a new block adds to [`Store::occupied_bytes`] when stored: none for one
    /// already in the arena (a committed reservation is counted since it was reserved).
    fn new_memory(&self, data: &[u8]) -> u64 {
        if self.arena.as_ref().is_some_and(|a| a.holds(data)) {
            0
        } else {
            data.len() as u64
        }
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

    /// Read blocks in chain order, verifying each checksum and refreshing each block's TTL
    /// (from `now`, by its own TTL class). Stops at the first block that is missing or
    /// corrupt: a corrupt block is removed and never served.
    pub fn get_chain(
        &mut self,
        scope: &Scope,
        chain: &[BlockHash],
        now: Instant,
    ) -> Vec<FetchedBlock> {
        let (blocks, corrupt) = self.read_chain(scope, chain, now).verify();
        if let Some(hash) = corrupt {
            self.drop_corrupt(&hash);
        }
        blocks
    }

    /// [`Store::get_chain`] in two halves, so that the checksums (a pass over every byte
    /// read) are verified after the store's lock is released: read the blocks and refresh
    /// their TTLs here, then [`ChainRead::verify`] them, then [`Store::drop_corrupt`] the
    /// block that failed, if one did.
    pub fn read_chain(&mut self, scope: &Scope, chain: &[BlockHash], now: Instant) -> ChainRead {
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
                    // The lower tier verified it as it read it.
                    out.push((read_through, None));
                    continue;
                }
            }
            let Some(block) = self.live(scope, hash, now) else {
                metrics::BLOCK_READS.with_label_values(&["miss"]).inc();
                break;
            };
            let fetched = FetchedBlock {
                hash: *hash,
                n_tokens: block.n_tokens,
                data: block.data.clone(),
            };
            let crc = block.checksum;
            let ttl = block.shared.ttl;
            self.touch(hash, now + ttl, ttl, false, true);
            out.push((fetched, Some(crc)));
        }
        if let Some((last, _)) = out.last()
            && let Some(b) = self.blocks.get_mut(&last.hash)
        {
            b.reads = b.reads.saturating_add(1);
        }
        ChainRead { blocks: out }
    }

    /// Remove `hash` if its stored bytes fail their checksum (a reader found them corrupt
    /// outside the lock; the block may have been replaced since).
    pub fn drop_corrupt(&mut self, hash: &BlockHash) {
        let corrupt = self
            .blocks
            .get(hash)
            .is_some_and(|b| checksum(&b.data) != b.checksum);
        if corrupt {
            tracing::error!(block = %hash, "checksum mismatch on read; dropping block");
            self.remove(hash, RemovalReason::Corrupt);
        }
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
        let ttl = block.shared.ttl;
        self.touch(hash, now + ttl, ttl, false, true);
        metrics::BLOCK_READS.with_label_values(&["hit"]).inc();
        Some(out)
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
        let terms = Terms::sent(ttl, kind, Copy::Own);
        self.put(scope, existing, new, terms, now)
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
        let terms = Terms::sent(ttl, kind, Copy::Replica);
        self.put_each(scope, existing, new, terms, now)
    }

    /// Store extra copies of blocks this node does not own (a writer's own copies, hot
    /// blocks it reads often): replicas, best effort, and the first blocks capacity eviction
    /// takes (wherever they sit in a chain). An owner's write of the same block later makes
    /// it an ordinary one. `of`: the kind of the write they copy. An object's extra copies
    /// hold nothing beside the object, in DRAM or in the tier below (where a copy no longer
    /// knows it was extra), so the object's deletion frees them.
    pub fn put_extra(
        &mut self,
        scope: &Scope,
        new: Vec<PutBlock>,
        ttl: Duration,
        of: EntryKind,
        now: Instant,
    ) -> Result<(), WriteRefused> {
        let terms = Terms {
            shared: of != EntryKind::Object,
            ..Terms::sent(ttl, EntryKind::BestEffort, Copy::Extra)
        };
        self.put_each(scope, &[], new, terms, now)
    }

    /// Store blocks another node held, handed over by a repair or a drain ([`Store::put_replica`]
    /// semantics), except those a deleted cache object released here within
    /// [`RELEASED_WINDOW`]: the peer read them before its own release, and taking them back
    /// would hold the deleted object's blocks again.
    pub fn put_handoff(
        &mut self,
        scope: &Scope,
        existing: &[BlockHash],
        new: Vec<PutBlock>,
        ttl: Duration,
        now: Instant,
        kind: EntryKind,
    ) -> Result<(), WriteRefused> {
        let released = |s: &Self, h: &BlockHash| {
            s.released
                .get(h)
                .is_some_and(|at| now.saturating_duration_since(*at) < RELEASED_WINDOW)
        };
        let existing: Vec<BlockHash> = existing
            .iter()
            .filter(|h| !released(self, h))
            .copied()
            .collect();
        let new: Vec<PutBlock> = new
            .into_iter()
            .filter(|b| !released(self, &b.hash))
            .collect();
        self.put_replica(scope, &existing, new, ttl, now, kind)
    }

    /// Remember that a deleted object released `hash` (see [`Store::put_handoff`]).
    pub(super) fn mark_released(&mut self, hash: BlockHash, now: Instant) {
        if self.released.insert(hash, now).is_none() {
            if self.released_order.len() >= RELEASED
                && let Some(old) = self.released_order.pop_front()
            {
                self.released.remove(&old);
            }
            self.released_order.push_back(hash);
        }
    }

    fn put_each(
        &mut self,
        scope: &Scope,
        existing: &[BlockHash],
        new: Vec<PutBlock>,
        terms: Terms,
        now: Instant,
    ) -> Result<(), WriteRefused> {
        let mut result = self.put(scope, existing, Vec::new(), terms, now);
        for b in new {
            if let Err(e) = self.put(scope, &[], vec![b], terms, now) {
                result = result.and(Err(e));
            }
        }
        result
    }

    fn put(
        &mut self,
        scope: &Scope,
        existing: &[BlockHash],
        new: Vec<PutBlock>,
        terms: Terms,
        now: Instant,
    ) -> Result<(), WriteRefused> {
        let Terms {
            ttl,
            kind,
            copy,
            checksums,
            shared,
        } = terms;
        let (replica, extra) = (copy != Copy::Own, copy == Copy::Extra);
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
        if checksums == Checksums::Verify && new.iter().any(|b| checksum(&b.data) != b.checksum) {
            return Err(refused(WriteRefused::Corrupt));
        }
        if existing.iter().any(|h| !self.contains(scope, h, now)) {
            return Err(refused(WriteRefused::MissingParent));
        }
        let pinned: BlockSet = existing
            .iter()
            .chain(new.iter().map(|b| &b.hash))
            .copied()
            .collect();
        let fresh = || new.iter().filter(|b| !self.blocks.contains_key(&b.hash));
        let incoming: u64 = fresh().map(|b| b.data.len() as u64).sum();
        let incoming_memory: u64 = fresh().map(|b| self.new_memory(&b.data)).sum();
        let tenant = scope.tenant;
        self.fit_quota(tenant, incoming, &pinned)?;
        self.admit(kind, &new, incoming_memory, &pinned)?;
        self.fit_capacity(tenant, incoming_memory, &pinned)?;
        let expires = now + ttl;
        let paid = kind.is_paid();
        if !self.released.is_empty() {
            // Written again: no longer a released block.
            for h in existing.iter().chain(new.iter().map(|b| &b.hash)) {
                self.released.remove(h);
            }
        }
        for h in existing {
            if !extra {
                self.unmark_extra(h);
            }
            self.touch(h, expires, ttl, paid, shared);
        }
        let inserted = self.insert_new(scope, new, terms, (expires, now))?;
        if writes_through(kind, ttl) {
            self.queue_write_through(existing.iter().chain(&inserted));
        }
        Ok(())
    }

    /// Selective admission: a best-effort write that would need room is refused when what
    /// it would evict ranks higher than it would (it is recorded as seen, so its next use
    /// ranks higher).
    fn admit(
        &mut self,
        kind: EntryKind,
        new: &[PutBlock],
        incoming_memory: u64,
        pinned: &BlockSet,
    ) -> Result<(), WriteRefused> {
        if kind == EntryKind::BestEffort
            && self.ranking.admits_selectively()
            && self.occupied_bytes() + incoming_memory > self.limits.capacity_bytes
            && let Some(first) = new.iter().find(|b| !self.blocks.contains_key(&b.hash))
        {
            let candidate =
                self.ranking
                    .prospective_key(&first.hash, self.clock + 1, self.blocks.len());
            let victim = self.capacity_victim(pinned);
            if victim.is_some_and(|(key, _)| key > candidate) {
                // Seen, though not stored: the next use of these blocks ranks higher.
                for b in new {
                    self.ranking.record(&b.hash, self.blocks.len());
                }
                return Err(refused(WriteRefused::NotAdmitted));
            }
        }
        Ok(())
    }

    /// Insert the blocks of `new` not yet held (touching those this scope already holds);
    /// none of them if one is held under another scope or misses its parent. The inserted.
    fn insert_new(
        &mut self,
        scope: &Scope,
        new: Vec<PutBlock>,
        terms: Terms,
        (expires, now): (Instant, Instant),
    ) -> Result<Vec<BlockHash>, WriteRefused> {
        let Terms {
            ttl,
            kind,
            copy,
            shared,
            ..
        } = terms;
        let (replica, extra) = (copy != Copy::Own, copy == Copy::Extra);
        let paid = kind.is_paid();
        let mut inserted: Vec<BlockHash> = Vec::new();
        for b in new {
            if self.blocks.contains_key(&b.hash) {
                if self.contains(scope, &b.hash, now) {
                    if !extra {
                        self.unmark_extra(&b.hash);
                    }
                    self.touch(&b.hash, expires, ttl, paid, shared);
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
            let held = Shared::of(shared, ttl, expires, now);
            self.insert(scope, b, (ttl, expires, held), paid, copy);
        }
        Ok(inserted)
    }

    /// Queue `hashes` for the write-through to a lower tier that keeps paid blocks (as many
    /// as the backlog takes; the rest stay in DRAM only).
    fn queue_write_through<'a>(&mut self, hashes: impl Iterator<Item = &'a BlockHash>) {
        if !self.lower.as_ref().is_some_and(|t| t.keeps_paid()) {
            return;
        }
        for h in hashes {
            if self.through.len() >= THROUGH_BACKLOG {
                // No writer keeps up (or none runs): these stay in DRAM only, as before.
                metrics::TIER_MOVES
                    .with_label_values(&["write_through_skipped"])
                    .inc();
                break;
            }
            if self.through_queued.insert(*h) {
                self.through.push_back(*h);
            }
        }
    }
}

impl Store {
    /// Evict `tenant`'s own leaves (never one of `pinned`) until `incoming` more bytes fit
    /// its quota, counting its reservations not yet committed; `Quota` when they cannot.
    fn fit_quota(
        &mut self,
        tenant: TenantId,
        incoming: u64,
        pinned: &BlockSet,
    ) -> Result<(), WriteRefused> {
        let Some(&quota) = self.tenant_quota.get(&tenant) else {
            return Ok(());
        };
        let pending = self.pending.get(&tenant).copied().unwrap_or(0);
        while self.tenant_bytes(tenant) + pending + incoming > quota {
            if !self.evict_one(Some(tenant), pinned, RemovalReason::Quota) {
                return Err(refused(WriteRefused::Quota));
            }
        }
        Ok(())
    }

    /// Make room for `incoming` more bytes under the node's capacity: best-effort leaves
    /// by the policy, then (nothing best-effort left, no room below for paid blocks) a
    /// tenant over its fair share gives way; `Capacity` when nothing can.
    fn fit_capacity(
        &mut self,
        tenant: TenantId,
        incoming: u64,
        pinned: &BlockSet,
    ) -> Result<(), WriteRefused> {
        while self.occupied_bytes() + incoming > self.limits.capacity_bytes {
            if self.evict_one(None, pinned, RemovalReason::Capacity) {
                continue;
            }
            // Another tenant holding more than its fair share (of DRAM and the tier below)
            // gives way (its default quota), so one tenant's paid writes cannot lock
            // everyone else out of the node for their TTL.
            let over = self.over_fair_share(tenant, incoming);
            if !over.is_some_and(|t| self.give_way(t, pinned)) {
                return Err(refused(WriteRefused::Capacity));
            }
        }
        Ok(())
    }
}

fn refused(r: WriteRefused) -> WriteRefused {
    metrics::WRITES_REFUSED
        .with_label_values(&[r.as_str()])
        .inc();
    r
}
