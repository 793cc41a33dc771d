//! The same-host path (`cache_fabric::local`) over a real Unix socket and a real shared
//! mapping: the arena's descriptor with HELLO, reservations invisible until committed and
//! counted against quota and capacity, leases that keep a block's bytes while the engine
//! reads them (evicted or not), heap blocks staged into the arena, a corrupt block dropped
//! when its reader says so, and nothing left behind by an engine that goes away.

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cache_fabric::local::serve_local;
use cache_fabric::{
    EntryKind, EvictionPolicy, FabricNode, NodeConfig, PutBlock, checksum, local::LocalServer,
};
use cachet_common::{BlockHash, Scope};
use common::{TempDir, scope};

const TOKEN: &str = "local-test-token";
const KIB: usize = 1024;

fn node(capacity: u64) -> Arc<FabricNode> {
    FabricNode::new(NodeConfig {
        dram_capacity_bytes: capacity,
        eviction: EvictionPolicy::Lru,
    })
}

fn serve(node: &Arc<FabricNode>, dir: &TempDir) -> LocalServer {
    serve_local(&dir.0.join("fabric.sock"), node.clone(), TOKEN.into()).unwrap()
}

fn h(i: u8) -> BlockHash {
    BlockHash([i; 32])
}

/// An engine's side of the socket, written from the protocol in `local.rs`.
struct Engine {
    s: UnixStream,
    base: *mut u8,
    len: usize,
    _fd: OwnedFd,
}

#[derive(Debug, PartialEq)]
struct Leased {
    hash: BlockHash,
    n_tokens: u32,
    crc: u32,
    offset: u64,
    len: u64,
}

impl Engine {
    fn connect(server: &LocalServer) -> Engine {
        Self::try_connect(server, TOKEN).expect("connects")
    }

    fn try_connect(server: &LocalServer, token: &str) -> Option<Engine> {
        let s = UnixStream::connect(server.path()).unwrap();
        let mut hello = vec![1u8];
        hello.extend((token.len() as u16).to_le_bytes());
        hello.extend(token.as_bytes());
        send(&s, &hello);
        let (status, rest, fd) = recv_with_fd(&s);
        if status != 0 {
            return None;
        }
        let len = u64::from_le_bytes(rest.try_into().unwrap()) as usize;
        let fd = fd.expect("the arena's descriptor comes with HELLO's answer");
        // SAFETY: a shared mapping of the arena's whole (sealed) length.
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
        assert_ne!(base, libc::MAP_FAILED);
        Some(Engine {
            s,
            base: base.cast(),
            len,
            _fd: fd,
        })
    }

    fn bytes(&self, offset: u64, len: usize) -> &[u8] {
        assert!(offset as usize + len <= self.len);
        // SAFETY: inside the mapping, which lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.base.add(offset as usize), len) }
    }

    fn bytes_mut(&mut self, offset: u64, len: usize) -> &mut [u8] {
        assert!(offset as usize + len <= self.len);
        // SAFETY: inside the mapping; the test is the only writer of the ranges it names.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(offset as usize), len) }
    }

    fn call(&mut self, body: &[u8], answer: usize) -> Vec<u8> {
        send(&self.s, body);
        let mut out = vec![0u8; answer];
        self.s.read_exact(&mut out).unwrap();
        out
    }

    fn has(&mut self, scope: Scope, hashes: &[BlockHash]) -> Vec<bool> {
        let mut b = vec![5u8];
        b.extend(chain_body(scope, hashes));
        let out = self.call(&b, 1 + hashes.len());
        assert_eq!(out[0], 0);
        out[1..].iter().map(|x| *x == 1).collect()
    }

    fn lease(&mut self, scope: Scope, hashes: &[BlockHash]) -> (u64, Vec<Leased>) {
        let mut b = vec![12u8];
        b.extend(chain_body(scope, hashes));
        let head = self.call(&b, 13);
        assert_eq!(head[0], 0);
        let id = u64::from_le_bytes(head[1..9].try_into().unwrap());
        let n = u32::from_le_bytes(head[9..13].try_into().unwrap()) as usize;
        let mut rest = vec![0u8; n * 56];
        self.s.read_exact(&mut rest).unwrap();
        let blocks = rest
            .chunks(56)
            .map(|c| Leased {
                hash: BlockHash(c[..32].try_into().unwrap()),
                n_tokens: u32::from_le_bytes(c[32..36].try_into().unwrap()),
                crc: u32::from_le_bytes(c[36..40].try_into().unwrap()),
                offset: u64::from_le_bytes(c[40..48].try_into().unwrap()),
                len: u64::from_le_bytes(c[48..56].try_into().unwrap()),
            })
            .collect();
        (id, blocks)
    }

    fn release(&mut self, id: u64, corrupt: Option<u32>) {
        let mut b = vec![13u8];
        b.extend(id.to_le_bytes());
        b.extend(corrupt.unwrap_or(u32::MAX).to_le_bytes());
        assert_eq!(self.call(&b, 1), vec![0]);
    }

    /// (reservation id, offsets) or the refusal code.
    fn reserve(
        &mut self,
        scope: Scope,
        existing: &[BlockHash],
        new: &[(BlockHash, Option<BlockHash>, usize)],
    ) -> Result<(u64, Vec<u64>), u8> {
        let mut b = vec![14u8];
        b.extend(scope.tenant.as_uuid().as_bytes());
        b.extend(scope.workspace.as_uuid().as_bytes());
        b.extend(300_000u64.to_le_bytes());
        // Best effort: these tests' writes may be evicted for capacity.
        b.push(1);
        b.extend((existing.len() as u32).to_le_bytes());
        for e in existing {
            b.extend(e.0);
        }
        b.extend((new.len() as u32).to_le_bytes());
        for (hash, parent, len) in new {
            b.extend(hash.0);
            match parent {
                Some(p) => {
                    b.push(1);
                    b.extend(p.0);
                }
                None => b.extend([0u8; 33]),
            }
            b.extend(16u32.to_le_bytes());
            b.extend((*len as u64).to_le_bytes());
        }
        send(&self.s, &b);
        let mut status = [0u8; 1];
        self.s.read_exact(&mut status).unwrap();
        if status[0] != 0 {
            let mut code = [0u8; 1];
            self.s.read_exact(&mut code).unwrap();
            return Err(code[0]);
        }
        let mut rest = vec![0u8; 8 + 8 * new.len()];
        self.s.read_exact(&mut rest).unwrap();
        let id = u64::from_le_bytes(rest[..8].try_into().unwrap());
        let offsets = rest[8..]
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok((id, offsets))
    }

    fn commit(&mut self, id: u64) -> Result<(), u8> {
        let mut b = vec![15u8];
        b.extend(id.to_le_bytes());
        send(&self.s, &b);
        let mut status = [0u8; 1];
        self.s.read_exact(&mut status).unwrap();
        if status[0] == 0 {
            return Ok(());
        }
        let mut code = [0u8; 1];
        self.s.read_exact(&mut code).unwrap();
        Err(code[0])
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: what mmap returned in `try_connect`.
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

fn chain_body(scope: Scope, hashes: &[BlockHash]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(scope.tenant.as_uuid().as_bytes());
    b.extend(scope.workspace.as_uuid().as_bytes());
    b.extend((hashes.len() as u32).to_le_bytes());
    for h in hashes {
        b.extend(h.0);
    }
    b
}

fn send(mut s: &UnixStream, body: &[u8]) {
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend(body);
    s.write_all(&frame).unwrap();
}

/// The first byte, the next 8 (if any), and the descriptor attached to them.
fn recv_with_fd(s: &UnixStream) -> (u8, Vec<u8>, Option<OwnedFd>) {
    let mut buf = [0u8; 9];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u8; 64];
    // SAFETY: msghdr zeroed, then pointed at live buffers for the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: a connected socket and a valid msghdr.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, 0) };
    assert!(n >= 1, "recvmsg: {n}");
    let mut fd = None;
    // SAFETY: walking the control messages recvmsg filled.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if !cmsg.is_null()
            && (*cmsg).cmsg_level == libc::SOL_SOCKET
            && (*cmsg).cmsg_type == libc::SCM_RIGHTS
        {
            let raw = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>());
            fd = Some(OwnedFd::from_raw_fd(raw));
        }
    }
    let mut got = n as usize;
    if buf[0] == 0 {
        while got < 9 {
            let mut rest = s;
            got += rest.read(&mut buf[got..]).unwrap();
        }
    }
    (buf[0], buf[1..got].to_vec(), fd)
}

/// Poll until `cond` (a connection's thread lets go of what it held when it sees the end).
fn eventually(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..200 {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{what}: not within 2 s");
}

fn fill(engine: &mut Engine, offset: u64, len: usize, seed: u8) -> u32 {
    let b = engine.bytes_mut(offset, len);
    for (i, x) in b.iter_mut().enumerate() {
        *x = seed.wrapping_add(i as u8);
    }
    checksum(b)
}

#[test]
fn a_wrong_token_gets_no_descriptor() {
    let dir = TempDir::new();
    let n = node(1 << 20);
    let server = serve(&n, &dir);
    assert!(Engine::try_connect(&server, "not-the-token").is_none());
    // The socket is the node user's alone.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(server.path())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn a_reserved_write_is_invisible_until_committed_then_leased_in_place() {
    let dir = TempDir::new();
    let n = node(4 << 20);
    let server = serve(&n, &dir);
    let mut e = Engine::connect(&server);
    let s = scope();
    let (id, offsets) = e
        .reserve(
            s,
            &[],
            &[(h(1), None, 64 * KIB), (h(2), Some(h(1)), 64 * KIB)],
        )
        .unwrap();
    assert_eq!(offsets[1], offsets[0] + 64 * KIB as u64, "side by side");
    assert_eq!(
        e.has(s, &[h(1), h(2)]),
        vec![false, false],
        "not visible yet"
    );
    assert!(
        n.with_store(|st| st.occupied_bytes()) >= 128 * KIB as u64,
        "a reservation takes capacity"
    );
    assert_eq!(
        n.with_store(|st| st.reserved_bytes(s.tenant)),
        128 * KIB as u64
    );
    let crcs = [
        fill(&mut e, offsets[0], 64 * KIB, 1),
        fill(&mut e, offsets[1], 64 * KIB, 2),
    ];
    e.commit(id).unwrap();
    assert_eq!(e.has(s, &[h(1), h(2)]), vec![true, true]);
    assert_eq!(n.with_store(|st| st.reserved_bytes(s.tenant)), 0);
    assert!(n.with_store(|st| st.in_arena(&h(1))));
    // A load leases the blocks where they were written: no copy, the writer's checksums.
    let (lease, blocks) = e.lease(s, &[h(1), h(2), h(3)]);
    assert_eq!(blocks.len(), 2, "the longest stored prefix");
    for (b, (off, crc)) in blocks.iter().zip(offsets.iter().zip(crcs)) {
        assert_eq!(
            (b.offset, b.crc, b.len, b.n_tokens),
            (*off, crc, 64 * KIB as u64, 16)
        );
    }
    e.release(lease, None);
    // A lease that found nothing holds nothing; releasing it is harmless.
    let (empty, none) = e.lease(scope(), &[h(1)]);
    assert!(none.is_empty(), "another scope reads nothing");
    e.release(empty, None);
    assert_eq!(e.has(s, &[h(1)]), vec![true], "the connection goes on");
    n.with_store(|st| st.check_invariants());
}

#[test]
fn a_leased_block_keeps_its_bytes_when_evicted_and_counts_until_released() {
    let dir = TempDir::new();
    // Room for four 64 KiB blocks.
    let n = node(256 * KIB as u64);
    let server = serve(&n, &dir);
    let mut e = Engine::connect(&server);
    let s = scope();
    let (id, off) = e.reserve(s, &[], &[(h(1), None, 64 * KIB)]).unwrap();
    let crc = fill(&mut e, off[0], 64 * KIB, 9);
    e.commit(id).unwrap();
    let (lease, blocks) = e.lease(s, &[h(1)]);
    assert_eq!(blocks[0].crc, crc);
    // Other writes push it out of the store while it is leased.
    let other = scope();
    for i in 10..14u8 {
        let data = Bytes::from(vec![i; 64 * KIB]);
        n.with_store(|st| {
            st.put_entry(
                &other,
                &[],
                vec![PutBlock::new(h(i), None, 16, data)],
                Duration::from_secs(60),
                tokio::time::Instant::now(),
                EntryKind::BestEffort,
            )
        })
        .ok();
    }
    assert!(!e.has(s, &[h(1)])[0], "evicted from the store");
    assert_eq!(
        checksum(e.bytes(blocks[0].offset, 64 * KIB)),
        crc,
        "its bytes stay while the engine reads them"
    );
    let arena = n.arena().unwrap().clone();
    assert!(
        n.with_store(|st| st.occupied_bytes()) <= 256 * KIB as u64,
        "the leased block's room is counted: the store made room around it"
    );
    let used = arena.used();
    e.release(lease, None);
    assert_eq!(arena.used(), used - 64 * KIB as u64, "freed once released");
    n.with_store(|st| st.check_invariants());
}

#[test]
fn a_heap_block_is_staged_into_the_arena_once() {
    let dir = TempDir::new();
    let n = node(1 << 20);
    let server = serve(&n, &dir);
    let mut e = Engine::connect(&server);
    let s = scope();
    let data = Bytes::from(vec![7u8; 32 * KIB]);
    let crc = checksum(&data);
    n.with_store(|st| {
        st.put_entry(
            &s,
            &[],
            vec![PutBlock::new(h(1), None, 16, data)],
            Duration::from_secs(60),
            tokio::time::Instant::now(),
            EntryKind::Paid,
        )
    })
    .unwrap();
    assert!(!n.with_store(|st| st.in_arena(&h(1))));
    let (lease, blocks) = e.lease(s, &[h(1)]);
    assert_eq!(blocks[0].crc, crc);
    assert!(e.bytes(blocks[0].offset, 32 * KIB).iter().all(|x| *x == 7));
    assert!(
        n.with_store(|st| st.in_arena(&h(1))),
        "the store keeps the arena copy"
    );
    e.release(lease, None);
    let (lease2, again) = e.lease(s, &[h(1)]);
    assert_eq!(
        again[0].offset, blocks[0].offset,
        "not copied a second time"
    );
    e.release(lease2, None);
    n.with_store(|st| st.check_invariants());
}

#[test]
fn a_block_its_reader_finds_corrupt_is_dropped() {
    let dir = TempDir::new();
    let n = node(1 << 20);
    let server = serve(&n, &dir);
    let mut e = Engine::connect(&server);
    let s = scope();
    let (id, off) = e
        .reserve(
            s,
            &[],
            &[(h(1), None, 8 * KIB), (h(2), Some(h(1)), 8 * KIB)],
        )
        .unwrap();
    fill(&mut e, off[0], 8 * KIB, 1);
    fill(&mut e, off[1], 8 * KIB, 2);
    e.commit(id).unwrap();
    // A byte flipped in the arena after the commit.
    e.bytes_mut(off[1], 8 * KIB)[100] ^= 0xff;
    let (lease, blocks) = e.lease(s, &[h(1), h(2)]);
    assert_eq!(checksum(e.bytes(blocks[0].offset, 8 * KIB)), blocks[0].crc);
    assert_ne!(checksum(e.bytes(blocks[1].offset, 8 * KIB)), blocks[1].crc);
    e.release(lease, Some(1));
    assert_eq!(e.has(s, &[h(1), h(2)]), vec![true, false]);
    // A false report drops nothing: the store checks again.
    let (lease, _) = e.lease(s, &[h(1)]);
    e.release(lease, Some(0));
    assert_eq!(e.has(s, &[h(1)]), vec![true]);
}

#[test]
fn reservations_count_against_the_tenants_quota() {
    let dir = TempDir::new();
    let n = node(4 << 20);
    let server = serve(&n, &dir);
    let mut e = Engine::connect(&server);
    let s = scope();
    n.with_store(|st| st.set_quota(s.tenant, Some(100 * KIB as u64)));
    let first = e.reserve(s, &[], &[(h(1), None, 64 * KIB)]).unwrap();
    assert_eq!(
        e.reserve(s, &[], &[(h(2), None, 64 * KIB)]),
        Err(1),
        "quota: the first reservation counts"
    );
    let mut abort = vec![16u8];
    abort.extend(first.0.to_le_bytes());
    assert_eq!(e.call(&abort, 1), vec![0]);
    assert!(e.reserve(s, &[], &[(h(2), None, 64 * KIB)]).is_ok());
}

#[test]
fn an_engine_that_goes_away_leaves_no_lease_and_no_reservation() {
    let dir = TempDir::new();
    let n = node(4 << 20);
    let server = serve(&n, &dir);
    let arena = {
        let mut e = Engine::connect(&server);
        let s = scope();
        let (id, off) = e.reserve(s, &[], &[(h(1), None, 64 * KIB)]).unwrap();
        fill(&mut e, off[0], 64 * KIB, 3);
        e.commit(id).unwrap();
        let arena = n.arena().unwrap().clone();
        let stored = arena.used();
        // A lease and a reservation still open when the engine dies; the block is then
        // evicted, so only the lease holds its extent.
        e.lease(s, &[h(1)]);
        e.reserve(s, &[h(1)], &[(h(2), Some(h(1)), 64 * KIB)])
            .unwrap();
        n.with_store(|st| st.purge_tenant(s.tenant));
        assert_eq!(arena.used(), stored + 64 * KIB as u64);
        assert_eq!(
            n.with_store(|st| st.reserved_bytes(s.tenant)),
            64 * KIB as u64
        );
        (arena, s)
    };
    let (arena, s) = arena;
    eventually("the dead engine's lease and reservation freed", || {
        arena.used() == 0 && n.with_store(|st| st.reserved_bytes(s.tenant)) == 0
    });
    n.with_store(|st| st.check_invariants());
}

#[test]
fn an_engine_that_never_releases_is_given_no_more_than_sixteen_leases() {
    let dir = TempDir::new();
    let n = node(4 << 20);
    let server = serve(&n, &dir);
    let mut e = Engine::connect(&server);
    let s = scope();
    let (id, off) = e.reserve(s, &[], &[(h(1), None, 8 * KIB)]).unwrap();
    fill(&mut e, off[0], 8 * KIB, 5);
    e.commit(id).unwrap();
    let held: Vec<u64> = (0..16)
        .map(|_| {
            let (lease, blocks) = e.lease(s, &[h(1)]);
            assert_eq!(blocks.len(), 1);
            lease
        })
        .collect();
    let (_, none) = e.lease(s, &[h(1)]);
    assert!(none.is_empty(), "a seventeenth lease is refused");
    e.release(held[0], None);
    let (again, blocks) = e.lease(s, &[h(1)]);
    assert_eq!(blocks.len(), 1, "one released, one more granted");
    e.release(again, None);
}
