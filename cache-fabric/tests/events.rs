//! Block events through a real Redis Stream: a node's writes and removals reach a follower's
//! prefix index, idempotently, with staleness measured.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use cache_fabric::events::{self, Follower};
use cache_fabric::index::PrefixIndex;
use cache_fabric::{
    EntryKind, EvictionPolicy, FabricClient, FabricNode, Holding, KeySpace, NodeConfig, PutBlock,
};
use cachet_common::{Scope, TenantId, WorkspaceId};
use tokio::time::Instant;

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

#[tokio::test]
async fn writes_and_evictions_reach_a_followers_index_through_redis() {
    let client = redis::Client::open(redis_url()).unwrap();
    let publish_conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut follow_conn = client.get_multiplexed_async_connection().await.unwrap();
    let stream = format!("cachet:test:blocks:{}", uuid::Uuid::new_v4());

    // Room for 4 blocks of 4 tokens × 8 bytes.
    let node = FabricNode::new(NodeConfig {
        dram_capacity_bytes: 4 * 32,
        eviction: EvictionPolicy::Lru,
    });
    let (sink, rx) = events::channel(1024);
    node.set_event_sink(sink);
    let publisher = tokio::spawn(events::publish(
        publish_conn,
        stream.clone(),
        "node-a".into(),
        rx,
        10_000,
        None,
    ));
    let c = FabricClient::local(node.clone());
    let s = Scope {
        tenant: TenantId::new(),
        workspace: WorkspaceId::new(),
    };
    let space = KeySpace::new(s, "m", "", "f32", 4);
    let toks: Vec<u32> = (0..16).collect();
    let k = space.prefix_keys(&toks, 16, &[16]);
    let blocks: Vec<PutBlock> = k
        .chain_to(16)
        .unwrap()
        .iter()
        .map(|l| PutBlock::new(l.hash, l.parent, 4, Bytes::from(vec![l.hash.0[0]; 32])))
        .collect();
    let now = Instant::now();
    c.write_entry(
        s,
        &k,
        16,
        &blocks,
        Holding {
            ttl: Duration::from_secs(300),
            kind: EntryKind::BestEffort,
        },
        now,
    )
    .await
    .unwrap();

    let index = Arc::new(RwLock::new(PrefixIndex::default()));
    let mut follower = Follower::new(&stream, "0-0", index.clone());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while index.read().unwrap().longest_prefix(&k.blocks) < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "events did not arrive"
        );
        follower
            .poll(&mut follow_conn, Duration::from_millis(200))
            .await
            .unwrap();
    }
    assert_eq!(
        index.read().unwrap().nodes(&k.blocks[0]).0,
        1,
        "slot 0 = node-a"
    );
    assert!(
        cache_fabric::metrics::INDEX_STALENESS.get_sample_count() >= 4,
        "staleness is measured for every applied event"
    );

    // A second entry evicts the first one's tail blocks: the index follows.
    let other: Vec<u32> = (100..108).collect();
    let k2 = space.prefix_keys(&other, 8, &[8]);
    let b2: Vec<PutBlock> = k2
        .chain_to(8)
        .unwrap()
        .iter()
        .map(|l| PutBlock::new(l.hash, l.parent, 4, Bytes::from(vec![1; 32])))
        .collect();
    c.write_entry(
        s,
        &k2,
        8,
        &b2,
        Holding {
            ttl: Duration::from_secs(300),
            kind: EntryKind::BestEffort,
        },
        now,
    )
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (a, b) = {
            let idx = index.read().unwrap();
            (
                idx.longest_prefix(&k.blocks),
                idx.longest_prefix(&k2.blocks),
            )
        };
        if a == 2 && b == 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "index stuck at {a}, {b}"
        );
        follower
            .poll(&mut follow_conn, Duration::from_millis(200))
            .await
            .unwrap();
    }

    // Replaying the stream from the start into a fresh index gives the same answer
    // (events are idempotent and ordered).
    let replayed = Arc::new(RwLock::new(PrefixIndex::default()));
    let mut again = Follower::new(&stream, "0-0", replayed.clone());
    while again
        .poll(&mut follow_conn, Duration::from_millis(50))
        .await
        .unwrap()
        > 0
    {}
    assert_eq!(replayed.read().unwrap().longest_prefix(&k.blocks), 2);
    assert_eq!(replayed.read().unwrap().len(), index.read().unwrap().len());

    drop(c);
    drop(node);
    let _ = tokio::time::timeout(Duration::from_secs(5), publisher).await;
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut follow_conn)
        .await
        .unwrap();
}

/// The documented KV event stream (docs/kv-events.md) through a real Redis: a node's writes
/// and evictions as DRAM stores and removals in numbered batches, and a resync a consumer
/// asks for answered with the node's clears and holdings.
#[tokio::test]
async fn the_kv_event_stream_carries_media_and_answers_a_resync() {
    use cache_fabric::kv_events::{self, Batch, KvEvent, Medium};
    let client = redis::Client::open(redis_url()).unwrap();
    let publish_conn = client.get_multiplexed_async_connection().await.unwrap();
    let kv_conn = client.get_multiplexed_async_connection().await.unwrap();
    let watch_conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut read_conn = client.get_multiplexed_async_connection().await.unwrap();
    let prefix = format!("cachet:test:kv:{}", uuid::Uuid::new_v4().simple());
    let node = FabricNode::new(NodeConfig {
        dram_capacity_bytes: 4 * 32,
        eviction: EvictionPolicy::Lru,
    });
    let stop = tokio_util::sync::CancellationToken::new();
    let (kv, source) = kv_events::channel(1024);
    let resync = Arc::new(tokio::sync::Notify::new());
    let n = node.clone();
    let publisher = kv_events::Publisher {
        prefix: prefix.clone(),
        node: "node-a".into(),
        max_len: 10_000,
        snapshot: Box::new(move || {
            n.with_store(|s| s.held_by_medium())
                .into_iter()
                .flat_map(|(m, h)| KvEvent::stored_chunks("node-a", m, &h))
                .collect()
        }),
        resync_every: Duration::ZERO,
    };
    tokio::spawn(publisher.run(kv_conn, source, resync.clone(), stop.clone()));
    tokio::spawn(kv_events::watch_resyncs(
        watch_conn,
        prefix.clone(),
        "node-a".into(),
        resync,
        stop.clone(),
    ));
    let (sink, rx) = events::channel(1024);
    node.set_event_sink(sink);
    tokio::spawn(events::publish(
        publish_conn,
        format!("{prefix}:blocks"),
        "node-a".into(),
        rx,
        10_000,
        Some(kv),
    ));
    let c = FabricClient::local(node.clone());
    let s = Scope {
        tenant: TenantId::new(),
        workspace: WorkspaceId::new(),
    };
    let space = KeySpace::new(s, "m", "", "f32", 4);
    let write = |first: u32| {
        let toks: Vec<u32> = (first..first + 16).collect();
        let k = space.prefix_keys(&toks, 16, &[16]);
        let blocks: Vec<PutBlock> = k
            .chain_to(16)
            .unwrap()
            .iter()
            .map(|l| PutBlock::new(l.hash, l.parent, 4, Bytes::from(vec![l.hash.0[0]; 32])))
            .collect();
        (k, blocks)
    };
    let holding = Holding {
        ttl: Duration::from_secs(300),
        kind: EntryKind::BestEffort,
    };
    let (k1, b1) = write(0);
    c.write_entry(s, &k1, 16, &b1, holding, Instant::now())
        .await
        .unwrap();

    // Read batches as a consumer would, until `done` says it has what it waits for.
    let mut last = "0-0".to_string();
    let mut batches: Vec<Batch> = Vec::new();
    let mut read_until = async |batches: &mut Vec<Batch>, done: &dyn Fn(&[Batch]) -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done(batches) {
            assert!(std::time::Instant::now() < deadline, "{batches:#?}");
            let reply: redis::Value = redis::cmd("XREAD")
                .arg("BLOCK")
                .arg(200)
                .arg("STREAMS")
                .arg(kv_events::stream(&prefix))
                .arg(&last)
                .query_async(&mut read_conn)
                .await
                .unwrap();
            for (id, b) in kv_events::parse_batches(reply) {
                last = id;
                batches.push(b.expect("every entry is a documented batch"));
            }
        }
    };
    let stored = |bs: &[Batch], medium: Medium| -> Vec<cachet_common::BlockHash> {
        bs.iter()
            .flat_map(|b| &b.events)
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    medium: m,
                    block_hashes,
                    ..
                } if *m == medium => Some(block_hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    };
    read_until(&mut batches, &|bs| {
        k1.blocks
            .iter()
            .all(|h| stored(bs, Medium::Dram).contains(h))
    })
    .await;
    // The epoch starts with the node's (empty) snapshot: clears of its fabric media.
    assert_eq!(batches[0].seq, 0);
    assert!(matches!(
        batches[0].events[0],
        KvEvent::AllBlocksCleared {
            medium: Medium::Dram,
            ..
        }
    ));
    assert!(batches.windows(2).all(|w| w[1].seq == w[0].seq + 1));

    // Another entry evicts two of the first one's blocks: removed from DRAM (no lower tier).
    let (k2, b2) = write(100);
    c.write_entry(s, &k2, 8, &b2[..2], holding, Instant::now())
        .await
        .unwrap();
    let removed = |bs: &[Batch]| -> usize {
        bs.iter()
            .flat_map(|b| &b.events)
            .filter(|e| {
                matches!(
                    e,
                    KvEvent::BlockRemoved {
                        medium: Medium::Dram,
                        ..
                    }
                )
            })
            .count()
    };
    read_until(&mut batches, &|bs| removed(bs) >= 2).await;

    // A consumer that lost batches asks for a resync: the node's clears, then what it holds.
    let seen = batches.len();
    let mut asking = client.get_multiplexed_async_connection().await.unwrap();
    kv_events::request_resync(&mut asking, &prefix, "node-a")
        .await
        .unwrap();
    read_until(&mut batches, &|bs| {
        stored(&bs[seen..], Medium::Dram).len() >= 4
    })
    .await;
    let snapshot = &batches[seen..];
    assert!(matches!(
        snapshot[0].events[0],
        KvEvent::AllBlocksCleared { .. }
    ));
    let held = stored(snapshot, Medium::Dram);
    assert_eq!(held.len(), 4, "what the node holds now");
    assert!(k2.blocks[..2].iter().all(|h| held.contains(h)));
    assert_eq!(
        snapshot[0].seq,
        batches[seen - 1].seq + 1,
        "in the node's sequence"
    );
    stop.cancel();
}
