//! Binary encodings shared by the transport's frames and the disk tier's record headers, so
//! a scope, a hash or an optional parent is written and read one way everywhere.

use bytes::{Buf, BufMut};
use cachet_common::{BlockHash, Scope, TenantId, WorkspaceId};

/// RDMA control ops on a node's TCP connection (feature `rdma`, see [`crate::rdma`]):
/// answered only by a node that exports a registered pool; any other node closes the
/// connection, and the reader uses TCP. Here, beside the encodings, because both sides use
/// them: the transport's server dispatches them, `rdma::serve` answers, `rdma::pull` asks.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) const OP_RDMA_CONNECT: u8 = 6;
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) const OP_RDMA_GET: u8 = 7;
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) const OP_RDMA_DONE: u8 = 8;

/// Ops an engine beside the node sends on its Unix socket only ([`crate::local`]): a
/// load's lease of blocks in the shared-memory arena and its end, a save's reservation of
/// room there, its commit and its abort.
pub(crate) const OP_LEASE: u8 = 12;
pub(crate) const OP_RELEASE: u8 = 13;
pub(crate) const OP_RESERVE: u8 = 14;
pub(crate) const OP_COMMIT: u8 = 15;
pub(crate) const OP_ABORT: u8 = 16;

/// Bytes of an encoded [`Scope`].
pub const SCOPE_LEN: usize = 32;
/// Bytes of an encoded optional parent (flag + hash).
pub const PARENT_LEN: usize = 33;

/// A malformed message: the connection that sent it is closed.
pub(crate) fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string())
}

pub fn put_scope(b: &mut impl BufMut, s: &Scope) {
    b.put_slice(s.tenant.as_uuid().as_bytes());
    b.put_slice(s.workspace.as_uuid().as_bytes());
}

/// Reads a scope; the caller checks that [`SCOPE_LEN`] bytes remain.
pub fn get_scope(b: &mut impl Buf) -> Scope {
    let mut t = [0u8; 16];
    b.copy_to_slice(&mut t);
    let mut w = [0u8; 16];
    b.copy_to_slice(&mut w);
    Scope {
        tenant: TenantId::from(uuid::Uuid::from_bytes(t)),
        workspace: WorkspaceId::from(uuid::Uuid::from_bytes(w)),
    }
}

/// Reads a hash; the caller checks that 32 bytes remain.
pub fn get_hash(b: &mut impl Buf) -> BlockHash {
    let mut h = [0u8; 32];
    b.copy_to_slice(&mut h);
    BlockHash(h)
}

pub fn put_parent(b: &mut impl BufMut, p: Option<BlockHash>) {
    match p {
        Some(p) => {
            b.put_u8(1);
            b.put_slice(&p.0);
        }
        None => {
            b.put_u8(0);
            b.put_slice(&[0; 32]);
        }
    }
}

/// Reads an optional parent; the caller checks that [`PARENT_LEN`] bytes remain.
pub fn get_parent(b: &mut impl Buf) -> Option<BlockHash> {
    let present = b.get_u8() == 1;
    let h = get_hash(b);
    present.then_some(h)
}

/// A scope and a chain of hashes (`scope:32 n:u32 hash:32 × n`, the body of GET, HAS and
/// LEASE), or `None` when the body is not exactly that.
pub fn get_chain(b: &mut impl Buf) -> Option<(Scope, Vec<BlockHash>)> {
    if b.remaining() < SCOPE_LEN + 4 {
        return None;
    }
    let scope = get_scope(b);
    let n = b.get_u32_le() as usize;
    if b.remaining() != n.checked_mul(32)? {
        return None;
    }
    Some((scope, (0..n).map(|_| get_hash(b)).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let s = Scope {
            tenant: TenantId::new(),
            workspace: WorkspaceId::new(),
        };
        let mut b = bytes::BytesMut::new();
        put_scope(&mut b, &s);
        put_parent(&mut b, Some(BlockHash([7; 32])));
        put_parent(&mut b, None);
        assert_eq!(b.len(), SCOPE_LEN + 2 * PARENT_LEN);
        let mut r = b.freeze();
        assert_eq!(get_scope(&mut r), s);
        assert_eq!(get_parent(&mut r), Some(BlockHash([7; 32])));
        assert_eq!(get_parent(&mut r), None);
        assert!(r.is_empty());
    }
}
