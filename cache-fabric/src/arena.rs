//! The same-host arena: block bytes in shared memory that an engine beside the node maps
//! once (decision 0029).
//!
//! An arena is one anonymous shared-memory file (`memfd_create`) of a fixed size, sealed so
//! that nobody holding its descriptor can shrink or grow it (a shrunk mapping would fault
//! the node on its next read), mapped read-write by the node. Its bytes are handed out as
//! [`Extent`]s placed by an [`ExtentAllocator`] at [`ALIGN`]ed offsets; an extent goes back
//! to the allocator when its last holder drops it, so a block evicted from the store while
//! an engine still reads it stays where it is until the engine is done
//! ([`crate::local`]'s leases).
//!
//! The descriptor is passed to engines over the node's Unix socket ([`crate::local`]); the
//! store counts what the arena holds outside the store (leased blocks it has evicted,
//! reservations not yet committed) against its capacity
//! ([`crate::store::Store::set_arena`]).
//!
//! Memory model: the node only reads an extent once it is committed (a reservation's bytes
//! are written by the engine, then committed with their checksums), and nothing writes a
//! committed extent. A process that breaks that contract (a faulty engine) can change block
//! bytes under a reader, which the reader's checksum catches; it cannot make the node read
//! or write outside the mapping, whose size is sealed.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::extents::ExtentAllocator;
use crate::metrics;

/// Every extent starts at a multiple of this (a page), and takes a whole number of them.
pub const ALIGN: u64 = 4096;

/// The bytes an extent of `len` bytes takes in the arena.
pub fn footprint(len: usize) -> u64 {
    (len as u64).div_ceil(ALIGN) * ALIGN
}

/// A node's shared-memory arena. Cheap to clone (one mapping, shared).
#[derive(Clone)]
pub struct Arena {
    shared: Arc<Shared>,
}

struct Shared {
    fd: OwnedFd,
    base: NonNull<u8>,
    len: usize,
    alloc: Mutex<ExtentAllocator>,
}

// SAFETY: `base` points to a shared mapping that lives as long as `Shared` (unmapped in its
// Drop); the mapping itself is plain memory, and who reads or writes which part of it is
// decided by the extents handed out under the allocator's mutex.
unsafe impl Send for Shared {}
// SAFETY: as above; `Shared` exposes no interior mutability but the allocator's mutex.
unsafe impl Sync for Shared {}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are exactly what mmap returned in `Arena::new`, and no
        // extent outlives `Shared` (each holds an `Arc` of it).
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("capacity", &self.capacity())
            .field("used", &self.used())
            .finish()
    }
}

impl Arena {
    /// A new arena of `capacity` bytes (rounded up to [`ALIGN`]). Its pages are taken from
    /// the machine as they are first written, not up front.
    pub fn new(capacity: u64) -> std::io::Result<Arena> {
        let len = usize::try_from(footprint(capacity.max(1) as usize))
            .map_err(|_| std::io::Error::other("arena larger than the address space"))?;
        let name = c"cachet-kv-arena";
        // SAFETY: `name` is NUL-terminated; the flags are valid for memfd_create.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a valid descriptor and a non-negative size.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: F_ADD_SEALS on a memfd made with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a shared read-write mapping of the whole file, at an address the kernel
        // chooses; checked for MAP_FAILED below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // Where the host lets shared memory use transparent huge pages
        // (`shmem_enabled` = advise), a first write takes one fault per 2 MiB, not per 4 KiB.
        // SAFETY: advice on the mapping just made; failure changes nothing.
        unsafe {
            libc::madvise(base, len, libc::MADV_HUGEPAGE);
        }
        let base = NonNull::new(base.cast::<u8>()).ok_or_else(|| std::io::Error::other("mmap"))?;
        metrics::ARENA_BYTES
            .with_label_values(&["capacity"])
            .set(len as i64);
        Ok(Arena {
            shared: Arc::new(Shared {
                fd,
                base,
                len,
                alloc: Mutex::new(ExtentAllocator::new(len as u64)),
            }),
        })
    }

    /// The arena's size in bytes.
    pub fn capacity(&self) -> u64 {
        self.shared.len as u64
    }

    /// Bytes of live extents (stored, leased or reserved), in whole [`ALIGN`] units.
    pub fn used(&self) -> u64 {
        self.allocator().used()
    }

    /// The descriptor engines map (passed over the node's Unix socket).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.fd.as_fd()
    }

    fn allocator(&self) -> std::sync::MutexGuard<'_, ExtentAllocator> {
        self.shared.alloc.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Room for `len` bytes, or `None` when no free extent is large enough.
    pub fn alloc(&self, len: usize) -> Option<Extent> {
        self.alloc_run(&[len]).map(|mut v| v.remove(0))
    }

    /// Room for blocks of `lens` bytes side by side (one contiguous run, so an engine can
    /// fill them with one strided copy per layer), each its own extent, freed on its own;
    /// `None` when no free extent holds the whole run.
    pub fn alloc_run(&self, lens: &[usize]) -> Option<Vec<Extent>> {
        if lens.is_empty() || lens.contains(&0) {
            return None;
        }
        let total: u64 = lens.iter().map(|l| footprint(*l)).sum();
        let start = self.allocator().alloc(total)?;
        metrics::ARENA_BYTES
            .with_label_values(&["allocated"])
            .add(total as i64);
        let mut at = start;
        Some(
            lens.iter()
                .map(|&len| {
                    let e = Extent {
                        shared: self.shared.clone(),
                        offset: at,
                        len,
                    };
                    at += footprint(len);
                    e
                })
                .collect(),
        )
    }

    /// Where `data` starts in the arena, if it lies wholly inside it.
    pub fn offset_of(&self, data: &[u8]) -> Option<u64> {
        let base = self.shared.base.as_ptr() as usize;
        let p = data.as_ptr() as usize;
        (p >= base && p + data.len() <= base + self.shared.len).then(|| (p - base) as u64)
    }

    /// Whether `data` lies in this arena.
    pub fn holds(&self, data: &[u8]) -> bool {
        self.offset_of(data).is_some()
    }
}

/// A block's place in the arena: writable while held alone (a reservation being filled, a
/// copy being staged), then frozen into [`Bytes`] that the store and leases share. Its room
/// goes back to the arena when the last holder drops it.
pub struct Extent {
    shared: Arc<Shared>,
    offset: u64,
    len: usize,
}

impl Extent {
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The extent's bytes, to write (a copy staged into the arena).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the range lies inside the mapping (the allocator handed it out of the
        // arena's length), and this extent is its only holder: `Extent` is not `Clone`, and
        // a frozen extent is no longer an `Extent`.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.shared.base.as_ptr().add(self.offset as usize),
                self.len,
            )
        }
    }

    /// The extent as shared, read-only block bytes.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Extent {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range lies inside the mapping, which outlives `self` (an `Arc`).
        unsafe {
            std::slice::from_raw_parts(
                self.shared.base.as_ptr().add(self.offset as usize),
                self.len,
            )
        }
    }
}

impl Drop for Extent {
    fn drop(&mut self) {
        let len = footprint(self.len);
        self.shared
            .alloc
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .free(self.offset, len);
        metrics::ARENA_BYTES
            .with_label_values(&["allocated"])
            .sub(len as i64);
    }
}

impl std::fmt::Debug for Extent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extent")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_are_aligned_and_given_back_when_the_last_holder_drops() {
        let arena = Arena::new(1 << 20).unwrap();
        assert_eq!(arena.capacity(), 1 << 20);
        let mut e = arena.alloc(5000).unwrap();
        assert_eq!(e.offset() % ALIGN, 0);
        assert_eq!(arena.used(), 8192, "two pages");
        e.as_mut_slice().fill(7);
        let b = e.freeze();
        let shared = b.clone();
        assert!(arena.holds(&b));
        assert_eq!(arena.offset_of(&b), Some(0));
        assert!(!arena.holds(&[0u8; 8]));
        drop(b);
        assert_eq!(arena.used(), 8192, "still held by a clone");
        assert!(shared.iter().all(|x| *x == 7));
        drop(shared);
        assert_eq!(arena.used(), 0);
    }

    #[test]
    fn a_run_is_contiguous_and_its_blocks_free_one_by_one() {
        let arena = Arena::new(64 * ALIGN).unwrap();
        let run = arena.alloc_run(&[4096, 100, 8192]).unwrap();
        let offsets: Vec<u64> = run.iter().map(Extent::offset).collect();
        assert_eq!(offsets, vec![0, 4096, 8192]);
        assert_eq!(arena.used(), 4 * ALIGN);
        let mut run = run.into_iter();
        drop(run.next());
        assert_eq!(arena.used(), 3 * ALIGN);
        drop(run);
        assert_eq!(arena.used(), 0);
        assert!(
            arena.alloc_run(&[65 * 4096]).is_none(),
            "larger than the arena"
        );
        assert!(arena.alloc_run(&[]).is_none());
    }

    #[test]
    fn the_descriptor_cannot_be_shrunk_by_whoever_holds_it() {
        let arena = Arena::new(1 << 16).unwrap();
        // SAFETY: a valid descriptor; the seal makes the call fail.
        let rc = unsafe { libc::ftruncate(arena.fd().as_raw_fd(), 0) };
        assert_ne!(rc, 0, "a sealed arena refuses to shrink");
        // The node's mapping still reads.
        let mut e = arena.alloc(16).unwrap();
        e.as_mut_slice().copy_from_slice(&[1; 16]);
        assert_eq!(e.freeze().as_ref(), &[1; 16]);
    }
}
