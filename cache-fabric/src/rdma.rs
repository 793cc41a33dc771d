//! RDMA (feature `rdma`): probing, the one-sided READ data path, and a transport that
//! falls back to TCP cleanly.
//!
//! What is here:
//! - [`probe`]: the RDMA devices of this host, or why there are none. A kernel without RDMA
//!   support answers `ENOSYS` to the device list (that is what these build machines do), which
//!   is "unavailable", never an error or a panic.
//! - [`verbs`]: devices, registered regions and reliable-connected queue pairs posting
//!   `IBV_WR_RDMA_READ` and polling their completions (over `ibverbs-sys`: the `ibverbs`
//!   crate's safe API posts only SENDs and hides the handles a READ needs).
//! - [`pull`]: the data path: a serving node stages blocks in its registered pool
//!   ([`Export`], answered by [`serve`]), the reader pulls them with coalesced READs and verifies each checksum;
//!   [`pull::RdmaTransport`] is the [`Transport`](crate::transport::Transport) that reads this
//!   way and uses TCP for everything else and whenever RDMA fails.
//! - The registered pool's blocks are placed by [`ExtentAllocator`] (first fit, neighbours
//!   merged on free), so peers can read them with one-sided READs.
//! - [`coalesce`]: KVDirect's coalescing: the blocks a reader wants from one peer, sorted by
//!   their offsets in that peer's pool, merged into as few READs as possible (adjacent or
//!   overlapping regions, up to a size limit per READ).
//!
//! The transport contract suite runs over RDMA when `CACHET_RDMA_DEVICE` names a device
//! (`cache-fabric/tests/transport.rs`); `scripts/rdma-vm.sh` runs it on a soft-RoCE device
//! inside a virtual machine, because the build machines' kernel has no RDMA support.

pub mod pull;
pub mod serve;
pub mod verbs;

use std::sync::{Arc, Mutex};

use cachet_common::BlockHash;

pub use crate::extents::ExtentAllocator;

use verbs::{Device, Region};

/// Whether this host can do RDMA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Availability {
    Available { devices: Vec<String> },
    Unavailable { reason: String },
}

/// The RDMA devices of this host, or why there are none. Never panics.
pub fn probe() -> Availability {
    match ibverbs::devices() {
        Err(e) if e.raw_os_error() == Some(38) || e.kind() == std::io::ErrorKind::Unsupported => {
            Availability::Unavailable {
                reason: "the kernel has no RDMA support (ENOSYS)".into(),
            }
        }
        Err(e) => Availability::Unavailable {
            reason: format!("listing RDMA devices failed: {e}"),
        },
        Ok(list) if list.is_empty() => Availability::Unavailable {
            reason: "no RDMA device".into(),
        },
        Ok(list) => Availability::Available {
            devices: list
                .iter()
                .map(|d| {
                    d.name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_else(|| "unnamed".into())
                })
                .collect(),
        },
    }
}

/// One block wanted from a peer: where it is in the peer's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub hash: BlockHash,
    pub offset: u64,
    pub len: u64,
}

/// One READ: a contiguous range of the peer's pool and the blocks inside it (with each
/// block's offset from the READ's start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Read {
    pub offset: u64,
    pub len: u64,
    pub parts: Vec<(BlockHash, u64, u64)>,
}

/// Merge the blocks wanted from one peer into as few READs as possible: regions that touch
/// or overlap join one READ as long as it stays within `max_read` bytes.
pub fn coalesce(wanted: &[Wanted], max_read: u64) -> Vec<Read> {
    let mut sorted: Vec<Wanted> = wanted.to_vec();
    sorted.sort_by_key(|w| (w.offset, w.len));
    let mut reads: Vec<Read> = Vec::new();
    for w in sorted {
        if let Some(r) = reads.last_mut() {
            let end = r.offset + r.len;
            let new_end = end.max(w.offset + w.len);
            if w.offset <= end && new_end - r.offset <= max_read {
                r.len = new_end - r.offset;
                r.parts.push((w.hash, w.offset - r.offset, w.len));
                continue;
            }
        }
        reads.push(Read {
            offset: w.offset,
            len: w.len,
            parts: vec![(w.hash, 0, w.len)],
        });
    }
    reads
}

/// A node's registered pool that peers READ staged blocks from.
pub struct Export {
    pub(crate) device: Arc<Device>,
    pub(crate) pool: Region,
    pub(crate) alloc: Mutex<ExtentAllocator>,
}

impl Export {
    /// Register a pool of `bytes` with `device`.
    pub fn new(device: Arc<Device>, bytes: usize) -> std::io::Result<Arc<Export>> {
        let pool = Region::new(&device, bytes)?;
        Ok(Arc::new(Export {
            alloc: Mutex::new(ExtentAllocator::new(pool.len() as u64)),
            device,
            pool,
        }))
    }

    /// Bytes staged right now (leases not yet released).
    pub fn staged_bytes(&self) -> u64 {
        self.alloc.lock().unwrap_or_else(|p| p.into_inner()).used()
    }

    pub(crate) fn free(&self, extents: &[(u64, u64)]) {
        let mut a = self.alloc.lock().unwrap_or_else(|p| p.into_inner());
        for &(off, len) in extents {
            a.free(off, len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    #[test]
    fn probing_never_panics_and_names_a_reason_without_rdma() {
        match probe() {
            Availability::Unavailable { reason } => assert!(!reason.is_empty()),
            Availability::Available { devices } => assert!(!devices.is_empty()),
        }
        if std::env::var_os("CACHET_EXPECT_RDMA").is_some() {
            assert!(matches!(probe(), Availability::Available { .. }));
        }
    }

    #[test]
    fn adjacent_blocks_become_one_read_and_gaps_split_reads() {
        let wanted = [
            Wanted {
                hash: h(2),
                offset: 4096,
                len: 4096,
            },
            Wanted {
                hash: h(1),
                offset: 0,
                len: 4096,
            },
            Wanted {
                hash: h(3),
                offset: 16384,
                len: 4096,
            },
        ];
        let reads = coalesce(&wanted, 1 << 20);
        assert_eq!(
            reads,
            vec![
                Read {
                    offset: 0,
                    len: 8192,
                    parts: vec![(h(1), 0, 4096), (h(2), 4096, 4096)]
                },
                Read {
                    offset: 16384,
                    len: 4096,
                    parts: vec![(h(3), 0, 4096)]
                },
            ]
        );
        // A READ never grows past the limit.
        let capped = coalesce(&wanted, 4096);
        assert_eq!(capped.len(), 3);
    }

    proptest! {
        /// Coalesced reads cover exactly the wanted blocks, each once, within the limit.
        #[test]
        fn coalesced_reads_cover_every_block(regions in proptest::collection::vec((0u64..64, 1u64..8), 1..40)) {
            let wanted: Vec<Wanted> = regions
                .iter()
                .enumerate()
                .map(|(i, (o, l))| Wanted { hash: h(i as u8), offset: o * 1024, len: l * 1024 })
                .collect();
            let reads = coalesce(&wanted, 16 * 1024);
            let mut seen = 0;
            for r in &reads {
                prop_assert!(r.len <= 16 * 1024 || r.parts.len() == 1);
                for (hash, off, len) in &r.parts {
                    let w = wanted.iter().find(|w| w.hash == *hash).unwrap();
                    prop_assert_eq!(r.offset + off, w.offset);
                    prop_assert_eq!(*len, w.len);
                    prop_assert!(off + len <= r.len);
                    seen += 1;
                }
            }
            prop_assert_eq!(seen, wanted.len());
        }
    }
}
