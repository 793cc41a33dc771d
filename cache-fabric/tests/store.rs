//! Fabric behaviour through its client API and store: TTL (paused time), refresh on read,
//! quotas, eviction with tails before ancestors, extra copies first and popular blocks'
//! last replicas last, paid entries protected from capacity eviction, frequency-aware admission of best-effort entries, checksums.

mod common;

use std::time::Duration;

use bytes::Bytes;
use cache_fabric::{
    EntryKind, EvictionPolicy, FabricClient, FabricNode, Holding, KeySpace, MissReason, NodeConfig,
    PrefixKeys, PutBlock, RemovalReason, WriteRefused,
};
use common::{TempDir, scope};

use cachet_common::Scope;
use proptest::prelude::*;
use tokio::time::Instant;

const B: usize = 4;
const BYTES_PER_TOKEN: usize = 8;

fn keys(scope: Scope, toks: &[u32], bps: &[usize]) -> PrefixKeys {
    KeySpace::new(scope, "m", "", "f16", B).prefix_keys(toks, toks.len(), bps)
}

/// All blocks of the chain to `offset`, with data derived from the hash.
fn blocks_to(keys: &PrefixKeys, offset: usize) -> Vec<PutBlock> {
    keys.chain_to(offset)
        .unwrap()
        .iter()
        .map(|l| {
            let n = l.end - l.start;
            let data: Vec<u8> = (0..n * BYTES_PER_TOKEN).map(|i| l.hash.0[i % 32]).collect();
            PutBlock::new(l.hash, l.parent, n as u32, Bytes::from(data))
        })
        .collect()
}

/// Write the whole chain of `keys` to `offset` as one entry with a TTL of `ttl_secs`.
async fn write_whole(
    c: &FabricClient,
    s: Scope,
    keys: &PrefixKeys,
    offset: usize,
    ttl_secs: u64,
    now: Instant,
    kind: EntryKind,
) -> Result<(), cache_fabric::WriteRefused> {
    c.write_entry(
        s,
        keys,
        offset,
        &blocks_to(keys, offset),
        Holding {
            ttl: Duration::from_secs(ttl_secs),
            kind,
        },
        now,
    )
    .await
}

fn client(capacity: u64) -> (FabricClient, std::sync::Arc<FabricNode>) {
    client_with(capacity, EvictionPolicy::Lru)
}

fn client_with(
    capacity: u64,
    eviction: EvictionPolicy,
) -> (FabricClient, std::sync::Arc<FabricNode>) {
    let node = FabricNode::new(NodeConfig {
        dram_capacity_bytes: capacity,
        eviction,
    });
    (FabricClient::local(node.clone()), node)
}

const PAID: EntryKind = EntryKind::Paid;
const AUTO: EntryKind = EntryKind::BestEffort;

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

#[tokio::test(start_paused = true)]
async fn entry_expires_after_its_ttl_and_reads_refresh_it() {
    let (c, node) = client(1 << 20);
    let s = scope();
    let t = toks(1, 10);
    let k = keys(s, &t, &[10]);
    let t0 = Instant::now();
    write_whole(&c, s, &k, 10, 300, t0, PAID).await.unwrap();
    assert_eq!(c.read_prefix(s, &k, 10, t0).await.tokens, 10);

    tokio::time::advance(Duration::from_secs(240)).await;
    // A read at 4 minutes refreshes the TTL to 4 + 5 minutes.
    assert_eq!(c.read_prefix(s, &k, 10, Instant::now()).await.tokens, 10);
    tokio::time::advance(Duration::from_secs(240)).await;
    assert_eq!(
        c.read_prefix(s, &k, 10, Instant::now()).await.tokens,
        10,
        "refreshed entry still live at 8 min"
    );
    tokio::time::advance(Duration::from_secs(301)).await;
    let r = c.read_prefix(s, &k, 10, Instant::now()).await;
    assert_eq!(r.tokens, 0);
    assert_eq!(
        c.miss_reason(s, &k, 10, Instant::now()).await,
        MissReason::Removed(RemovalReason::Expired)
    );
    node.with_store(|st| {
        assert!(st.is_empty());
        st.check_invariants();
    });
}

#[tokio::test(start_paused = true)]
async fn one_hour_entry_outlives_a_five_minute_one_sharing_its_blocks() {
    let (c, node) = client(1 << 20);
    let s = scope();
    let t = toks(2, 16);
    let k = keys(s, &t, &[6, 16]);
    let now = Instant::now();
    write_whole(&c, s, &k, 6, 3600, now, PAID).await.unwrap();
    write_whole(&c, s, &k, 16, 300, now, PAID).await.unwrap();
    tokio::time::advance(Duration::from_secs(600)).await;
    let r = c.read_prefix(s, &k, 16, Instant::now()).await;
    assert_eq!(
        r.tokens, 6,
        "the 5m entry is gone, the 1h prefix (with its tail) remains"
    );
    node.with_store(|st| st.check_invariants());
}

#[tokio::test]
async fn tenants_never_read_each_others_blocks() {
    let (c, _) = client(1 << 20);
    let (a, b) = (scope(), scope());
    let t = toks(3, 12);
    let ka = keys(a, &t, &[12]);
    c.write_entry(
        a,
        &ka,
        12,
        &blocks_to(&ka, 12),
        Holding {
            ttl: Duration::from_secs(300),
            kind: PAID,
        },
        Instant::now(),
    )
    .await
    .unwrap();
    // Tenant b computes its own keys for the same tokens: different hashes, nothing found.
    let kb = keys(b, &t, &[12]);
    assert_eq!(c.read_prefix(b, &kb, 12, Instant::now()).await.tokens, 0);
    // Even presenting a's hashes under b's scope finds nothing.
    assert_eq!(c.read_prefix(b, &ka, 12, Instant::now()).await.tokens, 0);
}

#[tokio::test]
async fn quota_evicts_only_the_tenants_own_lru_blocks() {
    let per_entry = (8 * BYTES_PER_TOKEN) as u64; // two blocks of 4 tokens
    let (c, node) = client(1 << 20);
    let (a, b) = (scope(), scope());
    c.set_tenant_quota(a.tenant, Some(2 * per_entry)).await;
    let now = Instant::now();
    let kb = keys(b, &toks(9, 8), &[8]);
    write_whole(&c, b, &kb, 8, 300, now, PAID).await.unwrap();
    let ka: Vec<PrefixKeys> = (0..3).map(|i| keys(a, &toks(10 + i, 8), &[8])).collect();
    for k in &ka {
        c.write_entry(
            a,
            k,
            8,
            &blocks_to(k, 8),
            Holding {
                ttl: Duration::from_secs(300),
                kind: PAID,
            },
            now,
        )
        .await
        .unwrap();
    }
    assert_eq!(c.tenant_bytes(a.tenant).await, 2 * per_entry);
    assert_eq!(
        c.read_prefix(a, &ka[0], 8, now).await.tokens,
        0,
        "oldest entry of a evicted"
    );
    assert_eq!(
        c.miss_reason(a, &ka[0], 8, now).await,
        MissReason::Removed(RemovalReason::Quota)
    );
    assert_eq!(c.read_prefix(a, &ka[2], 8, now).await.tokens, 8);
    assert_eq!(
        c.read_prefix(b, &kb, 8, now).await.tokens,
        8,
        "other tenant untouched"
    );
    // An entry larger than the whole quota is refused, and nothing of it stays.
    let big = keys(a, &toks(20, 24), &[24]);
    let r = c
        .write_entry(
            a,
            &big,
            24,
            &blocks_to(&big, 24),
            Holding {
                ttl: Duration::from_secs(300),
                kind: PAID,
            },
            now,
        )
        .await;
    assert_eq!(r, Err(WriteRefused::Quota));
    node.with_store(|st| st.check_invariants());
    assert!(c.tenant_bytes(a.tenant).await <= 2 * per_entry);
}

#[tokio::test]
async fn reserved_bytes_are_never_taken_by_other_tenants() {
    let block = (B * BYTES_PER_TOKEN) as u64;
    let (c, node) = client(8 * block);
    let (a, b) = (scope(), scope());
    node.with_store(|st| st.set_reservation(a.tenant, Some(3 * block)));
    let now = Instant::now();
    // A writes a 4-block chain first: under plain LRU it would be the first to go.
    let ka = keys(a, &toks(1, 4 * B), &[4 * B]);
    write_whole(&c, a, &ka, 4 * B, 300, now, AUTO)
        .await
        .unwrap();
    // B writes far more than the node holds.
    for seed in 10..40 {
        let kb = keys(b, &toks(seed, B), &[B]);
        write_whole(&c, b, &kb, B, 300, now, AUTO).await.unwrap();
        node.with_store(|st| st.check_invariants());
    }
    // A lost only what it held beyond its reservation (its chain's tail), nothing more.
    assert_eq!(c.tenant_bytes(a.tenant).await, 3 * block);
    assert_eq!(c.read_prefix(a, &ka, 4 * B, now).await.tokens, 3 * B);
    assert_eq!(c.tenant_bytes(b.tenant).await, 5 * block);
    // Without the reservation, A's blocks go like anyone's.
    node.with_store(|st| st.set_reservation(a.tenant, None));
    for seed in 40..50 {
        let kb = keys(b, &toks(seed, B), &[B]);
        write_whole(&c, b, &kb, B, 300, now, AUTO).await.unwrap();
    }
    assert_eq!(c.tenant_bytes(a.tenant).await, 0);
}

#[tokio::test]
async fn extra_copies_go_before_any_owned_block_and_an_owner_write_keeps_them() {
    let block = (B * BYTES_PER_TOKEN) as u64;
    let (c, node) = client(6 * block);
    let s = scope();
    let now = Instant::now();
    let one = |seed: u32| {
        let k = keys(s, &toks(seed, B), &[B]);
        (k.clone(), blocks_to(&k, B))
    };
    // Three owned blocks first (the oldest: plain LRU would take them first) ...
    for seed in 1..=3 {
        let (_, b) = one(seed);
        node.with_store(|st| st.put_replica(&s, &[], b, Duration::from_secs(300), now, AUTO))
            .unwrap();
    }
    // ... then three extra copies; one of them is then written by its owner.
    for seed in 11..=13 {
        let (_, b) = one(seed);
        node.with_store(|st| st.put_extra(&s, b, Duration::from_secs(300), AUTO, now))
            .unwrap();
    }
    let (_, owned_now) = one(13);
    node.with_store(|st| st.put_replica(&s, &[], owned_now, Duration::from_secs(300), now, AUTO))
        .unwrap();
    node.with_store(|st| st.check_invariants());
    // Three more blocks need room: the two remaining extra copies go first, then the
    // oldest owned block (the copy its owner wrote is owned now, and newer).
    for seed in 21..=23 {
        let (k, _) = one(seed);
        write_whole(&c, s, &k, B, 300, now, AUTO).await.unwrap();
    }
    for seed in [2, 3, 13, 21, 22, 23] {
        let (k, _) = one(seed);
        assert_eq!(
            c.read_prefix(s, &k, B, now).await.tokens,
            B,
            "block {seed} kept"
        );
    }
    for seed in [11, 12, 1] {
        let (k, _) = one(seed);
        assert_eq!(
            c.read_prefix(s, &k, B, now).await.tokens,
            0,
            "block {seed} evicted"
        );
    }
    node.with_store(|st| st.check_invariants());
}

/// A writer keeps its whole chain: the blocks it owns and extra copies of those other nodes
/// own, interleaved. The extra copies go first when room is needed, also from the middle of
/// the chain (their owners hold them); the owned blocks under them stay.
#[tokio::test]
async fn extra_copies_inside_a_chain_go_before_the_owned_blocks_under_them() {
    let block = (B * BYTES_PER_TOKEN) as u64;
    let (c, node) = client(6 * block);
    let s = scope();
    let now = Instant::now();
    let ttl = Duration::from_secs(300);
    let chain = keys(s, &toks(1, 4 * B), &[4 * B]);
    let (mut owned, mut extra) = (Vec::new(), Vec::new());
    for (i, b) in blocks_to(&chain, 4 * B).into_iter().enumerate() {
        if i % 2 == 1 {
            owned.push(b)
        } else {
            extra.push(b)
        }
    }
    let (owned_hashes, extra_hashes): (Vec<_>, Vec<_>) = (
        owned.iter().map(|b| b.hash).collect(),
        extra.iter().map(|b| b.hash).collect(),
    );
    // As `Cluster::write_entry` stores them: the owned blocks, then the extra copies.
    node.with_store(|st| st.put_replica(&s, &[], owned, ttl, now, AUTO))
        .unwrap();
    node.with_store(|st| st.put_extra(&s, extra, ttl, AUTO, now))
        .unwrap();
    node.with_store(|st| st.check_invariants());
    // Four more blocks on a node with room for six: both extra copies go, no owned block.
    let other = keys(s, &toks(2, 4 * B), &[4 * B]);
    write_whole(&c, s, &other, 4 * B, 300, now, AUTO)
        .await
        .unwrap();
    node.with_store(|st| {
        st.check_invariants();
        for h in &owned_hashes {
            assert!(st.contains(&s, h, now), "an owned block was evicted");
        }
        for h in &extra_hashes {
            assert!(!st.contains(&s, h, now), "an extra copy was kept");
        }
    });
    assert_eq!(c.read_prefix(s, &other, 4 * B, now).await.tokens, 4 * B);
}

/// The last replica of a popular block is sticky: capacity eviction takes every colder
/// leaf first, even newer ones; an extra copy never is; and once the block's uses fade it is
/// an ordinary leaf again.
#[tokio::test]
async fn a_popular_blocks_owner_copy_goes_last_until_its_uses_fade() {
    let block = (B * BYTES_PER_TOKEN) as u64;
    // A negligible horizon: eviction keys are recency (frequency moves a key by under one
    // use), so only stickiness can keep an old block.
    let (c, node) = client_with(
        4 * block,
        EvictionPolicy::Frequency {
            horizon_factor: 1e-6,
        },
    );
    let s = scope();
    let now = Instant::now();
    let one = |seed: u32| keys(s, &toks(seed, B), &[B]);
    let popular = one(1);
    write_whole(&c, s, &popular, B, 300, now, AUTO)
        .await
        .unwrap();
    for _ in 0..4 {
        assert_eq!(c.read_prefix(s, &popular, B, now).await.tokens, B);
    }
    // A popular block held as an extra copy gets no such standing.
    let extra_hot = one(2);
    node.with_store(|st| {
        st.put_extra(
            &s,
            blocks_to(&extra_hot, B),
            Duration::from_secs(300),
            AUTO,
            now,
        )
    })
    .unwrap();
    for _ in 0..4 {
        assert_eq!(c.read_prefix(s, &extra_hot, B, now).await.tokens, B);
    }
    // Twelve cold blocks through the three other places: the popular one stays.
    for seed in 100..112 {
        write_whole(&c, s, &one(seed), B, 300, now, AUTO)
            .await
            .unwrap();
        node.with_store(|st| st.check_invariants());
    }
    assert_eq!(c.read_prefix(s, &popular, B, now).await.tokens, B, "sticky");
    assert_eq!(
        c.read_prefix(s, &extra_hot, B, now).await.tokens,
        0,
        "extra copy evicted"
    );
    for seed in 109..112 {
        assert_eq!(c.read_prefix(s, &one(seed), B, now).await.tokens, B);
    }
    // Uses fade: the frequency sketch halves every ten uses per stored block (at least
    // 40,960 uses), taking the popular block's five uses to two. It then is an ordinary
    // leaf, older than every cold one, so the next eviction takes it.
    let scratch = scope();
    for seed in 0..42_000u32 {
        let k = keys(scratch, &toks(1_000_000 + seed, B), &[B]);
        let _ = write_whole(&c, scratch, &k, B, 300, now, AUTO).await;
    }
    write_whole(&c, s, &one(200), B, 300, now, AUTO)
        .await
        .unwrap();
    assert_eq!(
        c.read_prefix(s, &popular, B, now).await.tokens,
        0,
        "faded, evicted"
    );
    node.with_store(|st| st.check_invariants());
}

#[tokio::test]
async fn capacity_eviction_takes_tails_before_ancestors() {
    // Room for exactly 4 blocks of 4 tokens.
    let (c, node) = client(4 * (B * BYTES_PER_TOKEN) as u64);
    let s = scope();
    let now = Instant::now();
    let t = toks(4, 16);
    let k = keys(s, &t, &[16]);
    write_whole(&c, s, &k, 16, 300, now, AUTO).await.unwrap();
    // Re-read the chain so the root is the most recently used block; LRU alone would take it.
    c.read_prefix(s, &k, 4, now).await;
    let other = keys(s, &toks(5, 4), &[4]);
    write_whole(&c, s, &other, 4, 300, now, AUTO).await.unwrap();
    // The chain lost its tail block, not its root.
    assert_eq!(c.read_prefix(s, &k, 16, now).await.tokens, 12);
    node.with_store(|st| st.check_invariants());
}

#[tokio::test]
async fn a_flipped_bit_is_detected_and_the_block_never_served() {
    let (c, node) = client(1 << 20);
    let s = scope();
    let t = toks(6, 12);
    let k = keys(s, &t, &[12]);
    let now = Instant::now();
    write_whole(&c, s, &k, 12, 300, now, PAID).await.unwrap();
    assert!(node.with_store(|st| st.corrupt_for_test(&k.blocks[1])));
    let r = c.read_prefix(s, &k, 12, now).await;
    assert_eq!(r.tokens, 4, "prefix stops before the corrupt block");
    assert_eq!(
        c.miss_reason(s, &k, 12, now).await,
        MissReason::Removed(RemovalReason::Corrupt)
    );
    // A write whose bytes do not match their checksum is refused.
    let mut bad = blocks_to(&k, 12);
    bad[1].checksum ^= 1;
    assert_eq!(
        c.write_entry(
            s,
            &k,
            12,
            &bad,
            Holding {
                ttl: Duration::from_secs(300),
                kind: PAID
            },
            now
        )
        .await,
        Err(WriteRefused::Corrupt)
    );
}

#[tokio::test]
async fn checksums_are_verified_after_the_read_and_only_a_corrupt_block_is_dropped() {
    let (c, node) = client(1 << 20);
    let s = scope();
    let t = toks(8, 12);
    let k = keys(s, &t, &[12]);
    let now = Instant::now();
    write_whole(&c, s, &k, 12, 300, now, PAID).await.unwrap();
    assert!(node.with_store(|st| st.corrupt_for_test(&k.blocks[1])));
    // Read under the lock, verified after it: the corrupt block and those after it are not
    // returned, and it is named.
    let read = node.with_store(|st| st.read_chain(&s, &k.blocks, now));
    let (blocks, corrupt) = read.verify();
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0].hash, k.blocks[0]);
    assert_eq!(corrupt, Some(k.blocks[1]));
    // Dropping checks again under the lock: a sound block (replaced since the read, say)
    // stays; the corrupt one goes, as corrupt.
    node.with_store(|st| st.drop_corrupt(&k.blocks[0]));
    node.with_store(|st| st.drop_corrupt(&k.blocks[1]));
    assert_eq!(c.read_prefix(s, &k, 12, now).await.tokens, 4);
    assert_eq!(
        c.miss_reason(s, &k, 12, now).await,
        MissReason::Removed(RemovalReason::Corrupt)
    );
    // What a peer is sent: each block with the checksum its bytes were verified against.
    let read = node.with_store(|st| st.read_chain(&s, &k.blocks[..1], now));
    let (with, corrupt) = read.verify_with_checksums();
    assert_eq!(corrupt, None);
    assert_eq!(with.len(), 1);
    assert_eq!(with[0].1, cache_fabric::checksum(&with[0].0.data));
    node.with_store(|st| st.check_invariants());
}

#[tokio::test]
async fn tail_hits_are_exact_at_boundaries() {
    let (c, _) = client(1 << 20);
    let s = scope();
    let t = toks(7, 14);
    let k = keys(s, &t, &[6, 14]);
    let now = Instant::now();
    write_whole(&c, s, &k, 6, 300, now, PAID).await.unwrap();
    let r = c.read_prefix(s, &k, 14, now).await;
    assert_eq!(r.tokens, 6);
    assert_eq!(r.blocks.len(), 2);
    assert_eq!(r.blocks[1].n_tokens, 2);
}

#[tokio::test]
async fn paid_entries_are_never_evicted_for_capacity() {
    // Room for 4 blocks; a paid entry fills it.
    let (c, node) = client(4 * (B * BYTES_PER_TOKEN) as u64);
    let s = scope();
    let now = Instant::now();
    let k = keys(s, &toks(30, 16), &[16]);
    write_whole(&c, s, &k, 16, 300, now, PAID).await.unwrap();
    // Alone on the node, the tenant's fair share is the whole node: nothing of it goes.
    for kind in [AUTO, PAID] {
        let kx = keys(s, &toks(31, 4), &[4]);
        assert_eq!(
            write_whole(&c, s, &kx, 4, 300, now, kind).await,
            Err(WriteRefused::Capacity),
            "{kind:?} write must not displace a paid entry"
        );
    }
    assert_eq!(c.read_prefix(s, &k, 16, now).await.tokens, 16);
    // Its own tenant's quota still can.
    c.set_tenant_quota(s.tenant, Some(2 * (B * BYTES_PER_TOKEN) as u64))
        .await;
    assert_eq!(c.read_prefix(s, &k, 16, now).await.tokens, 8);
    node.with_store(|st| st.check_invariants());
}

/// With no quota set (the default), one tenant's paid entries cannot lock another out of a
/// full node for their TTL: a tenant over its fair share (the node split evenly between the
/// tenants on it) gives way, its own leaves first, counted as quota evictions; a tenant
/// within its share keeps everything, and a plan's quota takes the place of the fair share.
#[tokio::test]
async fn a_tenant_over_its_fair_share_gives_way_to_another_tenants_writes() {
    let block = (B * BYTES_PER_TOKEN) as u64;
    let (c, node) = client(4 * block);
    let (a, b) = (scope(), scope());
    let now = Instant::now();
    let ka = keys(a, &toks(40, 16), &[16]);
    write_whole(&c, a, &ka, 16, 3600, now, PAID).await.unwrap();
    // b's first block: a (4 blocks) is over its share of 2 and loses its tail.
    let kb1 = keys(b, &toks(41, 4), &[4]);
    write_whole(&c, b, &kb1, 4, 300, now, PAID).await.unwrap();
    assert_eq!(c.read_prefix(a, &ka, 16, now).await.tokens, 12);
    // b's second: a (3) still over, loses another; both now hold their share.
    let kb2 = keys(b, &toks(42, 4), &[4]);
    write_whole(&c, b, &kb2, 4, 300, now, PAID).await.unwrap();
    assert_eq!(c.read_prefix(a, &ka, 16, now).await.tokens, 8);
    // b's third would put b over its share: refused, and a keeps its share.
    let kb3 = keys(b, &toks(43, 4), &[4]);
    assert_eq!(
        write_whole(&c, b, &kb3, 4, 300, now, PAID).await,
        Err(WriteRefused::Capacity)
    );
    assert_eq!(c.read_prefix(a, &ka, 16, now).await.tokens, 8);
    node.with_store(|st| {
        st.check_invariants();
        assert_eq!(st.tenant_bytes(a.tenant), 2 * block);
        assert_eq!(st.tenant_bytes(b.tenant), 2 * block);
    });
    assert_eq!(node.tenant_stats(a.tenant, 5).evictions.evicted_quota, 2);
    // A plan's quota replaces the fair share: a tenant with one is not made to give way.
    let c_node = client(4 * block);
    let (c2, _) = c_node;
    let ka2 = keys(a, &toks(45, 16), &[16]);
    write_whole(&c2, a, &ka2, 16, 3600, now, PAID)
        .await
        .unwrap();
    c2.set_tenant_quota(a.tenant, Some(4 * block)).await;
    assert_eq!(
        write_whole(&c2, b, &kb1, 4, 300, now, PAID).await,
        Err(WriteRefused::Capacity)
    );
    assert_eq!(c2.read_prefix(a, &ka2, 16, now).await.tokens, 16);
}

/// With a disk tier, the fair share is of DRAM and disk together: one tenant's paid entries
/// fill both, and another tenant writing within its share makes it give way — its DRAM
/// leaves first, then (nothing of it left in DRAM) its disk blocks, so that paid leaves can
/// move down — counted as quota evictions. The writer never goes past its own share.
#[tokio::test]
async fn a_tenant_over_its_fair_share_of_dram_and_disk_gives_way() {
    let dir = TempDir::new();
    let block = (B * BYTES_PER_TOKEN) as u64;
    let node = FabricNode::with_disk(
        NodeConfig {
            dram_capacity_bytes: 2 * block,
            eviction: EvictionPolicy::DEFAULT,
        },
        &dir.0,
        6 * block,
    )
    .unwrap();
    let c = FabricClient::local(node.clone());
    let (a, b) = (scope(), scope());
    let now = Instant::now();
    let tier_blocks = |t: cachet_common::TenantId| -> u64 {
        node.tenant_stats(t, 0)
            .tiers
            .iter()
            .map(|u| u.bytes)
            .sum::<u64>()
            / block
    };
    // Alone, a holds the whole node: 2 blocks in DRAM, 6 moved to disk.
    for i in 0..8 {
        let k = keys(a, &toks(200 + i, B), &[B]);
        write_whole(&c, a, &k, B, 300, now, PAID).await.unwrap();
    }
    assert_eq!(
        node.with_store(|st| st.lower_tier_usage()),
        Some((6, 6 * block))
    );
    assert_eq!(tier_blocks(a.tenant), 8);
    // b writes four blocks, its share of the 8: a gives way, two blocks from DRAM, then two
    // from disk (DRAM then full of b's paid blocks, which move down).
    let mut kb = Vec::new();
    for i in 0..4 {
        let k = keys(b, &toks(300 + i, B), &[B]);
        write_whole(&c, b, &k, B, 300, now, PAID).await.unwrap();
        kb.push(k);
    }
    assert_eq!(tier_blocks(a.tenant), 4);
    assert_eq!(tier_blocks(b.tenant), 4);
    assert_eq!(node.tenant_stats(a.tenant, 0).evictions.evicted_quota, 4);
    // A fifth would put b over its share: refused, and a keeps its share.
    let k5 = keys(b, &toks(304, B), &[B]);
    assert_eq!(
        write_whole(&c, b, &k5, B, 300, now, PAID).await,
        Err(WriteRefused::Capacity)
    );
    assert_eq!(tier_blocks(a.tenant), 4);
    // Everything b paid for is readable, from whichever tier holds it.
    for k in &kb {
        assert_eq!(c.read_prefix(b, k, B, now).await.tokens, B);
    }
    node.with_store(|st| st.check_invariants());
}

#[tokio::test]
async fn best_effort_blocks_go_before_paid_ones_whatever_their_recency() {
    let (c, node) = client(4 * (B * BYTES_PER_TOKEN) as u64);
    let s = scope();
    let now = Instant::now();
    let paid = keys(s, &toks(40, 8), &[8]);
    let auto = keys(s, &toks(41, 8), &[8]);
    write_whole(&c, s, &paid, 8, 300, now, PAID).await.unwrap();
    write_whole(&c, s, &auto, 8, 300, now, AUTO).await.unwrap();
    // The automatic entry is now the most recently used; LRU alone would keep it.
    c.read_prefix(s, &auto, 8, now).await;
    let next = keys(s, &toks(42, 8), &[8]);
    write_whole(&c, s, &next, 8, 300, now, PAID).await.unwrap();
    assert_eq!(c.read_prefix(s, &paid, 8, now).await.tokens, 8);
    assert_eq!(c.read_prefix(s, &auto, 8, now).await.tokens, 0);
    assert_eq!(
        c.miss_reason(s, &auto, 8, now).await,
        MissReason::Removed(RemovalReason::Capacity)
    );
    node.with_store(|st| {
        assert!(st.is_paid(&paid.blocks[0]) && st.is_paid(&next.blocks[1]));
        st.check_invariants();
    });
}

#[tokio::test]
async fn a_paid_write_over_an_automatic_prefix_makes_the_whole_chain_paid() {
    let (c, node) = client(1 << 20);
    let s = scope();
    let now = Instant::now();
    let k = keys(s, &toks(43, 16), &[8, 16]);
    write_whole(&c, s, &k, 8, 300, now, AUTO).await.unwrap();
    node.with_store(|st| assert!(!st.is_paid(&k.blocks[0])));
    let rest: Vec<PutBlock> = blocks_to(&k, 16).into_iter().skip(2).collect();
    c.write_entry(
        s,
        &k,
        16,
        &rest,
        Holding {
            ttl: Duration::from_secs(300),
            kind: PAID,
        },
        now,
    )
    .await
    .unwrap();
    node.with_store(|st| {
        assert!(k.blocks.iter().all(|h| st.is_paid(h)));
        st.check_invariants();
    });
}

#[tokio::test]
async fn frequency_policy_declines_a_one_off_entry_that_would_displace_hot_blocks() {
    // Room for 4 blocks, held by two best-effort entries read many times.
    let (c, node) = client_with(4 * (B * BYTES_PER_TOKEN) as u64, EvictionPolicy::FREQUENCY);
    let s = scope();
    let now = Instant::now();
    let hot: Vec<PrefixKeys> = (0..2).map(|i| keys(s, &toks(50 + i, 8), &[8])).collect();
    for k in &hot {
        c.write_entry(
            s,
            k,
            8,
            &blocks_to(k, 8),
            Holding {
                ttl: Duration::from_secs(300),
                kind: AUTO,
            },
            now,
        )
        .await
        .unwrap();
    }
    for _ in 0..10 {
        for k in &hot {
            assert_eq!(c.read_prefix(s, k, 8, now).await.tokens, 8);
        }
    }
    let once = keys(s, &toks(60, 8), &[8]);
    assert_eq!(
        write_whole(&c, s, &once, 8, 300, now, AUTO).await,
        Err(WriteRefused::NotAdmitted)
    );
    // A paid entry is not subject to admission: it displaces best-effort blocks.
    write_whole(&c, s, &once, 8, 300, now, PAID).await.unwrap();
    assert_eq!(c.read_prefix(s, &once, 8, now).await.tokens, 8);
    // Under LRU the same one-off best-effort entry is simply stored.
    let (lru, _) = client(4 * (B * BYTES_PER_TOKEN) as u64);
    for k in &hot {
        lru.write_entry(
            s,
            k,
            8,
            &blocks_to(k, 8),
            Holding {
                ttl: Duration::from_secs(300),
                kind: AUTO,
            },
            now,
        )
        .await
        .unwrap();
    }
    write_whole(&lru, s, &once, 8, 300, now, AUTO)
        .await
        .unwrap();
    node.with_store(|st| st.check_invariants());
}

fn disk_node(
    dram_blocks: u64,
    dir: &std::path::Path,
) -> (FabricClient, std::sync::Arc<FabricNode>) {
    let node = FabricNode::with_disk(
        NodeConfig {
            dram_capacity_bytes: dram_blocks * (B * BYTES_PER_TOKEN) as u64,
            eviction: EvictionPolicy::Lru,
        },
        dir,
        1 << 20,
    )
    .unwrap();
    (FabricClient::local(node.clone()), node)
}

#[tokio::test]
async fn dram_pressure_demotes_to_disk_and_a_disk_hit_promotes() {
    let dir = TempDir::new();
    let (c, node) = disk_node(2, &dir.0);
    let s = scope();
    let now = Instant::now();
    let a = keys(s, &toks(70, 8), &[8]);
    let b = keys(s, &toks(71, 8), &[8]);
    write_whole(&c, s, &a, 8, 300, now, AUTO).await.unwrap();
    write_whole(&c, s, &b, 8, 300, now, AUTO).await.unwrap();
    node.with_store(|st| {
        assert_eq!(st.len(), 2, "DRAM holds b");
        assert_eq!(st.lower_tier_usage(), Some((2, 64)), "a went to disk");
    });
    // Reading a finds it on disk, brings it back (pushing b down), bytes intact.
    let r = c.read_prefix(s, &a, 8, now).await;
    assert_eq!(r.tokens, 8);
    for (got, want) in r.blocks.iter().zip(blocks_to(&a, 8)) {
        assert_eq!(got.data, want.data);
    }
    node.with_store(|st| {
        assert!(st.contains(&s, &a.blocks[0], now) && st.contains(&s, &a.blocks[1], now));
        assert_eq!(st.lower_tier_usage(), Some((2, 64)), "b went to disk");
        st.check_invariants();
    });
    assert_eq!(c.read_prefix(s, &b, 8, now).await.tokens, 8);
    // Another tenant presenting the hashes gets nothing from disk either.
    assert_eq!(c.read_prefix(scope(), &a, 8, now).await.tokens, 0);
}

/// DRAM full of paid entries: a new write demotes the least recently used paid leaves to the
/// disk tier (they stay readable for their TTL) instead of being refused; once the disk tier
/// is full of unexpired paid blocks too, writes are refused and nothing paid is dropped; a
/// block that cannot be promoted for lack of room is served from disk.
#[tokio::test]
async fn paid_entries_under_dram_pressure_move_to_disk_and_stay() {
    let dir = TempDir::new();
    let block = (B * BYTES_PER_TOKEN) as u64;
    let node = FabricNode::with_disk(
        NodeConfig {
            dram_capacity_bytes: 4 * block,
            eviction: EvictionPolicy::DEFAULT,
        },
        &dir.0,
        4 * block,
    )
    .unwrap();
    let c = FabricClient::local(node.clone());
    let (s, other) = (scope(), scope());
    let now = Instant::now();
    let first = keys(s, &toks(80, 16), &[16]);
    write_whole(&c, s, &first, 16, 300, now, PAID)
        .await
        .unwrap();
    // Another tenant's paid entry of four blocks: the first entry moves to disk, whole.
    let second = keys(other, &toks(81, 16), &[16]);
    write_whole(&c, other, &second, 16, 300, now, PAID)
        .await
        .unwrap();
    node.with_store(|st| {
        assert_eq!(st.lower_tier_usage(), Some((4, 4 * block)));
        st.check_invariants();
    });
    // Both tiers full of unexpired paid blocks: a further write is refused, not billed.
    let third = keys(other, &toks(82, 4), &[4]);
    assert_eq!(
        write_whole(&c, other, &third, 4, 300, now, PAID).await,
        Err(WriteRefused::Capacity)
    );
    assert_eq!(
        write_whole(&c, s, &third, 4, 300, now, AUTO).await,
        Err(WriteRefused::Capacity)
    );
    // Nothing paid was lost: the first entry is read from disk (no room to promote it),
    // the second from DRAM, bytes intact.
    for (who, k) in [(s, &first), (other, &second)] {
        let r = c.read_prefix(who, k, 16, now).await;
        assert_eq!(r.tokens, 16);
        for (got, want) in r.blocks.iter().zip(blocks_to(k, 16)) {
            assert_eq!(got.data, want.data);
        }
    }
    node.with_store(|st| {
        assert_eq!(st.lower_tier_usage(), Some((4, 4 * block)));
        st.check_invariants();
    });
    // Paid entries expire as usual: five minutes later there is room again.
    let later = now + Duration::from_secs(301);
    write_whole(&c, other, &third, 4, 300, later, PAID)
        .await
        .unwrap();
}

/// Repairs read the disk tier a batch at a time: each batch stops at the byte budget (after
/// at least one block), and the batches together hand over every block on disk exactly once.
#[tokio::test]
async fn the_disk_tier_is_handed_off_in_bounded_batches() {
    let dir = TempDir::new();
    let (c, node) = disk_node(2, &dir.0);
    let s = scope();
    let now = Instant::now();
    for seed in 0..10 {
        let k = keys(s, &toks(300 + seed, 8), &[8]);
        write_whole(&c, s, &k, 8, 300, now, AUTO).await.unwrap();
    }
    let block = (B * BYTES_PER_TOKEN) as u64;
    let (dram, lower) = node.with_store(|st| (st.handoff(now), st.lower_hashes()));
    assert_eq!(dram.len(), 2);
    assert_eq!(lower.len(), 18);
    let mut seen = std::collections::HashSet::new();
    let mut next = 0;
    while next < lower.len() {
        let (batch, used) = node.with_store(|st| st.lower_handoff(&lower[next..], 3 * block));
        assert!(!batch.is_empty() && batch.len() <= 3, "{}", batch.len());
        for h in &batch {
            assert!(seen.insert(h.block.hash), "handed off twice");
            assert_eq!(h.block.checksum, cache_fabric::checksum(&h.block.data));
        }
        next += used;
    }
    assert_eq!(seen.len(), 18);
    assert!(dram.iter().all(|h| !seen.contains(&h.block.hash)));
}

#[tokio::test]
async fn a_block_corrupted_on_disk_is_never_promoted_and_a_restart_recovers_the_rest() {
    let dir = TempDir::new();
    let s = scope();
    let now = Instant::now();
    let a = keys(s, &toks(80, 8), &[8]);
    {
        let (c, _) = disk_node(2, &dir.0);
        let b = keys(s, &toks(81, 8), &[8]);
        for k in [&a, &b] {
            c.write_entry(
                s,
                k,
                8,
                &blocks_to(k, 8),
                Holding {
                    ttl: Duration::from_secs(300),
                    kind: AUTO,
                },
                now,
            )
            .await
            .unwrap();
        }
    }
    // The node is gone (DRAM lost); a's blocks are on disk, its tail block demoted first.
    // Flip a byte of that first record's data (after the 8-byte prefix and the header).
    let seg = dir.0.join("seg-00000000.cachet");
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[cache_fabric::tier::PREFIX + cache_fabric::tier::HEADER] ^= 1;
    std::fs::write(&seg, bytes).unwrap();
    let (c, node) = disk_node(2, &dir.0);
    let r = c.read_prefix(s, &a, 8, now).await;
    assert_eq!(
        r.tokens, 4,
        "the intact first block is recovered; the corrupt tail never served"
    );
    node.with_store(|st| st.check_invariants());
}

/// A block whose disk copy fails its checksum when it is read is dropped and remembered, with
/// its place in the chain, for the cluster to fetch again from another owner.
#[tokio::test]
async fn a_block_found_corrupt_on_disk_is_remembered_for_healing() {
    let dir = TempDir::new();
    let (c, node) = disk_node(2, &dir.0);
    let s = scope();
    let now = Instant::now();
    let a = keys(s, &toks(90, 8), &[8]);
    let b = keys(s, &toks(91, 8), &[8]);
    write_whole(&c, s, &a, 8, 300, now, AUTO).await.unwrap();
    write_whole(&c, s, &b, 8, 300, now, AUTO).await.unwrap();
    // a went to disk, its tail first: flip a byte of that first record's data.
    let seg = dir.0.join("seg-00000000.cachet");
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[cache_fabric::tier::PREFIX + cache_fabric::tier::HEADER] ^= 1;
    std::fs::write(&seg, bytes).unwrap();
    assert_eq!(c.read_prefix(s, &a, 8, now).await.tokens, 4);
    let damaged = node.with_store(|st| st.take_damaged());
    assert_eq!(damaged.len(), 1);
    assert_eq!(
        (damaged[0].hash, damaged[0].parent),
        (a.blocks[1], Some(a.blocks[0]))
    );
    assert!(node.with_store(|st| st.take_damaged()).is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Random writes and reads from several tenants under capacity and quota pressure keep
    /// every index consistent, never exceed capacity, and never exceed a tenant's quota.
    #[test]
    /// Paid blocks are never evicted for capacity (a debug assertion in the store), and
    /// every eviction takes a leaf (the child counts in the invariants).
    #[test]
    fn random_workloads_keep_invariants_and_bounds(
        ops in proptest::collection::vec((0usize..3, 0u32..12, 1usize..20, any::<bool>(), any::<bool>()), 1..60),
        policy in 0usize..3,
        step in 0usize..cache_fabric::policy::LADDER.len(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        rt.block_on(async {
            let cap = 24 * (B * BYTES_PER_TOKEN) as u64;
            let quota = 10 * (B * BYTES_PER_TOKEN) as u64;
            let policy = [EvictionPolicy::Lru, EvictionPolicy::FREQUENCY, EvictionPolicy::Adaptive][policy];
            let (c, node) = client_with(cap, policy);
            // The adaptive policy at any setting it can learn keeps every rule.
            node.with_store(|st| st.set_adaptive_step_for_test(step));
            let scopes: Vec<Scope> = (0..3).map(|_| scope()).collect();
            c.set_tenant_quota(scopes[0].tenant, Some(quota)).await;
            for (who, seed, len, long_ttl, paid) in ops {
                let s = scopes[who];
                let t = toks(seed, len);
                let k = keys(s, &t, &[len]);
                let now = Instant::now();
                let read = c.read_prefix(s, &k, len, now).await;
                let new: Vec<PutBlock> = blocks_to(&k, len).into_iter().filter(|b| !read.blocks.iter().any(|r| r.hash == b.hash)).collect();
                let ttl = Duration::from_secs(if long_ttl { 3600 } else { 300 });
                let kind = if paid { PAID } else { AUTO };
                let _ = c.write_entry(s, &k, len, &new, Holding { ttl, kind }, now).await;
                tokio::time::advance(Duration::from_secs(45)).await;
                node.with_store(|st| {
                    st.check_invariants();
                    assert!(st.used_bytes() <= cap);
                    assert!(st.tenant_bytes(scopes[0].tenant) <= quota);
                });
            }
        });
    }
    /// With a disk tier under DRAM, a paid entry that was written stays readable, whole, for
    /// its TTL, whatever other tenants write — DRAM pressure only moves it to disk, and the
    /// disk tier never drops it to make room — unless its tenant held more than its fair
    /// share of the two and gave way to another's write: every such loss is counted as a
    /// quota eviction of its tenant. Capacities and invariants hold throughout.
    #[test]
    fn paid_entries_stay_readable_for_their_ttl_across_dram_and_disk(
        ops in proptest::collection::vec((0usize..3, 0u32..10, 1usize..6, any::<bool>()), 1..40),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        rt.block_on(async {
            let dir = TempDir::new();
            let block = (B * BYTES_PER_TOKEN) as u64;
            let node = FabricNode::with_disk(
                NodeConfig { dram_capacity_bytes: 8 * block, eviction: EvictionPolicy::DEFAULT },
                &dir.0,
                12 * block,
            )
            .unwrap();
            let c = FabricClient::local(node.clone());
            let scopes: Vec<Scope> = (0..3).map(|_| scope()).collect();
            let mut paid: Vec<(Scope, PrefixKeys, usize, Instant, u64)> = Vec::new();
            let gave_way = |s: &Scope| node.tenant_stats(s.tenant, 0).evictions.evicted_quota;
            for (who, seed, len, is_paid) in ops {
                let s = scopes[who];
                let n = len * B;
                let k = keys(s, &toks(seed, n), &[n]);
                let now = Instant::now();
                let read = c.read_prefix(s, &k, n, now).await;
                let new: Vec<PutBlock> = blocks_to(&k, n).into_iter().filter(|b| !read.blocks.iter().any(|r| r.hash == b.hash)).collect();
                let ttl = Duration::from_secs(300);
                let kind = if is_paid { PAID } else { AUTO };
                if c.write_entry(s, &k, n, &new, Holding { ttl, kind }, now).await.is_ok() && is_paid {
                    paid.push((s, k, n, now + ttl, gave_way(&s)));
                }
                tokio::time::advance(Duration::from_secs(20)).await;
                let now = Instant::now();
                let mut kept = Vec::new();
                for (s, k, n, expires, given) in paid {
                    if now + Duration::from_secs(2) >= expires {
                        continue;
                    }
                    let r = c.read_prefix(s, &k, n, now).await;
                    for (got, want) in r.blocks.iter().zip(blocks_to(&k, n)) {
                        assert_eq!(got.data, want.data);
                    }
                    if r.tokens == n {
                        kept.push((s, k, n, expires, given));
                    } else {
                        assert!(gave_way(&s) > given, "a paid entry was lost before its TTL, and not to the fair share");
                    }
                }
                paid = kept;
                node.with_store(|st| {
                    st.check_invariants();
                    assert!(st.used_bytes() <= 8 * block);
                    assert!(st.lower_tier_usage().is_some_and(|(_, b)| b <= 12 * block));
                });
            }
        });
    }

    /// Owners receive chains in pieces (replica writes without parents, parents later,
    /// ordinary writes over them): child counts and orphan counts stay exact (eviction
    /// takes leaves, and extra copies wherever they sit), and capacity and quota bounds hold.
    #[test]
    fn replica_writes_in_any_order_keep_invariants_and_bounds(
        ops in proptest::collection::vec((0usize..2, 0u32..8, 1usize..12, any::<u16>(), any::<bool>()), 1..60),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        rt.block_on(async {
            let cap = 16 * (B * BYTES_PER_TOKEN) as u64;
            let quota = 8 * (B * BYTES_PER_TOKEN) as u64;
            let (c, node) = client_with(cap, EvictionPolicy::DEFAULT);
            let scopes: Vec<Scope> = (0..2).map(|_| scope()).collect();
            c.set_tenant_quota(scopes[0].tenant, Some(quota)).await;
            for (who, seed, len, mask, paid) in ops {
                let s = scopes[who];
                let k = keys(s, &toks(seed, len * B), &[len * B]);
                let now = Instant::now();
                let kind = if paid { PAID } else { AUTO };
                let ttl = Duration::from_secs(300);
                let picked: Vec<PutBlock> = blocks_to(&k, len * B)
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << (i % 16)) != 0)
                    .map(|(_, b)| b)
                    .collect();
                node.with_store(|st| {
                    // Some as extra copies (a writer's own, hot blocks), some as an owner's.
                    let _ = if mask & 0x8000 != 0 {
                        st.put_extra(&s, picked, ttl, kind, now)
                    } else {
                        st.put_replica(&s, &[], picked, ttl, now, kind)
                    };
                    st.check_invariants();
                    assert!(st.used_bytes() <= cap);
                    assert!(st.tenant_bytes(scopes[0].tenant) <= quota);
                });
                tokio::time::advance(Duration::from_secs(40)).await;
            }
        });
    }
}

/// A tenant's view of a node: bytes per tier, its most-read prefixes with their chain's size,
/// blocks lost by reason; purging a tenant takes every block of it, in every tier, and no
/// other tenant's.
#[tokio::test(start_paused = true)]
async fn tenant_stats_and_purge_cover_every_tier_and_only_that_tenant() {
    let dir = TempDir::new();
    let node = FabricNode::with_disk(
        NodeConfig {
            dram_capacity_bytes: 4 * B as u64 * BYTES_PER_TOKEN as u64 * 8,
            eviction: EvictionPolicy::Lru,
        },
        &dir.0,
        1 << 20,
    )
    .unwrap();
    let c = FabricClient::local(node.clone());
    let (a, b) = (scope(), scope());
    let now = Instant::now();
    let toks: Vec<u32> = (0..16).collect();
    let ka = keys(a, &toks, &[16]);
    write_whole(&c, a, &ka, 16, 300, now, EntryKind::Paid)
        .await
        .unwrap();
    for _ in 0..3 {
        assert_eq!(c.read_prefix(a, &ka, 16, now).await.tokens, 16);
    }
    // b writes more than DRAM holds (best effort): its coldest blocks go to disk.
    let mut kbs = Vec::new();
    for i in 0..12u32 {
        let t: Vec<u32> = (0..16).map(|x| x + 1000 * (i + 1)).collect();
        let k = keys(b, &t, &[16]);
        write_whole(&c, b, &k, 16, 300, now, EntryKind::BestEffort)
            .await
            .unwrap();
        kbs.push(k);
    }
    let sa = node.tenant_stats(a.tenant, 10);
    let total = |s: &cache_fabric::stats::TenantCacheStats| s.total_bytes();
    assert_eq!(total(&sa), 16 * BYTES_PER_TOKEN as u64, "{sa:?}");
    assert_eq!(
        sa.tiers.iter().map(|t| t.tier.as_str()).collect::<Vec<_>>(),
        ["dram", "disk"]
    );
    let sb = node.tenant_stats(b.tenant, 10);
    assert!(sb.evictions.demoted > 0, "{sb:?}");
    assert!(
        sb.tiers[1].bytes > 0,
        "demoted blocks are counted on disk: {sb:?}"
    );
    // The prefix read three times is a's top one, with its whole chain's size.
    let top = node.tenant_stats(a.tenant, 10).top_prefixes;
    let p = top.first().expect("a's read prefix is listed");
    assert_eq!(p.reads, 3);
    assert_eq!(
        p.hash,
        ka.chain_to(16).unwrap().last().unwrap().hash.to_hex()
    );
    assert_eq!((p.tokens, p.bytes), (16, 16 * BYTES_PER_TOKEN as u64));
    assert!(p.paid);
    assert_eq!(p.ttl_secs, 300);
    // Quota evictions are counted as such.
    c.set_tenant_quota(b.tenant, Some(0)).await;
    let sb = node.tenant_stats(b.tenant, 10);
    assert!(sb.evictions.evicted_quota > 0, "{sb:?}");
    c.set_tenant_quota(b.tenant, None).await;
    let k = &kbs[0];
    write_whole(&c, b, k, 16, 300, now, EntryKind::BestEffort)
        .await
        .unwrap();
    // Purging b takes it from DRAM and disk; a keeps what it had.
    let a_before = total(&node.tenant_stats(a.tenant, 10));
    let gone = node.purge_tenant(b.tenant);
    assert!(gone >= 4, "{gone}");
    let sb = node.tenant_stats(b.tenant, 10);
    assert_eq!(total(&sb), 0, "{sb:?}");
    assert_eq!(c.read_prefix(b, k, 16, now).await.tokens, 0);
    assert_eq!(total(&node.tenant_stats(a.tenant, 10)), a_before);
    assert_eq!(c.read_prefix(a, &ka, 16, now).await.tokens, 16);
    node.with_store(|s| s.check_invariants());
    // And purging a leaves nothing of it either.
    assert!(node.purge_tenant(a.tenant) >= 4);
    let sa = node.tenant_stats(a.tenant, 10);
    assert_eq!(total(&sa), 0, "{sa:?}");
    assert!(sa.top_prefixes.is_empty());
    assert_eq!(c.read_prefix(a, &ka, 16, now).await.tokens, 0);
    node.with_store(|s| s.check_invariants());
}

const OBJECT: EntryKind = EntryKind::Object;

fn chain(k: &PrefixKeys, offset: usize) -> Vec<cachet_common::BlockHash> {
    k.chain_to(offset).unwrap().iter().map(|l| l.hash).collect()
}

fn unix_ms_in(d: Duration) -> u64 {
    (std::time::SystemTime::now() + d)
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A cache object's hold is kept apart from the entries' holds: reads never extend it, and
/// releasing it (the object deleted) drops every block nothing else holds, while a block a
/// request's breakpoint also wrote stays only as long as that entry needs, and one another
/// object holds stays until that object's expiry. A second release changes nothing.
#[tokio::test(start_paused = true)]
async fn releasing_an_objects_hold_frees_what_nothing_else_holds() {
    let (c, node) = client(1 << 20);
    let s = scope();
    let t = toks(80, 16);
    let k = keys(s, &t, &[4, 8, 16]);
    let now = Instant::now();
    // The object: 16 tokens (4 blocks) held a day.
    write_whole(&c, s, &k, 16, 86_400, now, OBJECT)
        .await
        .unwrap();
    // A request wrote the first 8 tokens at a 5-minute breakpoint.
    write_whole(&c, s, &k, 8, 300, now, PAID).await.unwrap();
    // Another object holds the first block for 2 hours.
    write_whole(&c, s, &k, 4, 7_200, now, OBJECT).await.unwrap();
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(c.read_prefix(s, &k, 16, Instant::now()).await.tokens, 16);

    let block = (B * BYTES_PER_TOKEN) as u64;
    let hashes = chain(&k, 16);
    let other_until = unix_ms_in(Duration::from_secs(7_200 - 60));
    let held: Vec<_> = hashes
        .iter()
        .enumerate()
        .map(|(i, h)| (*h, (i == 0).then_some(other_until)))
        .collect();
    let r = c.release(s, &held);
    assert_eq!((r.blocks_freed, r.bytes_freed), (2, 2 * block), "{r:?}");
    assert_eq!((r.blocks_held, r.bytes_held), (2, 2 * block), "{r:?}");
    node.with_store(|st| st.check_invariants());
    assert_eq!(c.read_prefix(s, &k, 16, Instant::now()).await.tokens, 8);
    assert_eq!(
        c.miss_reason(s, &k, 16, Instant::now()).await,
        MissReason::Removed(RemovalReason::Purged)
    );
    let again = c.release(s, &held);
    assert_eq!((again.blocks_freed, again.blocks_held), (0, 2), "{again:?}");
    // A peer's repair that read a freed block before its own release does not bring it
    // back; a new write of it (an object created again) does.
    let freed: Vec<PutBlock> = blocks_to(&k, 16).into_iter().skip(2).collect();
    let day = Duration::from_secs(86_400);
    node.with_store(|st| {
        let t = Instant::now();
        st.put_handoff(&s, &[], freed.clone(), day, t, OBJECT)
            .unwrap();
        assert!(
            !st.contains(&s, &freed[0].hash, t),
            "a handoff is not taken back"
        );
        st.put_replica(&s, &[], freed.clone(), day, t, OBJECT)
            .unwrap();
        assert!(st.contains(&s, &freed[0].hash, t), "a new write is");
        let r = st.release(&s, &held, t);
        assert_eq!(r.blocks_freed, 2, "{r:?}");
        st.check_invariants();
    });

    // The request's entry lapses after its 5 minutes (read at 1 min: refreshed to 6), not
    // the day the deleted object asked for; the other object's block stays its 2 hours.
    tokio::time::advance(Duration::from_secs(400)).await;
    assert_eq!(c.read_prefix(s, &k, 16, Instant::now()).await.tokens, 4);
    tokio::time::advance(Duration::from_secs(7_200)).await;
    assert_eq!(c.read_prefix(s, &k, 16, Instant::now()).await.tokens, 0);
    node.with_store(|st| {
        assert!(st.is_empty());
        st.check_invariants();
    });
}

/// Reads of an object's prefix do not extend its hold: it ends at the object's expiry.
#[tokio::test(start_paused = true)]
async fn reads_never_extend_an_objects_hold() {
    let (c, _node) = client(1 << 20);
    let s = scope();
    let k = keys(s, &toks(81, 8), &[8]);
    write_whole(&c, s, &k, 8, 600, Instant::now(), OBJECT)
        .await
        .unwrap();
    tokio::time::advance(Duration::from_secs(500)).await;
    assert_eq!(c.read_prefix(s, &k, 8, Instant::now()).await.tokens, 8);
    tokio::time::advance(Duration::from_secs(101)).await;
    assert_eq!(c.read_prefix(s, &k, 8, Instant::now()).await.tokens, 0);
}

/// On the disk tier: a released object's blocks go from disk too; what holds them besides
/// the object survives a restart with the blocks (the record keeps it), so a release applied
/// again after the restart (removals on disk are not persisted) frees the same blocks and
/// keeps the same ones.
#[tokio::test]
async fn a_release_reaches_the_disk_tier_and_is_applied_again_after_a_restart() {
    let dir = TempDir::new();
    let s = scope();
    let now = Instant::now();
    let k = keys(s, &toks(82, 16), &[8, 16]);
    let hashes = chain(&k, 16);
    let blocks: Vec<_> = hashes.iter().map(|h| (*h, None)).collect();
    let block = (B * BYTES_PER_TOKEN) as u64;
    {
        // DRAM of four blocks: the object's go to disk when another entry is written.
        let (c, node) = disk_node(4, &dir.0);
        write_whole(&c, s, &k, 16, 86_400, now, OBJECT)
            .await
            .unwrap();
        write_whole(&c, s, &k, 8, 3_600, now, PAID).await.unwrap();
        let other = keys(s, &toks(83, 16), &[16]);
        write_whole(&c, s, &other, 16, 300, now, PAID)
            .await
            .unwrap();
        node.with_store(|st| assert_eq!(st.lower_tier_usage(), Some((4, 4 * block))));
        let r = c.release(s, &blocks);
        assert_eq!(
            (r.bytes_freed, r.bytes_held),
            (2 * block, 2 * block),
            "{r:?}"
        );
        node.with_store(|st| st.check_invariants());
        assert_eq!(c.read_prefix(s, &k, 16, now).await.tokens, 8);
    }
    let (c, node) = disk_node(4, &dir.0);
    let r = c.release(s, &blocks);
    assert_eq!(r.bytes_held, 2 * block, "{r:?}");
    node.with_store(|st| st.check_invariants());
    assert_eq!(c.read_prefix(s, &k, 16, now).await.tokens, 8);
}

/// The node that wrote a cache object keeps extra copies of the blocks it does not own
/// (`Cluster::write_entry`); those copies hold nothing but the object, so its deletion frees
/// them also from the disk tier, where capacity eviction and the write-through put them and
/// where a copy no longer knows it was extra, and again after a restart (the extra copy's
/// record used to carry an entry's hold for the object's TTL, which kept it past a release).
#[tokio::test]
async fn an_objects_extra_copies_on_disk_go_with_its_release() {
    let dir = TempDir::new();
    let s = scope();
    let now = Instant::now();
    let k = keys(s, &toks(84, 16), &[16]);
    let blocks: Vec<_> = chain(&k, 16).iter().map(|h| (*h, None)).collect();
    let block = (B * BYTES_PER_TOKEN) as u64;
    let two_hours = Duration::from_secs(7_200);
    let hashes = chain(&k, 16);
    // How many of the object's blocks the disk tier holds.
    let on_disk = |node: &FabricNode| {
        let held = node.with_store(|st| st.held_by_medium());
        let lower = &held[1].1;
        hashes.iter().filter(|h| lower.contains(h)).count()
    };
    // The writer's extra copies, copied to disk.
    let extras = |node: &FabricNode| {
        node.with_store(|st| st.put_extra(&s, blocks_to(&k, 16), two_hours, OBJECT, now))
            .unwrap();
        node.with_store(|st| while st.write_through(1 << 20) > 0 {});
        assert_eq!(on_disk(node), 4);
    };
    {
        // DRAM of four blocks: the extra copies are written through to disk, and another
        // entry then evicts them from DRAM (extra copies go first).
        let (c, node) = disk_node(4, &dir.0);
        extras(&node);
        let other = keys(s, &toks(85, 16), &[16]);
        write_whole(&c, s, &other, 16, 300, now, PAID)
            .await
            .unwrap();
        let r = c.release(s, &blocks);
        assert_eq!((r.bytes_freed, r.bytes_held), (4 * block, 0), "{r:?}");
        assert_eq!(on_disk(&node), 0);
        node.with_store(|st| st.check_invariants());
        // In DRAM and on disk at once: both copies go.
        extras(&node);
        let r = c.release(s, &blocks);
        assert_eq!((r.bytes_freed, r.bytes_held), (4 * block, 0), "{r:?}");
        assert_eq!(on_disk(&node), 0);
        // Written again, then the node goes down before the deletion.
        extras(&node);
    }
    // Its release at the next start frees what the disk kept.
    let (c, node) = disk_node(4, &dir.0);
    assert_eq!(on_disk(&node), 4);
    let r = c.release(s, &blocks);
    assert_eq!((r.bytes_freed, r.bytes_held), (4 * block, 0), "{r:?}");
    assert_eq!(c.read_prefix(s, &k, 16, Instant::now()).await.tokens, 0);
    assert_eq!(on_disk(&node), 0);
    node.with_store(|st| st.check_invariants());
    // A best-effort entry's extra copies hold as the entry does: releasing an object that
    // shares the blocks leaves the entry its time.
    node.with_store(|st| st.put_extra(&s, blocks_to(&k, 16), two_hours, AUTO, now))
        .unwrap();
    node.with_store(|st| while st.write_through(1 << 20) > 0 {});
    c.release(s, &blocks);
    assert_eq!(on_disk(&node), 4);
}

/// Long holds — a cache object's, any write held past an hour (OpenAI's 24h retention) —
/// are copied to the disk tier as they are written, not only when DRAM pressure evicts them,
/// and their disk copies stay when a read brings them back to DRAM: a restart keeps them. A
/// 5-minute entry is not copied (a restart loses it, as before).
#[tokio::test]
async fn long_holds_are_written_through_to_disk_and_survive_restarts() {
    let dir = TempDir::new();
    let s = scope();
    let now = Instant::now();
    let obj = keys(s, &toks(90, 8), &[8]);
    let day = keys(s, &toks(91, 8), &[8]);
    let short = keys(s, &toks(92, 8), &[8]);
    let block = (B * BYTES_PER_TOKEN) as u64;
    {
        let (c, node) = disk_node(16, &dir.0);
        write_whole(&c, s, &obj, 8, 600, now, OBJECT).await.unwrap();
        write_whole(&c, s, &day, 8, 86_400, now, PAID)
            .await
            .unwrap();
        write_whole(&c, s, &short, 8, 300, now, PAID).await.unwrap();
        node.with_store(|st| {
            assert_eq!(st.write_through_backlog(), 4);
            assert_eq!(
                st.lower_tier_usage(),
                Some((0, 0)),
                "nothing until the writer runs"
            );
            assert_eq!(
                st.write_through(block),
                block,
                "a batch stops at its budget"
            );
            assert_eq!(st.write_through(u64::MAX), 3 * block);
            assert_eq!(st.write_through(u64::MAX), 0);
            assert_eq!(st.lower_tier_usage(), Some((4, 4 * block)));
            assert_eq!(st.len(), 6, "the DRAM copies stay");
            // The tenant's cache view counts a block in both tiers once.
            let stats = st.tenant_stats(s.tenant, now, 1);
            assert_eq!(stats.total_bytes(), 10 * block);
            assert_eq!(stats.distinct_bytes, 6 * block);
            st.check_invariants();
        });
    }
    for restart in 1..=2 {
        let (c, node) = disk_node(16, &dir.0);
        assert_eq!(
            c.read_prefix(s, &obj, 8, now).await.tokens,
            8,
            "restart {restart}"
        );
        assert_eq!(
            c.read_prefix(s, &day, 8, now).await.tokens,
            8,
            "restart {restart}"
        );
        assert_eq!(
            c.read_prefix(s, &short, 8, now).await.tokens,
            0,
            "restart {restart}"
        );
        node.with_store(|st| {
            assert_eq!(st.len(), 4, "promoted to DRAM");
            assert_eq!(
                st.lower_tier_usage(),
                Some((4, 4 * block)),
                "and kept on disk"
            );
            st.check_invariants();
        });
    }
}
