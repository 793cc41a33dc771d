//! The GPU-memory tier (feature `cuda`): block bytes in device memory through cudarc, the
//! metadata and crc32c on the host.
//!
//! The CUDA driver is loaded at run time, so a build with the feature runs anywhere:
//! [`GpuTier::open`] looks for the driver library before the first CUDA call (cudarc panics
//! rather than erring when it is missing), catches a panic from the binding as a last line of
//! defence, and answers [`TierError::Unavailable`] on a machine without a GPU.
//!
//! Every block is copied to the device on `put` and back on `get`, where its crc32c is
//! checked: a block whose device bytes changed is dropped and reported, never returned.
//! When full, the oldest block goes first (like [`crate::tier::DramTier`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use cachet_common::{BlockHash, TenantId};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use crate::integrity::checksum;
use crate::tier::{TierBlock, TierError, TierStore};

struct OnDevice {
    seq: u64,
    /// The block with empty `data`: its bytes are in `bytes`.
    meta: TierBlock,
    bytes: CudaSlice<u8>,
    len: u64,
    crc: u32,
}

/// Blocks in one GPU's memory.
pub struct GpuTier {
    stream: Arc<CudaStream>,
    ordinal: usize,
    blocks: HashMap<BlockHash, OnDevice>,
    order: BTreeMap<u64, BlockHash>,
    seq: u64,
    used: u64,
    capacity: u64,
}

fn device_error(e: impl std::fmt::Display) -> TierError {
    TierError::Unavailable(format!("cuda: {e}"))
}

impl GpuTier {
    /// A tier of `capacity` bytes on GPU `ordinal`, or why there is none.
    pub fn open(ordinal: usize, capacity: u64) -> Result<Self, TierError> {
        // SAFETY: `is_culib_present` only tries to dlopen the driver library; it calls no
        // CUDA function.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(TierError::Unavailable(
                "the CUDA driver library (libcuda) is not installed".into(),
            ));
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| TierError::Unavailable("the CUDA driver binding panicked".into()))?
            .map_err(device_error)?;
        Ok(Self {
            stream: ctx.default_stream(),
            ordinal,
            blocks: HashMap::new(),
            order: BTreeMap::new(),
            seq: 0,
            used: 0,
            capacity,
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Test hook: flip a bit of a block's device bytes, as failing memory would.
    #[doc(hidden)]
    pub fn corrupt_for_test(&mut self, hash: &BlockHash) -> Result<bool, TierError> {
        let Some(b) = self.blocks.get_mut(hash) else {
            return Ok(false);
        };
        let mut host = self.stream.clone_dtoh(&b.bytes).map_err(device_error)?;
        if let Some(x) = host.first_mut() {
            *x ^= 1;
        }
        self.stream
            .memcpy_htod(&host, &mut b.bytes)
            .map_err(device_error)?;
        Ok(true)
    }
}

impl TierStore for GpuTier {
    fn put(&mut self, block: TierBlock) -> Result<(), TierError> {
        let size = block.data.len() as u64;
        if size > self.capacity {
            return Err(TierError::TooLarge {
                size,
                capacity: self.capacity,
            });
        }
        self.remove(&block.hash);
        while self.used + size > self.capacity {
            let Some((_, h)) = self.order.pop_first() else {
                break;
            };
            if let Some(b) = self.blocks.remove(&h) {
                self.used -= b.len;
            }
        }
        let crc = checksum(&block.data);
        let bytes = self
            .stream
            .clone_htod(block.data.as_ref())
            .map_err(device_error)?;
        self.seq += 1;
        self.order.insert(self.seq, block.hash);
        self.used += size;
        let hash = block.hash;
        let meta = TierBlock {
            data: Bytes::new(),
            ..block
        };
        self.blocks.insert(
            hash,
            OnDevice {
                seq: self.seq,
                meta,
                bytes,
                len: size,
                crc,
            },
        );
        Ok(())
    }

    fn get(&mut self, hash: &BlockHash) -> Result<Option<TierBlock>, TierError> {
        let Some(b) = self.blocks.get(hash) else {
            return Ok(None);
        };
        let host = self.stream.clone_dtoh(&b.bytes).map_err(device_error)?;
        if checksum(&host) != b.crc {
            self.remove(hash);
            return Err(TierError::Corrupt(*hash));
        }
        Ok(Some(TierBlock {
            data: Bytes::from(host),
            ..b.meta.clone()
        }))
    }

    fn remove(&mut self, hash: &BlockHash) -> bool {
        match self.blocks.remove(hash) {
            Some(b) => {
                self.order.remove(&b.seq);
                self.used -= b.len;
                true
            }
            None => false,
        }
    }

    fn contains(&self, hash: &BlockHash) -> bool {
        self.blocks.contains_key(hash)
    }
    fn hashes(&self) -> Vec<BlockHash> {
        self.blocks.keys().copied().collect()
    }
    fn len(&self) -> usize {
        self.blocks.len()
    }
    fn used_bytes(&self) -> u64 {
        self.used
    }
    fn capacity_bytes(&self) -> u64 {
        self.capacity
    }
    fn name(&self) -> &'static str {
        "gpu"
    }
    fn inventory(&self) -> Vec<(BlockHash, TenantId, u64)> {
        self.blocks
            .iter()
            .map(|(h, b)| (*h, b.meta.scope.tenant, b.len))
            .collect()
    }
}
