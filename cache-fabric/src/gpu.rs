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

use std::sync::Arc;

use bytes::Bytes;
use cachet_common::{BlockHash, TenantId};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use crate::integrity::checksum;
use crate::tier::{Held, TierBlock, TierError, TierStore, held_bookkeeping};

/// A block on the device: its metadata on the host (`data` empty), its bytes in `bytes`.
struct OnDevice {
    meta: TierBlock,
    bytes: CudaSlice<u8>,
}

/// Blocks in one GPU's memory.
pub struct GpuTier {
    stream: Arc<CudaStream>,
    ordinal: usize,
    held: Held<OnDevice>,
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
            held: Held::new(capacity),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Test hook: flip a bit of a block's device bytes, as failing memory would.
    #[doc(hidden)]
    pub fn corrupt_for_test(&mut self, hash: &BlockHash) -> Result<bool, TierError> {
        let Some(b) = self.held.get_mut(hash) else {
            return Ok(false);
        };
        let b = &mut b.value;
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
        self.held.make_room(&block.hash, size)?;
        let crc = checksum(&block.data);
        let bytes = self
            .stream
            .clone_htod(block.data.as_ref())
            .map_err(device_error)?;
        let (hash, tenant) = (block.hash, block.scope.tenant);
        let meta = TierBlock {
            data: Bytes::new(),
            ..block
        };
        self.held
            .insert(hash, tenant, size, crc, OnDevice { meta, bytes });
        Ok(())
    }

    fn get(&mut self, hash: &BlockHash) -> Result<Option<TierBlock>, TierError> {
        let Some(b) = self.held.get(hash) else {
            return Ok(None);
        };
        let host = self
            .stream
            .clone_dtoh(&b.value.bytes)
            .map_err(device_error)?;
        if checksum(&host) != b.crc {
            self.held.remove(hash);
            return Err(TierError::Corrupt(*hash));
        }
        Ok(Some(TierBlock {
            data: Bytes::from(host),
            ..b.value.meta.clone()
        }))
    }

    held_bookkeeping!("gpu");
}
