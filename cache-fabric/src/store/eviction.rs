//! What leaves when room is needed, and the policy's hand in it: quota and capacity
//! victims (extra copies first, sticky popular leaves last), reservations and fair shares,
//! demotion of paid leaves, and re-ranking after the adaptive policy moves.

use super::*;

impl Store {
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
    /// Where the tier below keeps paid blocks, the share is of DRAM and that tier together
    /// (paid entries move down under DRAM pressure, so a tenant can fill both).
    pub(super) fn over_fair_share(&self, writer: TenantId, incoming: u64) -> Option<TenantId> {
        let (capacity, held) = self.fair_share_usage();
        let held_by = |t: TenantId| held.get(&t).copied().unwrap_or(0);
        let mut tenants = held.values().filter(|b| **b > 0).count();
        if held_by(writer) == 0 {
            tenants += 1;
        }
        let share = capacity / tenants.max(1) as u64;
        if held_by(writer) + incoming > share {
            return None;
        }
        held.iter()
            .filter(|(t, b)| {
                **t != writer
                    && **b > share
                    && !self.tenant_quota.contains_key(t)
                    && self.tenant_reserved.get(t).is_none_or(|r| *b > r)
            })
            .max_by_key(|(_, b)| **b)
            .map(|(t, _)| *t)
    }

    /// What the fair share divides, and what each tenant holds of it: DRAM, plus the tier
    /// below where it keeps paid blocks. Read only when a full node has nothing else to give.
    fn fair_share_usage(&self) -> (u64, HashMap<TenantId, u64>) {
        let mut held = self.tenant_bytes.clone();
        let mut capacity = self.limits.capacity_bytes;
        if let Some(tier) = self.lower.as_ref().filter(|t| t.keeps_paid()) {
            capacity += tier.capacity_bytes();
            for (t, b) in tier.usage_by_tenant() {
                *held.entry(t).or_insert(0) += b;
            }
        }
        (capacity, held)
    }

    /// Make DRAM room by taking from `over`, a tenant over its fair share: its
    /// lowest-ranked DRAM leaf; or, where it holds none that can go and the tier below keeps
    /// paid blocks, its blocks there (those it paid least to keep first) until a paid leaf
    /// can move down. Whether room was made.
    pub(super) fn give_way(&mut self, over: TenantId, pinned: &BlockSet) -> bool {
        if self.evict_one(Some(over), pinned, RemovalReason::Quota) {
            return true;
        }
        let Some(victims) = self
            .lower
            .as_ref()
            .filter(|t| t.keeps_paid())
            .map(|t| t.tenant_victims(over))
        else {
            return false;
        };
        for h in victims {
            if !self.lower.as_mut().is_some_and(|t| t.remove(&h)) {
                continue;
            }
            self.left_lower(&h);
            self.removals
                .entry(over)
                .or_default()
                .count(RemovalReason::Quota, false);
            metrics::EVICTIONS.with_label_values(&["quota"]).inc();
            if self.demote_paid(pinned) {
                return true;
            }
        }
        false
    }

    /// The best-effort leaf capacity eviction takes next: the lowest-ranked one that is not
    /// pinned and whose removal keeps its tenant at or above its reservation.
    /// Extra copies of blocks other nodes own go first, whatever their rank and wherever
    /// they sit in a chain; popular owner copies go last.
    pub(super) fn capacity_victim(&self, pinned: &BlockSet) -> Option<(u64, BlockHash)> {
        let takeable =
            |(_, h): &&(u64, BlockHash)| !pinned.contains(h) && self.reservation_allows(h);
        self.extras
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
    pub(super) fn reservation_allows(&self, hash: &BlockHash) -> bool {
        self.blocks.get(hash).is_none_or(|b| {
            let t = b.scope.tenant;
            let reserved = self.tenant_reserved.get(&t).copied().unwrap_or(0);
            self.tenant_bytes(t).saturating_sub(b.data.len() as u64) >= reserved
        })
    }

    /// Popular leaves whose uses faded become ordinary again; looks at the few least
    /// recently used ones each time capacity eviction runs, so the check is amortized.
    pub(super) fn unstick_faded(&mut self) {
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

    /// Set (or clear, with `None`) a tenant's resident-bytes quota. Lowering it below the
    /// tenant's usage evicts that tenant's own lowest-ranked blocks.
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
    pub(super) fn rekey_some(&mut self, budget: usize) {
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
            if self.extras.remove(&(old, hash)) {
                self.extras.insert((key, hash));
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
    pub(super) fn capacity_blocks(&self) -> usize {
        let cap = self.limits.capacity_bytes;
        let per_block = self
            .used_bytes
            .checked_div(self.blocks.len() as u64)
            .unwrap_or(1);
        usize::try_from(cap / per_block.max(1)).unwrap_or(usize::MAX)
    }

    /// Evict the lowest-ranked leaf of `tenant` (any leaf), or else of anyone (a leaf that
    /// is not paid), skipping `pinned`.
    pub(super) fn evict_one(
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
    pub(super) fn demote_paid(&mut self, pinned: &BlockSet) -> bool {
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

    /// Whether a stored block is kept last among leaves: popular, and used within the last
    /// two turnovers of the store ([`STICKY_GRACE_TURNS`]). The estimate alone fades too
    /// slowly (its counters halve every ten turnovers): the parent of a finished
    /// conversation, read on every turn, would outstay everything newer.
    pub(super) fn is_sticky(&self, hash: &BlockHash) -> bool {
        let grace = STICKY_GRACE_TURNS * self.blocks.len().max(1024) as u64;
        popular(&self.ranking, hash)
            && self
                .blocks
                .get(hash)
                .is_some_and(|b| self.clock.saturating_sub(b.last_use) <= grace)
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
}
