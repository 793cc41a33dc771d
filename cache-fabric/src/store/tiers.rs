//! The store and the tier under it: demotion on capacity eviction, promotion on a read,
//! handoff of held blocks (draining, re-replication), damaged blocks to fetch again.

use super::*;

impl Store {
    /// Blocks and bytes held by the lower tier, if there is one.
    pub fn lower_tier_usage(&self) -> Option<(usize, u64)> {
        self.lower.as_ref().map(|t| (t.len(), t.used_bytes()))
    }

    /// Block reads the lower tier has served since the store started.
    pub fn lower_tier_reads(&self) -> u64 {
        self.lower_reads
    }

    /// Bring `hash` back from the lower tier into DRAM if it is there, of this scope, not
    /// expired, verified, and continues `parent` (`None`: any parent, a replica read by
    /// hash); making room evicts (and so demotes) other blocks, never one of `pinned`.
    /// When no room can be made (DRAM full of paid blocks, the lower tier too), the block
    /// stays where it is and is returned to be served from there (`Some`, verified).
    pub(super) fn promote(
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
                self.left_lower(hash);
            }
            return None;
        }
        let len = tb.data.len() as u64;
        let mut pinned: BlockSet = pinned.iter().copied().collect();
        pinned.insert(*hash);
        while self.occupied_bytes() + len > self.limits.capacity_bytes {
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
        // A long hold's disk copy stays (written through: it is what a restart keeps).
        let long = super::writes_through(tb.kind(), tb.ttl);
        if let Some(tier) = self.lower.as_mut()
            && !long
        {
            tier.remove(hash);
            let medium = Medium::of_tier(tier.name());
            self.emit(StoreEvent::Removed {
                hash: *hash,
                medium,
                gone: false,
            });
        }
        let remaining = Duration::from_millis(tb.expires_unix_ms - wall);
        let put = PutBlock::new(*hash, tb.parent, tb.n_tokens, tb.data);
        // Without its parent here it comes back as a replica (its chain lives elsewhere).
        let copy = if parent.is_none() {
            super::Copy::Replica
        } else {
            super::Copy::Own
        };
        let shared = super::Shared {
            ttl: tb.shared_ttl,
            until: now + Duration::from_millis(tb.shared_until_unix_ms.saturating_sub(wall)),
        };
        self.insert(scope, put, (tb.ttl, now + remaining, shared), tb.paid, copy);
        metrics::TIER_MOVES.with_label_values(&["promoted"]).inc();
        self.lower_reads += 1;
        None
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
                kind: b.kind(),
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
                    let kind = tb.kind();
                    out.push(Handoff {
                        scope: tb.scope,
                        block: PutBlock::new(tb.hash, tb.parent, tb.n_tokens, tb.data),
                        ttl: tb.ttl,
                        remaining: Duration::from_millis(tb.expires_unix_ms - wall),
                        kind,
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
            sink.emit(StoreEvent::Stored(*h, Medium::Dram));
        }
        if let Some(tier) = &self.lower {
            let medium = Medium::of_tier(tier.name());
            for h in tier.hashes() {
                sink.emit(StoreEvent::Stored(h, medium));
            }
        }
    }

    /// Every block held, by medium (DRAM, the tier below): a snapshot for the KV event stream.
    pub fn held_by_medium(&self) -> Vec<(Medium, Vec<BlockHash>)> {
        let mut out = vec![(Medium::Dram, self.blocks.keys().copied().collect())];
        if let Some(tier) = &self.lower {
            out.push((Medium::of_tier(tier.name()), tier.hashes()));
        }
        out
    }

    /// A stored block as the tier below keeps it (its holds as wall-clock times).
    fn tier_block(&self, hash: &BlockHash) -> Option<TierBlock> {
        let b = self.blocks.get(hash)?;
        let now = Instant::now();
        let wall = unix_ms();
        let at = |i: Instant| wall + i.saturating_duration_since(now).as_millis() as u64;
        Some(TierBlock {
            hash: *hash,
            scope: b.scope,
            parent: b.parent,
            n_tokens: b.n_tokens,
            ttl: b.ttl,
            expires_unix_ms: at(b.expires_at),
            paid: b.paid,
            shared_ttl: b.shared.ttl,
            shared_until_unix_ms: at(b.shared.until),
            data: b.data.clone(),
        })
    }

    /// Copy blocks of long holds ([`super::writes_through`]) to the tier below while they
    /// stay in DRAM, up to about `budget` bytes (a call holds the store for that much disk
    /// writing; the node's writer calls again until nothing is left). Returns the bytes
    /// written. A restart then finds them in the tier below.
    pub fn write_through(&mut self, budget: u64) -> u64 {
        let mut written = 0u64;
        while written < budget {
            let Some(h) = self.through.pop_front() else {
                break;
            };
            self.through_queued.remove(&h);
            let Some(tb) = self.tier_block(&h) else {
                continue;
            };
            if tb.expires_unix_ms <= unix_ms() {
                continue;
            }
            let len = tb.data.len() as u64;
            let Some(tier) = self.lower.as_mut() else {
                self.through.clear();
                self.through_queued.clear();
                break;
            };
            match tier.put(tb) {
                Ok(()) => {
                    written += len;
                    metrics::TIER_MOVES
                        .with_label_values(&["written_through"])
                        .inc();
                }
                Err(e) => {
                    tracing::warn!(block = %h, error = %e, "writing a long hold through to the tier below failed");
                    metrics::TIER_MOVES
                        .with_label_values(&["write_through_failed"])
                        .inc();
                }
            }
        }
        written
    }

    /// Blocks waiting to be written through.
    pub fn write_through_backlog(&self) -> usize {
        self.through.len()
    }

    /// Copy a stored block to the lower tier (with its remaining TTL and paid flag); whether
    /// the tier took it.
    pub(super) fn demote(&mut self, hash: &BlockHash) -> bool {
        let Some(demoted) = self.tier_block(hash) else {
            return false;
        };
        let Some(tier) = self.lower.as_mut() else {
            return false;
        };
        let medium = Medium::of_tier(tier.name());
        match tier.put(demoted) {
            Ok(()) => {
                metrics::TIER_MOVES.with_label_values(&["demoted"]).inc();
                self.emit(StoreEvent::Stored(*hash, medium));
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

    /// A block left the tier below: the node still holds it if DRAM does.
    pub(super) fn left_lower(&self, hash: &BlockHash) {
        let Some(tier) = &self.lower else { return };
        self.emit(StoreEvent::Removed {
            hash: *hash,
            medium: Medium::of_tier(tier.name()),
            gone: !self.blocks.contains_key(hash),
        });
    }

    pub(super) fn note_damaged(&mut self, d: Damaged) {
        if self.damaged.len() >= DAMAGED {
            self.damaged.pop_front();
        }
        self.damaged.push_back(d);
    }

    /// The blocks dropped as corrupt since the last call (see [`Damaged`]).
    pub fn take_damaged(&mut self) -> Vec<Damaged> {
        self.damaged.drain(..).collect()
    }
}
