//! Block integrity: the crc32c every block carries from its writer. Computed once when a
//! block is offered ([`crate::store::PutBlock::new`]) and verified wherever its bytes are
//! trusted again: on every put and get of the DRAM store, in every tier's records (disk,
//! GPU), and by a reader of a peer's block over TCP or RDMA. A block that fails is dropped
//! and refetched or recomputed, never served.

/// crc32c of a block's bytes.
pub fn checksum(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}
