//! The tier contract, run against every `TierStore` (DRAM, local disk, and GPU memory with
//! the `cuda` feature where a GPU exists), and the disk tier's recovery after a restart or
//! a torn write.

mod common;

use std::time::Duration;

use bytes::Bytes;
use cache_fabric::tier::{DiskTier, DramTier, TierBlock, TierError, TierStore};
use common::{TempDir, scope};

use cachet_common::{BlockHash, Scope};
use sha2::{Digest, Sha256};

fn block(i: u64, size: usize, scope: Scope) -> TierBlock {
    let hash = BlockHash(Sha256::digest(i.to_le_bytes()).into());
    TierBlock {
        hash,
        scope,
        parent: (i > 0).then(|| BlockHash(Sha256::digest((i - 1).to_le_bytes()).into())),
        n_tokens: 16,
        ttl: Duration::from_secs(if i.is_multiple_of(2) { 300 } else { 3600 }),
        expires_unix_ms: 1_900_000_000_000 + i,
        paid: i.is_multiple_of(3),
        shared_ttl: Duration::from_secs(300),
        shared_until_unix_ms: 1_900_000_000_000 - i,
        data: Bytes::from(
            (0..size)
                .map(|j| (j as u64 * 31 + i) as u8)
                .collect::<Vec<u8>>(),
        ),
    }
}

/// What every tier must do. `capacity` is 10 blocks of 1 KiB.
fn contract<T: TierStore>(t: &mut T, corrupt: impl Fn(&mut T, &BlockHash)) {
    let s = scope();
    assert!(t.is_empty());
    let b = block(1, 1024, s);
    t.put(b.clone()).unwrap();
    assert!(t.contains(&b.hash));
    assert_eq!(
        t.get(&b.hash).unwrap().unwrap(),
        b,
        "bytes and metadata round-trip"
    );
    assert_eq!(t.used_bytes(), 1024);
    // Its record alone, without reading the bytes where the tier can.
    let (meta, len) = t.meta(&b.hash).unwrap().unwrap();
    assert_eq!(len, 1024);
    assert_eq!(
        meta,
        TierBlock {
            data: Bytes::new(),
            ..b.clone()
        }
    );
    assert!(t.meta(&block(99, 1, s).hash).unwrap().is_none());
    // Replacing a block does not double-count it.
    t.put(b.clone()).unwrap();
    assert_eq!((t.len(), t.used_bytes()), (1, 1024));
    assert!(t.get(&block(99, 1, s).hash).unwrap().is_none());
    assert!(t.remove(&b.hash));
    assert!(!t.remove(&b.hash));
    assert!(t.get(&b.hash).unwrap().is_none());
    assert_eq!(t.used_bytes(), 0);

    // Capacity holds, whatever is written (best-effort blocks: paid ones are below).
    for i in 0..40 {
        t.put(TierBlock {
            paid: false,
            ..block(100 + i, 1024, s)
        })
        .unwrap();
        assert!(t.used_bytes() <= t.capacity_bytes(), "{}", t.name());
    }
    assert!(
        t.get(&block(139, 1024, s).hash).unwrap().is_some(),
        "newest kept"
    );
    assert!(matches!(
        t.put(block(7, 20 * 1024, s)),
        Err(TierError::TooLarge { .. })
    ));

    // A flipped bit is detected, reported and the block is never returned.
    let victim = block(139, 1024, s).hash;
    corrupt(t, &victim);
    assert!(matches!(t.get(&victim), Err(TierError::Corrupt(h)) if h == victim));
    assert!(!t.contains(&victim));
    assert!(t.get(&victim).unwrap().is_none());

    // Per tenant: what each holds, and a purge that takes one tenant's blocks and no other's.
    let other = Scope {
        tenant: cachet_common::TenantId::new(),
        workspace: cachet_common::WorkspaceId::new(),
    };
    for i in 0..3 {
        t.put(TierBlock {
            paid: false,
            ..block(200 + i, 512, other)
        })
        .unwrap();
    }
    let (mine, mine_bytes) = t.tenant_usage(s.tenant);
    assert_eq!(t.tenant_usage(other.tenant), (3, 3 * 512));
    assert_eq!(mine + 3, t.len());
    assert_eq!(mine_bytes + 3 * 512, t.used_bytes());
    let gone = t.remove_tenant(other.tenant);
    assert_eq!(gone.len(), 3);
    assert!(gone.iter().all(|h| !t.contains(h)));
    assert_eq!(t.tenant_usage(other.tenant), (0, 0));
    assert_eq!(
        t.tenant_usage(s.tenant),
        (mine, mine_bytes),
        "another tenant's blocks stay"
    );
    assert_eq!(t.used_bytes(), mine_bytes);
}

#[test]
fn dram_tier_keeps_the_contract() {
    let mut t = DramTier::new(10 * 1024);
    contract(&mut t, |t, h| assert!(t.corrupt_for_test(h)));
}

#[test]
fn disk_tier_keeps_the_contract() {
    let dir = TempDir::new();
    let mut t = DiskTier::open_with(&dir.0, 10 * 1024, 4 * 1024).unwrap();
    contract(&mut t, |t, h| assert!(t.corrupt_for_test(h).unwrap()));
}

/// The disk tier keeps paid blocks until they expire: making room drops best-effort blocks
/// and expired paid ones (paid ones are copied out of a segment before it is deleted), and a
/// block that would need an unexpired paid one dropped is refused with `Full`. The copies
/// survive a restart.
#[test]
fn disk_tier_keeps_unexpired_paid_blocks_until_they_expire() {
    let dir = TempDir::new();
    let s = scope();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let paid = |i: u64| TierBlock {
        paid: true,
        expires_unix_ms: now + 600_000,
        ..block(i, 1024, s)
    };
    let free = |i: u64| TierBlock {
        paid: false,
        ..block(i, 1024, s)
    };
    let mut t = DiskTier::open_with(&dir.0, 10 * 1024, 3 * 1024).unwrap();
    assert!(t.keeps_paid());
    // Six paid blocks among twelve best-effort ones, through a 10-block tier.
    for i in 0..6 {
        t.put(paid(i)).unwrap();
        t.put(free(100 + 2 * i)).unwrap();
        t.put(free(101 + 2 * i)).unwrap();
        assert!(t.used_bytes() <= t.capacity_bytes());
    }
    for i in 0..6 {
        assert_eq!(
            t.get(&paid(i).hash).unwrap(),
            Some(paid(i)),
            "paid {i} kept"
        );
    }
    assert!(
        t.get(&free(100).hash).unwrap().is_none(),
        "oldest best-effort dropped"
    );
    // Paid blocks up to the whole capacity fit; one more does not, nor anything else.
    for i in 6..10 {
        t.put(paid(i)).unwrap();
    }
    assert!(matches!(t.put(paid(10)), Err(TierError::Full { .. })));
    assert!(matches!(t.put(free(200)), Err(TierError::Full { .. })));
    for i in 0..10 {
        assert_eq!(t.get(&paid(i).hash).unwrap(), Some(paid(i)));
    }
    // An expired paid block is no longer protected.
    assert!(t.remove(&paid(0).hash));
    let expired = TierBlock {
        expires_unix_ms: now - 1,
        ..paid(20)
    };
    t.put(expired.clone()).unwrap();
    t.put(paid(21)).unwrap();
    assert!(t.get(&expired.hash).unwrap().is_none());
    assert_eq!(t.get(&paid(21).hash).unwrap(), Some(paid(21)));
    drop(t);
    let mut t = DiskTier::open_with(&dir.0, 10 * 1024, 3 * 1024).unwrap();
    for i in (1..10).chain([21]) {
        assert_eq!(
            t.get(&paid(i).hash).unwrap(),
            Some(paid(i)),
            "paid {i} after a restart"
        );
    }
    assert!(t.used_bytes() <= t.capacity_bytes());
}

#[test]
fn disk_tier_recovers_its_blocks_after_a_restart() {
    let dir = TempDir::new();
    let s = scope();
    let blocks: Vec<TierBlock> = (0..12).map(|i| block(i, 3000, s)).collect();
    {
        let mut t = DiskTier::open_with(&dir.0, 1 << 20, 16 * 1024).unwrap();
        for b in &blocks {
            t.put(b.clone()).unwrap();
        }
        t.remove(&blocks[4].hash);
        assert!(t.segments() > 1);
    }
    let mut t = DiskTier::open_with(&dir.0, 1 << 20, 16 * 1024).unwrap();
    // A removal is not persisted: the record comes back, which is harmless for a cache
    // (the node re-announces what it holds). Everything else is intact, metadata included.
    for b in &blocks {
        assert_eq!(t.get(&b.hash).unwrap().as_ref(), Some(b));
    }
    assert_eq!(t.used_bytes(), 12 * 3000);
    // New writes after recovery land after the recovered records.
    let extra = block(50, 3000, s);
    t.put(extra.clone()).unwrap();
    drop(t);
    let mut t = DiskTier::open_with(&dir.0, 1 << 20, 16 * 1024).unwrap();
    assert_eq!(t.get(&extra.hash).unwrap(), Some(extra));
    assert_eq!(t.len(), 13);
}

#[test]
fn a_torn_write_loses_only_the_torn_record() {
    let dir = TempDir::new();
    let s = scope();
    let (a, b) = (block(1, 2000, s), block(2, 2000, s));
    {
        let mut t = DiskTier::open_with(&dir.0, 1 << 20, 1 << 20).unwrap();
        t.put(a.clone()).unwrap();
        t.put(b.clone()).unwrap();
    }
    // Cut the last record short, as a crash mid-write would.
    let seg = std::fs::read_dir(&dir.0)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let len = std::fs::metadata(&seg).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    f.set_len(len - 500).unwrap();
    drop(f);
    let mut t = DiskTier::open_with(&dir.0, 1 << 20, 1 << 20).unwrap();
    assert_eq!(t.get(&a.hash).unwrap(), Some(a));
    assert!(t.get(&b.hash).unwrap().is_none());
    // The segment was truncated to its intact part; writing continues cleanly after it.
    t.put(b.clone()).unwrap();
    drop(t);
    let mut t = DiskTier::open_with(&dir.0, 1 << 20, 1 << 20).unwrap();
    assert_eq!(t.get(&b.hash).unwrap(), Some(b));
}

#[test]
fn a_smaller_capacity_on_reopen_drops_the_oldest_segments() {
    let dir = TempDir::new();
    let s = scope();
    {
        let mut t = DiskTier::open_with(&dir.0, 1 << 20, 8 * 1024).unwrap();
        for i in 0..20 {
            t.put(block(i, 4000, s)).unwrap();
        }
    }
    let mut t = DiskTier::open_with(&dir.0, 20_000, 8 * 1024).unwrap();
    assert!(t.used_bytes() <= 20_000);
    assert!(t.get(&block(19, 4000, s).hash).unwrap().is_some());
    assert!(t.get(&block(0, 4000, s).hash).unwrap().is_none());
}

#[test]
fn a_record_corrupted_at_rest_is_skipped_on_recovery_and_later_ones_kept() {
    let dir = TempDir::new();
    let s = scope();
    let blocks: Vec<TierBlock> = (0..3).map(|i| block(i, 1000, s)).collect();
    {
        let mut t = DiskTier::open_with(&dir.0, 1 << 20, 1 << 20).unwrap();
        for b in &blocks {
            t.put(b.clone()).unwrap();
        }
        assert!(t.corrupt_for_test(&blocks[1].hash).unwrap());
    }
    let mut t = DiskTier::open_with(&dir.0, 1 << 20, 1 << 20).unwrap();
    assert_eq!(t.get(&blocks[0].hash).unwrap().as_ref(), Some(&blocks[0]));
    assert!(t.get(&blocks[1].hash).unwrap().is_none());
    assert_eq!(t.get(&blocks[2].hash).unwrap().as_ref(), Some(&blocks[2]));
    assert_eq!(t.used_bytes(), 2000);
}

/// The GPU tier keeps the same contract where a GPU exists; elsewhere it says why it cannot
/// open (and the test fails only when `CACHET_EXPECT_GPU` says a GPU is there).
#[cfg(feature = "cuda")]
#[test]
fn gpu_tier_keeps_the_contract_where_a_gpu_exists() {
    use cache_fabric::gpu::GpuTier;
    match GpuTier::open(0, 10 * 1024) {
        Ok(mut t) => contract(&mut t, |t, h| assert!(t.corrupt_for_test(h).unwrap())),
        Err(TierError::Unavailable(why)) => {
            assert!(
                std::env::var_os("CACHET_EXPECT_GPU").is_none(),
                "a GPU was expected: {why}"
            );
            eprintln!("no GPU here ({why}); the GPU tier contract did not run");
        }
        Err(e) => panic!("unexpected error opening the GPU tier: {e}"),
    }
}

/// A purge the node missed while it was down: at start, what the disk kept of the tenant
/// from before the purge goes (removals are not persisted, so even blocks dropped while up
/// come back with the segments); what was written after it, and other tenants', stay.
#[test]
fn disk_tier_drops_a_tenants_blocks_written_before_a_missed_purge() {
    let dir = TempDir::new();
    let (a, b) = (scope(), scope());
    let cutoff = 1_900_000_000_000u64;
    let at = |i: u64, s: Scope, written: u64| {
        let mut blk = block(i, 2000, s);
        blk.expires_unix_ms = written + blk.ttl.as_millis() as u64;
        blk
    };
    let old_a = at(1, a, cutoff - 5_000);
    let new_a = at(2, a, cutoff + 5_000);
    let old_b = at(3, b, cutoff - 5_000);
    {
        let mut t = DiskTier::open_with(&dir.0, 1 << 20, 1 << 20).unwrap();
        for blk in [&old_a, &new_a, &old_b] {
            t.put(blk.clone()).unwrap();
        }
        // Dropped while up (a purge applied then): back after the restart.
        t.remove(&old_a.hash);
    }
    let mut t = DiskTier::open_with(&dir.0, 1 << 20, 1 << 20).unwrap();
    assert!(t.contains(&old_a.hash));
    let gone = t.remove_tenant_written_before(a.tenant, cutoff);
    assert_eq!(gone, vec![old_a.hash]);
    assert!(!t.contains(&old_a.hash));
    assert!(t.contains(&new_a.hash) && t.contains(&old_b.hash));
    // The DRAM tier cannot tell when a block was written: asked at start, it keeps nothing
    // of the tenant's.
    let mut d = DramTier::new(1 << 20);
    d.put(new_a.clone()).unwrap();
    d.put(old_b.clone()).unwrap();
    assert_eq!(
        d.remove_tenant_written_before(a.tenant, cutoff),
        vec![new_a.hash]
    );
    assert!(d.contains(&old_b.hash));
}
