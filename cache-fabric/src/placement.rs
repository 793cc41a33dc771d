//! Where blocks live in a cluster: rendezvous (highest-random-weight) hashing, twice.
//!
//! 1. A tenant's **shard group** is the `G` nodes with the highest score for the tenant id:
//!    a tenant's blocks stay on a few nodes (locality for its prefixes, isolation of noisy
//!    tenants), and a node joining or leaving changes a group in at most one member.
//! 2. A block's **owners** are the `R` members of its tenant's group with the highest score
//!    for the block hash, on distinct racks where the group spans enough racks: the highest
//!    scoring node of each not-yet-used rack first, then the best remaining nodes.
//!
//! Scores are a fixed 64-bit mix of the key and a digest of the node id, so every process
//! computes the same placement from the same membership, with no coordination. Adding or
//! removing a node moves only the blocks whose owner set it enters or leaves (about `R/n`
//! of them, property-tested below); nothing else is reshuffled.

use cachet_common::{BlockHash, TenantId};
use sha2::{Digest, Sha256};

/// One member of the cluster as placement sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub id: String,
    /// Failure domain; `None` counts as a rack of its own.
    pub rack: Option<String>,
    seed: u64,
}

impl Member {
    pub fn new(id: impl Into<String>, rack: Option<String>) -> Self {
        let id = id.into();
        let d = Sha256::digest(id.as_bytes());
        let seed = u64::from_le_bytes(d[..8].try_into().expect("8 bytes"));
        Self { id, rack, seed }
    }
}

/// A view of the live members, ordered by id.
#[derive(Clone, Debug, Default)]
pub struct Membership {
    members: Vec<Member>,
}

/// The `fmix64` finalizer of MurmurHash3: a bijection that spreads every input bit.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn score(key: u64, m: &Member) -> u64 {
    mix(key ^ mix(m.seed))
}

fn tenant_key(t: TenantId) -> u64 {
    let v = t.as_uuid().as_u128();
    mix((v as u64) ^ mix((v >> 64) as u64))
}

fn block_key(h: &BlockHash) -> u64 {
    u64::from_le_bytes(h.0[..8].try_into().expect("8 bytes"))
}

impl Membership {
    pub fn new(mut members: Vec<Member>) -> Self {
        members.sort_by(|a, b| a.id.cmp(&b.id));
        members.dedup_by(|a, b| a.id == b.id);
        Self { members }
    }

    pub fn members(&self) -> &[Member] {
        &self.members
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The tenant's shard group: the `g` best-scoring members (all of them if fewer).
    pub fn shard_group(&self, tenant: TenantId, g: usize) -> Vec<&Member> {
        let key = tenant_key(tenant);
        let mut ranked: Vec<&Member> = self.members.iter().collect();
        ranked.sort_by_key(|m| std::cmp::Reverse(score(key, m)));
        ranked.truncate(g);
        ranked
    }

    /// The block's `r` owners inside the tenant's group of `g`, best first, on distinct
    /// racks as far as the group's racks allow.
    pub fn owners(&self, tenant: TenantId, block: &BlockHash, g: usize, r: usize) -> Vec<&Member> {
        let key = block_key(block);
        let mut ranked = self.shard_group(tenant, g);
        ranked.sort_by_key(|m| std::cmp::Reverse(score(key, m)));
        let mut chosen: Vec<&Member> = Vec::with_capacity(r);
        let mut racks: Vec<Option<&str>> = Vec::new();
        for m in &ranked {
            if chosen.len() == r {
                break;
            }
            let rack = m.rack.as_deref();
            // A member without a rack label is its own failure domain.
            if rack.is_none() || !racks.contains(&rack) {
                racks.push(rack);
                chosen.push(m);
            }
        }
        for m in &ranked {
            if chosen.len() == r {
                break;
            }
            if !chosen.iter().any(|c| c.id == m.id) {
                chosen.push(m);
            }
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn cluster(n: usize, racks: usize) -> Vec<Member> {
        (0..n)
            .map(|i| {
                let rack = (racks > 0).then(|| format!("rack-{}", i % racks));
                Member::new(format!("node-{i}"), rack)
            })
            .collect()
    }

    fn block(i: u64) -> BlockHash {
        BlockHash(Sha256::digest(i.to_le_bytes()).into())
    }

    fn ids(v: &[&Member]) -> HashSet<String> {
        v.iter().map(|m| m.id.clone()).collect()
    }

    #[test]
    fn owners_are_distinct_in_group_and_on_distinct_racks_when_possible() {
        let m = Membership::new(cluster(9, 3));
        let t = TenantId::new();
        let group = ids(&m.shard_group(t, 6));
        assert_eq!(group.len(), 6);
        for i in 0..500 {
            let o = m.owners(t, &block(i), 6, 3);
            assert_eq!(ids(&o).len(), 3);
            assert!(ids(&o).is_subset(&group));
            let racks: HashSet<_> = o.iter().map(|m| m.rack.clone()).collect();
            let group_racks: HashSet<_> =
                m.shard_group(t, 6).iter().map(|m| m.rack.clone()).collect();
            assert_eq!(racks.len(), 3.min(group_racks.len()), "block {i}");
        }
    }

    #[test]
    fn a_small_cluster_gives_what_it_has() {
        let m = Membership::new(cluster(2, 0));
        let o = m.owners(TenantId::new(), &block(1), 3, 3);
        assert_eq!(o.len(), 2);
        assert!(
            Membership::default()
                .owners(TenantId::new(), &block(1), 3, 2)
                .is_empty()
        );
    }

    #[test]
    fn load_spreads_evenly() {
        let m = Membership::new(cluster(8, 0));
        let t = TenantId::new();
        let mut per: std::collections::HashMap<String, usize> = Default::default();
        for i in 0..8000 {
            for o in m.owners(t, &block(i), 8, 2) {
                *per.entry(o.id.clone()).or_default() += 1;
            }
        }
        // 16,000 placements over 8 nodes: 2,000 each; allow ±15%.
        for (n, c) in per {
            assert!((1700..=2300).contains(&c), "{n}: {c}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// One node joining or leaving changes a shard group by at most one member in and
        /// one out, and a block's owners change only where that member was or becomes one
        /// of them: nothing else moves.
        #[test]
        fn membership_changes_move_only_blocks_whose_owners_change(
            n in 3usize..10, g in 2usize..8, r in 1usize..4, seed in any::<u64>(),
        ) {
            let base = cluster(n, 0);
            let old = Membership::new(base.clone());
            let mut grown = base.clone();
            grown.push(Member::new(format!("new-{seed}"), None));
            let mut shrunk = base;
            shrunk.remove((seed % n as u64) as usize);
            let t = TenantId::from(uuid::Uuid::from_u64_pair(seed, !seed));
            let old_group = ids(&old.shard_group(t, g));
            for changed in [Membership::new(grown), Membership::new(shrunk)] {
                let group = ids(&changed.shard_group(t, g));
                let left: HashSet<_> = old_group.difference(&group).cloned().collect();
                let came: HashSet<_> = group.difference(&old_group).cloned().collect();
                prop_assert!(left.len() <= 1 && came.len() <= 1);
                let mut moved = 0;
                for i in 0..400 {
                    let b = block(seed.wrapping_add(i));
                    let before = ids(&old.owners(t, &b, g, r));
                    let after = ids(&changed.owners(t, &b, g, r));
                    if before.is_disjoint(&left) && after.is_disjoint(&came) {
                        prop_assert_eq!(&before, &after);
                    }
                    if before != after {
                        moved += 1;
                    }
                }
                // Only blocks touching the one member in or out move: about r/g of them.
                let bound = 400.0 * (r.min(g) as f64 / g.min(n) as f64) * 2.0 + 40.0;
                prop_assert!((moved as f64) <= bound, "{} moved, bound {}", moved, bound);
            }
        }

        /// With racks, a change still leaves most blocks where they were.
        #[test]
        fn rack_aware_placement_stays_mostly_stable(n in 4usize..12, seed in any::<u64>()) {
            let base = cluster(n, 3);
            let old = Membership::new(base.clone());
            let mut grown = base;
            grown.push(Member::new(format!("new-{seed}"), Some("rack-0".into())));
            let bigger = Membership::new(grown);
            let t = TenantId::from(uuid::Uuid::from_u64_pair(seed, seed ^ 1));
            let changed = (0..600u64)
                .filter(|i| {
                    let b = block(seed.wrapping_add(*i));
                    ids(&old.owners(t, &b, n + 1, 2)) != ids(&bigger.owners(t, &b, n + 1, 2))
                })
                .count();
            // Each block's owner set changes only if the newcomer enters it: about 2/(n+1).
            let expected = 600.0 * 2.0 / (n as f64 + 1.0);
            prop_assert!((changed as f64) < expected * 1.6 + 30.0, "{} changed, ~{} expected", changed, expected);
        }
    }
}
