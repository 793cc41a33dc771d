//! The gateway's prefix index: which nodes hold which blocks, kept from the nodes' block
//! events, so a request can be routed to the node holding most of its prefix without asking
//! any node.
//!
//! - One map for all scopes: a block hash already has its scope (tenant, workspace, model) in
//!   its preimage, so no tenant can look up another's blocks, and the index needs no scope
//!   level. Keys are the hash's first 8 bytes (uniformly distributed, so the map hashes them
//!   by identity); values are the set of node slots holding the block, as a bitmask. About
//!   16–20 bytes per indexed block (`cachet loadtest index` measures it).
//! - A truncated key can collide (probability about n²/2⁶⁵: ~3·10⁻⁶ at 10 M blocks). A
//!   collision only makes the index overstate a prefix; the node read verifies full hashes
//!   and checksums, so the cost is a shorter hit than expected, never a wrong block.
//! - [`PrefixIndex::longest_prefix`] binary-searches the chain (a block's ancestors are
//!   normally indexed whenever it is: writes store whole prefixes and eviction takes tails
//!   first), so a 128K-token prompt (8,192 blocks) costs 13 map probes. A hole left by an
//!   out-of-order removal can make the answer too long; again the read corrects it.
//! - Events are idempotent: applying the same `Stored` or `Removed` twice changes nothing, so
//!   a node re-announcing what it holds after a restart, or a replay from a snapshot
//!   position, is safe.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use cachet_common::{BlockHash, BlockHasher};

/// Up to 64 node slots per index (a slot is reused after its node is removed).
pub const MAX_NODES: usize = 64;

/// A set of node slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeSet(pub u64);

impl NodeSet {
    pub fn contains(self, slot: usize) -> bool {
        slot < MAX_NODES && self.0 & (1 << slot) != 0
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub fn slots(self) -> impl Iterator<Item = usize> {
        (0..MAX_NODES).filter(move |s| self.0 & (1 << s) != 0)
    }
}

/// What a node reports about its blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockEvent {
    Stored { hash: BlockHash, slot: usize },
    Removed { hash: BlockHash, slot: usize },
}

fn key(h: &BlockHash) -> u64 {
    u64::from_le_bytes(h.0[..8].try_into().expect("8 bytes"))
}

/// Blocks → node slots.
#[derive(Default)]
pub struct PrefixIndex {
    map: HashMap<u64, NodeSet, BuildHasherDefault<BlockHasher>>,
}

impl PrefixIndex {
    pub fn with_capacity(blocks: usize) -> Self {
        Self {
            map: HashMap::with_capacity_and_hasher(blocks, Default::default()),
        }
    }

    /// Indexed blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Apply one event (idempotent). Returns whether the index changed.
    pub fn apply(&mut self, e: BlockEvent) -> bool {
        match e {
            BlockEvent::Stored { hash, slot } if slot < MAX_NODES => {
                let set = self.map.entry(key(&hash)).or_default();
                let before = *set;
                set.0 |= 1 << slot;
                before != *set
            }
            BlockEvent::Removed { hash, slot } if slot < MAX_NODES => {
                let k = key(&hash);
                let Some(set) = self.map.get_mut(&k) else {
                    return false;
                };
                let before = *set;
                set.0 &= !(1 << slot);
                if set.is_empty() {
                    self.map.remove(&k);
                }
                before.contains(slot)
            }
            _ => false,
        }
    }

    /// Forget a node entirely (it died): every block it held leaves the index.
    pub fn remove_node(&mut self, slot: usize) {
        if slot >= MAX_NODES {
            return;
        }
        let bit = !(1u64 << slot);
        self.map.retain(|_, set| {
            set.0 &= bit;
            !set.is_empty()
        });
    }

    /// Where one block is.
    pub fn nodes(&self, hash: &BlockHash) -> NodeSet {
        self.map.get(&key(hash)).copied().unwrap_or_default()
    }

    /// How many leading blocks of `chain` are indexed, by binary search.
    pub fn longest_prefix(&self, chain: &[BlockHash]) -> usize {
        chain.partition_point(|h| !self.nodes(h).is_empty())
    }

    /// For each node slot, about how many blocks of the indexed prefix it holds itself (its
    /// local share, for routing): counted on at most `samples` blocks spread evenly over the
    /// prefix and scaled up, so a 8,192-block prompt costs `samples` probes, not 8,192.
    /// Exact when the prefix has at most `samples` blocks.
    pub fn local_share(&self, chain: &[BlockHash], samples: usize) -> (usize, [u32; MAX_NODES]) {
        let n = self.longest_prefix(chain);
        let mut per = [0u32; MAX_NODES];
        if n == 0 || samples == 0 {
            return (n, per);
        }
        let step = n.div_ceil(samples);
        let mut taken = 0u32;
        for h in chain[..n].iter().step_by(step) {
            taken += 1;
            let mut bits = self.nodes(h).0;
            while bits != 0 {
                per[bits.trailing_zeros() as usize] += 1;
                bits &= bits - 1;
            }
        }
        for v in per.iter_mut() {
            *v = ((*v as u64 * n as u64) / taken as u64) as u32;
        }
        (n, per)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn h(i: u64) -> BlockHash {
        BlockHash(Sha256::digest(i.to_le_bytes()).into())
    }

    #[test]
    fn events_are_idempotent_and_prefixes_found() {
        let mut idx = PrefixIndex::default();
        let chain: Vec<BlockHash> = (0..100).map(h).collect();
        for (i, b) in chain.iter().enumerate().take(60) {
            assert!(idx.apply(BlockEvent::Stored {
                hash: *b,
                slot: i % 3
            }));
            assert!(!idx.apply(BlockEvent::Stored {
                hash: *b,
                slot: i % 3
            }));
        }
        assert_eq!(idx.longest_prefix(&chain), 60);
        assert_eq!(idx.longest_prefix(&chain[..10]), 10);
        assert_eq!(idx.longest_prefix(&[h(1000)]), 0);
        let (n, per) = idx.local_share(&chain, 100);
        assert_eq!((n, per[0], per[1], per[2]), (60, 20, 20, 20), "exact");
        let (_, per) = idx.local_share(&chain, 10);
        assert_eq!(per.iter().sum::<u32>(), 60, "sampled, scaled to the prefix");
        // Tail-first removal shortens the prefix; removing twice is a no-op.
        assert!(idx.apply(BlockEvent::Removed {
            hash: chain[59],
            slot: 59 % 3
        }));
        assert!(!idx.apply(BlockEvent::Removed {
            hash: chain[59],
            slot: 59 % 3
        }));
        assert_eq!(idx.longest_prefix(&chain), 59);
        // A dead node's blocks leave the index.
        idx.apply(BlockEvent::Stored {
            hash: chain[0],
            slot: 5,
        });
        idx.remove_node(0);
        assert!(idx.nodes(&chain[0]).contains(5) && !idx.nodes(&chain[0]).contains(0));
        assert_eq!(idx.nodes(&chain[3]), NodeSet::default());
        assert!(idx.nodes(&chain[4]).contains(1));
        // Holes (here every third block) can make the binary search overstate the prefix,
        // never understate it: the read that follows verifies block by block.
        assert!(idx.longest_prefix(&chain) >= 3);
        assert!(!idx.apply(BlockEvent::Stored {
            hash: chain[0],
            slot: MAX_NODES
        }));
    }
}
