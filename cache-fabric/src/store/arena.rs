//! The store over the same-host arena ([`crate::arena`]): reserving room for an engine's
//! write before its bytes exist, and moving a block's bytes into the arena (staged for an
//! engine's load) without changing anything else about it.

use super::*;
use crate::arena::{Arena, Extent, footprint};

impl Store {
    /// Count `arena` against this store's capacity (its blocks there, and what it holds
    /// outside the store). Set once, before any block is stored.
    pub fn set_arena(&mut self, arena: Arena) {
        debug_assert!(self.blocks.is_empty());
        self.arena = Some(arena);
    }

    /// Room in the arena for an engine's write of blocks of `lens` bytes for `scope`,
    /// side by side: the tenant's quota (its stored bytes and other reservations) and the
    /// node's capacity are made to fit as for a write (evicting as a write would, never a
    /// block of `pinned`), then the run is allocated. The reservation counts against the
    /// tenant's quota until [`Store::unreserve`]; its bytes count against the capacity
    /// for as long as its extents live.
    pub fn reserve(
        &mut self,
        scope: &Scope,
        lens: &[usize],
        pinned: &[BlockHash],
        now: Instant,
    ) -> Result<Vec<Extent>, WriteRefused> {
        let Some(arena) = self.arena.clone() else {
            return Err(refused(WriteRefused::Unavailable));
        };
        self.purge_expired(now);
        let pinned: BlockSet = pinned.iter().copied().collect();
        let bytes: u64 = lens.iter().map(|l| *l as u64).sum();
        let room: u64 = lens.iter().map(|l| footprint(*l)).sum();
        let tenant = scope.tenant;
        self.fit_quota(tenant, bytes, &pinned)?;
        self.fit_capacity(tenant, room, &pinned)?;
        // The capacity fits; the arena may still lack one free run that long (its free
        // room in pieces): evict until it has one.
        loop {
            if let Some(run) = arena.alloc_run(lens) {
                *self.pending.entry(tenant).or_default() += bytes;
                return Ok(run);
            }
            if !self.evict_one(None, &pinned, RemovalReason::Capacity) {
                return Err(refused(WriteRefused::Capacity));
            }
        }
    }

    /// A reservation of `bytes` for `tenant` is over (committed, aborted, or its engine
    /// went away): it no longer counts against the tenant's quota.
    pub fn unreserve(&mut self, tenant: TenantId, bytes: u64) {
        if let Some(p) = self.pending.get_mut(&tenant) {
            *p = p.saturating_sub(bytes);
            if *p == 0 {
                self.pending.remove(&tenant);
            }
        }
    }

    /// Store an engine's write whose new blocks are extents of a reservation of
    /// `reserved` bytes it filled ([`Store::reserve`]), with checksums the caller computed
    /// from those bytes: [`Store::put_entry`] without a second pass over the bytes under
    /// the lock. The reservation ends whatever the answer.
    pub fn commit_reserved(
        &mut self,
        scope: &Scope,
        existing: &[BlockHash],
        new: Vec<PutBlock>,
        holding: Holding,
        now: Instant,
        reserved: u64,
    ) -> Result<(), WriteRefused> {
        self.unreserve(scope.tenant, reserved);
        let terms = Terms {
            checksums: Checksums::Computed,
            ..Terms::sent(holding.ttl, holding.kind, Copy::Own)
        };
        self.put(scope, existing, new, terms, now)
    }

    /// Bytes reserved for `tenant` and not yet committed.
    pub fn reserved_bytes(&self, tenant: TenantId) -> u64 {
        self.pending.get(&tenant).copied().unwrap_or(0)
    }

    /// Room in the arena for a copy of a stored block of `len` bytes (one an engine is
    /// about to load that lives on the heap), evicting for it as a write would; `None`
    /// when no room can be made.
    pub fn stage_room(&mut self, len: usize, pinned: &[BlockHash]) -> Option<Extent> {
        let arena = self.arena.clone()?;
        let pinned: BlockSet = pinned.iter().copied().collect();
        loop {
            if self.occupied_bytes() + footprint(len) <= self.limits.capacity_bytes
                && let Some(e) = arena.alloc(len)
            {
                return Some(e);
            }
            if !self.evict_one(None, &pinned, RemovalReason::Capacity) {
                return None;
            }
        }
    }

    /// Store `staged` (a copy of `hash`'s bytes in the arena) as the block's bytes, if the
    /// block still holds `was` (the bytes copied): the heap copy is let go. Whether it did.
    pub fn adopt_staged(&mut self, hash: &BlockHash, was: &Bytes, staged: Bytes) -> bool {
        let same = self.blocks.get(hash).is_some_and(|b| {
            b.data.as_ptr() == was.as_ptr()
                && b.data.len() == was.len()
                && staged.len() == was.len()
        });
        if same {
            self.replace_data(hash, staged);
        }
        same
    }

    /// Swap a stored block's bytes for `data` (the same length), keeping the arena's count.
    pub(super) fn replace_data(&mut self, hash: &BlockHash, data: Bytes) {
        let Some(b) = self.blocks.get_mut(hash) else {
            return;
        };
        if let Some(a) = &self.arena {
            if a.holds(&b.data) {
                self.arena_bytes -= footprint(b.data.len());
            }
            if a.holds(&data) {
                self.arena_bytes += footprint(data.len());
            }
        }
        b.data = data;
    }

    /// Whether a block's bytes live in the arena.
    pub fn in_arena(&self, hash: &BlockHash) -> bool {
        match (&self.arena, self.blocks.get(hash)) {
            (Some(a), Some(b)) => a.holds(&b.data),
            _ => false,
        }
    }
}
