//! The same-host path: an engine beside the node (vLLM's KV connector) loads and saves
//! blocks through the node's shared-memory arena ([`crate::arena`]) instead of copying
//! them over a socket (decision 0029).
//!
//! The node listens on a Unix socket (mode 0600: only its own user connects). Frames are the
//! TCP transport's (length-prefixed, little-endian; [`crate::transport`]); a connection
//! opens with HELLO and the cluster token, and its answer carries the arena's descriptor
//! (`SCM_RIGHTS`), which the engine maps once. Receiving it is also the proof that the two
//! share a host. Then:
//!
//! ```text
//! request                                        response
//! HELLO   1 = token_len:u16 token                ok capacity:u64       + the arena's fd
//! HAS     5 = scope:32 n:u32 hash:32 × n         ok, n × held:u8
//! REPORT 10 = tag:16 local:u32 loaded:u32 failed:u32   ok
//! LEASE  12 = scope:32 n:u32 hash:32 × n         ok lease:u64 count:u32,
//!                                                count × (hash:32 n_tokens:u32 crc:u32 offset:u64 len:u64)
//! RELEASE 13 = lease:u64 corrupt:u32             ok      (corrupt: index of the first block
//!                                                         that failed its checksum, or u32::MAX)
//! RESERVE 14 = scope:32 ttl_ms:u64 kind:u8       ok reservation:u64 n_new × offset:u64
//!             n_existing:u32 hash:32 × n          | refused reason:u8
//!             n_new:u32 (hash:32 parent:33 n_tokens:u32 len:u64) × n
//! COMMIT 15 = reservation:u64                    ok | refused reason:u8
//! ABORT  16 = reservation:u64                    ok
//! ```
//!
//! - **LEASE** reads the longest stored prefix (TTLs refreshed, as GET) and answers where
//!   each block lies in the arena with the checksum the engine verifies as it copies it: the
//!   one check on the block's way to the engine. A block on the heap (written by a peer, read
//!   back from the disk tier, made by an in-process engine) is copied into the arena first
//!   and the store keeps that copy. The blocks stay where they are until RELEASE or the
//!   connection's end, never on a timer: a block evicted meanwhile keeps its extent, and its
//!   bytes count against the capacity until then. A RELEASE naming a corrupt block drops it
//!   from the store (checked again there).
//! - **RESERVE** makes room for a write as a write would (quota, counting the tenant's other
//!   reservations, then capacity) and allocates its new blocks side by side; the engine
//!   fills them straight from its paged KV. **COMMIT** computes each block's checksum from
//!   the arena's bytes and stores the entry (admission, refusals, events as for PUT): a
//!   block is visible only once committed. ABORT, or the connection's end, frees the room.
//!
//! Each connection is served on a thread of its own: its work is memory copies, checksums
//! and the store's lock, never waiting on the network, and an engine holds one or two.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use cachet_common::{BlockHash, Scope};

use crate::arena::{Arena, Extent, footprint};
use crate::integrity::checksum;
use crate::metrics;
use crate::node::FabricNode;
use crate::reports::ConnectorReport;
use crate::store::{EntryKind, Holding, PutBlock};
use crate::transport::{
    DENIED, OK, OP_HAS, OP_HELLO, OP_REPORT, REFUSED, has_answer, refused_code, same_secret,
};
use crate::wire::{
    OP_ABORT, OP_COMMIT, OP_LEASE, OP_RELEASE, OP_RESERVE, PARENT_LEN, SCOPE_LEN, bad, get_chain,
    get_hash, get_parent, get_scope,
};

/// Largest frame an engine sends here (no block bytes travel on this socket: hashes only).
const MAX_FRAME: usize = 64 << 20;
/// One leased block in a LEASE answer.
const LEASED_LEN: usize = 32 + 4 + 4 + 8 + 8;
/// RELEASE's "no block was corrupt".
const NONE_CORRUPT: u32 = u32::MAX;
/// Leases one connection may hold at once. The connector holds one at a time (it releases a
/// load's lease before the next load); a byte bound would cut a long prefix's load short on
/// a node with little DRAM, while what a lease holds outside the store already counts
/// against the capacity.
const MAX_LEASES: usize = 16;
/// How long a new connection may take to say HELLO.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// A node's Unix socket for engines on its host; the socket file is removed when dropped.
pub struct LocalServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
}

impl LocalServer {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Why the same-host path could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("the shared-memory arena: {0}")]
    Arena(std::io::Error),
    #[error("the Unix socket at {path}: {source}")]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Open `node`'s arena and serve engines on its host at `path` (a socket left there by a
/// process that is gone is replaced; one that still answers is not), each connection
/// opening with `token`.
pub fn serve_local(
    path: &Path,
    node: Arc<FabricNode>,
    token: Arc<str>,
) -> Result<LocalServer, LocalError> {
    let arena = node.open_arena().map_err(LocalError::Arena)?;
    let socket_err = |source| LocalError::Socket {
        path: path.to_path_buf(),
        source,
    };
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(socket_err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another process serves this socket",
            )));
        }
        std::fs::remove_file(path).map_err(socket_err)?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(socket_err)?;
    }
    let listener = UnixListener::bind(path).map_err(socket_err)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(socket_err)?;
    }
    node.set_local_socket(path.to_path_buf());
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let capacity = arena.capacity();
    std::thread::Builder::new()
        .name("fabric-local".into())
        .spawn(move || accept_loop(listener, node, token, arena, flag))
        .map_err(socket_err)?;
    tracing::info!(
        path = %path.display(),
        arena_bytes = capacity,
        "fabric node open to engines on this host (shared memory)"
    );
    Ok(LocalServer {
        path: path.to_path_buf(),
        stop,
    })
}

fn accept_loop(
    listener: UnixListener,
    node: Arc<FabricNode>,
    token: Arc<str>,
    arena: Arena,
    stop: Arc<AtomicBool>,
) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "fabric local socket accept failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let (node, token, arena) = (node.clone(), token.clone(), arena.clone());
        let spawned = std::thread::Builder::new()
            .name("fabric-local-conn".into())
            .spawn(move || {
                let peer = peer_pid(&stream);
                metrics::LOCAL_CONNECTIONS.inc();
                let mut conn = Conn::new(node, arena);
                match conn.serve(stream, &token) {
                    Err(e) if e.kind() != std::io::ErrorKind::UnexpectedEof => {
                        tracing::info!(?peer, error = %e, "engine connection closed")
                    }
                    _ => tracing::debug!(?peer, "engine connection closed"),
                }
                // Whatever the engine still held is let go here (`Conn`'s fields drop).
                drop(conn);
                metrics::LOCAL_CONNECTIONS.dec();
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "no thread for an engine connection");
        }
    }
}

/// The process at the other end (logged when it goes away).
fn peer_pid(s: &UnixStream) -> Option<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a `ucred` of the given length on a connected Unix socket.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred.pid)
}

/// Blocks an engine is reading (a LEASE not yet released).
struct Lease {
    blocks: Vec<(BlockHash, Bytes)>,
    room: u64,
}

impl Drop for Lease {
    fn drop(&mut self) {
        metrics::ARENA_BYTES
            .with_label_values(&["leased"])
            .sub(self.room as i64);
    }
}

/// Room an engine is filling (a RESERVE not yet committed or aborted).
struct Reservation {
    node: Arc<FabricNode>,
    scope: Scope,
    holding: Holding,
    existing: Vec<BlockHash>,
    /// Each new block's hash, parent and tokens, with its extent.
    blocks: Vec<(BlockHash, Option<BlockHash>, u32, Extent)>,
    bytes: u64,
    room: u64,
    /// Counted as committed or aborted; otherwise dropped with its connection.
    ended: bool,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        metrics::ARENA_BYTES
            .with_label_values(&["reserved"])
            .sub(self.room as i64);
        if !self.ended {
            let (tenant, bytes) = (self.scope.tenant, self.bytes);
            self.node.with_store(|s| s.unreserve(tenant, bytes));
            metrics::LOCAL_OPS
                .with_label_values(&["reserve", "dropped"])
                .inc();
        }
    }
}

/// One engine connection's state: what it leases and reserves, let go when it ends.
struct Conn {
    node: Arc<FabricNode>,
    arena: Arena,
    leases: HashMap<u64, Lease>,
    reservations: HashMap<u64, Reservation>,
    next_id: u64,
}

impl Conn {
    fn new(node: Arc<FabricNode>, arena: Arena) -> Self {
        Self {
            node,
            arena,
            leases: HashMap::new(),
            reservations: HashMap::new(),
            next_id: 1,
        }
    }

    fn serve(&mut self, mut s: UnixStream, token: &str) -> std::io::Result<()> {
        // A process that connects and says nothing does not keep a thread for long; an
        // engine that said HELLO may then be idle for as long as it likes.
        s.set_read_timeout(Some(HELLO_TIMEOUT))?;
        let mut hello = read_frame(&mut s)?;
        s.set_read_timeout(None)?;
        if hello.remaining() < 3 || hello.get_u8() != OP_HELLO {
            return Err(bad("first frame is not HELLO"));
        }
        let n = hello.get_u16_le() as usize;
        if hello.remaining() != n || !same_secret(&hello, token.as_bytes()) {
            s.write_all(&[DENIED])?;
            return Err(bad("wrong cluster token"));
        }
        let mut answer = [0u8; 9];
        answer[0] = OK;
        answer[1..].copy_from_slice(&self.arena.capacity().to_le_bytes());
        send_with_fd(&s, &answer, self.arena.fd())?;
        loop {
            let mut f = read_frame(&mut s)?;
            if !f.has_remaining() {
                return Err(bad("empty frame"));
            }
            let op = f.get_u8();
            let out = match op {
                OP_HAS => {
                    let (scope, hashes) = get_chain(&mut f).ok_or_else(|| bad("malformed HAS"))?;
                    has_answer(&self.node, &scope, &hashes)
                }
                OP_REPORT => {
                    let (tag, report) =
                        ConnectorReport::decode(f).ok_or_else(|| bad("REPORT length"))?;
                    self.node.reports().put(tag, report);
                    ok()
                }
                OP_LEASE => {
                    let (scope, chain) = get_chain(&mut f).ok_or_else(|| bad("malformed LEASE"))?;
                    self.lease(scope, &chain)
                }
                OP_RELEASE => {
                    if f.remaining() != 12 {
                        return Err(bad("RELEASE length"));
                    }
                    let (id, corrupt) = (f.get_u64_le(), f.get_u32_le());
                    self.release(id, corrupt)?;
                    ok()
                }
                OP_RESERVE => self.reserve(f)?,
                OP_COMMIT => {
                    if f.remaining() != 8 {
                        return Err(bad("COMMIT length"));
                    }
                    self.commit(f.get_u64_le())?
                }
                OP_ABORT => {
                    if f.remaining() != 8 {
                        return Err(bad("ABORT length"));
                    }
                    let id = f.get_u64_le();
                    if let Some(mut r) = self.reservations.remove(&id) {
                        r.node.with_store(|s| s.unreserve(r.scope.tenant, r.bytes));
                        r.ended = true;
                        metrics::LOCAL_OPS.with_label_values(&["abort", "ok"]).inc();
                    }
                    ok()
                }
                _ => return Err(bad("unknown op")),
            };
            s.write_all(&out)?;
        }
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }

    /// The longest stored prefix of `chain`, each block in the arena and leased.
    fn lease(&mut self, scope: Scope, chain: &[BlockHash]) -> BytesMut {
        if self.leases.len() >= MAX_LEASES {
            // An engine releases each load's lease before its next: one that does not is
            // stuck or faulty, and is given nothing more to hold.
            metrics::LOCAL_OPS
                .with_label_values(&["lease", "over_limit"])
                .inc();
            return lease_answer(0, &[], &self.arena);
        }
        let now = tokio::time::Instant::now();
        let read = self
            .node
            .with_store(|st| st.read_chain(&scope, chain, now))
            .for_reader();
        let mut leased: Vec<(BlockHash, u32, u32, Bytes)> = Vec::with_capacity(read.len());
        let mut room = 0;
        for (b, crc) in read {
            let need = footprint(b.data.len());
            let data = if self.arena.holds(&b.data) {
                b.data
            } else {
                match self.stage(&b.hash, &b.data, chain) {
                    Some(d) => d,
                    None => break,
                }
            };
            room += need;
            leased.push((b.hash, b.n_tokens, crc, data));
        }
        let id = self.id();
        let out = lease_answer(id, &leased, &self.arena);
        if !leased.is_empty() {
            metrics::ARENA_BYTES
                .with_label_values(&["leased"])
                .add(room as i64);
            metrics::LOCAL_OPS.with_label_values(&["lease", "ok"]).inc();
            let blocks = leased.into_iter().map(|(h, _, _, d)| (h, d)).collect();
            self.leases.insert(id, Lease { blocks, room });
        }
        out
    }

    /// A copy in the arena of a block the store keeps on the heap, which the store keeps
    /// from now on (if the block is still the one copied); `None` when no room is left.
    fn stage(&self, hash: &BlockHash, data: &Bytes, chain: &[BlockHash]) -> Option<Bytes> {
        let mut extent = self
            .node
            .with_store(|st| st.stage_room(data.len(), chain))?;
        extent.as_mut_slice().copy_from_slice(data);
        let staged = extent.freeze();
        self.node
            .with_store(|st| st.adopt_staged(hash, data, staged.clone()));
        metrics::ARENA_STAGED_BYTES.inc_by(data.len() as u64);
        Some(staged)
    }

    fn release(&mut self, id: u64, corrupt: u32) -> std::io::Result<()> {
        // A lease of no block holds nothing (and was never kept): releasing it is a no-op.
        let Some(lease) = self.leases.remove(&id) else {
            return Ok(());
        };
        let result = if corrupt == NONE_CORRUPT {
            "ok"
        } else {
            let (hash, _) = lease
                .blocks
                .get(corrupt as usize)
                .ok_or_else(|| bad("RELEASE names a block outside its lease"))?;
            // Checked again under the store's lock: dropped only if its bytes really fail.
            self.node.with_store(|st| st.drop_corrupt(hash));
            metrics::BLOCK_READS.with_label_values(&["corrupt"]).inc();
            "corrupt"
        };
        metrics::LOCAL_OPS
            .with_label_values(&["release", result])
            .inc();
        Ok(())
    }

    fn reserve(&mut self, mut f: Bytes) -> std::io::Result<BytesMut> {
        if f.remaining() < SCOPE_LEN + 8 + 1 + 4 {
            return Err(bad("short RESERVE"));
        }
        let scope = get_scope(&mut f);
        let ttl = Duration::from_millis(f.get_u64_le());
        let kind = match f.get_u8() {
            0 => EntryKind::Paid,
            1 => EntryKind::BestEffort,
            2 => EntryKind::Object,
            _ => return Err(bad("RESERVE entry kind")),
        };
        let n = f.get_u32_le() as usize;
        if f.remaining() < n.saturating_mul(32).saturating_add(4) {
            return Err(bad("RESERVE hash count"));
        }
        let existing: Vec<BlockHash> = (0..n).map(|_| get_hash(&mut f)).collect();
        let m = f.get_u32_le() as usize;
        const NEW_LEN: usize = 32 + PARENT_LEN + 4 + 8;
        if m == 0 || f.remaining() != m.saturating_mul(NEW_LEN) {
            return Err(bad("RESERVE block count"));
        }
        let mut wanted = Vec::with_capacity(m);
        let mut lens = Vec::with_capacity(m);
        for _ in 0..m {
            let hash = get_hash(&mut f);
            let parent = get_parent(&mut f);
            let n_tokens = f.get_u32_le();
            let len = usize::try_from(f.get_u64_le()).map_err(|_| bad("RESERVE length"))?;
            if len == 0 || len as u64 > self.arena.capacity() {
                return Err(bad("RESERVE block length"));
            }
            wanted.push((hash, parent, n_tokens));
            lens.push(len);
        }
        let pinned: Vec<BlockHash> = existing
            .iter()
            .copied()
            .chain(wanted.iter().map(|w| w.0))
            .collect();
        let now = tokio::time::Instant::now();
        let run = self
            .node
            .with_store(|st| st.reserve(&scope, &lens, &pinned, now));
        let extents = match run {
            Ok(e) => e,
            Err(e) => {
                metrics::LOCAL_OPS
                    .with_label_values(&["reserve", "refused"])
                    .inc();
                let mut out = BytesMut::with_capacity(2);
                out.put_u8(REFUSED);
                out.put_u8(refused_code(e));
                return Ok(out);
            }
        };
        let id = self.id();
        let mut out = BytesMut::with_capacity(9 + 8 * m);
        out.put_u8(OK);
        out.put_u64_le(id);
        for e in &extents {
            out.put_u64_le(e.offset());
        }
        let room: u64 = lens.iter().map(|l| footprint(*l)).sum();
        metrics::ARENA_BYTES
            .with_label_values(&["reserved"])
            .add(room as i64);
        metrics::LOCAL_OPS
            .with_label_values(&["reserve", "ok"])
            .inc();
        let blocks = wanted
            .into_iter()
            .zip(extents)
            .map(|((h, p, t), e)| (h, p, t, e))
            .collect();
        self.reservations.insert(
            id,
            Reservation {
                node: self.node.clone(),
                scope,
                holding: Holding { ttl, kind },
                existing,
                blocks,
                bytes: lens.iter().map(|l| *l as u64).sum(),
                room,
                ended: false,
            },
        );
        Ok(out)
    }

    fn commit(&mut self, id: u64) -> std::io::Result<BytesMut> {
        let mut r = self
            .reservations
            .remove(&id)
            .ok_or_else(|| bad("COMMIT of an unknown reservation"))?;
        r.ended = true;
        // The checksums, from the arena's bytes, outside the store's lock.
        let crcs = checksums(r.blocks.iter().map(|b| b.3.as_ref()).collect());
        let new: Vec<PutBlock> = std::mem::take(&mut r.blocks)
            .into_iter()
            .zip(crcs)
            .map(|((hash, parent, n_tokens, extent), checksum)| PutBlock {
                hash,
                parent,
                n_tokens,
                data: extent.freeze(),
                checksum,
            })
            .collect();
        let now = tokio::time::Instant::now();
        let (scope, existing, holding, bytes) = (r.scope, &r.existing, r.holding, r.bytes);
        let stored = self
            .node
            .with_store(|st| st.commit_reserved(&scope, existing, new, holding, now, bytes));
        let mut out = BytesMut::with_capacity(2);
        match stored {
            Ok(()) => {
                metrics::LOCAL_OPS
                    .with_label_values(&["commit", "ok"])
                    .inc();
                out.put_u8(OK);
            }
            Err(e) => {
                metrics::LOCAL_OPS
                    .with_label_values(&["commit", "refused"])
                    .inc();
                out.put_u8(REFUSED);
                out.put_u8(refused_code(e));
            }
        }
        Ok(out)
    }
}

/// LEASE's answer: the lease's id and where each block lies.
fn lease_answer(id: u64, leased: &[(BlockHash, u32, u32, Bytes)], arena: &Arena) -> BytesMut {
    let mut out = BytesMut::with_capacity(13 + leased.len() * LEASED_LEN);
    out.put_u8(OK);
    out.put_u64_le(id);
    out.put_u32_le(leased.len() as u32);
    for (hash, n_tokens, crc, data) in leased {
        out.put_slice(&hash.0);
        out.put_u32_le(*n_tokens);
        out.put_u32_le(*crc);
        out.put_u64_le(arena.offset_of(data).unwrap_or(u64::MAX));
        out.put_u64_le(data.len() as u64);
    }
    out
}

/// Each block's checksum, computed on up to as many threads as the machine has cores for
/// a large commit (a 7K-token prefix of an 8B model is ~1 GiB).
fn checksums(blocks: Vec<&[u8]>) -> Vec<u32> {
    let total: usize = blocks.iter().map(|b| b.len()).sum();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(blocks.len())
        .min(total.div_ceil(16 << 20))
        .max(1);
    if threads == 1 {
        return blocks.iter().map(|b| checksum(b)).collect();
    }
    let per = blocks.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> = blocks
            .chunks(per)
            .map(|part| s.spawn(move || part.iter().map(|b| checksum(b)).collect::<Vec<u32>>()))
            .collect();
        parts
            .into_iter()
            .flat_map(|h| h.join().expect("a checksum thread panicked"))
            .collect()
    })
}

fn ok() -> BytesMut {
    let mut out = BytesMut::with_capacity(1);
    out.put_u8(OK);
    out
}

fn read_frame(s: &mut UnixStream) -> std::io::Result<Bytes> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(bad("frame exceeds the limit"));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    Ok(Bytes::from(buf))
}

/// Send `data` with `fd` attached (`SCM_RIGHTS`): the receiver gets its own descriptor of
/// the same file.
fn send_with_fd(s: &UnixStream, data: &[u8], fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let raw = fd.as_raw_fd();
    let fd_len = std::mem::size_of::<libc::c_int>() as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_len) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields set below point at live buffers that
    // outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `control` is CMSG_SPACE bytes for one descriptor, so the first header and
    // its data fit; CMSG_FIRSTHDR is non-null for a control buffer that large.
    let sent = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_len) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), raw);
        libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let sent = sent as usize;
    if sent < data.len() {
        let mut rest = s;
        rest.write_all(&data[sent..])?;
    }
    Ok(())
}
