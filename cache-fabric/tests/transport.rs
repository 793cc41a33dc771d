//! The transport contract, run against every `Transport` implementation: blocks move
//! intact, checksums are enforced, tenants stay apart, and a peer without the cluster token
//! gets nothing. TCP always; with the `rdma` feature, the RDMA transport without a device
//! (all TCP), and over RDMA READ when `CACHET_RDMA_DEVICE` names a device
//! (`scripts/rdma-vm.sh` runs that on soft-RoCE in a virtual machine).

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cache_fabric::transport::{RemoteEntry, TcpTransport, Transport, TransportError, serve_tcp};
use cache_fabric::{
    EntryKind, EvictionPolicy, FabricNode, NodeConfig, PutBlock, RemovalReason, WriteRefused,
};
use common::scope;

use cachet_common::{BlockHash, Scope};
use sha2::{Digest, Sha256};

const TOKEN: &str = "cluster-token-for-tests";

fn hash(s: &str) -> BlockHash {
    BlockHash(Sha256::digest(s.as_bytes()).into())
}

/// A chain of `n` blocks of `size` bytes each, the data derived from the hash; like real
/// block keys, the hashes depend on the scope.
fn chain(scope: Scope, tag: &str, n: usize, size: usize) -> Vec<PutBlock> {
    let mut out = Vec::new();
    let mut parent = None;
    for i in 0..n {
        let h = hash(&format!("{}/{}/{tag}/{i}", scope.tenant, scope.workspace));
        let data: Vec<u8> = (0..size).map(|j| h.0[j % 32] ^ (j / 32) as u8).collect();
        out.push(PutBlock::new(h, parent, 16, Bytes::from(data)));
        parent = Some(h);
    }
    out
}

async fn node() -> (String, Arc<FabricNode>) {
    let node = FabricNode::new(NodeConfig {
        dram_capacity_bytes: 1 << 30,
        eviction: EvictionPolicy::DEFAULT,
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(serve_tcp(listener, node.clone(), TOKEN.into()));
    (addr, node)
}

/// Store `blocks` on `node` as one paid entry.
fn store(node: &FabricNode, scope: Scope, blocks: &[PutBlock]) {
    node.with_store(|st| {
        st.put_entry(
            &scope,
            &[],
            blocks.to_vec(),
            Duration::from_secs(300),
            tokio::time::Instant::now(),
            EntryKind::Paid,
        )
    })
    .unwrap();
}

fn entry(scope: Scope, blocks: &[PutBlock], kind: EntryKind) -> RemoteEntry {
    RemoteEntry {
        scope,
        existing: vec![],
        new: blocks.to_vec(),
        ttl: Duration::from_secs(300),
        kind,
        replica: false,
        handoff: false,
    }
}

/// The contract every transport must keep.
async fn contract<T: Transport>(t: &T, addr: &str, node: &FabricNode) {
    let s = scope();
    let blocks = chain(s, "a", 5, 3000);
    let hashes: Vec<BlockHash> = blocks.iter().map(|b| b.hash).collect();

    // Put, then read the whole chain back byte for byte.
    t.put_entry(addr, &entry(s, &blocks, EntryKind::Paid))
        .await
        .unwrap()
        .unwrap();
    let got = t.get_chain(addr, s, &hashes).await.unwrap();
    assert_eq!(got.len(), 5);
    for (g, b) in got.iter().zip(&blocks) {
        assert_eq!((g.hash, g.n_tokens, &g.data), (b.hash, b.n_tokens, &b.data));
    }
    // A chain is read up to its first missing block.
    let mut longer = hashes.clone();
    longer.insert(3, hash("missing"));
    assert_eq!(t.get_chain(addr, s, &longer).await.unwrap().len(), 3);
    assert!(
        t.get_chain(addr, s, &[hash("nothing")])
            .await
            .unwrap()
            .is_empty()
    );

    // Another tenant (or workspace) sees nothing, even with the right hashes.
    assert!(
        t.get_chain(addr, scope(), &hashes)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        t.get_block(addr, scope(), hashes[0])
            .await
            .unwrap()
            .is_none()
    );

    // A large block is pulled in ranges and arrives whole.
    let big = chain(s, "big", 1, (9 << 20) + 7);
    t.put_entry(addr, &entry(s, &big, EntryKind::BestEffort))
        .await
        .unwrap()
        .unwrap();
    let b = t.get_block(addr, s, big[0].hash).await.unwrap().unwrap();
    assert_eq!(b.data, big[0].data);
    assert!(
        t.get_block(addr, s, hash("absent"))
            .await
            .unwrap()
            .is_none()
    );

    // A large block corrupted at rest: the ranged pull sees the mismatch, the verifying
    // re-read makes the node drop it, and nothing is served.
    let big2 = chain(s, "big2", 1, 5 << 20);
    t.put_entry(addr, &entry(s, &big2, EntryKind::BestEffort))
        .await
        .unwrap()
        .unwrap();
    assert!(node.with_store(|st| st.corrupt_for_test(&big2[0].hash)));
    assert!(t.get_block(addr, s, big2[0].hash).await.unwrap().is_none());
    assert_eq!(
        node.with_store(|st| st.removal_reason(&big2[0].hash)),
        Some(RemovalReason::Corrupt)
    );

    // Refusals come back as the node's answer, not as transport failures.
    let mut orphan = chain(s, "orphan", 2, 100);
    orphan.remove(0);
    assert_eq!(
        t.put_entry(addr, &entry(s, &orphan, EntryKind::Paid))
            .await
            .unwrap(),
        Err(WriteRefused::MissingParent)
    );
    let mut bad = chain(s, "bad", 1, 100);
    bad[0].checksum ^= 1;
    assert_eq!(
        t.put_entry(addr, &entry(s, &bad, EntryKind::Paid))
            .await
            .unwrap(),
        Err(WriteRefused::Corrupt)
    );

    // A block hash stored for another scope is refused, and the owner's block untouched.
    let intruder = RemoteEntry {
        scope: scope(),
        ..entry(s, &blocks[..1], EntryKind::Paid)
    };
    assert_eq!(
        t.put_entry(addr, &intruder).await.unwrap(),
        Err(WriteRefused::Conflict)
    );
    assert_eq!(t.get_chain(addr, s, &hashes[..1]).await.unwrap().len(), 1);

    // A bit flipped at rest is detected by the node and the block is never served.
    assert!(node.with_store(|st| st.corrupt_for_test(&hashes[2])));
    assert_eq!(t.get_chain(addr, s, &hashes).await.unwrap().len(), 2);
    assert_eq!(
        node.with_store(|st| st.removal_reason(&hashes[2])),
        Some(RemovalReason::Corrupt)
    );

    // Owners hold blocks without their parents: a replica write of a chain's middle is
    // stored and served by hash, where an ordinary entry write is refused.
    let mid = chain(s, "replica", 4, 2048);
    assert_eq!(
        t.put_entry(addr, &entry(s, &mid[2..], EntryKind::Paid))
            .await
            .unwrap(),
        Err(WriteRefused::MissingParent)
    );
    let replica = RemoteEntry {
        replica: true,
        handoff: false,
        existing: vec![mid[0].hash],
        ..entry(s, &mid[2..], EntryKind::Paid)
    };
    assert_eq!(t.put_entry(addr, &replica).await.unwrap(), Ok(()));
    let got = t.get_block(addr, s, mid[3].hash).await.unwrap().unwrap();
    assert_eq!(got.data, mid[3].data);
    assert!(t.get_block(addr, s, mid[1].hash).await.unwrap().is_none());
    // The parent arriving later adopts its children: the chain is whole again.
    let parents = RemoteEntry {
        replica: true,
        handoff: false,
        ..entry(s, &mid[..2], EntryKind::Paid)
    };
    assert_eq!(t.put_entry(addr, &parents).await.unwrap(), Ok(()));
    let hashes: Vec<BlockHash> = mid.iter().map(|b| b.hash).collect();
    assert_eq!(t.get_chain(addr, s, &hashes).await.unwrap().len(), 4);
    node.with_store(|st| st.check_invariants());
    // HAS answers per hash, and only for the scope that stored it.
    let probe = [mid[1].hash, hash("never stored"), mid[3].hash];
    assert_eq!(
        t.has(addr, s, &probe).await.unwrap(),
        vec![true, false, true]
    );
    assert_eq!(
        t.has(addr, scope(), &probe).await.unwrap(),
        vec![false, false, false]
    );
}

#[tokio::test]
async fn tcp_transport_keeps_the_contract() {
    let (addr, node) = node().await;
    let t = TcpTransport::new(TOKEN);
    contract(&t, &addr, &node).await;
    // Striping off (one range) keeps it too.
    let mut one = TcpTransport::new(TOKEN);
    one.stripes = 1;
    contract(&one, &addr, &node).await;
}

#[tokio::test]
async fn a_peer_without_the_cluster_token_gets_nothing() {
    let (addr, node) = node().await;
    let s = scope();
    let blocks = chain(s, "secret", 1, 64);
    store(&node, s, &blocks);
    let t = TcpTransport::new("wrong-token");
    let r = t.get_chain(&addr, s, &[blocks[0].hash]).await;
    assert!(
        matches!(r, Err(TransportError::Unauthorized { .. })),
        "{r:?}"
    );
    // Raw bytes that are not a HELLO get the connection closed.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut raw = tokio::net::TcpStream::connect(&addr).await.unwrap();
    raw.write_all(&[5, 0, 0, 0, 2, 1, 2, 3, 4]).await.unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(raw.read(&mut buf).await.unwrap_or(0), 0);
}

#[tokio::test]
async fn a_dead_node_is_a_transport_error_not_a_hang() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    let t = TcpTransport::new(TOKEN);
    let r = t.get_chain(&addr, scope(), &[hash("x")]).await;
    assert!(matches!(r, Err(TransportError::Io { .. })), "{r:?}");
}

/// Built with RDMA but no device enabled: every call goes over TCP and keeps the contract.
#[cfg(feature = "rdma")]
#[tokio::test]
async fn rdma_transport_without_a_device_is_tcp() {
    use cache_fabric::rdma::pull::RdmaTransport;
    let (addr, node) = node().await;
    let t = RdmaTransport::new(TOKEN);
    contract(&t, &addr, &node).await;
    assert_eq!((t.rdma_bytes(), t.fallbacks()), (0, 0));
}

/// Over a real RDMA device (`CACHET_RDMA_DEVICE`, e.g. `rxe0`): blocks arrive by RDMA READ
/// from the serving node's registered pool, the contract holds, every lease is released,
/// a chain larger than the pool is served up to where the pool ran out, and a peer that
/// exports no pool is read over TCP.
#[cfg(feature = "rdma")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_transport_keeps_the_contract_over_a_device() {
    use cache_fabric::rdma::verbs::Device;
    use cache_fabric::rdma::{Export, pull::RdmaTransport};
    let Some(name) = std::env::var("CACHET_RDMA_DEVICE")
        .ok()
        .filter(|n| !n.is_empty())
    else {
        eprintln!("skipped: CACHET_RDMA_DEVICE names no RDMA device (scripts/rdma-vm.sh)");
        return;
    };
    let device = Device::open(Some(&name)).expect("the named RDMA device opens");
    let (addr, served) = node().await;
    let export = Export::new(device.clone(), 64 << 20).unwrap();
    served.export_rdma(export.clone());
    let t = RdmaTransport::new(TOKEN);
    t.enable(device.clone());
    // Connections open in the background on first use; open one now so the contract's
    // reads go over RDMA.
    t.connect_now(&addr).await.unwrap();
    contract(&t, &addr, &served).await;
    assert_eq!(t.fallbacks(), 0, "no read fell back to TCP");
    assert!(
        t.rdma_bytes() > 9 << 20,
        "the blocks, the 9 MiB one included, arrived by RDMA READ ({} bytes)",
        t.rdma_bytes()
    );
    // RDONE is not answered: the node frees a lease when it reads it.
    for _ in 0..500 {
        if export.staged_bytes() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(export.staged_bytes(), 0, "every lease was released");

    // Several readers at once over their own queue pairs.
    let s = scope();
    let blocks = chain(s, "parallel", 8, 256 << 10);
    let hashes: Vec<BlockHash> = blocks.iter().map(|b| b.hash).collect();
    t.put_entry(&addr, &entry(s, &blocks, EntryKind::Paid))
        .await
        .unwrap()
        .unwrap();
    let t = Arc::new(t);
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let (t, addr, hashes) = (t.clone(), addr.clone(), hashes.clone());
            tokio::spawn(async move { t.get_chain(&addr, s, &hashes).await.unwrap() })
        })
        .collect();
    for r in readers {
        let got = r.await.unwrap();
        assert_eq!(got.len(), 8);
        for (g, b) in got.iter().zip(&blocks) {
            assert_eq!(g.data, b.data);
        }
    }
    assert_eq!(t.fallbacks(), 0);

    // A block larger than the reader's receive region goes over TCP for that call only; the
    // peer stays on RDMA.
    let mut narrow = RdmaTransport::new(TOKEN);
    narrow.set_region_bytes(1 << 20);
    narrow.enable(device.clone());
    narrow.connect_now(&addr).await.unwrap();
    let wide = chain(s, "wide", 1, 3 << 20);
    t.put_entry(&addr, &entry(s, &wide, EntryKind::BestEffort))
        .await
        .unwrap()
        .unwrap();
    let got = narrow
        .get_block(&addr, s, wide[0].hash)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.data, wide[0].data);
    assert_eq!((narrow.rdma_bytes(), narrow.fallbacks()), (0, 0));
    let got = narrow.get_chain(&addr, s, &hashes[..2]).await.unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(
        narrow.rdma_bytes(),
        2 * (256 << 10),
        "small blocks still by RDMA"
    );

    // A pool smaller than the chain: the prefix that fit is served, the rest is not.
    let (small_addr, small) = node().await;
    small.export_rdma(Export::new(device.clone(), 1 << 20).unwrap());
    let long = chain(s, "long", 6, 300 << 10);
    let long_hashes: Vec<BlockHash> = long.iter().map(|b| b.hash).collect();
    t.put_entry(&small_addr, &entry(s, &long, EntryKind::Paid))
        .await
        .unwrap()
        .unwrap();
    t.connect_now(&small_addr).await.unwrap();
    let got = t.get_chain(&small_addr, s, &long_hashes).await.unwrap();
    assert_eq!(got.len(), 3, "three 300 KiB blocks fit a 1 MiB pool");
    for (g, b) in got.iter().zip(&long) {
        assert_eq!(g.data, b.data);
    }

    // A peer that leaves the view takes its connections (and pinned regions) with it.
    assert_eq!(t.peers(), 2);
    t.retain_peers(&[addr.as_str()]);
    assert_eq!(t.peers(), 1);
    assert_eq!(t.get_chain(&addr, s, &hashes).await.unwrap().len(), 8);

    // A node that exports nothing refuses RCONNECT: the reader falls back to TCP.
    let (plain_addr, plain) = node().await;
    let t2 = RdmaTransport::new(TOKEN);
    t2.enable(device);
    assert!(t2.connect_now(&plain_addr).await.is_err());
    contract(&t2, &plain_addr, &plain).await;
    assert!(t2.fallbacks() >= 1);
    assert_eq!(t2.rdma_bytes(), 0);
}

/// A node answers what a tenant holds on it (the admin console's cache view) to a peer with
/// the cluster token, and only for the tenant asked about.
#[tokio::test]
async fn a_node_reports_a_tenants_cache_to_the_cluster() {
    let (addr, node) = node().await;
    let t = TcpTransport::new(TOKEN);
    let (a, b) = (scope(), scope());
    let blocks = chain(a, "stats", 3, 1000);
    t.put_entry(&addr, &entry(a, &blocks, EntryKind::Paid))
        .await
        .unwrap()
        .unwrap();
    let hashes: Vec<BlockHash> = blocks.iter().map(|b| b.hash).collect();
    assert_eq!(t.get_chain(&addr, a, &hashes).await.unwrap().len(), 3);
    let mut got = t.tenant_stats(&addr, a.tenant, 5).await.unwrap();
    let mut local = node.tenant_stats(a.tenant, 5);
    // The TTL left is read at two moments (milliseconds apart, more in a slow VM): compare
    // it within a second, and everything else exactly.
    let (remote_ttl, local_ttl) = (
        got.top_prefixes[0].ttl_left_ms,
        local.top_prefixes[0].ttl_left_ms,
    );
    assert!(
        remote_ttl >= local_ttl && remote_ttl - local_ttl < 1000,
        "{remote_ttl} vs {local_ttl}"
    );
    got.top_prefixes[0].ttl_left_ms = 0;
    local.top_prefixes[0].ttl_left_ms = 0;
    assert_eq!(got, local);
    assert_eq!(got.total_bytes(), 3000);
    assert_eq!(got.top_prefixes[0].reads, 1);
    assert_eq!(got.top_prefixes[0].hash, hashes[2].to_hex());
    assert_eq!(got.top_prefixes[0].tokens, 48);
    let other = t.tenant_stats(&addr, b.tenant, 5).await.unwrap();
    assert_eq!(other.total_bytes(), 0);
    assert!(other.top_prefixes.is_empty());
    let wrong = TcpTransport::new("not-the-cluster-token");
    assert!(matches!(
        wrong.tenant_stats(&addr, a.tenant, 5).await,
        Err(TransportError::Unauthorized { .. })
    ));
}

/// A length-prefixed frame of the fabric wire.
fn frame(body: Vec<u8>) -> Vec<u8> {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend(body);
    f
}

/// A raw connection to the node at `addr`, past its HELLO.
async fn greeted(addr: &str) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut hello = vec![1u8];
    hello.extend((TOKEN.len() as u16).to_le_bytes());
    hello.extend(TOKEN.as_bytes());
    raw.write_all(&frame(hello)).await.unwrap();
    assert_eq!(raw.read_u8().await.unwrap(), 0);
    raw
}

/// What an engine's own KV connector uses, byte for byte as `connectors/vllm` sends it: HAS
/// answers without touching the blocks, REPORT lands in the node's reports for the gateway.
#[tokio::test]
async fn an_engine_connector_looks_up_and_reports_on_the_raw_wire() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, node) = node().await;
    let s = scope();
    let blocks = chain(s, "connector", 2, 64);
    store(&node, s, &blocks);
    let mut raw = greeted(&addr).await;
    // HAS: both blocks, then a block nobody stored.
    let mut has = vec![5u8];
    has.extend(s.tenant.as_uuid().as_bytes());
    has.extend(s.workspace.as_uuid().as_bytes());
    has.extend(3u32.to_le_bytes());
    for h in [blocks[0].hash, blocks[1].hash, hash("absent")] {
        has.extend(h.0);
    }
    raw.write_all(&frame(has)).await.unwrap();
    let mut answer = [0u8; 4];
    raw.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer, [0, 1, 1, 0]);
    // REPORT: tag (big-endian u128, a UUID's bytes), local, loaded, failed tokens.
    let tag = 0x0123_4567_89ab_cdef_0011_2233_4455_6677u128;
    let mut report = vec![10u8];
    report.extend(tag.to_be_bytes());
    for n in [128u32, 256, 128] {
        report.extend(n.to_le_bytes());
    }
    raw.write_all(&frame(report)).await.unwrap();
    assert_eq!(raw.read_u8().await.unwrap(), 0);
    let got = node
        .reports()
        .take_within(tag, Duration::from_secs(1))
        .await
        .expect("the report reached the node");
    assert_eq!(
        (got.local_tokens, got.loaded_tokens, got.failed_tokens),
        (128, 256, 128)
    );
    assert_eq!(got.cached_tokens(), 384);
    // A short REPORT closes the connection (the node stays up).
    raw.write_all(&frame(vec![10u8, 1, 2])).await.unwrap();
    let mut buf = [0u8; 4];
    assert_eq!(raw.read(&mut buf).await.unwrap_or(0), 0);
}

/// The trace context a tracing node sends before a request frame (TRACE: the `traceparent`,
/// its length in a byte) takes no answer, and the request after it is served as usual; a
/// TRACE whose length disagrees with its contents closes the connection.
#[tokio::test]
async fn a_trace_context_before_a_request_is_taken_without_an_answer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, node) = node().await;
    let s = scope();
    let blocks = chain(s, "traced", 1, 64);
    store(&node, s, &blocks);
    let mut raw = greeted(&addr).await;
    let tp = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let trace = |len: u8, tp: &[u8]| {
        let mut t = vec![18u8, len];
        t.extend(tp);
        frame(t)
    };
    let mut has = vec![5u8];
    has.extend(s.tenant.as_uuid().as_bytes());
    has.extend(s.workspace.as_uuid().as_bytes());
    has.extend(1u32.to_le_bytes());
    has.extend(blocks[0].hash.0);
    // TRACE and HAS in one write: the first answer on the wire is HAS's.
    let mut both = trace(tp.len() as u8, tp);
    both.extend(frame(has.clone()));
    raw.write_all(&both).await.unwrap();
    let mut answer = [0u8; 2];
    raw.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer, [0, 1]);
    // Twice on one connection, and a request without one in between.
    raw.write_all(&frame(has.clone())).await.unwrap();
    raw.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer, [0, 1]);
    raw.write_all(&trace(tp.len() as u8 + 1, tp)).await.unwrap();
    let mut buf = [0u8; 4];
    assert_eq!(raw.read(&mut buf).await.unwrap_or(0), 0);
}
