//! Following the stream as a router does: which engine instance's own KV cache holds which
//! block (medium `ENGINE`), kept from the nodes' batches, with the stream's resync protocol.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use cachet_common::BlockHash;

use super::{Batch, Continuity, KvEvent, Medium, Sequences, parse_batches, request_resync, stream};
use crate::index::{BlockEvent, MAX_NODES, PrefixIndex};
use crate::metrics;

/// Which engine instances hold which blocks.
#[derive(Default)]
pub struct EngineView {
    index: PrefixIndex,
    /// Instance → its slot in the index.
    slots: HashMap<String, usize>,
    /// Slot → the node its instance runs beside.
    node_of: HashMap<usize, String>,
}

impl EngineView {
    /// Of `chain`, the leading blocks in the cache of the node's engine instance that holds
    /// the most of them. Counted block by block up to the first one missing (an engine's
    /// cache evicts in any order, so a binary search could count past a hole).
    pub fn leading(&self, node: &str, chain: &[BlockHash]) -> usize {
        self.node_of
            .iter()
            .filter(|(_, n)| n.as_str() == node)
            .map(|(slot, _)| {
                chain
                    .iter()
                    .take_while(|h| self.index.nodes(h).contains(*slot))
                    .count()
            })
            .max()
            .unwrap_or(0)
    }

    /// Blocks held in engine caches (each counted once).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    fn slot(&mut self, node: &str, instance: &str) -> Option<usize> {
        if let Some(s) = self.slots.get(instance) {
            return Some(*s);
        }
        let s = (0..MAX_NODES).find(|s| !self.node_of.contains_key(s))?;
        self.slots.insert(instance.to_string(), s);
        self.node_of.insert(s, node.to_string());
        Some(s)
    }

    /// Apply one batch's engine events (other media are the fabric's, indexed elsewhere).
    pub fn apply(&mut self, b: &Batch) -> usize {
        let mut applied = 0;
        for e in b.events.iter().filter(|e| e.medium() == Medium::Engine) {
            let Some(slot) = self.slot(&b.node, e.instance()) else {
                continue;
            };
            match e {
                KvEvent::BlockStored { block_hashes, .. } => {
                    for &hash in block_hashes {
                        self.index.apply(BlockEvent::Stored { hash, slot });
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    for &hash in block_hashes {
                        self.index.apply(BlockEvent::Removed { hash, slot });
                    }
                }
                KvEvent::AllBlocksCleared { .. } => self.index.remove_node(slot),
            }
            applied += 1;
        }
        applied
    }

    /// A node left: its instances' blocks leave the view and their slots are free again.
    pub fn forget_node(&mut self, node: &str) {
        let gone: Vec<usize> = self
            .node_of
            .iter()
            .filter(|(_, n)| n.as_str() == node)
            .map(|(s, _)| *s)
            .collect();
        for s in gone {
            self.index.remove_node(s);
            self.node_of.remove(&s);
            self.slots.retain(|_, v| *v != s);
        }
    }
}

/// Keeps an [`EngineView`] from the stream.
pub struct EngineFollower {
    prefix: String,
    last_id: Option<String>,
    seqs: Sequences,
    view: Arc<RwLock<EngineView>>,
}

impl EngineFollower {
    pub fn new(prefix: impl Into<String>, view: Arc<RwLock<EngineView>>) -> Self {
        Self {
            prefix: prefix.into(),
            last_id: None,
            seqs: Sequences::default(),
            view,
        }
    }

    /// The first call positions the follower at the stream's end and asks every node for a
    /// resync (the view is built from their snapshots); each call then applies the batches
    /// that came (waiting up to `block`), asking a node whose batches were lost for a resync.
    /// Use a connection of its own: it blocks.
    pub async fn poll(
        &mut self,
        conn: &mut (impl redis::aio::ConnectionLike + Send),
        block: Duration,
    ) -> redis::RedisResult<usize> {
        let stream = stream(&self.prefix);
        let last = match &self.last_id {
            Some(l) => l.clone(),
            None => {
                let tail: Vec<redis::Value> = redis::cmd("XREVRANGE")
                    .arg(&stream)
                    .arg("+")
                    .arg("-")
                    .arg("COUNT")
                    .arg(1)
                    .query_async(conn)
                    .await?;
                let id = crate::streams::parse_entries(tail)
                    .pop()
                    .map_or_else(|| "0-0".to_string(), |(id, _)| id);
                request_resync(conn, &self.prefix, "*").await?;
                self.last_id = Some(id.clone());
                id
            }
        };
        let reply: redis::Value = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(500)
            .arg("BLOCK")
            .arg(block.as_millis() as u64)
            .arg("STREAMS")
            .arg(&stream)
            .arg(&last)
            .query_async(conn)
            .await?;
        // Decoded before the view is locked: routing reads it on every request.
        let batches = parse_batches(reply);
        let mut applied = 0;
        let mut gaps = Vec::new();
        {
            let view = self.view.clone();
            let mut view = view.write().unwrap_or_else(|p| p.into_inner());
            for (id, batch) in batches {
                self.last_id = Some(id);
                let Some(b) = batch else { continue };
                if self.seqs.check(&b) == Continuity::Gap && !gaps.contains(&b.node) {
                    gaps.push(b.node.clone());
                }
                applied += view.apply(&b);
            }
        }
        for node in gaps {
            metrics::KV_EVENTS.with_label_values(&["gaps"]).inc();
            tracing::info!(node = %node, "KV events were lost; asking the node for a resync");
            request_resync(conn, &self.prefix, &node).await?;
        }
        Ok(applied)
    }

    /// A node left the cluster.
    pub fn forget_node(&mut self, node: &str) {
        self.seqs.forget(node);
        self.view
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .forget_node(node);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    fn stored(instance: &str, medium: Medium, hashes: &[u8]) -> KvEvent {
        KvEvent::BlockStored {
            instance: instance.into(),
            medium,
            block_hashes: hashes.iter().map(|i| h(*i)).collect(),
            parent_block_hash: None,
            block_size: Some(128),
            engine_medium: None,
        }
    }

    fn batch(node: &str, events: Vec<KvEvent>) -> Batch {
        Batch {
            node: node.into(),
            epoch: "e".into(),
            seq: 0,
            ts_ms: 0,
            events,
        }
    }

    #[test]
    fn the_view_counts_leading_blocks_per_node_from_engine_events_only() {
        let mut v = EngineView::default();
        v.apply(&batch(
            "n1",
            vec![
                stored("n1/0", Medium::Engine, &[1, 2, 3]),
                stored("n1/1", Medium::Engine, &[1, 2, 3, 4]),
                stored("n1", Medium::Dram, &[1, 2, 3, 4, 5]),
            ],
        ));
        v.apply(&batch("n2", vec![stored("n2/0", Medium::Engine, &[1, 3])]));
        let chain: Vec<BlockHash> = (1..=5).map(h).collect();
        assert_eq!(
            v.leading("n1", &chain),
            4,
            "the better of its two instances"
        );
        assert_eq!(v.leading("n2", &chain), 1, "a hole ends the leading run");
        assert_eq!(v.leading("n3", &chain), 0);
        v.apply(&batch(
            "n1",
            vec![KvEvent::AllBlocksCleared {
                instance: "n1/1".into(),
                medium: Medium::Engine,
            }],
        ));
        assert_eq!(v.leading("n1", &chain), 3);
        v.apply(&batch(
            "n1",
            vec![KvEvent::BlockRemoved {
                instance: "n1/0".into(),
                medium: Medium::Engine,
                block_hashes: vec![h(2)],
            }],
        ));
        assert_eq!(v.leading("n1", &chain), 1);
        v.forget_node("n1");
        assert_eq!(v.leading("n1", &chain), 0);
        assert_eq!(v.slots.len(), 1, "n1's slots are free again");
    }
}
