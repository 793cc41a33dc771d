//! The store's entries: inserting, touching and forgetting blocks, the leaf sets eviction
//! reads, expiry, per-tenant stats and purges, and the invariants tests check.

use super::*;

impl Store {
    pub(super) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    pub(super) fn live<'a>(
        &'a self,
        scope: &Scope,
        hash: &BlockHash,
        now: Instant,
    ) -> Option<&'a Block> {
        self.blocks
            .get(hash)
            .filter(|b| b.scope == *scope && b.expires_at > now)
    }

    /// Why a block is gone, if it was here recently.
    pub fn removal_reason(&self, hash: &BlockHash) -> Option<RemovalReason> {
        self.tombstones.get(hash).copied()
    }

    /// Store a new block held for `ttl` until `expires_at`, `shared` the part of that hold
    /// that is not a cache object's.
    pub(super) fn insert(
        &mut self,
        scope: &Scope,
        b: PutBlock,
        (ttl, expires_at, shared): (Duration, Instant, super::Shared),
        paid: bool,
        copy: super::Copy,
    ) {
        let (replica, extra) = (copy != super::Copy::Own, copy == super::Copy::Extra);
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
        if extra && !paid {
            self.extras.insert((key, b.hash));
        }
        self.expiry.insert((expires_at, b.hash));
        self.used_bytes += len;
        if self.arena.as_ref().is_some_and(|a| a.holds(&b.data)) {
            self.arena_bytes += crate::arena::footprint(b.data.len());
        }
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
                shared,
            },
        );
        metrics::BLOCKS_WRITTEN.inc();
        metrics::BYTES_WRITTEN.inc_by(len);
        self.emit(StoreEvent::Stored(b.hash, Medium::Dram));
        self.publish_gauges(scope.tenant);
    }

    /// Mark used (a new eviction key); extend expiry to at least `expires_at` (within
    /// [`EXPIRY_SLACK`]) and the TTL class to at least `ttl`; `paid` marks it paid (a paid
    /// block stays paid); `shared`: the hold is not a cache object's (it extends the
    /// block's shared hold too).
    pub(super) fn touch(
        &mut self,
        hash: &BlockHash,
        expires_at: Instant,
        ttl: Duration,
        paid: bool,
        shared: bool,
    ) {
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
        // The eviction sets, updated in place (fields, not methods: `b` is still borrowed).
        if b.extra && self.extras.remove(&(old_key, *hash)) && !b.paid {
            self.extras.insert((key, *hash));
        }
        if b.children == 0 {
            self.leaves.remove(&(old_key, *hash));
            self.sticky_leaves.remove(&(old_key, *hash));
            self.paid_leaves.remove(&(old_key, *hash));
            if b.paid {
                self.paid_leaves.insert((key, *hash));
            } else {
                self.leaves.insert((key, *hash));
                if !b.extra && popular(&self.ranking, hash) {
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
        if shared {
            b.shared.until = b.shared.until.max(expires_at);
            b.shared.ttl = b.shared.ttl.max(ttl);
        }
    }

    pub(super) fn purge_expired(&mut self, now: Instant) {
        while let Some(&(at, h)) = self.expiry.first() {
            if at > now {
                break;
            }
            self.remove(&h, RemovalReason::Expired);
        }
    }

    pub(super) fn remove(&mut self, hash: &BlockHash, reason: RemovalReason) {
        let demoted = reason == RemovalReason::Capacity && self.demote(hash);
        self.forget(hash, reason, demoted);
    }

    /// Take a block out of DRAM (`demoted`: it is still held by the lower tier).
    pub(super) fn forget(&mut self, hash: &BlockHash, reason: RemovalReason, demoted: bool) {
        let Some(b) = self.blocks.remove(hash) else {
            return;
        };
        if reason == RemovalReason::Corrupt {
            self.note_damaged(Damaged {
                scope: b.scope,
                hash: *hash,
                parent: b.parent,
                remaining: b.expires_at.saturating_duration_since(Instant::now()),
                kind: b.kind(),
            });
        }
        debug_assert!(
            !(b.paid && reason == RemovalReason::Capacity && !demoted),
            "a paid block was dropped for capacity"
        );
        // Still held (on disk) after a demotion; otherwise gone from this node.
        self.emit(StoreEvent::Removed {
            hash: *hash,
            medium: Medium::Dram,
            gone: !demoted,
        });
        self.expiry.remove(&(b.expires_at, *hash));
        let tenant = b.scope.tenant;
        self.unset_leaf(tenant, b.key, *hash);
        self.extras.remove(&(b.key, *hash));
        let len = b.data.len() as u64;
        self.used_bytes -= len;
        if self.arena.as_ref().is_some_and(|a| a.holds(&b.data)) {
            self.arena_bytes -= crate::arena::footprint(b.data.len());
        }
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

    /// Release a deleted cache object's hold on `blocks` of `scope`, each with until when
    /// the scope's other live objects still hold it (Unix ms; `None`: none does). A block
    /// nothing else holds is dropped from every tier; one still held keeps only what its
    /// other holds need (the entries written at breakpoints and reads kept apart in
    /// `Shared`, and the other objects). Extra copies of blocks other nodes own go
    /// either way: their owners decide. Applying a release again changes nothing more.
    pub fn release(
        &mut self,
        scope: &Scope,
        blocks: &[(BlockHash, Option<u64>)],
        now: Instant,
    ) -> Released {
        let wall = unix_ms();
        let mut out = Released::default();
        for &(hash, kept) in blocks {
            let kept = kept.filter(|&k| k > wall);
            self.mark_released(hash, now);
            let before = out;
            if let Some(b) = self.blocks.get(&hash).filter(|b| b.scope == *scope) {
                let others = kept.map(|k| now + Duration::from_millis(k - wall));
                let until = others.map_or(b.shared.until, |k| k.max(b.shared.until));
                let len = b.data.len() as u64;
                if b.extra || until <= now {
                    self.forget(&hash, RemovalReason::Purged, false);
                    out.blocks_freed += 1;
                    out.bytes_freed += len;
                } else {
                    self.shorten(&hash, until);
                    out.blocks_held += 1;
                    out.bytes_held += len;
                }
            }
            // A block in both tiers (a long hold written through) counts once.
            let below = self.release_lower(scope, &hash, kept, wall);
            if out == before {
                out += below;
            }
        }
        out
    }

    /// [`Store::release`] of one block in the tier below DRAM.
    fn release_lower(
        &mut self,
        scope: &Scope,
        hash: &BlockHash,
        kept: Option<u64>,
        wall: u64,
    ) -> Released {
        let mut out = Released::default();
        let Some(tier) = self.lower.as_mut().filter(|t| t.contains(hash)) else {
            return out;
        };
        // The record's header decides; the bytes are read only to rewrite a shorter expiry.
        match tier.meta(hash) {
            Ok(Some((meta, len))) if meta.scope == *scope => {
                let until = kept.unwrap_or(0).max(meta.shared_until_unix_ms);
                if until <= wall {
                    tier.remove(hash);
                    out.blocks_freed += 1;
                    out.bytes_freed += len;
                } else {
                    if until < meta.expires_unix_ms {
                        let rewritten = tier.get(hash).and_then(|b| match b {
                            Some(tb) => tier.put(TierBlock {
                                expires_unix_ms: until,
                                ..tb
                            }),
                            None => Ok(()),
                        });
                        if let Err(e) = rewritten {
                            tracing::warn!(block = %hash, error = %e, "rewriting a released block's expiry failed; it is dropped");
                            tier.remove(hash);
                        }
                    }
                    out.blocks_held += 1;
                    out.bytes_held += len;
                }
            }
            Ok(_) => return out,
            Err(e) => {
                tracing::warn!(block = %hash, error = %e, "reading a released block failed; it is dropped");
                tier.remove(hash);
            }
        }
        if !self.lower.as_ref().is_some_and(|t| t.contains(hash)) {
            self.left_lower(hash);
        }
        out
    }

    /// Bring a block's expiry forward to `until` (a hold on it was released).
    fn shorten(&mut self, hash: &BlockHash, until: Instant) {
        let Some(b) = self.blocks.get_mut(hash) else {
            return;
        };
        if until < b.expires_at {
            self.expiry.remove(&(b.expires_at, *hash));
            self.expiry.insert((until, *hash));
            b.expires_at = until;
        }
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
        let mut distinct_bytes = dram.bytes;
        let mut tiers = vec![dram];
        if let Some(t) = &self.lower {
            let (blocks, bytes) = t.tenant_usage(tenant);
            tiers.push(TierUsage {
                tier: t.name().to_string(),
                blocks: blocks as u64,
                bytes,
            });
            // Written-through copies of blocks DRAM holds too count once.
            distinct_bytes += t
                .inventory()
                .into_iter()
                .filter(|(h, owner, _)| {
                    *owner == tenant
                        && !self
                            .blocks
                            .get(h)
                            .is_some_and(|b| b.scope.tenant == tenant && b.expires_at > now)
                })
                .map(|(_, _, bytes)| bytes)
                .sum::<u64>();
        }
        TenantCacheStats {
            tiers,
            evictions: self.removals.get(&tenant).copied().unwrap_or_default(),
            top_prefixes,
            nodes: 1,
            distinct_bytes,
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
                self.left_lower(&h);
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

    /// Drop the blocks of `tenant` that the tier below DRAM kept from before `before_unix_ms`
    /// (a purge this node missed while it was down: applied at start, before it serves).
    /// The DRAM tier starts empty, so only the tier below holds such blocks.
    pub fn purge_tenant_written_before(&mut self, tenant: TenantId, before_unix_ms: u64) -> usize {
        let Some(t) = self.lower.as_mut() else {
            return 0;
        };
        let gone = t.remove_tenant_written_before(tenant, before_unix_ms);
        let n = gone.len();
        for h in gone {
            self.left_lower(&h);
        }
        n
    }

    pub(super) fn set_leaf(
        &mut self,
        tenant: TenantId,
        key: u64,
        hash: BlockHash,
        paid: bool,
        extra: bool,
    ) {
        if paid {
            self.paid_leaves.insert((key, hash));
        } else {
            self.leaves.insert((key, hash));
            if !extra && self.is_sticky(&hash) {
                self.sticky_leaves.insert((key, hash));
            }
        }
        self.tenant_leaves
            .entry(tenant)
            .or_default()
            .insert((key, hash));
    }

    /// An owner wrote this block: it is no longer an extra copy.
    pub(super) fn unmark_extra(&mut self, hash: &BlockHash) {
        if let Some(b) = self.blocks.get_mut(hash)
            && b.extra
        {
            b.extra = false;
            let (key, leaf, paid) = (b.key, b.children == 0, b.paid);
            self.extras.remove(&(key, *hash));
            if leaf && !paid && self.is_sticky(hash) {
                self.sticky_leaves.insert((key, *hash));
            }
        }
    }

    pub(super) fn unset_leaf(&mut self, tenant: TenantId, key: u64, hash: BlockHash) {
        self.leaves.remove(&(key, hash));
        self.sticky_leaves.remove(&(key, hash));
        self.paid_leaves.remove(&(key, hash));
        if let Some(set) = self.tenant_leaves.get_mut(&tenant) {
            set.remove(&(key, hash));
        }
    }

    /// Whether a block is stored as part of a paid entry.
    pub fn is_paid(&self, hash: &BlockHash) -> bool {
        self.blocks.get(hash).is_some_and(|b| b.paid)
    }

    pub(super) fn publish_gauges(&self, tenant: TenantId) {
        metrics::RESIDENT_BYTES.set(self.used_bytes as i64);
        metrics::RESIDENT_BLOCKS.set(self.blocks.len() as i64);
        self.publish_tier_gauges();
        metrics::TENANT_BYTES
            .with_label_values(&[&tenant.to_string()])
            .set(self.tenant_bytes(tenant) as i64);
    }

    /// Bytes used and capacity of each tier.
    pub(super) fn publish_tier_gauges(&self) {
        let tiers = [("dram", self.used_bytes, self.limits.capacity_bytes)]
            .into_iter()
            .chain(
                self.lower
                    .as_ref()
                    .map(|t| ("lower", t.used_bytes(), t.capacity_bytes())),
            );
        for (tier, used, capacity) in tiers {
            metrics::TIER_BYTES
                .with_label_values(&[tier, "used"])
                .set(used as i64);
            metrics::TIER_BYTES
                .with_label_values(&[tier, "capacity"])
                .set(capacity as i64);
        }
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
        self.replace_data(hash, Bytes::from(v));
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
        if let Some(a) = &self.arena {
            let in_arena: u64 = self
                .blocks
                .values()
                .filter(|b| a.holds(&b.data))
                .map(|b| crate::arena::footprint(b.data.len()))
                .sum();
            assert_eq!(in_arena, self.arena_bytes, "arena bytes");
        }
        let mut orphans: BlockMap<u32> = BlockMap::default();
        for b in self.blocks.values() {
            if let Some(p) = b.parent.filter(|p| !self.blocks.contains_key(p)) {
                *orphans.entry(p).or_default() += 1;
            }
        }
        assert_eq!(orphans, self.orphans, "orphan counts");
        let extra: BTreeSet<(u64, BlockHash)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.extra && !b.paid)
            .map(|(h, b)| (b.key, *h))
            .collect();
        assert_eq!(extra, self.extras, "extra copies");
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
            assert!(!self.extras.contains(l), "an extra copy is never sticky");
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
