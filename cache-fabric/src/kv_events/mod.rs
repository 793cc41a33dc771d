//! One stream of KV events for every router: which instance holds which block on which
//! medium, published by every node to the Redis Stream `{prefix}:kv-events`.
//!
//! A node publishes two kinds of holdings, both named by Cachet's scoped block keys (never a
//! token id, a text or an engine's own hash):
//!
//! - its fabric store's blocks, instance = the node id, medium `DRAM`, `DISK` or `GPU` (the
//!   tier the block is on; a demoted block is stored on `DISK` and removed from `DRAM`);
//! - the blocks in the KV cache of each engine beside it (vLLM's own prefix cache), medium
//!   `ENGINE`, instance = `{node}/{engine instance}`, translated from the engine's own KV
//!   events ([`vllm`]) through the map its connector gives the node ([`EngineMap`]).
//!
//! The format (docs/kv-events.md is the reference a router written elsewhere follows): each
//! stream entry has one field, `batch`, a JSON object
//!
//! ```json
//! {"node": "n1", "epoch": "5f0c…", "seq": 42, "ts_ms": 1764325000123,
//!  "events": [{"type": "BlockStored", "instance": "n1/0", "medium": "ENGINE",
//!              "block_hashes": ["9f2c…"], "parent_block_hash": null, "block_size": 128,
//!              "engine_medium": "CPU"},
//!             {"type": "BlockRemoved", "instance": "n1", "medium": "DRAM", "block_hashes": […]},
//!             {"type": "AllBlocksCleared", "instance": "n1/0", "medium": "ENGINE"}]}
//! ```
//!
//! shaped like vLLM's own `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, minus their
//! token ids and extra keys. `seq` counts a node's batches from 0 within one `epoch` (a
//! node's life); a consumer that sees a node's `seq` skip (a batch lost: Redis away, the
//! stream trimmed past its position) asks for a resync by adding `node <id>` (or `node *`) to
//! `{prefix}:kv-resync`, and the node answers in its stream with an `AllBlocksCleared` for
//! each of its (instance, medium) followed by everything it holds. Every new epoch starts the
//! same way, so applying the batches in order rebuilds the holdings.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cachet_common::BlockHash;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics;

mod follow;
pub mod map;
pub mod vllm;

pub use follow::{EngineFollower, EngineView};
pub use map::EngineMap;

/// Where a block is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Medium {
    /// An engine's own KV cache (vLLM's prefix cache): a hit there needs no load at all.
    Engine,
    /// The fabric node's DRAM tier.
    Dram,
    /// The fabric node's local-disk tier.
    Disk,
    /// The fabric node's GPU-memory tier.
    Gpu,
}

impl Medium {
    /// The medium of a fabric tier, by its `TierStore::name`.
    pub fn of_tier(name: &str) -> Self {
        match name {
            "gpu" => Medium::Gpu,
            "dram" => Medium::Dram,
            _ => Medium::Disk,
        }
    }
}

/// Block keys as lowercase hex in the stream.
mod hex_keys {
    use cachet_common::BlockHash;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn parse(s: &str) -> Option<BlockHash> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(BlockHash(out))
    }

    pub fn serialize<S: Serializer>(v: &[BlockHash], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|h| hex::encode(h.0)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<BlockHash>, D::Error> {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|s| parse(s).ok_or_else(|| D::Error::custom("a block hash is 64 hex digits")))
            .collect()
    }

    pub mod option {
        use super::*;

        pub fn serialize<S: Serializer>(v: &Option<BlockHash>, s: S) -> Result<S::Ok, S::Error> {
            match v {
                Some(h) => s.serialize_some(&hex::encode(h.0)),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<BlockHash>, D::Error> {
            Option::<String>::deserialize(d)?
                .map(|s| parse(&s).ok_or_else(|| D::Error::custom("a block hash is 64 hex digits")))
                .transpose()
        }
    }
}

/// One event of the stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    BlockStored {
        instance: String,
        medium: Medium,
        #[serde(with = "hex_keys")]
        block_hashes: Vec<BlockHash>,
        #[serde(with = "hex_keys::option", default)]
        parent_block_hash: Option<BlockHash>,
        /// Tokens per block (an engine's block size); absent for fabric blocks, whose
        /// length each block carries itself.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        block_size: Option<u32>,
        /// For `ENGINE`: where the engine keeps it (vLLM's own medium: GPU, CPU, …).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        engine_medium: Option<String>,
    },
    BlockRemoved {
        instance: String,
        medium: Medium,
        #[serde(with = "hex_keys")]
        block_hashes: Vec<BlockHash>,
    },
    AllBlocksCleared {
        instance: String,
        medium: Medium,
    },
}

impl KvEvent {
    pub fn instance(&self) -> &str {
        match self {
            KvEvent::BlockStored { instance, .. }
            | KvEvent::BlockRemoved { instance, .. }
            | KvEvent::AllBlocksCleared { instance, .. } => instance,
        }
    }

    pub fn medium(&self) -> Medium {
        match self {
            KvEvent::BlockStored { medium, .. }
            | KvEvent::BlockRemoved { medium, .. }
            | KvEvent::AllBlocksCleared { medium, .. } => *medium,
        }
    }

    /// `hashes` stored on `medium` of `instance`, as events of at most [`SNAPSHOT_CHUNK`]
    /// blocks each.
    pub fn stored_chunks(instance: &str, medium: Medium, hashes: &[BlockHash]) -> Vec<KvEvent> {
        hashes
            .chunks(SNAPSHOT_CHUNK)
            .map(|c| KvEvent::BlockStored {
                instance: instance.to_string(),
                medium,
                block_hashes: c.to_vec(),
                parent_block_hash: None,
                block_size: None,
                engine_medium: None,
            })
            .collect()
    }
}

/// Blocks per event in a snapshot.
pub const SNAPSHOT_CHUNK: usize = 1024;

/// One entry of the stream: a node's batch of events.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub node: String,
    /// The node's life: a new one after every start.
    pub epoch: String,
    /// The batch's number in this epoch, from 0, one more each batch.
    pub seq: u64,
    pub ts_ms: u64,
    pub events: Vec<KvEvent>,
}

/// The stream's name.
pub fn stream(prefix: &str) -> String {
    format!("{prefix}:kv-events")
}

/// Where consumers ask for a resync.
pub fn resync_stream(prefix: &str) -> String {
    format!("{prefix}:kv-resync")
}

/// A node's end of its event channel: never blocks. An event dropped (the channel full)
/// makes the node publish a snapshot once it can, so no consumer keeps a wrong view.
#[derive(Clone)]
pub struct KvSink {
    tx: mpsc::Sender<KvEvent>,
    lost: Arc<AtomicBool>,
}

impl KvSink {
    pub fn emit(&self, e: KvEvent) {
        if self.tx.try_send(e).is_err() {
            self.lost.store(true, Ordering::Relaxed);
            metrics::KV_EVENTS.with_label_values(&["dropped"]).inc();
        }
    }
}

/// The receiving end, for [`Publisher::run`].
pub struct KvSource {
    rx: mpsc::Receiver<KvEvent>,
    lost: Arc<AtomicBool>,
}

pub fn channel(capacity: usize) -> (KvSink, KvSource) {
    let (tx, rx) = mpsc::channel(capacity);
    let lost = Arc::new(AtomicBool::new(false));
    (
        KvSink {
            tx,
            lost: lost.clone(),
        },
        KvSource { rx, lost },
    )
}

/// What a node publishes its events as.
pub struct Publisher {
    pub prefix: String,
    pub node: String,
    /// Entries the stream keeps (trimmed approximately).
    pub max_len: usize,
    /// Everything the node holds now, for a new epoch and for a resync.
    pub snapshot: Box<dyn Fn() -> Vec<KvEvent> + Send + Sync>,
    /// Least time between two resyncs the node answers.
    pub resync_every: Duration,
}

/// Most events in one batch.
const BATCH_EVENTS: usize = 256;

impl Publisher {
    /// Publish the node's events until `stop` (or the channel closes): a snapshot first (a
    /// new epoch), then batches as events come, and a snapshot again when a consumer asks
    /// (rate-limited) or when an event or batch was lost here.
    pub async fn run(
        self,
        mut conn: impl redis::aio::ConnectionLike + Send,
        mut source: KvSource,
        resync: Arc<tokio::sync::Notify>,
        stop: CancellationToken,
    ) {
        let epoch = uuid::Uuid::new_v4().simple().to_string();
        let stream = stream(&self.prefix);
        let mut seq = 0u64;
        let mut pending: Vec<KvEvent> = self.snapshot_events();
        let mut last_resync = tokio::time::Instant::now();
        loop {
            if pending.is_empty() {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    e = source.rx.recv() => match e {
                        Some(e) => pending.push(e),
                        None => return,
                    },
                    _ = resync.notified() => {
                        let wait = self.resync_every.saturating_sub(last_resync.elapsed());
                        tokio::time::sleep(wait).await;
                        last_resync = tokio::time::Instant::now();
                        pending = self.snapshot_events();
                        metrics::KV_EVENTS.with_label_values(&["resyncs"]).inc();
                    }
                }
            }
            while pending.len() < BATCH_EVENTS {
                match source.rx.try_recv() {
                    Ok(e) => pending.push(e),
                    Err(_) => break,
                }
            }
            let take = pending.len().min(BATCH_EVENTS);
            let batch = Batch {
                node: self.node.clone(),
                epoch: epoch.clone(),
                seq,
                ts_ms: crate::unix_ms(),
                events: pending.drain(..take).collect(),
            };
            seq += 1;
            let n = batch.events.len() as u64;
            if append(&mut conn, &stream, self.max_len, &batch).await {
                metrics::KV_EVENTS
                    .with_label_values(&["published"])
                    .inc_by(n);
            } else {
                // Lost: consumers see the skipped seq; the node starts over with a snapshot.
                metrics::KV_EVENTS.with_label_values(&["dropped"]).inc_by(n);
                source.lost.store(true, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            if pending.is_empty() && source.lost.swap(false, Ordering::Relaxed) {
                pending = self.snapshot_events();
                metrics::KV_EVENTS.with_label_values(&["resyncs"]).inc();
            }
        }
    }

    /// Everything held, after a clear of each (instance, medium) it names (and of the
    /// node's own fabric media, which may hold nothing now).
    fn snapshot_events(&self) -> Vec<KvEvent> {
        let held = (self.snapshot)();
        let mut cleared: Vec<(String, Medium)> = [Medium::Dram, Medium::Disk, Medium::Gpu]
            .into_iter()
            .map(|m| (self.node.clone(), m))
            .collect();
        for e in &held {
            let k = (e.instance().to_string(), e.medium());
            if !cleared.contains(&k) {
                cleared.push(k);
            }
        }
        cleared
            .into_iter()
            .map(|(instance, medium)| KvEvent::AllBlocksCleared { instance, medium })
            .chain(held)
            .collect()
    }
}

/// XADD one batch, retried a few times; whether it is in the stream.
async fn append(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    stream: &str,
    max_len: usize,
    batch: &Batch,
) -> bool {
    let json = serde_json::to_vec(batch).expect("a batch serializes");
    for attempt in 0..5u32 {
        let r: redis::RedisResult<()> = redis::cmd("XADD")
            .arg(stream)
            .arg("MAXLEN")
            .arg("~")
            .arg(max_len)
            .arg("*")
            .arg("batch")
            .arg(&json)
            .query_async(conn)
            .await;
        match r {
            Ok(()) => return true,
            Err(e) => {
                tracing::warn!(error = %e, attempt, "publishing KV events failed");
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
        }
    }
    false
}

/// Follow `{prefix}:kv-resync` from now on and wake `resync` for each request naming `node`
/// (or `*`), until `stop`.
pub async fn watch_resyncs(
    mut conn: impl redis::aio::ConnectionLike + Send,
    prefix: String,
    node: String,
    resync: Arc<tokio::sync::Notify>,
    stop: CancellationToken,
) {
    let stream = resync_stream(&prefix);
    let mut last = "$".to_string();
    while !stop.is_cancelled() {
        let reply: redis::RedisResult<redis::Value> = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(100)
            .arg("BLOCK")
            .arg(200)
            .arg("STREAMS")
            .arg(&stream)
            .arg(&last)
            .query_async(&mut conn)
            .await;
        match reply {
            Ok(v) => {
                for (id, fields) in crate::streams::parse_xread(v) {
                    last = id;
                    let asked = fields
                        .iter()
                        .any(|(k, v)| k == b"node" && (v == b"*" || v == node.as_bytes()));
                    if asked {
                        resync.notify_one();
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading KV resync requests failed");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// What a consumer of the stream keeps per node to notice a gap.
#[derive(Default)]
pub struct Sequences {
    last: std::collections::HashMap<String, (String, u64)>,
}

/// What a batch means for a consumer that has followed the node so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Continuity {
    /// The next batch of the epoch it knows, or the first of a new epoch (which starts with
    /// the node's clears and holdings).
    InOrder,
    /// Batches were lost before this one: ask the node for a resync.
    Gap,
}

impl Sequences {
    pub fn check(&mut self, b: &Batch) -> Continuity {
        let prev = self.last.insert(b.node.clone(), (b.epoch.clone(), b.seq));
        match prev {
            Some((epoch, seq)) if epoch == b.epoch && b.seq != seq + 1 => Continuity::Gap,
            // A first sight mid-epoch is a gap too (what came before it is unknown), unless
            // the batch starts a snapshot.
            None if b.seq != 0
                && !matches!(b.events.first(), Some(KvEvent::AllBlocksCleared { .. })) =>
            {
                Continuity::Gap
            }
            _ => Continuity::InOrder,
        }
    }

    /// Forget a node (it left): its next batch is a first sight.
    pub fn forget(&mut self, node: &str) {
        self.last.remove(node);
    }
}

/// Ask `node` (or every node, `*`) for a resync.
pub async fn request_resync(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    prefix: &str,
    node: &str,
) -> redis::RedisResult<()> {
    redis::cmd("XADD")
        .arg(resync_stream(prefix))
        .arg("MAXLEN")
        .arg("~")
        .arg(1000)
        .arg("*")
        .arg("node")
        .arg(node)
        .query_async(conn)
        .await
}

/// The batches of an `XREAD`/`XRANGE` reply of the stream, with their entry ids.
pub fn parse_batches(v: redis::Value) -> Vec<(String, Option<Batch>)> {
    crate::streams::parse_xread(v)
        .into_iter()
        .map(|(id, fields)| {
            let batch = fields
                .iter()
                .find(|(k, _)| k == b"batch")
                .and_then(|(_, v)| serde_json::from_slice(v).ok());
            (id, batch)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    #[test]
    fn events_read_as_documented() {
        let e = KvEvent::BlockStored {
            instance: "n1/0".into(),
            medium: Medium::Engine,
            block_hashes: vec![h(1), h(2)],
            parent_block_hash: None,
            block_size: Some(128),
            engine_medium: Some("CPU".into()),
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["type"], "BlockStored");
        assert_eq!(v["medium"], "ENGINE");
        assert_eq!(v["block_hashes"][1], "02".repeat(32));
        assert_eq!(v["parent_block_hash"], serde_json::Value::Null);
        assert_eq!(serde_json::from_value::<KvEvent>(v).unwrap(), e);
        let r: KvEvent = serde_json::from_str(
            r#"{"type":"BlockRemoved","instance":"n1","medium":"DISK","block_hashes":["0101010101010101010101010101010101010101010101010101010101010101"]}"#,
        )
        .unwrap();
        assert_eq!(r.medium(), Medium::Disk);
        assert!(
            serde_json::from_str::<KvEvent>(
                r#"{"type":"BlockRemoved","instance":"n1","medium":"DISK","block_hashes":["01"]}"#
            )
            .is_err(),
            "a short hash is refused"
        );
        let c: KvEvent = serde_json::from_str(
            r#"{"type":"AllBlocksCleared","instance":"n1/0","medium":"ENGINE"}"#,
        )
        .unwrap();
        assert_eq!(c.instance(), "n1/0");
    }

    fn batch(node: &str, epoch: &str, seq: u64) -> Batch {
        Batch {
            node: node.into(),
            epoch: epoch.into(),
            seq,
            ts_ms: 0,
            events: vec![],
        }
    }

    #[test]
    fn a_skipped_seq_or_a_first_sight_mid_epoch_is_a_gap() {
        let mut s = Sequences::default();
        assert_eq!(s.check(&batch("a", "e1", 0)), Continuity::InOrder);
        assert_eq!(s.check(&batch("a", "e1", 1)), Continuity::InOrder);
        assert_eq!(s.check(&batch("a", "e1", 3)), Continuity::Gap);
        assert_eq!(s.check(&batch("a", "e1", 4)), Continuity::InOrder);
        assert_eq!(
            s.check(&batch("a", "e2", 0)),
            Continuity::InOrder,
            "a restarted node"
        );
        assert_eq!(s.check(&batch("b", "e9", 7)), Continuity::Gap);
        let mut snapshot = batch("c", "e3", 5);
        snapshot.events.push(KvEvent::AllBlocksCleared {
            instance: "c".into(),
            medium: Medium::Dram,
        });
        assert_eq!(
            s.check(&snapshot),
            Continuity::InOrder,
            "a first sight of a snapshot"
        );
        s.forget("b");
        assert_eq!(s.check(&batch("b", "e9", 0)), Continuity::InOrder);
    }

    #[test]
    fn a_snapshot_clears_every_instance_and_medium_it_names_first() {
        let p = Publisher {
            prefix: "p".into(),
            node: "n1".into(),
            max_len: 10,
            snapshot: Box::new(|| {
                let mut v = KvEvent::stored_chunks("n1", Medium::Dram, &[h(1)]);
                v.extend(KvEvent::stored_chunks(
                    "n1/0",
                    Medium::Engine,
                    &(0..2000).map(|i| h(i as u8)).collect::<Vec<_>>(),
                ));
                v
            }),
            resync_every: Duration::ZERO,
        };
        let ev = p.snapshot_events();
        let clears: Vec<_> = ev
            .iter()
            .take_while(|e| matches!(e, KvEvent::AllBlocksCleared { .. }))
            .map(|e| (e.instance().to_string(), e.medium()))
            .collect();
        assert_eq!(
            clears,
            vec![
                ("n1".into(), Medium::Dram),
                ("n1".into(), Medium::Disk),
                ("n1".into(), Medium::Gpu),
                ("n1/0".into(), Medium::Engine)
            ]
        );
        assert_eq!(ev.len(), 4 + 1 + 2, "2000 engine blocks in two events");
    }
}
