//! Placement of variable-length extents in a fixed range of bytes: first fit over a free
//! list, freed neighbours merged so the range does not fragment into unusable slivers. Used
//! by the RDMA registered pool (`rdma`) and by the same-host shared-memory arena
//! ([`crate::arena`]).

use std::collections::BTreeMap;

/// Offsets of blocks in a registered pool of `capacity` bytes: first fit, freed neighbours
/// merged, so a pool does not fragment into unusable slivers.
#[derive(Clone, Debug)]
pub struct ExtentAllocator {
    capacity: u64,
    /// Free extents: offset → length, never adjacent to each other.
    free: BTreeMap<u64, u64>,
    used: u64,
}

impl ExtentAllocator {
    pub fn new(capacity: u64) -> Self {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Self {
            capacity,
            free,
            used: 0,
        }
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Room for `len` bytes, or `None` if no free extent is large enough.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        let (&off, &extent) = self.free.iter().find(|(_, l)| **l >= len)?;
        self.free.remove(&off);
        if extent > len {
            self.free.insert(off + len, extent - len);
        }
        self.used += len;
        Some(off)
    }

    /// Give back `len` bytes at `off` (as returned by [`ExtentAllocator::alloc`]).
    pub fn free(&mut self, off: u64, len: u64) {
        debug_assert!(off + len <= self.capacity);
        let (mut start, mut end) = (off, off + len);
        if let Some((&p, &pl)) = self.free.range(..off).next_back()
            && p + pl == off
        {
            self.free.remove(&p);
            start = p;
        }
        if let Some(&nl) = self.free.get(&end) {
            self.free.remove(&end);
            end += nl;
        }
        self.free.insert(start, end - start);
        self.used -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_freed_extent_between_two_free_ones_merges_them() {
        let mut a = ExtentAllocator::new(300);
        let (x, y, z) = (
            a.alloc(100).unwrap(),
            a.alloc(100).unwrap(),
            a.alloc(100).unwrap(),
        );
        assert_eq!((x, y, z), (0, 100, 200));
        assert_eq!(a.alloc(1), None, "full");
        a.free(x, 100);
        a.free(z, 100);
        assert_eq!(a.alloc(150), None, "two free extents of 100, none of 150");
        a.free(y, 100);
        assert_eq!(a.used(), 0);
        assert_eq!(a.alloc(300), Some(0), "the three merged back into one");
    }

    #[test]
    fn a_run_freed_piece_by_piece_comes_back_whole() {
        let mut a = ExtentAllocator::new(1 << 20);
        let run = a.alloc(4 * 4096).unwrap();
        for i in [2u64, 0, 3, 1] {
            a.free(run + i * 4096, 4096);
        }
        assert_eq!(a.used(), 0);
        assert_eq!(a.alloc(1 << 20), Some(0));
    }

    proptest! {
        /// Allocations never overlap, stay inside the pool, and freeing everything gives the
        /// whole pool back as one extent.
        #[test]
        fn pool_allocations_never_overlap(ops in proptest::collection::vec((1u64..5000, any::<bool>()), 1..200)) {
            let mut pool = ExtentAllocator::new(64 * 1024);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (len, free_one) in ops {
                if free_one && !live.is_empty() {
                    let (o, l) = live.swap_remove(len as usize % live.len());
                    pool.free(o, l);
                } else if let Some(o) = pool.alloc(len) {
                    prop_assert!(o + len <= pool.capacity());
                    for &(lo, ll) in &live {
                        prop_assert!(o + len <= lo || lo + ll <= o, "overlap");
                    }
                    live.push((o, len));
                }
                prop_assert_eq!(pool.used(), live.iter().map(|(_, l)| l).sum::<u64>());
            }
            for (o, l) in live.drain(..) {
                pool.free(o, l);
            }
            prop_assert_eq!(pool.alloc(64 * 1024), Some(0));
        }

    }
}
