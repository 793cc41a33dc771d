//! Tier speed: put and get of KV-sized blocks through each [`TierStore`] — DRAM, the local
//! disk (segment files in a temporary directory), and, in a build with `--features cuda` on
//! a machine with a GPU, GPU memory — in one run, so the figures compare.
//!
//!     cargo bench -p cache-fabric --bench tiers                    # DRAM and disk
//!     cargo bench -p cache-fabric --features cuda --bench tiers    # and GPU memory
//!
//! Each tier takes `CACHET_BENCH_TIER_BLOCKS` blocks (default 256) of 2 MiB (16 tokens of
//! Llama-3-8B's KV at bf16: 128 KiB a token) and of 128 KiB, then gives every one back
//! (checksum verified, as a read does). Prints GiB/s for puts and gets, best of three
//! rounds. The disk tier writes through the page cache (no fsync), as it does in service.

use std::time::{Duration, Instant};

use bytes::Bytes;
use cache_fabric::tier::{DiskTier, DramTier, TierBlock, TierStore};
use cachet_common::{BlockHash, Scope, TenantId, WorkspaceId};

fn blocks(n: usize, size: usize) -> Vec<TierBlock> {
    let scope = Scope {
        tenant: TenantId::new(),
        workspace: WorkspaceId::new(),
    };
    (0..n)
        .map(|i| {
            let mut hash = [0u8; 32];
            hash[..8].copy_from_slice(&(i as u64).to_le_bytes());
            hash[8..16].copy_from_slice(&(size as u64).to_le_bytes());
            TierBlock {
                hash: BlockHash(hash),
                scope,
                parent: None,
                n_tokens: 16,
                ttl: Duration::from_secs(3600),
                expires_unix_ms: u64::MAX / 2,
                paid: false,
                shared_ttl: Duration::from_secs(3600),
                shared_until_unix_ms: u64::MAX / 2,
                data: Bytes::from(vec![(i % 251) as u8; size]),
            }
        })
        .collect()
}

/// Best-of-three (put, get) GiB/s of `blocks` through `tier`.
fn run(tier: &mut dyn TierStore, blocks: &[TierBlock]) -> (f64, f64) {
    let bytes = blocks.iter().map(|b| b.data.len()).sum::<usize>() as f64;
    let gib = |d: Duration| bytes / d.as_secs_f64() / (1u64 << 30) as f64;
    let (mut put, mut get) = (0f64, 0f64);
    for _ in 0..3 {
        for b in blocks {
            tier.remove(&b.hash);
        }
        let t = Instant::now();
        for b in blocks {
            tier.put(b.clone()).expect("put");
        }
        put = put.max(gib(t.elapsed()));
        let t = Instant::now();
        for b in blocks {
            let got = tier.get(&b.hash).expect("get").expect("present");
            assert_eq!(got.data.len(), b.data.len());
        }
        get = get.max(gib(t.elapsed()));
    }
    (put, get)
}

fn main() {
    let n: usize = std::env::var("CACHET_BENCH_TIER_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    println!("tier   block     blocks  put GiB/s  get GiB/s");
    for size in [2usize << 20, 128 << 10] {
        let set = blocks(n, size);
        let capacity = (n * size) as u64 * 2;
        let mut tiers: Vec<(&str, Box<dyn TierStore>)> =
            vec![("dram", Box::new(DramTier::new(capacity)))];
        let dir = std::env::temp_dir().join(format!("cachet-bench-tiers-{}", std::process::id()));
        tiers.push((
            "disk",
            Box::new(DiskTier::open(&dir, capacity).expect("open the disk tier")),
        ));
        #[cfg(feature = "cuda")]
        match cache_fabric::gpu::GpuTier::open(0, capacity) {
            Ok(t) => tiers.push(("gpu", Box::new(t))),
            Err(e) => println!("gpu    (not measured: {e})"),
        }
        for (name, mut tier) in tiers {
            let (put, get) = run(tier.as_mut(), &set);
            println!(
                "{name:<6} {:>5} KiB {n:>7} {put:>10.2} {get:>10.2}",
                size >> 10
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
