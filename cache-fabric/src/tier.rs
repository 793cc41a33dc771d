//! Where block bytes live: the [`TierStore`] trait and its DRAM and local-disk
//! implementations, behind one contract test suite (`cache-fabric/tests/tiers.rs`).
//!
//! A tier stores opaque block records (bytes plus the metadata needed to put a block back
//! into the node's index: scope, parent, token count, TTL and paid flag) under their hash,
//! verifies the crc32c of every record it returns, and keeps itself within a byte capacity.
//! The node's eviction and TTL logic live in [`crate::store`]; a tier is the place bytes go
//! (DRAM pressure demotes to disk before dropping; a disk hit promotes).
//!
//! The disk tier writes append-only segment files (`seg-<n>.cachet`, 64 MiB by default).
//! Each record is a fixed header with its own crc32c, then the data:
//!
//! ```text
//! magic "CKV2" | header_crc:u32 | hash:32 | tenant:16 | workspace:16 | has_parent:u8
//! | parent:32 | n_tokens:u32 | ttl_ms:u64 | expires_unix_ms:u64 | paid:u8
//! | shared_ttl_ms:u64 | shared_until_unix_ms:u64 | data_crc:u32 | len:u64 | data
//! ```
//!
//! (`shared_*`: the holds other than cache objects', what deleting an object brings the
//! block back to.) Segments of the earlier format (`CKV1`, without them) are dropped at open.
//!
//! On open, every segment is scanned and the index rebuilt: a record whose data fails its
//! crc is skipped (its header vouches for its length), a torn record or a corrupt header ends
//! the segment's scan there and the file is truncated to what was intact. Removal drops the index entry;
//! space is reclaimed by deleting whole segments, oldest first, when over capacity (a
//! segment's live blocks go with it — a disk cache, not a database), except *paid* blocks
//! that have not expired: they are copied into a newer segment first, and a block that would
//! need one of them dropped is refused (`Full`). The store demotes paid entries only to a
//! tier that keeps them so ([`TierStore::keeps_paid`]). A record whose data no
//! longer matches its crc is reported as corrupt, dropped, and never returned.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use cachet_common::{BlockHash, Scope, TenantId};

use crate::integrity::checksum;
use crate::wire::{get_hash, get_parent, get_scope, put_parent, put_scope};

/// A block as a tier keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct TierBlock {
    pub hash: BlockHash,
    pub scope: Scope,
    pub parent: Option<BlockHash>,
    pub n_tokens: u32,
    pub ttl: Duration,
    /// When the block expires, in milliseconds since the Unix epoch (wall clock, so that it
    /// survives a restart).
    pub expires_unix_ms: u64,
    pub paid: bool,
    /// The holds other than cache objects': their TTL class and until when (ms since the
    /// epoch) they keep the block (see [`crate::EntryKind::Object`]); `expires_unix_ms` is
    /// the later of this and the objects' holds.
    pub shared_ttl: Duration,
    pub shared_until_unix_ms: u64,
    pub data: Bytes,
}

impl TierBlock {
    /// The kind of hold a copy of this block elsewhere gets (see the store's handoff).
    pub fn kind(&self) -> crate::EntryKind {
        use crate::EntryKind;
        if !self.paid {
            EntryKind::BestEffort
        } else if self.expires_unix_ms > self.shared_until_unix_ms + 1000 {
            EntryKind::Object
        } else {
            EntryKind::Paid
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("tier I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("block {0:?} failed its checksum and was dropped")]
    Corrupt(BlockHash),
    #[error("a block of {size} bytes cannot fit a tier of {capacity}")]
    TooLarge { size: u64, capacity: u64 },
    #[error("tier unavailable: {0}")]
    Unavailable(String),
    #[error("the tier holds {protected} bytes of unexpired paid blocks of its {capacity}: no room")]
    Full { protected: u64, capacity: u64 },
}

impl cachet_common::error::ServiceError for TierError {
    fn error_code(&self) -> cachet_common::error::ErrorCode {
        use cachet_common::error::ErrorCode;
        match self {
            // No room for more paid blocks: the cache is full, not broken.
            TierError::Full { .. } => ErrorCode::Overloaded,
            TierError::Io(_)
            | TierError::Corrupt(_)
            | TierError::TooLarge { .. }
            | TierError::Unavailable(_) => ErrorCode::Api,
        }
    }
}

/// One storage tier. Implementations: [`DramTier`], [`DiskTier`], and `GpuTier` (feature
/// `cuda`, in `crate::gpu`).
pub trait TierStore: Send {
    /// Store (or replace) a block, making room within the capacity if needed.
    fn put(&mut self, block: TierBlock) -> Result<(), TierError>;
    /// A stored block, its bytes verified; `Corrupt` (and the block dropped) on a mismatch.
    fn get(&mut self, hash: &BlockHash) -> Result<Option<TierBlock>, TierError>;
    /// A block's record without its bytes (`data` empty) and the bytes' length: what
    /// deciding about it needs, without reading a large block. By default the whole block
    /// is read.
    fn meta(&mut self, hash: &BlockHash) -> Result<Option<(TierBlock, u64)>, TierError> {
        Ok(self.get(hash)?.map(|b| {
            let len = b.data.len() as u64;
            (
                TierBlock {
                    data: Bytes::new(),
                    ..b
                },
                len,
            )
        }))
    }
    fn remove(&mut self, hash: &BlockHash) -> bool;
    fn contains(&self, hash: &BlockHash) -> bool;
    /// Every stored block's hash (re-announcing and handing off what a node holds).
    fn hashes(&self) -> Vec<BlockHash>;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes of block data held (what capacity counts).
    fn used_bytes(&self) -> u64;
    fn capacity_bytes(&self) -> u64;
    /// A short name for metrics and logs.
    fn name(&self) -> &'static str;
    /// Every stored block's hash, tenant and data bytes.
    fn inventory(&self) -> Vec<(BlockHash, TenantId, u64)>;
    /// Blocks and bytes of `tenant` held (its administrators' cache view).
    fn tenant_usage(&self, tenant: TenantId) -> (usize, u64) {
        self.inventory()
            .into_iter()
            .filter(|(_, t, _)| *t == tenant)
            .fold((0, 0), |(n, bytes), (_, _, len)| (n + 1, bytes + len))
    }
    /// Bytes each tenant holds here (the fair share across tiers). By default from the
    /// inventory.
    fn usage_by_tenant(&self) -> HashMap<TenantId, u64> {
        let mut out = HashMap::new();
        for (_, t, len) in self.inventory() {
            *out.entry(t).or_insert(0) += len;
        }
        out
    }
    /// `tenant`'s blocks in the order they should give way when the tenant holds more than
    /// its fair share: by default in inventory order.
    fn tenant_victims(&self, tenant: TenantId) -> Vec<BlockHash> {
        self.inventory()
            .into_iter()
            .filter(|(_, t, _)| *t == tenant)
            .map(|(h, _, _)| h)
            .collect()
    }
    /// Drop every block of `tenant` (its tenant was deleted); the hashes dropped.
    fn remove_tenant(&mut self, tenant: TenantId) -> Vec<BlockHash> {
        let gone: Vec<BlockHash> = self
            .inventory()
            .into_iter()
            .filter(|(_, t, _)| *t == tenant)
            .map(|(h, _, _)| h)
            .collect();
        for h in &gone {
            self.remove(h);
        }
        gone
    }
    /// Drop every block of `tenant` written before `before_unix_ms` (a purge this tier's node
    /// missed while it was down); the hashes dropped. A tier that cannot tell when a block was
    /// written keeps nothing of the tenant's: it is only asked at start, before anything new
    /// is written.
    fn remove_tenant_written_before(
        &mut self,
        tenant: TenantId,
        before_unix_ms: u64,
    ) -> Vec<BlockHash> {
        let _ = before_unix_ms;
        self.remove_tenant(tenant)
    }
    /// Whether the tier keeps paid blocks until they expire: it never drops one to make room
    /// (`put` answers [`TierError::Full`] instead). The store demotes paid entries only to
    /// such a tier.
    fn keeps_paid(&self) -> bool {
        false
    }
}

/// What the plain tiers (DRAM, the GPU's memory) share: their blocks by hash, each with its
/// crc32c and its place in insertion order, within a capacity in bytes; when full, the oldest
/// inserted goes first. `V` is where a tier keeps a block's bytes.
pub struct Held<V> {
    blocks: HashMap<BlockHash, Slot<V>>,
    order: BTreeMap<u64, BlockHash>,
    seq: u64,
    used: u64,
    capacity: u64,
}

/// One block held: where its bytes are, their length, its tenant and its crc32c.
pub struct Slot<V> {
    seq: u64,
    pub len: u64,
    pub tenant: TenantId,
    pub crc: u32,
    pub value: V,
}

impl<V> Held<V> {
    pub fn new(capacity: u64) -> Self {
        Self {
            blocks: HashMap::new(),
            order: BTreeMap::new(),
            seq: 0,
            used: 0,
            capacity,
        }
    }

    /// Make room for a block of `size` bytes under `hash`: its old copy and then the oldest
    /// blocks go; a block larger than the whole tier is refused.
    pub fn make_room(&mut self, hash: &BlockHash, size: u64) -> Result<(), TierError> {
        if size > self.capacity {
            return Err(TierError::TooLarge {
                size,
                capacity: self.capacity,
            });
        }
        self.remove(hash);
        while self.used + size > self.capacity {
            let Some((_, h)) = self.order.pop_first() else {
                break;
            };
            if let Some(b) = self.blocks.remove(&h) {
                self.used -= b.len;
            }
        }
        Ok(())
    }

    /// Hold a block (after [`Held::make_room`]), newest in order.
    pub fn insert(&mut self, hash: BlockHash, tenant: TenantId, len: u64, crc: u32, value: V) {
        self.seq += 1;
        self.order.insert(self.seq, hash);
        self.used += len;
        let slot = Slot {
            seq: self.seq,
            len,
            tenant,
            crc,
            value,
        };
        self.blocks.insert(hash, slot);
    }

    pub fn get(&self, hash: &BlockHash) -> Option<&Slot<V>> {
        self.blocks.get(hash)
    }

    pub fn get_mut(&mut self, hash: &BlockHash) -> Option<&mut Slot<V>> {
        self.blocks.get_mut(hash)
    }

    pub fn remove(&mut self, hash: &BlockHash) -> bool {
        match self.blocks.remove(hash) {
            Some(b) => {
                self.order.remove(&b.seq);
                self.used -= b.len;
                true
            }
            None => false,
        }
    }

    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.blocks.contains_key(hash)
    }
    pub fn hashes(&self) -> Vec<BlockHash> {
        self.blocks.keys().copied().collect()
    }
    pub fn len(&self) -> usize {
        self.blocks.len()
    }
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
    pub fn used_bytes(&self) -> u64 {
        self.used
    }
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity
    }
    pub fn inventory(&self) -> Vec<(BlockHash, TenantId, u64)> {
        self.blocks
            .iter()
            .map(|(h, b)| (*h, b.tenant, b.len))
            .collect()
    }
}

/// The [`TierStore`] methods a plain tier answers from its [`Held`] bookkeeping (field
/// `held`), by name.
macro_rules! held_bookkeeping {
    ($name:literal) => {
        fn remove(&mut self, hash: &BlockHash) -> bool {
            self.held.remove(hash)
        }
        fn contains(&self, hash: &BlockHash) -> bool {
            self.held.contains(hash)
        }
        fn hashes(&self) -> Vec<BlockHash> {
            self.held.hashes()
        }
        fn len(&self) -> usize {
            self.held.len()
        }
        fn used_bytes(&self) -> u64 {
            self.held.used_bytes()
        }
        fn capacity_bytes(&self) -> u64 {
            self.held.capacity_bytes()
        }
        fn name(&self) -> &'static str {
            $name
        }
        fn inventory(&self) -> Vec<(BlockHash, TenantId, u64)> {
            self.held.inventory()
        }
    };
}
#[cfg(feature = "cuda")]
pub(crate) use held_bookkeeping;

/// The DRAM tier as a plain tier: blocks in memory, oldest inserted dropped first when full.
pub struct DramTier {
    held: Held<TierBlock>,
}

impl DramTier {
    pub fn new(capacity: u64) -> Self {
        Self {
            held: Held::new(capacity),
        }
    }

    /// Test hook: flip a bit of a stored block.
    #[doc(hidden)]
    pub fn corrupt_for_test(&mut self, hash: &BlockHash) -> bool {
        let Some(b) = self.held.get_mut(hash) else {
            return false;
        };
        let mut v = b.value.data.to_vec();
        if let Some(x) = v.first_mut() {
            *x ^= 1;
        }
        b.value.data = Bytes::from(v);
        true
    }
}

impl TierStore for DramTier {
    fn put(&mut self, block: TierBlock) -> Result<(), TierError> {
        let size = block.data.len() as u64;
        self.held.make_room(&block.hash, size)?;
        let crc = checksum(&block.data);
        self.held
            .insert(block.hash, block.scope.tenant, size, crc, block);
        Ok(())
    }

    fn get(&mut self, hash: &BlockHash) -> Result<Option<TierBlock>, TierError> {
        let Some(b) = self.held.get(hash) else {
            return Ok(None);
        };
        if checksum(&b.value.data) != b.crc {
            self.held.remove(hash);
            return Err(TierError::Corrupt(*hash));
        }
        Ok(Some(b.value.clone()))
    }

    held_bookkeeping!("dram");
}

/// A segment record: the magic, the header's crc32c, the header (its last 8 bytes: the data
/// length), then the data.
pub const MAGIC: &[u8; 4] = b"CKV2";
/// The magic of the records of the format before the shared hold was recorded: such a
/// segment is dropped whole at open (a cache's content, computed again when needed).
const OLD_MAGIC: &[u8; 4] = b"CKV1";
/// Header bytes after the magic and the header crc.
pub const HEADER: usize = 32 + 16 + 16 + 1 + 32 + 4 + 8 + 8 + 1 + 8 + 8 + 4 + 8;
/// The magic and the header crc.
pub const PREFIX: usize = 4 + 4;

/// Where one record is.
#[derive(Clone, Copy, Debug)]
struct Loc {
    segment: u64,
    offset: u64,
    len: u64,
    /// A paid block's expiry (ms since the epoch): it is kept until then. 0 if not paid.
    paid_until_ms: u64,
    /// When the record was written (ms since the epoch): its expiry less its TTL.
    written_ms: u64,
    tenant: TenantId,
}

fn written_ms(b: &TierBlock) -> u64 {
    b.expires_unix_ms
        .saturating_sub(b.ttl.as_millis().min(u64::MAX as u128) as u64)
}

fn paid_until(b: &TierBlock) -> u64 {
    if b.paid { b.expires_unix_ms } else { 0 }
}

/// The local-disk tier: append-only segment files in one directory.
pub struct DiskTier {
    dir: PathBuf,
    segment_bytes: u64,
    capacity: u64,
    index: HashMap<BlockHash, Loc>,
    /// Segment id → (file, bytes written, live data bytes).
    segments: BTreeMap<u64, (File, u64, u64)>,
    used: u64,
    /// Bytes of paid blocks in the index (expired or not): an upper bound of what making
    /// room must keep, so the exact count is only taken when this bound leaves no room.
    paid_bytes: u64,
    /// Bytes in the index per tenant (the fair share across tiers reads it on every write
    /// a full node refuses otherwise).
    tenant_used: HashMap<TenantId, u64>,
}

/// Take `len` bytes off `tenant`'s count, forgetting a tenant that holds none.
fn untally(counts: &mut HashMap<TenantId, u64>, tenant: TenantId, len: u64) {
    if let Some(b) = counts.get_mut(&tenant) {
        *b -= len;
        if *b == 0 {
            counts.remove(&tenant);
        }
    }
}

fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("seg-{id:08}.cachet"))
}

fn encode_header(b: &TierBlock, data_crc: u32) -> BytesMut {
    let mut h = BytesMut::with_capacity(HEADER);
    h.put_slice(&b.hash.0);
    put_scope(&mut h, &b.scope);
    put_parent(&mut h, b.parent);
    h.put_u32_le(b.n_tokens);
    h.put_u64_le(b.ttl.as_millis() as u64);
    h.put_u64_le(b.expires_unix_ms);
    h.put_u8(b.paid as u8);
    h.put_u64_le(b.shared_ttl.as_millis() as u64);
    h.put_u64_le(b.shared_until_unix_ms);
    h.put_u32_le(data_crc);
    h.put_u64_le(b.data.len() as u64);
    h
}

/// Decoded header: the block without data, the data crc and length.
fn decode_header(mut h: &[u8]) -> (TierBlock, u32, u64) {
    let hash = get_hash(&mut h);
    let scope = get_scope(&mut h);
    let parent = get_parent(&mut h);
    let n_tokens = h.get_u32_le();
    let ttl = Duration::from_millis(h.get_u64_le());
    let expires_unix_ms = h.get_u64_le();
    let paid = h.get_u8() == 1;
    let shared_ttl = Duration::from_millis(h.get_u64_le());
    let shared_until_unix_ms = h.get_u64_le();
    let crc = h.get_u32_le();
    let len = h.get_u64_le();
    (
        TierBlock {
            hash,
            scope,
            parent,
            n_tokens,
            ttl,
            expires_unix_ms,
            paid,
            shared_ttl,
            shared_until_unix_ms,
            data: Bytes::new(),
        },
        crc,
        len,
    )
}

/// One record [`scan_segment`] found: its block (without data), where it starts, its data
/// length, and whether the data matches its checksum.
#[derive(Debug)]
pub struct ScannedRecord {
    pub block: TierBlock,
    pub offset: usize,
    pub len: u64,
    pub data_ok: bool,
}

/// Read a segment's bytes as recovery does: every record whose header is intact, up to the
/// first torn or corrupt header (or one whose length runs past the end); the second value is
/// where that valid part ends. Whatever the bytes, this neither panics nor reads past them.
pub fn scan_segment(bytes: &[u8]) -> (Vec<ScannedRecord>, usize) {
    let mut records = Vec::new();
    let mut off = 0usize;
    while off + PREFIX + HEADER <= bytes.len() {
        if &bytes[off..off + 4] != MAGIC {
            break;
        }
        let hcrc = u32::from_le_bytes(bytes[off + 4..off + 8].try_into().expect("4"));
        let header = &bytes[off + PREFIX..off + PREFIX + HEADER];
        if checksum(header) != hcrc {
            break;
        }
        let (block, dcrc, len) = decode_header(header);
        let start = off + PREFIX + HEADER;
        let Some(end) = usize::try_from(len)
            .ok()
            .and_then(|l| start.checked_add(l))
            .filter(|e| *e <= bytes.len())
        else {
            break;
        };
        records.push(ScannedRecord {
            block,
            offset: off,
            len,
            data_ok: checksum(&bytes[start..end]) == dcrc,
        });
        off = end;
    }
    (records, off)
}

impl DiskTier {
    /// Open (creating if needed) the tier in `dir`, recovering every intact record.
    pub fn open(dir: impl Into<PathBuf>, capacity: u64) -> Result<Self, TierError> {
        Self::open_with(dir, capacity, 64 << 20)
    }

    pub fn open_with(
        dir: impl Into<PathBuf>,
        capacity: u64,
        segment_bytes: u64,
    ) -> Result<Self, TierError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)?;
        let mut ids: Vec<u64> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_prefix("seg-")?
                    .strip_suffix(".cachet")?
                    .parse()
                    .ok()
            })
            .collect();
        ids.sort_unstable();
        let mut tier = Self {
            dir,
            segment_bytes,
            capacity,
            index: HashMap::new(),
            segments: BTreeMap::new(),
            used: 0,
            paid_bytes: 0,
            tenant_used: HashMap::new(),
        };
        for id in ids {
            tier.recover_segment(id)?;
        }
        // A capacity lowered since the last run is enforced even on paid blocks.
        if tier.enforce_capacity(0).is_err() {
            while tier.used > tier.capacity {
                let Some((&id, _)) = tier.segments.first_key_value() else {
                    break;
                };
                tier.drop_segment(id)?;
            }
        }
        Ok(tier)
    }

    /// Scan one segment: index every intact record up to the first torn or corrupt one,
    /// and truncate the file there so new records follow valid ones.
    fn recover_segment(&mut self, id: u64) -> Result<(), TierError> {
        let path = segment_path(&self.dir, id);
        // Append mode: new records always go to the end, also after a truncation below.
        let mut file = OpenOptions::new().read(true).append(true).open(&path)?;
        let size = file.metadata()?.len();
        let mut bytes = Vec::with_capacity(size as usize);
        file.read_to_end(&mut bytes)?;
        if bytes.starts_with(OLD_MAGIC) {
            tracing::info!(segment = %path.display(), "a segment of the earlier record format is dropped");
            drop(file);
            std::fs::remove_file(&path)?;
            return Ok(());
        }
        let (records, valid) = scan_segment(&bytes);
        let mut live = 0u64;
        for ScannedRecord {
            block,
            offset: off,
            len,
            data_ok,
        } in records
        {
            if !data_ok {
                // The header vouches for the length: skip just this record.
                tracing::error!(segment = %path.display(), offset = off, block = %block.hash, "block data failed its checksum; not recovered");
                continue;
            }
            // A later record of the same hash replaces an earlier one.
            if let Some(old) = self.index.insert(
                block.hash,
                Loc {
                    segment: id,
                    offset: off as u64,
                    len,
                    paid_until_ms: paid_until(&block),
                    written_ms: written_ms(&block),
                    tenant: block.scope.tenant,
                },
            ) {
                self.used -= old.len;
                self.untally(old.tenant, old.len);
                if old.paid_until_ms > 0 {
                    self.paid_bytes -= old.len;
                }
                if let Some(seg) = self.segments.get_mut(&old.segment) {
                    seg.2 -= old.len;
                } else if old.segment == id {
                    live -= old.len;
                }
            }
            self.used += len;
            *self.tenant_used.entry(block.scope.tenant).or_insert(0) += len;
            if paid_until(&block) > 0 {
                self.paid_bytes += len;
            }
            live += len;
        }
        let off = valid;
        if (off as u64) < size {
            tracing::warn!(segment = %path.display(), kept = off, size, "torn or corrupt record; truncating the segment there");
            file.set_len(off as u64)?;
        }
        self.segments.insert(id, (file, off as u64, live));
        Ok(())
    }

    /// Drop whole segments, oldest first, until `incoming` more bytes fit; unexpired paid
    /// blocks of a segment are copied into a newer one first. `Full` (and nothing dropped)
    /// if they alone leave no room.
    fn enforce_capacity(&mut self, incoming: u64) -> Result<(), TierError> {
        if self.used + incoming <= self.capacity {
            return Ok(());
        }
        debug_assert_eq!(
            self.paid_bytes,
            self.index
                .values()
                .filter(|l| l.paid_until_ms > 0)
                .map(|l| l.len)
                .sum::<u64>(),
            "paid byte count"
        );
        let now = crate::unix_ms();
        let protected: u64 = if self.paid_bytes + incoming <= self.capacity {
            self.paid_bytes
        } else {
            self.index
                .values()
                .filter(|l| l.paid_until_ms > now)
                .map(|l| l.len)
                .sum()
        };
        if protected + incoming > self.capacity {
            return Err(TierError::Full {
                protected,
                capacity: self.capacity,
            });
        }
        // Each round drops the oldest segment, so every byte that is not protected is
        // reached within one pass over the segments there are now.
        let mut rounds = 2 * self.segments.len() + 2;
        while self.used + incoming > self.capacity && rounds > 0 {
            rounds -= 1;
            let Some((&id, _)) = self.segments.first_key_value() else {
                break;
            };
            let keep: Vec<BlockHash> = self
                .index
                .iter()
                .filter(|(_, l)| l.segment == id && l.paid_until_ms > now)
                .map(|(h, _)| *h)
                .collect();
            let mut moved = Vec::with_capacity(keep.len());
            for h in keep {
                // A copy that fails its checksum is dropped by `get`, never carried on.
                if let Ok(Some(b)) = self.get(&h) {
                    moved.push(b);
                }
            }
            for b in moved {
                self.append(b, id + 1)?;
            }
            self.drop_segment(id)?;
        }
        if self.used + incoming > self.capacity {
            return Err(TierError::Full {
                protected,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    fn untally(&mut self, tenant: TenantId, len: u64) {
        untally(&mut self.tenant_used, tenant, len);
    }

    fn drop_segment(&mut self, id: u64) -> Result<(), TierError> {
        self.segments.remove(&id);
        let (mut freed, mut paid) = (0, 0);
        let tenant_used = &mut self.tenant_used;
        self.index.retain(|_, l| {
            if l.segment == id {
                freed += l.len;
                if l.paid_until_ms > 0 {
                    paid += l.len;
                }
                untally(tenant_used, l.tenant, l.len);
                false
            } else {
                true
            }
        });
        self.used -= freed;
        self.paid_bytes -= paid;
        match std::fs::remove_file(segment_path(&self.dir, id)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The segment to append `record` bytes to: the last one if it is at least `min_id`
    /// and has room, else a new one.
    fn writable_segment(&mut self, record: u64, min_id: u64) -> Result<u64, TierError> {
        if let Some((&id, (_, written, _))) = self.segments.last_key_value()
            && id >= min_id
            && (*written == 0 || written + record <= self.segment_bytes)
        {
            return Ok(id);
        }
        let id = self
            .segments
            .last_key_value()
            .map(|(id, _)| id + 1)
            .unwrap_or(0)
            .max(min_id);
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create_new(true)
            .open(segment_path(&self.dir, id))?;
        self.segments.insert(id, (file, 0, 0));
        Ok(id)
    }

    /// Test hook: flip one bit of a stored block's data on disk.
    #[doc(hidden)]
    pub fn corrupt_for_test(&mut self, hash: &BlockHash) -> Result<bool, TierError> {
        let Some(l) = self.index.get(hash).copied() else {
            return Ok(false);
        };
        let path = segment_path(&self.dir, l.segment);
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        let at = l.offset + (PREFIX + HEADER) as u64;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at)?;
        b[0] ^= 1;
        f.write_all_at(&b, at)?;
        Ok(true)
    }

    pub fn segments(&self) -> usize {
        self.segments.len()
    }

    /// Write `block` as a new record in a segment numbered at least `min_segment`
    /// (replacing any earlier record of its hash), without making room.
    fn append(&mut self, block: TierBlock, min_segment: u64) -> Result<(), TierError> {
        self.remove(&block.hash);
        let len = block.data.len() as u64;
        let header = encode_header(&block, checksum(&block.data));
        let record = (PREFIX + HEADER) as u64 + len;
        let id = self.writable_segment(record, min_segment)?;
        let (file, written, live) = self.segments.get_mut(&id).expect("just chosen");
        let mut prefix = [0u8; PREFIX];
        prefix[..4].copy_from_slice(MAGIC);
        prefix[4..].copy_from_slice(&checksum(&header).to_le_bytes());
        file.write_all(&prefix)?;
        file.write_all(&header)?;
        file.write_all(&block.data)?;
        let offset = *written;
        *written += record;
        *live += len;
        self.used += len;
        *self.tenant_used.entry(block.scope.tenant).or_insert(0) += len;
        if paid_until(&block) > 0 {
            self.paid_bytes += len;
        }
        self.index.insert(
            block.hash,
            Loc {
                segment: id,
                offset,
                len,
                paid_until_ms: paid_until(&block),
                written_ms: written_ms(&block),
                tenant: block.scope.tenant,
            },
        );
        Ok(())
    }
}

impl DiskTier {
    /// The first `bytes` of the record at `l` (its prefix and header, or all of it).
    fn read_record(&self, l: Loc, bytes: usize) -> std::io::Result<Vec<u8>> {
        let (file, _, _) = self
            .segments
            .get(&l.segment)
            .expect("indexed segment is open");
        let mut raw = vec![0u8; bytes];
        file.read_exact_at(&mut raw, l.offset)?;
        Ok(raw)
    }
}

impl TierStore for DiskTier {
    fn put(&mut self, block: TierBlock) -> Result<(), TierError> {
        let len = block.data.len() as u64;
        if len > self.capacity {
            return Err(TierError::TooLarge {
                size: len,
                capacity: self.capacity,
            });
        }
        self.remove(&block.hash);
        self.enforce_capacity(len)?;
        self.append(block, 0)
    }

    fn get(&mut self, hash: &BlockHash) -> Result<Option<TierBlock>, TierError> {
        let Some(l) = self.index.get(hash).copied() else {
            return Ok(None);
        };
        let raw = self.read_record(l, PREFIX + HEADER + l.len as usize)?;
        let header = &raw[PREFIX..PREFIX + HEADER];
        let hcrc = u32::from_le_bytes(raw[4..8].try_into().expect("4"));
        let header_ok = checksum(header) == hcrc;
        let (mut block, dcrc, len) = decode_header(header);
        let data = Bytes::from(raw).slice(PREFIX + HEADER..);
        if !header_ok
            || data.len() != len as usize
            || block.hash != *hash
            || checksum(&data) != dcrc
        {
            self.remove(hash);
            return Err(TierError::Corrupt(*hash));
        }
        block.data = data;
        Ok(Some(block))
    }

    fn meta(&mut self, hash: &BlockHash) -> Result<Option<(TierBlock, u64)>, TierError> {
        let Some(l) = self.index.get(hash).copied() else {
            return Ok(None);
        };
        let raw = self.read_record(l, PREFIX + HEADER)?;
        let header = &raw[PREFIX..];
        let hcrc = u32::from_le_bytes(raw[4..8].try_into().expect("4"));
        let (block, _, len) = decode_header(header);
        if checksum(header) != hcrc || len != l.len || block.hash != *hash {
            self.remove(hash);
            return Err(TierError::Corrupt(*hash));
        }
        Ok(Some((block, len)))
    }

    fn remove(&mut self, hash: &BlockHash) -> bool {
        let Some(l) = self.index.remove(hash) else {
            return false;
        };
        self.used -= l.len;
        self.untally(l.tenant, l.len);
        if l.paid_until_ms > 0 {
            self.paid_bytes -= l.len;
        }
        let empty = match self.segments.get_mut(&l.segment) {
            Some(seg) => {
                seg.2 -= l.len;
                seg.2 == 0 && self.segments.len() > 1
            }
            None => false,
        };
        // A segment with nothing live left (and not the one being written) is deleted.
        if empty && self.segments.last_key_value().map(|(id, _)| *id) != Some(l.segment) {
            let _ = self.drop_segment(l.segment);
        }
        true
    }

    fn contains(&self, hash: &BlockHash) -> bool {
        self.index.contains_key(hash)
    }
    fn hashes(&self) -> Vec<BlockHash> {
        self.index.keys().copied().collect()
    }
    fn len(&self) -> usize {
        self.index.len()
    }
    fn used_bytes(&self) -> u64 {
        self.used
    }
    fn capacity_bytes(&self) -> u64 {
        self.capacity
    }
    fn name(&self) -> &'static str {
        "disk"
    }
    fn inventory(&self) -> Vec<(BlockHash, TenantId, u64)> {
        self.index
            .iter()
            .map(|(h, l)| (*h, l.tenant, l.len))
            .collect()
    }

    fn usage_by_tenant(&self) -> HashMap<TenantId, u64> {
        debug_assert_eq!(
            self.tenant_used.values().sum::<u64>(),
            self.used,
            "per-tenant byte count"
        );
        self.tenant_used.clone()
    }

    fn tenant_usage(&self, tenant: TenantId) -> (usize, u64) {
        let n = self.index.values().filter(|l| l.tenant == tenant).count();
        (n, self.tenant_used.get(&tenant).copied().unwrap_or(0))
    }

    /// Blocks past their paid expiry (or never paid) first, then the paid ones that expire
    /// soonest: what the tenant paid least to keep.
    fn tenant_victims(&self, tenant: TenantId) -> Vec<BlockHash> {
        let mut mine: Vec<(u64, BlockHash)> = self
            .index
            .iter()
            .filter(|(_, l)| l.tenant == tenant)
            .map(|(h, l)| (l.paid_until_ms, *h))
            .collect();
        mine.sort_unstable();
        mine.into_iter().map(|(_, h)| h).collect()
    }

    fn remove_tenant_written_before(
        &mut self,
        tenant: TenantId,
        before_unix_ms: u64,
    ) -> Vec<BlockHash> {
        let gone: Vec<BlockHash> = self
            .index
            .iter()
            .filter(|(_, l)| l.tenant == tenant && l.written_ms < before_unix_ms)
            .map(|(h, _)| *h)
            .collect();
        for h in &gone {
            self.remove(h);
        }
        gone
    }
    fn keeps_paid(&self) -> bool {
        true
    }
}
