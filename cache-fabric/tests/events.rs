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
