//! vLLM's KV events, followed by the node beside it and published in Cachet's keys.
//!
//! vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
//! "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'` publishes every
//! change to its prefix cache on a ZMQ PUB socket: messages of three frames (topic, sequence
//! number as 8 bytes big-endian, a msgpack `[ts, events, dp_rank]` batch), each event a
//! msgpack map tagged by `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`; older
//! versions: arrays with the tag first). Its ROUTER replay socket answers `["", start seq]`
//! with every buffered batch from there, then an end marker (sequence -1).
//!
//! [`follow`] subscribes, translates each event's vLLM hashes into Cachet keys through the
//! node's [`EngineMap`] (dropping token ids, extra keys and any block no connector mapped)
//! and emits them with medium `ENGINE`. A skipped sequence number is filled from the replay
//! socket; what replay cannot fill, and a vLLM that restarted (its sequence starts over) or
//! went away (the connection dropped), clears the instance: an engine cache thought empty
//! costs a load, one thought full a wrong route.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rmpv::Value;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use super::map::{EngineHash, EngineMap};
use super::{KvEvent, KvSink, Medium};
use crate::metrics;

/// One vLLM instance's publisher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VllmEvents {
    /// The name its events carry in Cachet's stream (`{node}/{index}`).
    pub instance: String,
    /// Its PUB endpoint (`tcp://127.0.0.1:5557`).
    pub endpoint: String,
    /// Its replay endpoint, if it has one.
    pub replay: Option<String>,
}

/// Media Cachet's own connector reports to vLLM's publisher (the fabric's tiers, already
/// published by the node): not the engine's cache.
pub const CONNECTOR_MEDIUM_PREFIX: &str = "CACHET";

/// One decoded vLLM event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VllmEvent {
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        block_size: Option<u32>,
        medium: Option<String>,
    },
    Removed {
        hashes: Vec<EngineHash>,
        medium: Option<String>,
    },
    Cleared,
}

/// A batch's payload → its events (those that cannot be read are skipped and counted).
pub fn decode_batch(payload: &[u8]) -> Option<Vec<VllmEvent>> {
    let v = rmpv::decode::read_value(&mut &payload[..]).ok()?;
    let Value::Array(parts) = v else { return None };
    let Some(Value::Array(events)) = parts.get(1) else {
        return None;
    };
    Some(
        events
            .iter()
            .filter_map(|e| {
                let d = decode_event(e);
                if d.is_none() {
                    metrics::KV_EVENTS.with_label_values(&["unreadable"]).inc();
                }
                d
            })
            .collect(),
    )
}

fn hash_of(v: &Value) -> Option<EngineHash> {
    match v {
        Value::Integer(i) => {
            let n = i.as_u64().or_else(|| i.as_i64().map(|x| x as u64))?;
            Some(n.to_be_bytes().to_vec().into_boxed_slice())
        }
        Value::Binary(b) => Some(b.clone().into_boxed_slice()),
        _ => None,
    }
}

fn hashes_of(v: Option<&Value>) -> Option<Vec<EngineHash>> {
    match v? {
        Value::Array(a) => a.iter().map(hash_of).collect(),
        _ => None,
    }
}

fn text_of(v: Option<&Value>) -> Option<String> {
    v.and_then(|v| v.as_str()).map(str::to_string)
}

/// An event's fields: by name (a tagged map), or by position after the tag (an array).
enum Fields<'a> {
    Named(&'a [(Value, Value)]),
    Positional(&'a [Value]),
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str, pos: usize) -> Option<&'a Value> {
        match self {
            Fields::Named(m) => m
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
            Fields::Positional(a) => a.get(pos + 1),
        }
    }
}

fn decode_event(e: &Value) -> Option<VllmEvent> {
    let (tag, fields) = match e {
        Value::Map(m) => {
            let f = Fields::Named(m);
            (text_of(f.get("type", 0))?, f)
        }
        Value::Array(a) => (text_of(a.first())?, Fields::Positional(a)),
        _ => return None,
    };
    let field = |name: &str, pos: usize| fields.get(name, pos);
    match tag.as_str() {
        "BlockStored" => Some(VllmEvent::Stored {
            hashes: hashes_of(field("block_hashes", 0))?,
            parent: field("parent_block_hash", 1).and_then(hash_of),
            block_size: field("block_size", 3)
                .and_then(|v| v.as_u64())
                .and_then(|n| u32::try_from(n).ok()),
            medium: text_of(field("medium", 5)),
        }),
        "BlockRemoved" => Some(VllmEvent::Removed {
            hashes: hashes_of(field("block_hashes", 0))?,
            medium: text_of(field("medium", 1)),
        }),
        "AllBlocksCleared" => Some(VllmEvent::Cleared),
        _ => None,
    }
}

fn is_connectors(medium: &Option<String>) -> bool {
    medium
        .as_deref()
        .is_some_and(|m| m.starts_with(CONNECTOR_MEDIUM_PREFIX))
}

/// One vLLM event in Cachet's keys (none when nothing in it is Cachet's).
pub fn translate(map: &EngineMap, instance: &str, e: VllmEvent) -> Option<KvEvent> {
    match e {
        VllmEvent::Stored {
            hashes,
            parent,
            block_size,
            medium,
        } => {
            if is_connectors(&medium) {
                return None;
            }
            let (keys, parent) = map.stored(instance, &hashes, parent.as_ref());
            (!keys.is_empty()).then(|| KvEvent::BlockStored {
                instance: instance.to_string(),
                medium: Medium::Engine,
                block_hashes: keys,
                parent_block_hash: parent,
                block_size,
                engine_medium: medium,
            })
        }
        VllmEvent::Removed { hashes, medium } => {
            if is_connectors(&medium) {
                return None;
            }
            let keys = map.removed(instance, &hashes);
            (!keys.is_empty()).then(|| KvEvent::BlockRemoved {
                instance: instance.to_string(),
                medium: Medium::Engine,
                block_hashes: keys,
            })
        }
        VllmEvent::Cleared => Some(clear(map, instance)),
    }
}

fn clear(map: &EngineMap, instance: &str) -> KvEvent {
    map.cleared(instance);
    KvEvent::AllBlocksCleared {
        instance: instance.to_string(),
        medium: Medium::Engine,
    }
}

/// Where a follower is in vLLM's sequence.
#[derive(Default)]
struct Position {
    last: Option<u64>,
}

/// What to do with a batch numbered `seq`.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    Apply,
    /// Batches `from..seq` are missing.
    Replay {
        from: u64,
    },
    /// vLLM started over (its numbering did): its cache is empty.
    Restarted,
}

impl Position {
    fn next(&self, seq: u64) -> Next {
        match self.last {
            None => Next::Apply,
            Some(l) if seq == l + 1 => Next::Apply,
            Some(l) if seq <= l => Next::Restarted,
            Some(l) => Next::Replay { from: l + 1 },
        }
    }
}

/// Wait until a `tcp://host:port` endpoint accepts a connection (true), or `stop` (false).
/// Other endpoints are not probed.
async fn accepts(endpoint: &str, stop: &CancellationToken) -> bool {
    let Some(addr) = endpoint.strip_prefix("tcp://") else {
        return true;
    };
    loop {
        let probe =
            tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr));
        tokio::select! {
            _ = stop.cancelled() => return false,
            r = probe => {
                if matches!(r, Ok(Ok(_))) {
                    return true;
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return false,
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}

/// Follow `v`'s publisher until `stop`, emitting its events in Cachet's keys to `sink`.
pub async fn follow(v: VllmEvents, map: Arc<EngineMap>, sink: KvSink, stop: CancellationToken) {
    loop {
        let followed = follow_once(&v, &map, &sink, &stop).await;
        if stop.is_cancelled() {
            return;
        }
        if let Err(e) = followed {
            tracing::warn!(instance = %v.instance, endpoint = %v.endpoint, error = %e, "following vLLM's KV events failed; retrying");
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

async fn follow_once(
    v: &VllmEvents,
    map: &EngineMap,
    sink: &KvSink,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    // vLLM binds its publisher only once its engine is up, which can take a minute: wait for
    // the port first. (The zeromq crate's own connect retries for 30 s and fails; a follower
    // whose first connect had timed out was seen to receive nothing after it reconnected.)
    if !accepts(&v.endpoint, stop).await {
        return Ok(());
    }
    let mut sub = zeromq::SubSocket::new();
    let mut monitor = sub.monitor();
    tokio::select! {
        _ = stop.cancelled() => return Ok(()),
        r = sub.connect(&v.endpoint) => r?,
    }
    sub.subscribe("").await?;
    tracing::info!(instance = %v.instance, endpoint = %v.endpoint, "following vLLM's KV events");
    let mut pos = Position::default();
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            ev = futures::StreamExt::next(&mut monitor) => {
                if matches!(ev, Some(SocketEvent::Disconnected(_)) | None) {
                    // vLLM went away: whatever comes back starts with an empty cache.
                    tracing::info!(instance = %v.instance, "vLLM's KV event publisher disconnected; its cache is taken as empty");
                    sink.emit(clear(map, &v.instance));
                    pos = Position::default();
                }
                continue;
            }
            m = sub.recv() => m?,
        };
        let Some((seq, payload)) = frames(&msg) else {
            metrics::KV_EVENTS.with_label_values(&["unreadable"]).inc();
            continue;
        };
        match pos.next(seq) {
            Next::Apply => {}
            Next::Restarted => {
                sink.emit(clear(map, &v.instance));
            }
            Next::Replay { from } => {
                metrics::KV_EVENTS.with_label_values(&["gaps"]).inc();
                let replayed = match &v.replay {
                    Some(r) => replay(r, from, seq).await,
                    None => Err(anyhow::anyhow!("no replay endpoint")),
                };
                match replayed {
                    Ok(batches) if batches.first().map(|(s, _)| *s) == Some(from) => {
                        for (_, p) in batches {
                            apply(map, &v.instance, sink, &p);
                        }
                    }
                    other => {
                        let why = match other {
                            Err(e) => e.to_string(),
                            Ok(_) => "the replay buffer no longer has them".into(),
                        };
                        tracing::warn!(instance = %v.instance, from, to = seq, %why, "vLLM's KV events were lost; its cache is taken as empty");
                        sink.emit(clear(map, &v.instance));
                    }
                }
            }
        }
        pos.last = Some(seq);
        apply(map, &v.instance, sink, payload);
    }
}

/// A published message's sequence number and payload.
fn frames(msg: &ZmqMessage) -> Option<(u64, &Bytes)> {
    let seq = msg.get(1)?;
    let seq = u64::from_be_bytes(seq.as_ref().try_into().ok()?);
    Some((seq, msg.get(2)?))
}

fn apply(map: &EngineMap, instance: &str, sink: &KvSink, payload: &[u8]) {
    let Some(events) = decode_batch(payload) else {
        metrics::KV_EVENTS.with_label_values(&["unreadable"]).inc();
        return;
    };
    for e in events {
        if let Some(k) = translate(map, instance, e) {
            sink.emit(k);
        }
    }
}

/// Batches `from..until` from vLLM's replay socket, in order.
async fn replay(endpoint: &str, from: u64, until: u64) -> anyhow::Result<Vec<(u64, Bytes)>> {
    const END: u64 = u64::MAX;
    let ask = async {
        let mut dealer = zeromq::DealerSocket::new();
        dealer.connect(endpoint).await?;
        let req = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        dealer.send(req).await?;
        let mut out = Vec::new();
        loop {
            let m = dealer.recv().await?;
            // ["", topic, seq, payload]
            let (Some(seq), Some(payload)) = (m.get(2), m.get(3)) else {
                anyhow::bail!("a replay answer of {} frames", m.len());
            };
            let seq = u64::from_be_bytes(seq.as_ref().try_into()?);
            if seq == END {
                return Ok(out);
            }
            if seq >= from && seq < until {
                out.push((seq, payload.clone()));
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), ask)
        .await
        .map_err(|_| anyhow::anyhow!("replay timed out"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_common::BlockHash;

    /// A batch as vLLM's msgspec encoder writes it (a map per event, tagged by `type`).
    fn batch(events: Vec<Value>) -> Vec<u8> {
        let v = Value::Array(vec![Value::F64(1.5), Value::Array(events), Value::Nil]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).unwrap();
        out
    }

    fn map(pairs: Vec<(&str, Value)>) -> Value {
        Value::Map(
            pairs
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        )
    }

    fn stored(hashes: &[u64], parent: Option<u64>) -> Value {
        map(vec![
            ("type", Value::from("BlockStored")),
            (
                "block_hashes",
                Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
            ),
            ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
            ("token_ids", Value::Array((0..4).map(Value::from).collect())),
            ("block_size", Value::from(128)),
            ("lora_id", Value::Nil),
            ("medium", Value::from("CPU")),
            ("lora_name", Value::Nil),
            (
                "extra_keys",
                Value::Array(vec![Value::Array(vec![Value::from("tenant salt")])]),
            ),
        ])
    }

    fn e(i: u64) -> EngineHash {
        i.to_be_bytes().to_vec().into_boxed_slice()
    }

    #[test]
    fn vllm_batches_are_read_and_translated_without_their_tokens() {
        let m = EngineMap::default();
        m.learn([(e(11), BlockHash([1; 32])), (e(12), BlockHash([2; 32]))]);
        let payload = batch(vec![
            stored(&[11, 12, 13], None),
            map(vec![
                ("type", Value::from("BlockRemoved")),
                ("block_hashes", Value::Array(vec![Value::from(12u64)])),
                ("medium", Value::from("CPU")),
            ]),
            // The array form of older versions, and a connector's own report.
            Value::Array(vec![Value::from("AllBlocksCleared")]),
            map(vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(11u64)])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", Value::Array(vec![])),
                ("block_size", Value::from(128)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("CACHET_DRAM")),
            ]),
        ]);
        let events = decode_batch(&payload).unwrap();
        assert_eq!(events.len(), 4);
        let out: Vec<KvEvent> = events
            .into_iter()
            .filter_map(|ev| translate(&m, "n1/0", ev))
            .collect();
        assert_eq!(
            out.len(),
            3,
            "the connector's own event is not the engine's cache"
        );
        assert_eq!(
            out[0],
            KvEvent::BlockStored {
                instance: "n1/0".into(),
                medium: Medium::Engine,
                block_hashes: vec![BlockHash([1; 32]), BlockHash([2; 32])],
                parent_block_hash: None,
                block_size: Some(128),
                engine_medium: Some("CPU".into()),
            }
        );
        let json = serde_json::to_string(&out).unwrap();
        assert!(!json.contains("token") && !json.contains("salt"), "{json}");
        assert!(
            matches!(&out[1], KvEvent::BlockRemoved { block_hashes, .. } if block_hashes == &[BlockHash([2; 32])])
        );
        assert!(matches!(out[2], KvEvent::AllBlocksCleared { .. }));
        assert_eq!(m.held("n1/0"), 0);
        assert!(decode_batch(b"\xc1 not msgpack").is_none());
    }

    #[test]
    fn sequence_numbers_say_apply_replay_or_restarted() {
        let mut p = Position::default();
        assert_eq!(p.next(7), Next::Apply, "a first sight");
        p.last = Some(7);
        assert_eq!(p.next(8), Next::Apply);
        assert_eq!(p.next(11), Next::Replay { from: 8 });
        assert_eq!(p.next(0), Next::Restarted);
        assert_eq!(p.next(7), Next::Restarted);
    }

    /// vLLM binds its publisher only once its engine is up: a follower started before that
    /// waits for the port and receives what is published once it is bound.
    #[tokio::test]
    async fn a_follower_started_before_the_publisher_binds_receives_its_events() {
        use zeromq::PubSocket;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ep = format!("tcp://127.0.0.1:{port}");
        let m = Arc::new(EngineMap::default());
        m.learn([(e(1), BlockHash([1; 32]))]);
        let (sink, mut source) = super::super::channel(64);
        let stop = CancellationToken::new();
        let task = tokio::spawn(follow(
            VllmEvents {
                instance: "n1/0".into(),
                endpoint: ep.clone(),
                replay: None,
            },
            m.clone(),
            sink,
            stop.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut publisher = PubSocket::new();
        publisher.bind(&ep).await.unwrap();
        let msg = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&0u64.to_be_bytes()),
            Bytes::from(batch(vec![stored(&[1], None)])),
        ])
        .unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                publisher.send(msg.clone()).await.unwrap();
                if let Ok(Some(ev)) =
                    tokio::time::timeout(Duration::from_millis(100), source.rx.recv()).await
                {
                    break ev;
                }
            }
        })
        .await
        .expect("the follower connected once the publisher was bound");
        assert!(matches!(got, KvEvent::BlockStored { .. }));
        stop.cancel();
        task.await.unwrap();
    }

    /// A real ZMQ peer (this crate's PUB and ROUTER sockets) in vLLM's framing: a gap is
    /// filled from the replay socket, and a dropped connection clears the instance.
    #[tokio::test]
    async fn a_gap_is_filled_from_the_replay_socket() {
        use zeromq::{PubSocket, RouterSocket};
        let mut publisher = PubSocket::new();
        let ep = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .unwrap()
            .to_string();
        let mut router = RouterSocket::new();
        let rep = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let m = Arc::new(EngineMap::default());
        m.learn((1..=3).map(|i| (e(i), BlockHash([i as u8; 32]))));
        let (sink, mut source) = super::super::channel(64);
        let stop = CancellationToken::new();
        let task = tokio::spawn(follow(
            VllmEvents {
                instance: "n1/0".into(),
                endpoint: ep,
                replay: Some(rep),
            },
            m.clone(),
            sink,
            stop.clone(),
        ));
        let msg = |seq: u64, h: u64| {
            ZmqMessage::try_from(vec![
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(batch(vec![stored(&[h], None)])),
            ])
            .unwrap()
        };
        // Until the subscription has reached the publisher, messages are dropped: send the
        // first one until it arrives.
        let first = loop {
            publisher.send(msg(0, 1)).await.unwrap();
            if let Ok(Some(ev)) =
                tokio::time::timeout(Duration::from_millis(100), source.rx.recv()).await
            {
                break ev;
            }
        };
        assert!(matches!(first, KvEvent::BlockStored { .. }));
        // Batch 1 is lost on the way; batch 2 arrives, and the follower asks for 1.
        publisher.send(msg(2, 3)).await.unwrap();
        let req = router.recv().await.unwrap();
        assert_eq!(req.get(2).unwrap().as_ref(), &1u64.to_be_bytes());
        let id = req.get(0).unwrap().clone();
        for (seq, h) in [(1u64, 2u64), (2, 3)] {
            let mut r = msg(seq, h);
            r.push_front(Bytes::new());
            r.push_front(id.clone());
            router.send(r).await.unwrap();
        }
        let end = ZmqMessage::try_from(vec![
            id,
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&u64::MAX.to_be_bytes()),
            Bytes::new(),
        ])
        .unwrap();
        router.send(end).await.unwrap();
        let mut got = Vec::new();
        while got.len() < 2 {
            if let Some(KvEvent::BlockStored { block_hashes, .. }) = source.rx.recv().await {
                got.push(block_hashes[0].0[0]);
            }
        }
        assert_eq!(
            got,
            vec![2, 3],
            "the replayed batch, then the one that showed the gap"
        );
        assert_eq!(m.held("n1/0"), 3);
        // The publisher goes away: the instance's cache is taken as empty.
        drop(publisher);
        let cleared = tokio::time::timeout(Duration::from_secs(5), source.rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(cleared, KvEvent::AllBlocksCleared { .. }));
        assert_eq!(m.held("n1/0"), 0);
        stop.cancel();
        task.await.unwrap();
    }
}
