//! Engines' own block hashes → Cachet's block keys, on one node.
//!
//! An engine's KV events name blocks by the engine's hashes (vLLM's: a hash of the token ids,
//! its parent and the request's cache salt). Cachet's connector, which knows both names of
//! every full block of a prompt it was given keys for, tells the node the pairs before the
//! engine computes or loads the blocks (`MAP` on the fabric's wire). The node keeps:
//!
//! - the pairs not yet seen stored (`pending`): bounded, oldest dropped first (a request
//!   that never ran leaves nothing behind for long);
//! - per engine instance, the blocks its cache holds (`held`): what its `BlockRemoved` and a
//!   snapshot need. Bounded by the engine's own cache size; cleared with it.
//!
//! A block the engine stores that no connector mapped (a request sent to vLLM directly, the
//! blocks of generated tokens) is not Cachet's: it is counted and left out.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use cachet_common::BlockHash;

use super::{KvEvent, Medium};
use crate::metrics;

/// An engine's name for a block, as its events carry it (vLLM: the 64-bit integer form,
/// big-endian, or the hash's bytes).
pub type EngineHash = Box<[u8]>;

/// Pairs kept waiting for their block to be stored, by default.
pub const PENDING: usize = 1 << 18;

pub struct EngineMap {
    inner: Mutex<Inner>,
}

struct Inner {
    pending: HashMap<EngineHash, BlockHash>,
    order: VecDeque<EngineHash>,
    cap: usize,
    held: HashMap<String, HashMap<EngineHash, BlockHash>>,
}

impl Default for EngineMap {
    fn default() -> Self {
        Self::with_capacity(PENDING)
    }
}

impl EngineMap {
    pub fn with_capacity(cap: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                pending: HashMap::new(),
                order: VecDeque::new(),
                cap: cap.max(1),
                held: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connector's pairs (engine hash, Cachet key).
    pub fn learn(&self, pairs: impl IntoIterator<Item = (EngineHash, BlockHash)>) {
        let mut m = self.lock();
        for (h, k) in pairs {
            if m.pending.insert(h.clone(), k).is_none() {
                m.order.push_back(h);
            }
            while m.pending.len() > m.cap {
                let Some(old) = m.order.pop_front() else {
                    break;
                };
                m.pending.remove(&old);
            }
        }
        // The order queue holds each pending hash once, plus hashes already taken out.
        if m.order.len() > 2 * m.cap {
            let Inner { pending, order, .. } = &mut *m;
            order.retain(|h| pending.contains_key(h));
        }
    }

    /// The engine `instance` stored these blocks: their keys (the mapped ones, in order) and
    /// the key of `parent` where it is known.
    pub fn stored(
        &self,
        instance: &str,
        hashes: &[EngineHash],
        parent: Option<&EngineHash>,
    ) -> (Vec<BlockHash>, Option<BlockHash>) {
        let mut m = self.lock();
        let parent = parent.and_then(|p| {
            m.held
                .get(instance)
                .and_then(|h| h.get(p))
                .or_else(|| m.pending.get(p))
                .copied()
        });
        let mut keys = Vec::with_capacity(hashes.len());
        for h in hashes {
            // Kept pending too: another instance may store the same block (the same
            // content hashes the same on every instance).
            let Some(k) = m
                .pending
                .get(h)
                .copied()
                .or_else(|| m.held.values().find_map(|held| held.get(h).copied()))
            else {
                metrics::KV_EVENTS.with_label_values(&["unmapped"]).inc();
                continue;
            };
            m.held
                .entry(instance.to_string())
                .or_default()
                .insert(h.clone(), k);
            keys.push(k);
        }
        (keys, parent)
    }

    /// The engine `instance` dropped these blocks: the keys of those it held.
    pub fn removed(&self, instance: &str, hashes: &[EngineHash]) -> Vec<BlockHash> {
        let mut m = self.lock();
        let Some(held) = m.held.get_mut(instance) else {
            return Vec::new();
        };
        hashes.iter().filter_map(|h| held.remove(h)).collect()
    }

    /// The engine `instance`'s cache was emptied (reset, restarted).
    pub fn cleared(&self, instance: &str) {
        self.lock().held.remove(instance);
    }

    /// Blocks the engine `instance` holds.
    pub fn held(&self, instance: &str) -> usize {
        self.lock().held.get(instance).map_or(0, |h| h.len())
    }

    /// Every instance's holdings as stored events (for a snapshot); `instances` are named
    /// even when they hold nothing, so a snapshot clears them.
    pub fn snapshot(&self, instances: &[String]) -> Vec<KvEvent> {
        let m = self.lock();
        let mut out = Vec::new();
        for i in instances {
            out.push(KvEvent::AllBlocksCleared {
                instance: i.clone(),
                medium: Medium::Engine,
            });
            if let Some(held) = m.held.get(i) {
                let keys: Vec<BlockHash> = held.values().copied().collect();
                out.extend(KvEvent::stored_chunks(i, Medium::Engine, &keys));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(i: u64) -> EngineHash {
        i.to_be_bytes().to_vec().into_boxed_slice()
    }

    fn k(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    #[test]
    fn mapped_blocks_are_translated_held_per_instance_and_removed() {
        let m = EngineMap::with_capacity(100);
        m.learn([(e(1), k(1)), (e(2), k(2))]);
        let (keys, parent) = m.stored("a", &[e(1), e(2), e(3)], None);
        assert_eq!(keys, vec![k(1), k(2)], "the unmapped block is left out");
        assert_eq!(parent, None);
        let (keys, parent) = m.stored("b", &[e(2)], Some(&e(1)));
        assert_eq!((keys, parent), (vec![k(2)], Some(k(1))));
        assert_eq!((m.held("a"), m.held("b")), (2, 1));
        assert_eq!(m.removed("a", &[e(2), e(9)]), vec![k(2)]);
        assert_eq!(m.removed("a", &[e(2)]), vec![], "twice is a no-op");
        m.cleared("b");
        assert_eq!(m.held("b"), 0);
        let snap = m.snapshot(&["a".into(), "b".into()]);
        assert_eq!(snap.len(), 3, "a cleared and its block, b cleared");
    }

    #[test]
    fn pending_pairs_are_bounded_oldest_first_but_held_ones_stay() {
        let m = EngineMap::with_capacity(3);
        m.learn((0..3).map(|i| (e(i), k(i as u8))));
        m.stored("a", &[e(0)], None);
        m.learn((3..10).map(|i| (e(i), k(i as u8))));
        let (keys, _) = m.stored("a", &[e(1), e(9)], None);
        assert_eq!(keys, vec![k(9)], "e(1) fell out of the pending pairs");
        assert_eq!(
            m.removed("a", &[e(0)]),
            vec![k(0)],
            "a held block is still known"
        );
        let (keys, _) = m.stored("b", &[e(0)], None);
        assert!(keys.is_empty(), "a and b no longer hold it");
    }
}
