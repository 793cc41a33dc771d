//! Cluster reads, writes, repair and drain across real TCP nodes in one process (the
//! multi-process test with `cachet node` processes is the root crate's `tests/cluster.rs`).
//! With the `rdma` feature and `CACHET_RDMA_DEVICE` naming a device (`scripts/rdma-vm.sh`),
//! every member also exports an RDMA pool and reads from its peers by RDMA READ.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cache_fabric::Holding;
use cache_fabric::cluster::{Cluster, ClusterConfig, View};
use cache_fabric::membership::NodeRecord;
use cache_fabric::transport::{TcpTransport, Transport, serve_tcp};
use cache_fabric::{
    EntryKind, EvictionPolicy, FabricClient, FabricNode, KeySpace, NodeConfig, PrefixKeys, PutBlock,
};
use cachet_common::{BlockHash, Scope};
use common::scope;
use tokio::time::Instant;

const TOKEN: &str = "cluster-token-for-tests";
const B: usize = 4;

struct Member {
    record: NodeRecord,
    node: Arc<FabricNode>,
    serving: tokio::task::JoinHandle<()>,
}

/// The RDMA device the members use, if `CACHET_RDMA_DEVICE` names one.
#[cfg(feature = "rdma")]
fn rdma_device() -> Option<Arc<cache_fabric::rdma::verbs::Device>> {
    static DEVICE: std::sync::OnceLock<Option<Arc<cache_fabric::rdma::verbs::Device>>> =
        std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let name = std::env::var("CACHET_RDMA_DEVICE").ok()?;
            (!name.is_empty()).then(|| {
                cache_fabric::rdma::verbs::Device::open(Some(&name))
                    .expect("the named RDMA device opens")
            })
        })
        .clone()
}

async fn member(id: &str) -> Member {
    let node = FabricNode::new(NodeConfig {
        dram_capacity_bytes: 1 << 30,
        eviction: EvictionPolicy::DEFAULT,
    });
    #[cfg(feature = "rdma")]
    if let Some(device) = rdma_device() {
        node.export_rdma(cache_fabric::rdma::Export::new(device, 16 << 20).unwrap());
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let serving = tokio::spawn(serve_tcp(listener, node.clone(), TOKEN.into()));
    Member {
        record: NodeRecord {
            id: id.into(),
            addr,
            rack: None,
            dram_capacity_bytes: 1 << 30,
            disk_capacity_bytes: 0,
            epoch: 1,
            dram_used_bytes: 0,
            api_addr: None,
            ..Default::default()
        },
        node,
        serving,
    }
}

fn client(m: &Member, members: &[&Member]) -> (FabricClient, Arc<Cluster>) {
    #[allow(unused_mut)]
    let mut config = ClusterConfig::default();
    // Over soft-RoCE in an emulated machine every verb is slow; these tests check what
    // arrives, not how fast, so reads may wait longer before recomputing.
    #[cfg(feature = "rdma")]
    if rdma_device().is_some() {
        config.min_deadline = Duration::from_secs(10);
    }
    let cluster = Cluster::new(m.record.id.clone(), m.node.clone(), TOKEN, config);
    #[cfg(feature = "rdma")]
    if let Some(device) = rdma_device() {
        cluster.enable_rdma(device);
    }
    let records: Vec<NodeRecord> = members.iter().map(|m| m.record.clone()).collect();
    cluster.set_view(View::from_records(&records));
    (
        FabricClient::clustered(m.node.clone(), cluster.clone()),
        cluster,
    )
}

fn keys(s: Scope, n_tokens: usize) -> PrefixKeys {
    let toks: Vec<u32> = (0..n_tokens as u32).collect();
    KeySpace::new(s, "m", "", "f16", B).prefix_keys(&toks, n_tokens, &[n_tokens])
}

fn blocks(k: &PrefixKeys, offset: usize) -> Vec<PutBlock> {
    k.chain_to(offset)
        .unwrap()
        .iter()
        .map(|l| {
            let data: Vec<u8> = (0..512).map(|i| l.hash.0[i % 32] ^ i as u8).collect();
            PutBlock::new(
                l.hash,
                l.parent,
                (l.end - l.start) as u32,
                Bytes::from(data),
            )
        })
        .collect()
}

/// Write the entry of `new` ending at `offset` with a 5-minute TTL; it must succeed.
async fn write(
    c: &FabricClient,
    s: Scope,
    k: &PrefixKeys,
    offset: usize,
    new: &[PutBlock],
    kind: EntryKind,
) {
    c.write_entry(
        s,
        k,
        offset,
        new,
        Holding {
            ttl: Duration::from_secs(300),
            kind,
        },
        Instant::now(),
    )
    .await
    .unwrap();
}

/// How many of `members` hold `hash` (asked over the transport).
async fn copies(members: &[&Member], s: Scope, hash: BlockHash) -> usize {
    let t = TcpTransport::new(TOKEN);
    let mut n = 0;
    for m in members {
        if t.has(&m.record.addr, s, &[hash]).await.unwrap()[0] {
            n += 1;
        }
    }
    n
}

#[tokio::test]
async fn blocks_land_on_their_owners_and_any_member_reads_them() {
    let (a, b, c) = (member("a").await, member("b").await, member("c").await);
    let all = [&a, &b, &c];
    let (ca, cluster) = client(&a, &all);
    let (cb, cluster_b) = client(&b, &all);
    #[cfg(feature = "rdma")]
    if rdma_device().is_some() {
        // Wait for the connections set_view opened (or open them), so B's reads use RDMA.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let _ = cluster_b.connect_rdma().await;
    }
    #[cfg(not(feature = "rdma"))]
    let _ = cluster_b;
    #[cfg(feature = "rdma")]
    let (rdma_bytes, fallbacks) = (
        cache_fabric::metrics::RDMA_BYTES.get(),
        cache_fabric::metrics::RDMA
            .with_label_values(&["fallback"])
            .get(),
    );
    let s = scope();
    let k = keys(s, 12 * B + 2);
    let offset = 12 * B + 2;
    let new = blocks(&k, offset);
    write(&ca, s, &k, offset, &new, EntryKind::Paid).await;

    // Every block is on each of its R = 2 owners (and on the writer, which keeps them).
    let view = cluster.view();
    for blk in &new {
        let owners = cluster.owners(&view, s.tenant, &blk.hash);
        assert_eq!(owners.len(), 2);
        let t = TcpTransport::new(TOKEN);
        for o in &owners {
            let m = all.iter().find(|m| m.record.id == *o).unwrap();
            assert!(t.has(&m.record.addr, s, &[blk.hash]).await.unwrap()[0]);
        }
    }

    // Node B holds only what it owns, yet reads the whole prefix, tail included, verified.
    let read = cb.read_prefix(s, &k, offset, Instant::now()).await;
    assert_eq!(read.tokens, offset);
    for (got, want) in read.blocks.iter().zip(&new) {
        assert_eq!(got.data, want.data);
    }
    // Another scope reads nothing of it.
    let other = scope();
    assert_eq!(
        cb.read_prefix(other, &k, offset, Instant::now())
            .await
            .tokens,
        0
    );
    // Over RDMA, the blocks B lacked arrived by READ, and nothing fell back to TCP.
    #[cfg(feature = "rdma")]
    if rdma_device().is_some() {
        assert!(cache_fabric::metrics::RDMA_BYTES.get() > rdma_bytes);
        assert_eq!(
            cache_fabric::metrics::RDMA
                .with_label_values(&["fallback"])
                .get(),
            fallbacks
        );
    }
}

#[tokio::test]
async fn a_dead_owner_costs_nothing_and_repair_restores_r() {
    let (a, b, c) = (member("a").await, member("b").await, member("c").await);
    let all = [&a, &b, &c];
    let (ca, _) = client(&a, &all);
    let offset = 16 * B;
    // A scope whose blocks include one owned by A and C (so B lacks it and repair has work):
    // each block's owner pair is one of three, so 16 blocks miss that pair once in ~650
    // scopes; try another then.
    let mut tries = 0;
    let (s, k, new, lacking) = loop {
        let s = scope();
        let k = keys(s, offset);
        let new = blocks(&k, offset);
        write(&ca, s, &k, offset, &new, EntryKind::BestEffort).await;
        let mut lacking = 0;
        for blk in &new {
            lacking += usize::from(copies(&[&b], s, blk.hash).await == 0);
        }
        if lacking > 0 {
            break (s, k, new, lacking);
        }
        tries += 1;
        assert!(tries < 10, "no scope placed a block on A and C");
    };
    // C dies; readers' views still list it (membership lags by the heartbeat expiry).
    c.serving.abort();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // A reader holding nothing gets every block from a live owner: C's failures fall over
    // to the other owner.
    let d = member("d").await;
    let (cd, _) = client(&d, &all);
    let read = cd.read_prefix(s, &k, offset, Instant::now()).await;
    assert_eq!(read.tokens, offset);

    // The view drops C; repair on A (the writer keeps every block) pushes each block to its
    // new owners, A and B.
    let (_, cluster_a) = client(&a, &[&a, &b]);
    let report = cluster_a.repair().await;
    assert!(report.pushed > 0 && report.failed == 0, "{report:?}");
    assert_eq!(report.missing as usize, lacking, "{report:?}");
    for blk in &new {
        assert_eq!(copies(&[&a, &b], s, blk.hash).await, 2);
    }
    // A second repair finds nothing missing.
    assert_eq!(cluster_a.repair().await.missing, 0);
}

#[tokio::test]
async fn blocks_nobody_can_serve_are_recomputed_not_waited_for() {
    let (a, b) = (member("a").await, member("b").await);
    let s = scope();
    let offset = 8 * B;
    let k = keys(s, offset);
    let new = blocks(&k, offset);
    let (ca, _) = client(&a, &[&a]);
    write(&ca, s, &k, offset, &new, EntryKind::Paid).await;
    // B believes A and a node that never answers own the blocks.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut ghost = a.record.clone();
    ghost.id = "ghost".into();
    ghost.addr = silent.local_addr().unwrap().to_string();
    a.serving.abort();
    let cluster = Cluster::new(
        "b",
        b.node.clone(),
        TOKEN,
        ClusterConfig {
            min_deadline: Duration::from_millis(200),
            ..ClusterConfig::default()
        },
    );
    cluster.set_view(View::from_records(&[ghost, b.record.clone()]));
    let cb = FabricClient::clustered(b.node.clone(), cluster);
    // The read gives up at its deadline instead of hanging on the silent node (the timeout
    // only catches a hang: it is far above the deadline).
    let read = tokio::time::timeout(
        Duration::from_secs(30),
        cb.read_prefix(s, &k, offset, Instant::now()),
    )
    .await
    .expect("the read hung on a silent owner");
    assert_eq!(read.tokens, 0);
}

/// An owner that finds its copy of a block corrupt drops it (never serving it) and then
/// fetches it again from another owner, with its kind and remaining TTL: R copies again
/// without waiting for a membership change.
#[tokio::test]
async fn an_owner_refetches_a_block_it_dropped_as_corrupt() {
    let (a, b, c) = (member("a").await, member("b").await, member("c").await);
    let all = [&a, &b, &c];
    let (ca, cluster) = client(&a, &all);
    let s = scope();
    let offset = 8 * B;
    let k = keys(s, offset);
    let new = blocks(&k, offset);
    write(&ca, s, &k, offset, &new, EntryKind::Paid).await;
    // A block that B owns, with its other copy on another owner.
    let view = cluster.view();
    let blk = new
        .iter()
        .find(|blk| {
            cluster
                .owners(&view, s.tenant, &blk.hash)
                .contains(&"b".to_string())
        })
        .expect("B owns some block");
    let (_, cluster_b) = client(&b, &all);
    assert!(b.node.with_store(|st| st.corrupt_for_test(&blk.hash)));
    // A reader pulling it from B gets nothing from B (the copy fails its checksum there).
    let t = TcpTransport::new(TOKEN);
    assert!(
        t.get_block(&b.record.addr, s, blk.hash)
            .await
            .unwrap()
            .is_none()
    );
    assert!(!t.has(&b.record.addr, s, &[blk.hash]).await.unwrap()[0]);
    // B heals: the block is back, intact, still paid.
    assert_eq!(cluster_b.heal().await, 1);
    let got = t
        .get_block(&b.record.addr, s, blk.hash)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.data, blk.data);
    assert!(b.node.with_store(|st| st.is_paid(&blk.hash)));
    assert_eq!(cluster_b.heal().await, 0, "nothing left to heal");
}

#[tokio::test]
async fn a_draining_node_hands_its_blocks_to_the_remaining_owners() {
    let (a, b, c) = (member("a").await, member("b").await, member("c").await);
    let all = [&a, &b, &c];
    let (ca, cluster_a) = client(&a, &all);
    let s = scope();
    let offset = 16 * B;
    let k = keys(s, offset);
    let new = blocks(&k, offset);
    write(&ca, s, &k, offset, &new, EntryKind::Paid).await;
    let report = cluster_a.drain().await;
    assert_eq!(report.failed, 0);
    for blk in &new {
        assert_eq!(
            copies(&[&b, &c], s, blk.hash).await,
            2,
            "both remaining nodes"
        );
    }
}

#[tokio::test]
async fn hot_blocks_gain_replicas_on_their_readers_and_extra_copies_are_best_effort() {
    let (a, b, c, d) = (
        member("a").await,
        member("b").await,
        member("c").await,
        member("d").await,
    );
    let all = [&a, &b, &c];
    let (ca, cluster_a) = client(&a, &all);
    let s = scope();
    let offset = 8 * B;
    let k = keys(s, offset);
    let new = blocks(&k, offset);
    write(&ca, s, &k, offset, &new, EntryKind::Paid).await;
    // The writer's copies of blocks it does not own are extra replicas: best effort.
    let view = cluster_a.view();
    for blk in &new {
        let owns = cluster_a
            .owners(&view, s.tenant, &blk.hash)
            .contains(&"a".to_string());
        assert_eq!(a.node.with_store(|st| st.is_paid(&blk.hash)), owns);
    }
    // D, outside the owner sets, pulls the prefix: after the third pull within the window
    // every block is hot and D keeps its own copy.
    let (cd, _) = client(&d, &all);
    let t = TcpTransport::new(TOKEN);
    for round in 1..=3 {
        let read = cd.read_prefix(s, &k, offset, Instant::now()).await;
        assert_eq!(read.tokens, offset);
        let held = t
            .has(
                &d.record.addr,
                s,
                &new.iter().map(|b| b.hash).collect::<Vec<_>>(),
            )
            .await
            .unwrap();
        assert_eq!(
            held.iter().all(|h| *h),
            round == 3,
            "round {round}: {held:?}"
        );
    }
    drop((b, c));
}
