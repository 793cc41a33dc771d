//! Block events from nodes to gateways: a node's store reports every block it starts or stops
//! holding, a publisher appends them to a Redis Stream, and each gateway follows the stream
//! into its [`PrefixIndex`].
//!
//! - The store never waits on Redis: events go through a bounded channel; when it is full
//!   (Redis away for long) events are dropped and counted. Events are idempotent, so a node
//!   re-announcing what it holds, or a replayed batch, is harmless.
//! - Stream entries: `n` node id, `o` `s` (stored) or `r` (removed), `h` the 32-byte hash,
//!   `t` the event's wall-clock time in ms. The stream is trimmed (`MAXLEN ~`).
//! - The follower assigns each node id an index slot, applies entries in stream order, and
//!   records the index's staleness: apply time − event time
//!   (`cachet_fabric_index_staleness_seconds`).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use cachet_common::BlockHash;
use redis::Value;
use tokio::sync::mpsc;

use crate::index::{BlockEvent, MAX_NODES, PrefixIndex};
use crate::kv_events::{KvEvent, KvSink, Medium};
use crate::{metrics, unix_ms};

/// What a store reports: a block entering or leaving one of its media (DRAM, the tier
/// below).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreEvent {
    /// The node holds the block on this medium (perhaps on another too).
    Stored(BlockHash, Medium),
    /// The block left this medium; `gone`: the node holds it on none now.
    Removed {
        hash: BlockHash,
        medium: Medium,
        gone: bool,
    },
}

impl StoreEvent {
    /// The same change in the documented KV event stream, `node` being the instance.
    pub fn to_kv(self, node: &str) -> KvEvent {
        match self {
            StoreEvent::Stored(h, medium) => KvEvent::BlockStored {
                instance: node.to_string(),
                medium,
                block_hashes: vec![h],
                parent_block_hash: None,
                block_size: None,
                engine_medium: None,
            },
            StoreEvent::Removed { hash, medium, .. } => KvEvent::BlockRemoved {
                instance: node.to_string(),
                medium,
                block_hashes: vec![hash],
            },
        }
    }
}

/// The store's end of the event channel. Never blocks.
#[derive(Clone)]
pub struct EventSink(mpsc::Sender<StoreEvent>);

impl EventSink {
    pub fn emit(&self, e: StoreEvent) {
        if self.0.try_send(e).is_err() {
            metrics::EVENTS.with_label_values(&["dropped"]).inc();
        }
    }
}

/// A bounded event channel for one node.
pub fn channel(capacity: usize) -> (EventSink, mpsc::Receiver<StoreEvent>) {
    let (tx, rx) = mpsc::channel(capacity);
    (EventSink(tx), rx)
}

/// Append the node's events to `stream` in batches until the channel closes (whether a
/// block is on the node: a move between its media is not an event there), and hand each,
/// with its medium, to the documented KV event stream's publisher (`kv`). A failed batch
/// is retried a few times, then dropped (and counted); the index misses those blocks (a node
/// re-announcing its holdings would heal it; not built yet).
pub async fn publish(
    mut conn: impl redis::aio::ConnectionLike + Send,
    stream: String,
    node: String,
    mut rx: mpsc::Receiver<StoreEvent>,
    max_len: usize,
    kv: Option<KvSink>,
) {
    let mut batch = Vec::with_capacity(512);
    while let Some(first) = rx.recv().await {
        batch.clear();
        batch.push(first);
        while batch.len() < 512 {
            match rx.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        let t = unix_ms();
        let mut pipe = redis::pipe();
        if let Some(kv) = &kv {
            for e in &batch {
                kv.emit(e.to_kv(&node));
            }
        }
        batch.retain(|e| !matches!(e, StoreEvent::Removed { gone: false, .. }));
        if batch.is_empty() {
            continue;
        }
        for e in &batch {
            let (o, h) = match e {
                StoreEvent::Stored(h, _) => ("s", h),
                StoreEvent::Removed { hash, .. } => ("r", hash),
            };
            pipe.cmd("XADD")
                .arg(&stream)
                .arg("MAXLEN")
                .arg("~")
                .arg(max_len)
                .arg("*")
                .arg("n")
                .arg(&node)
                .arg("o")
                .arg(o)
                .arg("h")
                .arg(&h.0[..])
                .arg("t")
                .arg(t)
                .ignore();
        }
        let mut sent = false;
        for attempt in 0..5u32 {
            match pipe.query_async::<()>(&mut conn).await {
                Ok(()) => {
                    sent = true;
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, attempt, "publishing block events failed");
                    tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                }
            }
        }
        metrics::EVENTS
            .with_label_values(&[if sent { "published" } else { "dropped" }])
            .inc_by(batch.len() as u64);
    }
}

/// Keeps a [`PrefixIndex`] from the stream.
pub struct Follower {
    stream: String,
    last_id: String,
    slots: HashMap<String, usize>,
    index: Arc<RwLock<PrefixIndex>>,
}

impl Follower {
    /// Follow `stream` from its beginning (`0-0`; the stream holds the recent past) or from
    /// `from` (an id, or `$` for new entries only).
    pub fn new(stream: impl Into<String>, from: &str, index: Arc<RwLock<PrefixIndex>>) -> Self {
        Self {
            stream: stream.into(),
            last_id: from.to_string(),
            slots: HashMap::new(),
            index,
        }
    }

    /// The slot of a node id, assigned on first sight (`None` past [`MAX_NODES`]).
    pub fn slot(&mut self, node: &str) -> Option<usize> {
        if let Some(s) = self.slots.get(node) {
            return Some(*s);
        }
        let s = self.slots.len();
        if s >= MAX_NODES {
            return None;
        }
        self.slots.insert(node.to_string(), s);
        Some(s)
    }

    /// Read and apply one batch (waiting up to `block` for it). Returns entries applied.
    pub async fn poll(
        &mut self,
        conn: &mut impl redis::aio::ConnectionLike,
        block: Duration,
    ) -> redis::RedisResult<usize> {
        let reply: Value = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(1000)
            .arg("BLOCK")
            .arg(block.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(&self.last_id)
            .query_async(conn)
            .await?;
        let entries = crate::streams::parse_xread(reply);
        let now = unix_ms();
        let mut applied = 0;
        let index_lock = self.index.clone();
        let mut index = index_lock.write().unwrap_or_else(|p| p.into_inner());
        for (id, fields) in entries {
            self.last_id = id;
            let get = |k: &[u8]| {
                fields
                    .iter()
                    .find(|(f, _)| f == k)
                    .map(|(_, v)| v.as_slice())
            };
            let (Some(node), Some(o), Some(h), Some(t)) =
                (get(b"n"), get(b"o"), get(b"h"), get(b"t"))
            else {
                continue;
            };
            let Ok(hash) = <[u8; 32]>::try_from(h) else {
                continue;
            };
            let node = String::from_utf8_lossy(node).into_owned();
            let Some(slot) = self.slot(&node) else {
                continue;
            };
            let hash = BlockHash(hash);
            index.apply(match o {
                b"s" => BlockEvent::Stored { hash, slot },
                _ => BlockEvent::Removed { hash, slot },
            });
            applied += 1;
            if let Some(t) = std::str::from_utf8(t)
                .ok()
                .and_then(|t| t.parse::<u64>().ok())
            {
                metrics::INDEX_STALENESS.observe(now.saturating_sub(t) as f64 / 1000.0);
            }
        }
        metrics::EVENTS
            .with_label_values(&["applied"])
            .inc_by(applied as u64);
        Ok(applied)
    }
}
